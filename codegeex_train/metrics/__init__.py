"""Metrics are data: one record (a flat dict) per logged step, sent to interchangeable sinks.

A record holds ``iteration``, an optional ``split`` ("train" default, "valid", "test") and plain numbers.
Train records use the names ``consumed_samples lr loss grad_norm loss_scale skipped_iterations
iteration_time_ms tokens_per_s tflops_per_device mfu memory_gb`` (``skipped_iterations``: optimizer steps that
DeepSpeed skipped in the log interval, fp16 overflows); eval records ``{split}_loss {split}_ppl``. Any other key
is carried through every sink too. Sinks:

- console: one Megatron-style line per record (only the keys present; the byte counts ``comm_*`` and
  ``memory_*_bytes`` are left to the file, wandb and the plots);
- JSON lines (``--metrics-file``, default ``<save>/metrics.jsonl``): appended, so a resumed run continues
  the same file; after a restart from an older checkpoint some iterations appear twice, and the later
  line is the one that counts;
- wandb (``--wandb-project``): ``{split}/{name}`` at ``step=iteration``, offline when there is no key;
- TensorBoard (``--tensorboard-dir``): the same names, steps and values (double precision), less what Megatron's
  ``--no-log-*-to-tensorboard`` switches and ``--tensorboard-log-interval`` leave out.

Only the logging rank (the last pipeline stage's first rank: it holds the loss) writes anything; every
other rank builds a ``MetricsLogger(enabled=False)`` so the trainer calls it unconditionally.

Credentials never reach a sink: the value of every environment variable whose name looks like a credential
(``*KEY*``, ``*TOKEN*``, ``*SECRET*``, ``*PASSWORD*``, ...; values of 8+ characters) is replaced by
``<redacted>`` wherever it appears in a record, the run config or the wandb run name (e.g. a token pasted
into a path on the command line), and so are credentials recognisable by their form (a URL's user information,
``?token=``, ``hf_...``): ``config/redaction.py``, which the resolved config and the checkpoints use too. wandb
records no command line when one of them is in ``sys.argv``.

=======================  ================================================================
``records.py``           building a record (speed, memory), plain values, the console line
``sinks.py``             console and JSON lines
``wandb_sink.py``        wandb, online or offline, and a reader for offline runs
``tensorboard_sink.py``  TensorBoard event files
``logger.py``            ``MetricsLogger``: what the loop calls
=======================  ================================================================

May import nothing else of codegeex_train (``config`` for a type and its redaction): the loop, evaluation and
tools all log through it.
"""

from codegeex_train.config.redaction import REDACTED, redact_secrets, secret_values
from codegeex_train.metrics.logger import MetricsLogger
from codegeex_train.metrics.records import format_record, memory_gb, plain_record, throughput_record
from codegeex_train.metrics.sinks import ConsoleSink, JsonlSink
from codegeex_train.metrics.tensorboard_sink import TensorBoardSink
from codegeex_train.metrics.wandb_sink import WandbSink, read_offline_wandb_history

__all__ = ["MetricsLogger", "ConsoleSink", "JsonlSink", "WandbSink", "TensorBoardSink", "format_record",
           "plain_record", "throughput_record", "memory_gb", "read_offline_wandb_history", "secret_values",
           "redact_secrets", "REDACTED"]
