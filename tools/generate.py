"""Complete code with a trained checkpoint: KV-cached decoding at the checkpoint's TP size.

    # one prompt, greedy (single process, CPU or one GPU)
    python tools/generate.py --load outputs/codegen-default --prompt 'def fibonacci(n):\\n' --max-new-tokens 64
    # a file of prompts (jsonl: one {"prompt": ...} object per line, other keys copied to the output; any other
    # file, .gz too: the whole file is one prompt), sampled, HumanEval's stop strings, jsonl out
    python tools/generate.py --load CKPT --prompt-file prompts.jsonl --output completions.jsonl \\
        --temperature 0.8 --top-p 0.95 --seed 1 --stop '\\ndef' '\\nclass' '\\nif' '\\nprint' '\\n#'
    # a TP 2 checkpoint on 2 processes (gloo on CPU, nccl on GPUs), launched like training
    torchrun --nproc_per_node 2 tools/generate.py --load CKPT_TP2 --tensor-model-parallel-size 2 --prompt ...
    # a Hugging Face model directory as it is (e.g. a downloaded Qwen2.5-Coder): converted on the fly at TP 1 into
    # a temporary directory (one line on stderr says so), its tokenizer with it
    python tools/generate.py --load ~/models/Qwen2.5-Coder-1.5B --prompt 'def quicksort(xs):\\n'
    # interactive: with neither --prompt nor --prompt-file, prompts are read from stdin
    python tools/generate.py --load CKPT
    # fill in the middle (a checkpoint trained with --fim-rate > 0): a file with one <FILL_HERE> where the middle
    # goes, or the prefix and suffix; the filled-in text is printed (with --output: the middle, as "completion")
    python tools/generate.py --load CKPT --infill module.py --max-new-tokens 64
    python tools/generate.py --load CKPT --prefix 'def add(a, b):\\n    ' --suffix '\\n\\nprint(add(1, 2))\\n'

The tokenizer is the one the checkpoint records (training checkpoints record their tokenizer flags, file paths
absolute); any tokenizer flag given (--tokenizer-type/--tokenizer-model/--vocab-file/--merge-file/
--whitespace-encoding) replaces it; a checkpoint that records none (e.g. converted) gets the flags or, with none,
the shipped default tokenizer. One line on stderr says which. In --prompt and --stop, \\n, \\t and \\\\ stand for a
newline, a tab and a backslash; --prompt-file is read verbatim. Completions are cut before the first stop string;
CodeGeeX's whitespace tokens come out as spaces. All TP ranks emit the same tokens (the TP group's first rank
samples and broadcasts; see codegeex_train/generation/generator.py); rank 0 prints and writes.

Infilling (--infill FILE..., or --prefix/--suffix) builds the fill-in-the-middle prompt in the order the checkpoint
records it was trained with (the one it saw most: SPM when its --fim-spm-rate was above 0.5, else PSM; between 0
and 1 it saw both and either works; --fim-order psm|spm chooses) and ends the middle at the end of the
document (EOD) or any FIM sentinel. A checkpoint trained without FIM (or recording nothing of it) is refused; one
converted from a family whose tokenizer holds its FIM sentinels (Qwen2.5-Coder, StarCoder2, DeepSeek-Coder) records
that it infills, in PSM and its own sentinels.

Bad input ends with one ``generate.py: error: ...`` line and a non-zero exit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from codegeex_train.checkpoint.files import TOKENIZER_FIELDS, CheckpointError, checkpoint_tokenizer
from codegeex_train.config.arguments import ConfigError, DataConfig, ParallelConfig
from codegeex_train.config.model_config import ModelConfig
from codegeex_train.config.options import Default, add_config_flags
from codegeex_train.config.tokenizer_flags import TokenizerFlags
from codegeex_train.bounded_read import FileReadError, describe_size, json_objects, read_text
from codegeex_train.tokenization.code_tokens import FIM_ORDERS
from codegeex_train.tokenization.tokenizer import TokenizerError, load_tokenizer
from codegeex_train.distributed.cluster import ClusterError, join_process_group, rank_env_from_slurm
from codegeex_train.distributed.log import get_logger, setup_logging
from codegeex_train.distributed.topology import Topology
from codegeex_train.formats.huggingface.on_the_fly import checkpoint_dir
from codegeex_train.layout.dims import ParallelDims
from codegeex_train.generation import FimFormat, Generator, InfillError, SamplingParams
from codegeex_train.generation.generator import check_checkpoint_layout
from codegeex_train.generation.infill import DEFAULT_MARKER, fim_format, fim_tokens_if_trained, split_at_marker

PROG = "generate.py"
logger = get_logger("tools.generate")
PARALLEL_FIELDS = ("tensor_model_parallel_size", "distributed_backend", "distributed_timeout_minutes")
END_OF_PROMPT = "."  # interactive mode: a line holding only this ends a prompt
_ESCAPE = re.compile(r"\\([nt\\])")
# The most read of one input: a --prompt-file (decompressed), an --infill file, a prompt on stdin.
MAX_INPUT_BYTES = 256 << 20


class GenerateError(ValueError):
    """Bad input; the message names the flag, file or prompt."""


def unescape(text: str) -> str:
    """\\n, \\t and \\\\ as a newline, a tab and a backslash; any other backslash stays."""
    return _ESCAPE.sub(lambda m: {"n": "\n", "t": "\t", "\\": "\\"}[m.group(1)], text)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--load", required=True, help="checkpoint directory (its 'latest'), saved by training or "
                   "tools/convert_checkpoint.py at this TP size and PP 1; or a Hugging Face model directory "
                   "(config.json: Llama, Mistral, Qwen2, StarCoder2, GPT-2, CodeGeeX), converted on the fly at TP 1")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--prompt", help="one prompt (\\n, \\t, \\\\ escapes)")
    source.add_argument("--prompt-file", help="jsonl of {\"prompt\": ...} objects, one per line (other keys are "
                        "copied to --output); any other file (.gz too) is one prompt")
    source.add_argument("--infill", nargs="+", metavar="FILE", help="fill in the middle of each file, marked by one "
                        f"--infill-marker (default {DEFAULT_MARKER}); needs a checkpoint trained with --fim-rate > 0")
    fim = p.add_argument_group("fill in the middle (a checkpoint trained with --fim-rate > 0)")
    fim.add_argument("--prefix", help="the text before the middle (\\n, \\t, \\\\ escapes; default empty with "
                     "--suffix)")
    fim.add_argument("--suffix", help="the text after the middle (escapes as --prefix; default empty with --prefix)")
    fim.add_argument("--infill-marker", default=DEFAULT_MARKER, help="what marks the middle in --infill files "
                     "(default: %(default)s)")
    fim.add_argument("--fim-order", choices=FIM_ORDERS, default=None, help="prompt order (default: the one the "
                     "checkpoint trained with: spm when its --fim-spm-rate was above 0.5, else psm)")
    p.add_argument("--output", help="write one jsonl record per prompt: its input keys, prompt, completion; "
                   "infilling: infill (the file), prefix, suffix, completion (the middle) (default: print the "
                   "prompts and completions, or the filled-in texts)")
    s = p.add_argument_group("sampling")
    add_config_flags(s, SamplingParams, SamplingParams.FLAGS)
    s.add_argument("--stop", nargs="+", default=[], metavar="STRING", help="end a completion before the first of "
                   "these strings (\\n, \\t, \\\\ escapes), e.g. HumanEval's '\\ndef' '\\nclass' '\\nif' '\\nprint' "
                   "'\\n#'")
    s.add_argument("--batch-size", type=int, default=8, help="rows decoded together (continuous batching: a "
                   "finished row makes room for the next prompt; default: 8)")
    m = p.add_argument_group("device")
    m.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: this rank's GPU when CUDA is available and DS_ACCELERATOR is not cpu")
    precision = m.add_mutually_exclusive_group()
    precision.add_argument("--bf16", action="store_true", help="weights and cache in bf16 (default fp32)")
    precision.add_argument("--fp16", action="store_true", help="weights and cache in fp16")
    add_config_flags(p.add_argument_group("tokenizer (default: the one the checkpoint records; any of these "
                                          "replaces it)"), TokenizerFlags,
                     defaults=dict.fromkeys(TOKENIZER_FIELDS, Default(shown="the checkpoint's")))
    add_config_flags(p.add_argument_group("parallelism"), ParallelConfig, PARALLEL_FIELDS)
    args = p.parse_args(argv)
    args.infilling = args.infill is not None or args.prefix is not None or args.suffix is not None
    if (args.prefix is not None or args.suffix is not None) and (args.prompt is not None or args.prompt_file
                                                                  is not None or args.infill is not None):
        p.error("--prefix/--suffix: not with --prompt, --prompt-file or --infill (they name another input)")
    if not args.infilling and (args.fim_order is not None or args.infill_marker != DEFAULT_MARKER):
        p.error("--fim-order and --infill-marker go with --infill or --prefix/--suffix")
    if not args.infill_marker:
        p.error("--infill-marker: must not be empty")
    if args.batch_size < 1:
        p.error(f"--batch-size {args.batch_size}: must be >= 1")
    if args.tensor_model_parallel_size < 1:
        p.error(f"--tensor-model-parallel-size {args.tensor_model_parallel_size}: must be >= 1")
    return args


def not_utf8(text: str, where: str) -> None:
    """GenerateError when ``text`` holds a lone surrogate: bytes that were not UTF-8 (Python decodes them so from the
    command line and a C-locale stdin) or a JSON ``\\udXXX`` escape. No tokenizer can encode it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        what = f"the byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"a lone surrogate U+{code:04X}"
        raise GenerateError(f"{where}: not UTF-8 text ({what} at character {e.start}); give the text in UTF-8") \
            from None


def read_prompt_file(path: str) -> list[dict]:
    """Records with a "prompt": a jsonl file's objects, or the whole file as one prompt (at most
    ``MAX_INPUT_BYTES``, decompressed)."""
    text = read_text(path, MAX_INPUT_BYTES, "--prompt-file", gunzip=Path(path).suffix == ".gz")
    lines = text.splitlines()
    first = next((line for line in lines if line.strip()), "")
    try:
        jsonl = isinstance(json.loads(first), dict)
    except (json.JSONDecodeError, RecursionError):  # not JSON (or nested past Python's limit): no JSON lines
        jsonl = False
    if not jsonl:
        if not text:
            raise GenerateError(f"--prompt-file {path}: the file is empty")
        return [{"prompt": text}]
    records = []
    for lineno, record in json_objects(enumerate(lines, 1), path):  # FileReadError naming the line
        if not isinstance(record.get("prompt"), str):
            raise GenerateError(f"{path}:{lineno}: expected a JSON object with a string \"prompt\"")
        records.append(record)
    return records


def read_infill_file(path: str, marker: str) -> dict:
    """{"infill": path, "prefix", "suffix"}: the UTF-8 file (at most ``MAX_INPUT_BYTES``) split at its one
    ``marker``."""
    text = read_text(path, MAX_INPUT_BYTES, "--infill")
    prefix, suffix = split_at_marker(text, marker, f"--infill {path}")
    return {"infill": path, "prefix": prefix, "suffix": suffix}


def check_infill(tokenizer, config: ModelConfig, fim: FimFormat, record: dict, where: str) -> None:
    not_utf8(record["prefix"] + record["suffix"], where)
    n = len(fim.prompt_ids(tokenizer, record["prefix"], record["suffix"]))
    if n > config.max_position_embeddings:
        raise GenerateError(f"{where}: prefix and suffix are {n} tokens with the FIM sentinels; the model has "
                            f"{config.max_position_embeddings} positions (--max-position-embeddings)")


def check_prompt(tokenizer, config: ModelConfig, prompt: str, where: str) -> None:
    not_utf8(prompt, where)
    n = len(tokenizer.encode(prompt))
    if n == 0:
        raise GenerateError(f"{where}: the prompt is empty")
    if n > config.max_position_embeddings:
        raise GenerateError(f"{where}: the prompt is {n} tokens; the model has {config.max_position_embeddings} "
                            f"positions (--max-position-embeddings)")


def prepare(args: argparse.Namespace, world_size: int):
    """Everything checkable before any process group: sampling flags, layout, tokenizer, checkpoint, prompts.
    Returns (sampling params, tokenizer, model config, records or None, the line saying which tokenizer, the FIM
    format when infilling else None)."""
    for i, stop in enumerate(args.stop, 1):
        not_utf8(stop, f"--stop (string {i})")
    not_utf8(args.infill_marker, "--infill-marker")
    try:
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, seed=args.seed, stop=tuple(unescape(s) for s in args.stop))
    except ValueError as e:
        raise GenerateError(str(e)) from None
    tp = args.tensor_model_parallel_size
    if tp != world_size:
        raise GenerateError(f"--tensor-model-parallel-size {tp} with {world_size} process(es): generation runs one TP "
                            f"group, so launch {tp} processes (torchrun --nproc_per_node {tp})")
    _, meta = check_checkpoint_layout(args.load, tp)
    settings, which = checkpoint_tokenizer(args.load, meta, {name: getattr(args, name) for name in TOKENIZER_FIELDS})
    tokenizer = load_tokenizer(DataConfig(**settings))
    fim_tokens_if_trained(meta, tokenizer)  # a FIM-trained model's sentinels, at the ids training gave them
    config = ModelConfig(**meta["model_config"])
    if tokenizer.vocab_size > config.padded_vocab_size:
        raise GenerateError(f"the tokenizer has {tokenizer.vocab_size} ids, more than the {config.padded_vocab_size} "
                            f"of --load {args.load}: pass the tokenizer flags training used")
    records, fim = None, None
    if args.infilling:
        fim = fim_format(meta, tokenizer, args.fim_order, where=f"checkpoint {args.load}",
                         flag="--infill" if args.infill is not None else "--prefix/--suffix")
        if args.infill is not None:
            records = [read_infill_file(path, args.infill_marker) for path in args.infill]
        else:
            records = [{"prefix": unescape(args.prefix or ""), "suffix": unescape(args.suffix or "")}]
        for record in records:
            check_infill(tokenizer, config, fim, record, f"--infill {record['infill']}" if "infill" in record
                         else "--prefix/--suffix")
    elif args.prompt is not None:
        records = [{"prompt": unescape(args.prompt)}]
        check_prompt(tokenizer, config, records[0]["prompt"], "--prompt")
    elif args.prompt_file is not None:
        records = read_prompt_file(args.prompt_file)
        for i, record in enumerate(records):
            check_prompt(tokenizer, config, record["prompt"], f"--prompt-file {args.prompt_file} prompt {i + 1}")
    return params, tokenizer, config, records, which, fim


def init_group(args: argparse.Namespace, world_size: int) -> tuple[object, torch.device]:
    """(TP group or None, device): one process needs no process group; N processes form one TP group."""
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()
                                         and os.environ.get("DS_ACCELERATOR", "cuda") != "cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if world_size == 1:
        return None, device
    backend = args.distributed_backend if args.distributed_backend != "auto" else ("nccl" if use_cuda else "gloo")
    timeout = timedelta(minutes=args.distributed_timeout_minutes)
    if not dist.is_initialized():
        join_process_group(backend, timeout, device)
    topology = Topology(ParallelDims(world_size, world_size, 1), timeout=timeout)  # as training builds it
    return topology.tp_group, device


def read_stdin_prompt(stdin) -> tuple[str | None, bool]:
    """(prompt, more): binary ``stdin``'s lines until one holding only '.' (more prompts may follow) or the end of
    input, as UTF-8 text with text mode's line ends; None when no line was read. A prompt that is not UTF-8, or
    past ``MAX_INPUT_BYTES`` (its rest read and dropped a bounded line at a time, so that the next prompt starts
    after its '.'), is a GenerateError."""
    lines, size, more = [], 0, False
    while line := stdin.readline(MAX_INPUT_BYTES + 1):
        if line.rstrip(b"\r\n") == END_OF_PROMPT.encode():
            more = True
            break
        size += len(line)
        if size <= MAX_INPUT_BYTES:
            lines.append(line)
        else:
            lines.clear()  # hold none of it while the rest is skipped
    if size > MAX_INPUT_BYTES:
        raise GenerateError(f"a prompt on stdin: larger than {describe_size(MAX_INPUT_BYTES)}, the bound on one "
                            f"prompt: refused")
    if not lines:
        return None, more
    try:
        return b"".join(lines).decode("utf-8").replace("\r\n", "\n").replace("\r", "\n"), more
    except UnicodeDecodeError as e:
        raise GenerateError(f"a prompt on stdin: not UTF-8 text ({e.reason} at byte {e.start})") from None


def read_interactive(rank: int) -> tuple[str | None, bool, str | None]:
    """(prompt, more, error): rank 0 reads a prompt from stdin (``read_stdin_prompt``); every rank receives the
    same. The prompt is None when no line was read, or when ``error`` says why it was refused."""
    message = (None, False, None)
    if rank == 0:
        try:
            message = (*read_stdin_prompt(sys.stdin.buffer), None)
        except GenerateError as e:
            message = (None, True, str(e))
    if dist.is_initialized():
        box = [message]
        dist.broadcast_object_list(box, src=0)
        message = box[0]
    return message


class Sink:
    """Rank 0's output: jsonl records in --output, else the prompts and completions on stdout."""

    def __init__(self, output: str | None, rank: int):
        self.file = None
        self.rank, self.count = rank, 0
        if output and rank == 0:
            try:
                Path(output).parent.mkdir(parents=True, exist_ok=True)
                self.file = open(output, "w", encoding="utf-8")
            except OSError as e:
                raise GenerateError(f"--output {output}: cannot write it ({e.strerror or e})") from None

    def put(self, record: dict, completion: str, show_prompt: bool = True) -> None:
        if self.rank != 0:
            return
        if self.file is not None:
            self.file.write(json.dumps({**record, "completion": completion}, ensure_ascii=False) + "\n")
            self.file.flush()
        else:
            if self.count:
                print("-" * 40)
            if "suffix" in record:  # an infilled middle: the whole text
                print(record["prefix"] + completion + record["suffix"], flush=True)
            else:
                print((record["prompt"] if show_prompt else "") + completion, flush=True)
        self.count += 1

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def run_batches(gen: Generator, records: list[dict], params: SamplingParams, batch_size: int, sink: Sink,
                fim: FimFormat | None = None) -> None:
    """Every record through the generator's continuous batching (``batch_size`` rows at once), written in the
    records' order as soon as each one and those before it are done."""
    if fim is None:
        stream = gen.stream([r["prompt"] for r in records], params, batch_size=batch_size)
    else:
        stream = gen.stream_infill([r["prefix"] for r in records], [r["suffix"] for r in records], params, fim,
                                   batch_size=batch_size)
    done: dict[int, str] = {}
    written = 0
    for index, completion in stream:
        done[index] = completion
        while written in done:
            sink.put(records[written], done.pop(written))
            written += 1


def interactive(gen: Generator, params: SamplingParams, config: ModelConfig, tokenizer, rank: int, sink: Sink) -> None:
    logger.info(f"Type or paste a prompt; a line holding only '{END_OF_PROMPT}' generates, the end of input (Ctrl-D) "
                f"generates and quits.")
    more = True
    while more:
        prompt, more, error = read_interactive(rank)
        try:
            if error is not None:
                raise GenerateError(error)
            if prompt is None:
                continue
            check_prompt(tokenizer, config, prompt, "prompt")
        except GenerateError as e:  # a bad prompt does not end the session
            if rank == 0:
                print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
            continue
        sink.put({"prompt": prompt}, gen.generate([prompt], params)[0], show_prompt=False)


def fail(message: str, rank: int, code: int = 2) -> None:
    if rank == 0:
        print(f"{PROG}: error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def main(argv: list[str] | None = None) -> None:
    rank_env_from_slurm()
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if rank != 0:
        warnings.simplefilter("ignore")  # every rank would repeat rank 0's warnings
    setup_logging(rank=rank, info_stream="stderr")  # stdout is the completions
    args = parse_args(argv)
    with contextlib.ExitStack() as converted:
        try:  # --load HF_DIR: converted on the fly (removed on leaving)
            args.load, note = converted.enter_context(checkpoint_dir(args.load, args.tensor_model_parallel_size))
        except (CheckpointError, ValueError, OSError) as e:
            fail(str(e), rank)
        if note:
            logger.info(note)
        generate(args, rank, world_size)


def generate(args: argparse.Namespace, rank: int, world_size: int) -> None:
    """main's work once ``args.load`` is a checkpoint of ours."""
    try:  # the same on every rank: rank 0 reports
        params, tokenizer, config, records, which_tokenizer, fim = prepare(args, world_size)
        sink = Sink(args.output, rank)
    except (GenerateError, ConfigError, TokenizerError, CheckpointError, InfillError, FileReadError, OSError) as e:
        fail(str(e), rank)
    logger.info(which_tokenizer)
    owns_group = world_size > 1 and not dist.is_initialized()
    try:
        tp_group, device = init_group(args, world_size)
    except ClusterError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    try:
        error = None
        try:
            dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
            gen = Generator.from_checkpoint(args.load, tokenizer, tp_group=tp_group, device=device, dtype=dtype)
        except (CheckpointError, ValueError, OSError) as e:  # a shard may fail on one rank only
            error = f"{'' if rank == 0 else f'rank {rank}: '}{e}"
        errors = [error]
        if world_size > 1:
            errors = [None] * world_size
            dist.all_gather_object(errors, error)
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            fail(first, rank)
        if records is None:
            interactive(gen, params, config, tokenizer, rank, sink)
        else:
            run_batches(gen, records, params, args.batch_size, sink, fim)
    finally:
        sink.close()
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()
    if sink.file is not None:
        logger.info(f"wrote {sink.count} completion(s) to {args.output}")


if __name__ == "__main__":
    main()
