"""``MetricsLogger``: one object the loop calls, fanning each record out to the sinks."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from tqdm import tqdm

from codegeex_train.config.redaction import redact_secrets, secret_values
from codegeex_train.metrics.records import plain_record
from codegeex_train.metrics.sinks import ConsoleSink, JsonlSink, Sink
from codegeex_train.metrics.tensorboard_sink import TensorBoardSink
from codegeex_train.metrics.wandb_sink import WandbSink

if TYPE_CHECKING:
    from codegeex_train.config.arguments import LoggingConfig


def tensorboard_exclusions(cfg: LoggingConfig) -> frozenset[str]:
    """The train-record keys Megatron's --no-log-*-to-tensorboard switches keep out of TensorBoard."""
    switches = {"lr": cfg.log_learning_rate_to_tensorboard, "loss_scale": cfg.log_loss_scale_to_tensorboard,
                "grad_norm": cfg.log_gradient_norm_to_tensorboard}
    return frozenset(key for key, on in switches.items() if not on)


class MetricsLogger:
    """Fans each record out to the console, JSON-lines, wandb and TensorBoard sinks, and drives the progress bar.

    Built on every rank; with ``enabled=False`` every method is a no-op and ``wandb_run_id`` is None (a
    trainer that saves the id from another rank must fetch it from the logging rank)."""

    def __init__(self, cfg: LoggingConfig, *, enabled: bool, save_dir: str | None, run_config: dict,
                 train_iters: int, start_iteration: int = 0, resume_wandb_id: str | None = None,
                 wandb_init_timeout: float = 30.0) -> None:
        self.enabled = enabled
        self.sinks: list[Sink] = []
        self.wandb: WandbSink | None = None
        self._bar: tqdm | None = None
        if not enabled:
            return
        self._secrets = secret_values()
        run_config = redact_secrets(run_config, self._secrets)
        self.sinks.append(ConsoleSink(train_iters))
        metrics_file = cfg.metrics_file or (os.path.join(save_dir, "metrics.jsonl") if save_dir else None)
        if metrics_file:
            self.sinks.append(JsonlSink(metrics_file))
        if cfg.wandb_project:
            self.wandb = WandbSink(project=cfg.wandb_project, name=redact_secrets(cfg.wandb_name, self._secrets),
                                   directory=cfg.wandb_dir or save_dir or os.getcwd(), run_config=run_config,
                                   run_id=resume_wandb_id, init_timeout=wandb_init_timeout)
            self.sinks.append(self.wandb)
        if cfg.tensorboard_dir:
            self.sinks.append(TensorBoardSink(cfg.tensorboard_dir, queue_size=cfg.tensorboard_queue_size,
                                              log_interval=cfg.tensorboard_log_interval,
                                              exclude=tensorboard_exclusions(cfg), start_iteration=start_iteration))
        if cfg.progress_bar and sys.stderr.isatty():
            # Only on a terminal: redirected (e.g. `| tee logs/train-*.log`), each carriage-return redraw would
            # land in the log; the console lines above carry the same progress there.
            self._bar = tqdm(total=train_iters, initial=start_iteration, desc="train", unit="it",
                             dynamic_ncols=True, mininterval=1.0)

    @property
    def wandb_run_id(self) -> str | None:
        return self.wandb.run_id if self.wandb else None

    def log(self, record: dict) -> None:
        """Send one record (needs ``iteration``; values may be tensors or numpy scalars) to every sink."""
        if not self.enabled:
            return
        record = redact_secrets(plain_record(record), self._secrets)
        for sink in self.sinks:
            sink.write(record)
        if self._bar is not None and record["split"] == "train" and record.get("loss") is not None:
            self._bar.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)

    def log_metadata(self, record: dict) -> None:
        """A ``split: metadata`` line in metrics.jsonl (run facts such as the cluster layout; wandb has them in
        its run config); not printed, not a metric."""
        if not self.enabled:
            return
        record = redact_secrets({"iteration": int(record["iteration"]), "split": "metadata",
                                 **{k: v for k, v in record.items() if k != "iteration"}}, self._secrets)
        for sink in self.sinks:
            if isinstance(sink, JsonlSink):
                sink.write(record)

    def advance(self, iteration: int) -> None:
        """Move the progress bar to ``iteration`` (call every iteration; cheap, no host sync)."""
        if self._bar is not None:
            self._bar.update(iteration - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        for sink in self.sinks:
            sink.close()
        self.sinks = []

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
