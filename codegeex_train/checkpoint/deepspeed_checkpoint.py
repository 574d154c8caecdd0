"""Training checkpoints through DeepSpeed, in the layout of ``checkpoint/files.py``.

DeepSpeed writes the model file of each model-parallel rank (with our metadata and training state as
client state) and the ZeRO optimizer partitions of every rank. ``latest`` is written by us, last and
atomically, after every rank has reported its files written: a process killed mid-save leaves ``latest`` at the
previous complete tag.

DeepSpeed reads and writes every file through its engine's ``checkpoint_engine``; ``install_checkpoint_engine``
replaces it (``training/engine.py`` does, after ``deepspeed.initialize``) by :class:`SafeCheckpointEngine`:

* ``load``: :func:`~codegeex_train.checkpoint.safe_load.safe_torch_load`, weights-only with our allow-list,
  instead of DeepSpeed's ``torch.load(weights_only=False)``. The preflight check of ``--load`` is then no
  longer what stands between a file and a full unpickle: a file changed after it is refused just the same.
* ``save`` / ``makedirs``: a failure (disk full, quota, permissions) is recorded, the half-written file removed,
  and nothing more is written on that rank, instead of raising out of the middle of DeepSpeed's save (the other
  ranks would wait in its barriers). ``commit_save`` then gathers every rank's outcome: when any failed, rank 0
  removes the partial tag directory, leaves ``latest`` as it was and prints one ``error:`` line naming the
  directory, the cause and the last complete checkpoint; every rank raises :class:`CheckpointSaveError`.
  Every file is fsynced before ``latest`` may name it. Under ``--async-save`` ``save`` hands the state dict to the
  ``background`` writer instead (``checkpoint/async_save.py``) and ``commit_save`` runs later, at a step boundary.

A save is :func:`write_checkpoint` (every rank's files) then :func:`commit_save` (``latest``). Which writer, when,
and what follows a commit (retention, the preemption marker) is the checkpoint manager's (``checkpoint/manager.py``),
the one saving API the loop calls.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import shutil

import torch
import torch.distributed as dist

from codegeex_train.checkpoint.deepspeed_files import IncompleteCheckpoint, Part, TagFiles, check_model_states
from codegeex_train.checkpoint.files import META_KEY, checkpoint_tag, read_latest, write_latest
from codegeex_train.config.options import type_name
from codegeex_train.checkpoint.run_dir import clear_tag_for
from codegeex_train.checkpoint.safe_load import CheckpointError, safe_torch_load
from codegeex_train.checkpoint.train_state import TrainState, rng_state, set_rng_state
from codegeex_train.config.model_config import ModelConfig
from codegeex_train.distributed.topology import Topology
from codegeex_train.tensor_parallel import RNGStatesTracker

logger = logging.getLogger(__name__)


class CheckpointStop(SystemExit):
    """A checkpoint failure found while the ranks run, raised on every rank alike after rank 0 printed the one
    ``error:`` line. A ``SystemExit`` (code 1): uncaught, the process ends without a traceback, since the line
    already said everything; ``str()`` of it is that line's message."""

    def __init__(self, message: str):
        super().__init__(1)
        self.message = message

    def __str__(self) -> str:
        return self.message


class CheckpointSaveError(CheckpointStop):
    """A save that failed on some rank (disk full, quota, permissions): the partial tag directory is removed and
    ``latest`` is unchanged."""


class CheckpointLoadError(CheckpointStop):
    """A checkpoint file refused while DeepSpeed loaded it (changed after the preflight check): nothing in it ran."""


def _cause(error: BaseException, path: str | None = None) -> str:
    """The operating system's words for a failed write ('No space left on device'), from ``error`` or what it
    was raised from; else, when the filesystem of ``path`` has no space left, that; else the error's first line."""
    seen = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.strerror:
            return seen.strerror
        seen = seen.__cause__ or seen.__context__
    text = " ".join(str(error).split())[:300] or type(error).__name__
    try:  # torch's C++ writer (legacy format) says only 'iostream error'
        full = path is not None and os.statvfs(os.path.dirname(path) or ".").f_bavail == 0
    except OSError:
        full = False
    return f"{os.strerror(errno.ENOSPC)} ({text})" if full else text


class SafeCheckpointEngine:
    """DeepSpeed's checkpoint engine (``engine.checkpoint_engine``) with its ``load`` made weights-only and its
    writes made to fail quietly and be reported (see the module docstring). Everything else is the wrapped
    engine's."""

    def __init__(self, inner):
        self.inner = inner
        self.failure: tuple[str, str] | None = None  # (what could not be written, the cause), on this rank
        self.background = None  # --async-save: the save's BackgroundWriter (checkpoint/async_save.py) while it runs

    def __getattr__(self, name):  # create, commit, is_data_parallel_writer, ...: the wrapped engine's
        return getattr(self.inner, name)

    def load(self, path: str, map_location=None):
        return safe_torch_load(path, map_location=map_location)

    def _fail(self, path: str, error: BaseException) -> None:
        if self.failure is None:
            self.failure = (str(path), _cause(error, str(path)))

    def makedirs(self, path, exist_ok=False):
        if self.failure is not None:
            return
        try:
            os.makedirs(path, exist_ok=exist_ok)
        except OSError as e:
            self._fail(path, e)

    def _open(self, path: str):
        """The file a save writes (a seam for tests that simulate a full disk)."""
        return open(path, "wb")

    def save(self, state_dict, path: str):
        if self.failure is not None:  # this rank already failed: write nothing more
            return
        if self.background is not None:  # a host copy now, the write on the writer thread
            self.background.submit(state_dict, path, self.write)
            return
        failure = self.write(state_dict, path)
        if failure is not None and self.failure is None:
            self.failure = failure

    def write(self, state_dict, path: str) -> tuple[str, str] | None:
        """``state_dict`` to ``path``, synced to disk; on failure the partial file is removed and (path, cause)
        returned."""
        try:
            if type(self.inner).__name__ == "TorchCheckpointEngine":  # its save, through a file we hold
                with self._open(path) as f:  # write errors arrive as OSError with the system's reason
                    torch.save(state_dict, f, _use_new_zipfile_serialization=self.inner.zipfile_serialization)
                    f.flush()
                    os.fsync(f.fileno())
            else:
                self.inner.save(state_dict, path)
        except (OSError, RuntimeError) as e:
            try:
                os.unlink(path)
            except OSError:
                pass
            return str(path), _cause(e, str(path))
        return None

    def copy_recovery_scripts(self, original, save_path) -> None:
        """DeepSpeed's ``_copy_recovery_script`` (rank 0 copies zero_to_fp32.py next to the files), failures
        recorded like a save's."""
        if self.failure is not None:
            return
        try:
            original(save_path)
        except OSError as e:
            self._fail(os.path.join(save_path, "zero_to_fp32.py"), e)

    def take_failure(self) -> tuple[str, str] | None:
        failure, self.failure = self.failure, None
        return failure


def install_checkpoint_engine(engine) -> SafeCheckpointEngine:
    """Make ``engine`` (a DeepSpeedEngine) read and write its checkpoint files through a :class:`SafeCheckpointEngine`
    (idempotent); returns it."""
    current = engine.checkpoint_engine
    if isinstance(current, SafeCheckpointEngine):
        return current
    safe = SafeCheckpointEngine(current)
    engine.checkpoint_engine = safe
    original = getattr(engine, "_copy_recovery_script", None)
    if original is not None:  # a plain copyfile on rank 0 in the middle of DeepSpeed's save: recorded, not raised
        engine._copy_recovery_script = lambda save_path: safe.copy_recovery_scripts(original, save_path)
    return safe


def _agree(failure):
    """Every rank's view of the ranks' outcomes: ``None`` when no rank failed, else (first failing rank, its
    ``failure``, how many ranks failed). Collective: one all-reduce, and a broadcast only after a failure."""
    device = (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl"
              else torch.device("cpu"))
    failed = torch.zeros(dist.get_world_size(), dtype=torch.int32, device=device)
    failed[dist.get_rank()] = failure is not None
    dist.all_reduce(failed)
    ranks = failed.nonzero().flatten().tolist()
    if not ranks:
        return None
    shared = [failure]
    dist.broadcast_object_list(shared, src=ranks[0])
    return ranks[0], shared[0], len(ranks)


def all_ranks(flag: bool) -> bool:
    """Whether ``flag`` holds on every rank. Collective: one all-reduce (MIN) of one integer."""
    device = (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl"
              else torch.device("cpu"))
    value = torch.tensor([int(flag)], dtype=torch.int32, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


def _last_complete(save_dir: str) -> str:
    try:
        return (f"the last complete checkpoint is {read_latest(save_dir)} in {save_dir} (relaunch with --load "
                f"{save_dir} to resume from it)")
    except CheckpointError:
        return f"{save_dir} holds no complete checkpoint ('latest' names none)"


def _fail_save(save_dir: str, tag: str, rank: int, failure: tuple[str, str], failed_ranks: int) -> None:
    """Every rank: rank 0 removes the partial ``save_dir/tag`` and prints the one line; all raise."""
    path, cause = failure
    tag_dir = os.path.join(save_dir, tag)
    try:
        latest = read_latest(save_dir)
    except CheckpointError:
        latest = None
    if latest == tag:  # re-saving the tag `latest` names: never remove the checkpoint it points at
        removed = f"{tag_dir} is the tag 'latest' names and was partly overwritten: check it before resuming"
    else:
        removed = f"removed the partial {tag_dir}"
        if dist.get_rank() == 0:
            shutil.rmtree(tag_dir, ignore_errors=True)
    others = failed_ranks - 1
    more = f" (and {others} more rank{'s' if others > 1 else ''})" if others else ""
    message = (f"could not save checkpoint {tag} to {save_dir}: rank {rank}{more} could not write {path}: {cause}; "
               f"{removed}; 'latest' is unchanged: {_last_complete(save_dir)}")
    if dist.get_rank() == 0:  # the ranks agreed on the message: said once
        logger.error(message)
    dist.barrier()  # the directory is gone before any rank raises
    raise CheckpointSaveError(message)


def _clear_tag(save_dir: str, tag: str, run_id: str) -> None:
    """Every rank, before a save writes ``save_dir/tag``: rank 0 moves aside a directory there that this run did not
    write (``run_dir.clear_tag_for``); the ranks then agree (the barrier before any rank writes into it). A move
    that fails stops the save on every rank, the directory left as it was."""
    failure = None
    if dist.get_rank() == 0:
        try:
            clear_tag_for(save_dir, tag, run_id)
        except OSError as e:
            failure = (os.path.join(save_dir, tag), _cause(e))
    outcome = _agree(failure)
    if outcome is not None:
        path, cause = outcome[1]
        message = (f"could not save checkpoint {tag} to {save_dir}: {path} is there, not written by this run, and "
                   f"could not be moved aside ({cause}); nothing was written, 'latest' is unchanged: "
                   f"{_last_complete(save_dir)}")
        if dist.get_rank() == 0:
            logger.error(message)
        raise CheckpointSaveError(message)


def write_checkpoint(engine, save_dir: str, state: TrainState, config: ModelConfig, topology: Topology,
                     tracker: RNGStatesTracker, *, tokenizer: dict | None = None, num_chunks: int = 1,
                     resolved_config: str | None = None, background=None) -> tuple[str, tuple[str, str] | None]:
    """Every rank: its files of the save at ``state.iteration``; ``latest`` is left as it is (:func:`commit_save`
    moves it once every rank's files are on disk). Returns (the tag, this rank's failure or None).

    ``tokenizer``: the run's tokenizer settings (``files.tokenizer_settings``), recorded for the tools;
    ``resolved_config``: the run's flags as a config file (``config_file.dump_resolved``), recorded as
    ``resolved_config`` in the metadata (``--config`` of it reproduces the run).

    ``background`` (--async-save: an idle ``async_save.BackgroundWriter``): every file is snapshotted to host memory
    and queued, and this returns before anything is written; the writer's seal carries this rank's failure (the
    failure returned is None) and ``AsyncCheckpointer.commit`` commits the save later."""
    tag = checkpoint_tag(state.iteration)
    rng = rng_state(tracker)
    if topology.cp_size > 1:
        # DeepSpeed writes the client state from the first rank of its data-parallel group (DP x CP) only, but each
        # CP rank has streams of its own (other tokens, other dropout masks): that rank's file carries them all.
        every = [None] * topology.cp_size
        dist.all_gather_object(every, rng, group=topology.cp_group)
        rng = {**rng, "context_parallel": every}
    state = dataclasses.replace(state, rng=rng)
    meta = {"model_config": dataclasses.asdict(config), "tp_size": topology.tp_size, "pp_size": topology.pp_size,
            "iteration": state.iteration, "train_state": dataclasses.asdict(state), "num_chunks": num_chunks}
    if tokenizer is not None:
        meta["tokenizer"] = tokenizer
    if resolved_config is not None:
        meta["resolved_config"] = resolved_config
    _clear_tag(save_dir, tag, state.run_id)
    safe = install_checkpoint_engine(engine)
    safe.take_failure()
    if background is not None:
        background.begin(save_dir, tag)
    safe.background = background
    try:
        engine.save_checkpoint(save_dir, tag=tag, client_state={META_KEY: meta}, save_latest=False)
    finally:
        safe.background = None
    if background is not None:
        background.seal(safe.take_failure())  # written behind training; committed at a later step boundary
        return tag, None
    return tag, safe.take_failure()


def commit_save(save_dir: str, tag: str, failure: tuple[str, str] | None) -> None:
    """Every rank, once its files of ``save_dir/tag`` are written and synced (``failure``: why not, on this rank):
    ``latest`` names the tag, or every rank raises CheckpointSaveError (see ``_fail_save``). On return ``latest``
    names ``tag`` on disk and every rank knows it (what the manager's retention then relies on)."""
    outcome = _agree(failure)  # every rank's files are written, or why not
    if outcome is not None:
        _fail_save(save_dir, tag, *outcome)
    failure = None
    if dist.get_rank() == 0:
        try:
            write_latest(save_dir, tag)
        except OSError as e:
            failure = (os.path.join(save_dir, "latest"), _cause(e))
    outcome = _agree(failure)  # also the barrier: `latest` names the tag before any rank goes on
    if outcome is not None:
        _fail_save(save_dir, tag, *outcome)


def _check_train_state(path, state: object) -> None:
    """The training state a resume restores (``TrainState``, RNG streams as tensors), checked for its types."""
    where = f"{path}: train_state"
    fields = {f.name for f in dataclasses.fields(TrainState)}
    if not isinstance(state, dict) or not set(state) <= fields or not {"iteration", "consumed_train_samples",
                                                                       "rng"} <= set(state):
        raise CheckpointError(f"{where} is not a training state (the fields of TrainState)")
    for key in ("iteration", "consumed_train_samples"):
        if type(state[key]) is not int or state[key] < 0:
            raise CheckpointError(f"{where}: {key} is {type_name(state[key])}, not an integer >= 0")
    for key in ("wandb_run_id", "run_id"):
        if state.get(key) is not None and not isinstance(state[key], str):
            raise CheckpointError(f"{where}: {key} is {type_name(state[key])}, not a string")
    rng = state["rng"]
    if not (isinstance(rng, dict) and isinstance(rng.get("cpu"), torch.Tensor) and isinstance(rng.get("tracker"), dict)
            and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in rng["tracker"].items())):
        raise CheckpointError(f"{where}: rng is not the random-number states (tensors under 'cpu' and 'tracker')")
    per_cp_rank = rng.get("context_parallel", [])
    if not isinstance(per_cp_rank, list) or not all(
            isinstance(r, dict) and isinstance(r.get("cpu"), torch.Tensor) and isinstance(r.get("tracker"), dict)
            and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in r["tracker"].items())
            for r in per_cp_rank):
        raise CheckpointError(f"{where}: rng's context_parallel entry is not one random-number state per CP rank")


def check_training_state(tag: str, files: TagFiles, states: dict[int, dict]) -> int:
    """Before ``load_checkpoint``: what it reads beyond the weights is there and agrees with the files (``states``:
    each model-parallel rank's model file, all present): the training state, at the iteration the tag names, and
    DeepSpeed's fields with the world sizes of the files present. Returns the DP size DeepSpeed recorded (how many
    ZeRO files each model-parallel rank must have). :class:`IncompleteCheckpoint` (or CheckpointError for a field of
    the wrong type) otherwise."""
    path, meta = files.model[0], states[0][META_KEY]
    if "train_state" not in meta:
        evidence = "ZeRO optimizer files" if files.zero else "DeepSpeed's fields in the model file"
        raise IncompleteCheckpoint(f"{path} records no training state (iteration, consumed samples, RNG streams), "
                                   f"though {evidence} show a training run saved it", Part.TRAINING)
    _check_train_state(path, meta["train_state"])
    iteration = meta["iteration"]
    if meta["train_state"]["iteration"] != iteration:
        raise IncompleteCheckpoint(f"{path}: its training state is at iteration {meta['train_state']['iteration']}, "
                                   f"its metadata at {iteration}", Part.TRAINING)
    if tag.startswith("iter_") and tag != checkpoint_tag(iteration):
        raise IncompleteCheckpoint(f"{path} records iteration {iteration}, but its tag directory is {tag} (a save at "
                                   f"iteration {iteration} writes {checkpoint_tag(iteration)}): the files were moved "
                                   f"or copied over another save's", Part.TRAINING)
    mp_size, dp_sizes = len(states), set()
    for mp_rank, state in sorted(states.items()):
        check_model_states(files.model[mp_rank], state)
        if state["mp_world_size"] != mp_size:
            raise IncompleteCheckpoint(f"{files.model[mp_rank]}: DeepSpeed recorded {state['mp_world_size']} "
                                       f"model-parallel ranks, the metadata TP x PP = {mp_size}", Part.TRAINING)
        dp_sizes.add(state["dp_world_size"])
    if len(dp_sizes) != 1 or 0 in dp_sizes:
        raise IncompleteCheckpoint(f"{files.tag_dir}: its model files record the DP sizes {sorted(dp_sizes)}, not one "
                                   f"DP size >= 1: files of different saves are mixed in", Part.TRAINING)
    return dp_sizes.pop()


def load_checkpoint(engine, load_dir: str, tag: str, tracker: RNGStatesTracker, *, load_optimizer_states: bool = True,
                    load_rng: bool = True, topology: Topology | None = None) -> TrainState:
    """Resume model, optimizer, LR schedule, consumed samples and RNG states from a training checkpoint.

    Every file DeepSpeed reads goes through :class:`SafeCheckpointEngine` (weights-only). A file refused there
    (changed since the preflight check) stops every rank with one ``error:`` line from rank 0
    (:class:`CheckpointLoadError`); nothing in it is run.

    ``load_optimizer_states=False`` (--no-load-optim): the optimizer starts afresh (no Adam moments, its step count
    from 0) while the weights, LR schedule and counters are restored. DeepSpeed (0.19.8, ``engine.load_checkpoint``)
    then skips the ZeRO partition files altogether and rebuilds ZeRO-1/2's fp32 master partitions from the loaded
    model weights (``_restore_from_bit16_weights``: each DP rank copies its slice of the flat weight buffer), so the
    first step updates the loaded weights, not the initial ones; and the ZeRO files' DP size need not be this run's.
    ``load_rng=False`` (--no-load-rng): the random-number streams stay as this run seeded them. A checkpoint saved
    at the same CP size gives each CP rank (of ``topology``) its own streams back; at another CP size (through the
    universal format or not) CP rank 0's, as every rank of a run without CP has."""
    install_checkpoint_engine(engine)
    error = None
    try:  # DeepSpeed's ZeRO-1/2 load runs no collective after its reads: every rank reaches _agree below
        _, client = engine.load_checkpoint(load_dir, tag=tag, load_optimizer_states=load_optimizer_states,
                                           load_lr_scheduler_states=True)
    except CheckpointError as e:
        error, client = " ".join(str(e).split()), None
    outcome = _agree(error)
    if outcome is not None:
        message = f"--load {load_dir} ({tag}): {outcome[1]}"
        if dist.get_rank() == 0:
            logger.error(message)
        raise CheckpointLoadError(message)
    if client is None or "train_state" not in client.get(META_KEY, {}):
        raise CheckpointError(f"--load {load_dir} ({tag}): DeepSpeed found no training state to resume")
    state = TrainState(**client[META_KEY]["train_state"])
    if load_rng:
        per_cp_rank = state.rng.get("context_parallel", [])
        cp_rank, cp_size = (topology.cp_rank, topology.cp_size) if topology is not None else (0, 1)
        set_rng_state(per_cp_rank[cp_rank] if len(per_cp_rank) == cp_size > 1 else state.rng, tracker)
    return state
