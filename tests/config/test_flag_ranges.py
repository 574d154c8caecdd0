"""Every numeric flag, any value (huge and negative integers, NaN, infinities, fractions for an integer flag): the
command line either accepts it, and then it lies in the range a Megatron user expects (the table below, written
here rather than read from the fields' ``bounds``), or refuses it with exactly one ``error:`` line naming the flag
(exit 2 from the parser, or one ``ConfigError`` line, which ``pretrain.main`` prints as ``error: ...``): never a
traceback, never silence. Pure logic, no process group."""

import contextlib
import io
import math
import warnings

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from codegeex_train.config.arguments import SECTIONS, Args, ConfigError, parser, split_problem, validate
from codegeex_train.config.options import dataclass_from_args


def at_least(lo):
    return lambda x: x >= lo


def above(lo):
    return lambda x: x > lo


def unit_open(x):
    return 0 <= x < 1


TABLE = {  # flag: (type, which values a run may take)
    "--num-layers": (int, at_least(1)),
    "--hidden-size": (int, at_least(1)),
    "--num-attention-heads": (int, at_least(1)),
    "--ffn-hidden-size": (int, at_least(1)),
    "--max-position-embeddings": (int, at_least(1)),
    "--make-vocab-size-divisible-by": (int, at_least(1)),
    "--hidden-dropout": (float, unit_open),
    "--attention-dropout": (float, unit_open),
    "--layernorm-epsilon": (float, above(0)),
    "--init-method-std": (float, above(0)),
    "--tensor-model-parallel-size": (int, at_least(1)),
    "--context-parallel-size": (int, at_least(1)),
    "--rotary-percent": (float, lambda x: 0 < x <= 1),
    "--rotary-base": (int, above(1)),
    "--rope-scaling-factor": (float, above(0)),
    "--rope-original-max-position-embeddings": (int, at_least(1)),
    "--rope-low-freq-factor": (float, above(0)),
    "--rope-high-freq-factor": (float, above(0)),
    "--yarn-beta-fast": (float, above(0)),
    "--yarn-beta-slow": (float, above(0)),
    "--yarn-attention-factor": (float, above(0)),
    "--window-size": (int, at_least(1)),
    "--num-query-groups": (int, at_least(1)),
    "--pipeline-model-parallel-size": (int, at_least(1)),
    "--decoder-first-pipeline-num-layers": (int, at_least(1)),
    "--decoder-last-pipeline-num-layers": (int, at_least(1)),
    "--num-layers-per-virtual-pipeline-stage": (int, at_least(1)),
    "--distributed-timeout-minutes": (float, lambda x: 0 < x <= 1e6),  # timedelta overflows far above
    "--micro-batch-size": (int, at_least(1)),
    "--global-batch-size": (int, at_least(1)),
    "--num-microbatches": (int, at_least(1)),
    "--seq-length": (int, at_least(1)),
    "--train-iters": (int, at_least(1)),
    "--seed": (int, lambda x: 0 <= x < 2**32),  # numpy's RandomState
    "--recompute-num-layers": (int, at_least(1)),
    "--save-interval": (int, at_least(0)),  # 0: only at the end (Megatron's falsy interval)
    "--keep-last-n-checkpoints": (int, at_least(1)),
    "--keep-every-n-iterations": (int, at_least(1)),
    "--eval-interval": (int, at_least(0)),
    "--eval-iters": (int, at_least(0)),
    "--eval-humaneval-interval": (int, at_least(1)),
    "--eval-humaneval-tasks": (int, lambda x: 1 <= x <= 164),
    "--eval-humaneval-max-new-tokens": (int, at_least(1)),
    "--eval-infilling-interval": (int, at_least(1)),
    "--eval-infilling-tasks": (int, at_least(1)),
    "--eval-infilling-max-new-tokens": (int, at_least(1)),
    "--fim-rate": (float, lambda x: 0 <= x <= 1),
    "--fim-spm-rate": (float, lambda x: 0 <= x <= 1),
    "--fim-fragment-rate": (float, lambda x: 0 <= x <= 1),
    "--zero-stage": (int, lambda x: x in (0, 1, 2)),
    "--exit-interval": (int, at_least(1)),
    "--exit-duration-in-mins": (float, above(0)),
    "--max-consecutive-skipped-iterations": (int, at_least(0)),
    "--lr": (float, at_least(0)),
    "--min-lr": (float, at_least(0)),
    "--lr-decay-iters": (int, at_least(1)),
    "--lr-warmup-iters": (int, at_least(0)),
    "--lr-warmup-fraction": (float, lambda x: 0 <= x <= 1),
    "--weight-decay": (float, at_least(0)),
    "--clip-grad": (float, at_least(0)),
    "--adam-beta1": (float, unit_open),
    "--adam-beta2": (float, unit_open),
    "--adam-eps": (float, above(0)),
    "--sgd-momentum": (float, unit_open),
    "--num-workers": (int, at_least(0)),
    "--log-interval": (int, at_least(1)),
    "--peak-tflops": (float, above(0)),
    "--tensorboard-log-interval": (int, at_least(1)),
    "--tensorboard-queue-size": (int, at_least(1)),
    "--profile-step-start": (int, at_least(0)),
    "--profile-step-end": (int, at_least(1)),
    "--profile-ranks": (int, at_least(0)),  # several values; each is checked (which ranks exist: at launch)
}
BASE = ["--data-path", "x"]
PARSER = parser()  # built once (15 ms); what parse_args does per call
SETTINGS = settings(derandomize=True, database=None, max_examples=20, deadline=None)
# Tried for every flag on top of the random draws (which need not include them): the values a typo or a computed
# flag in a script produces.
EDGES = ["nan", "inf", "-inf", "1e400", "-1", "0", "1", "0.5", "1.5", str(2**64), "", "x"]


def run(argv: list[str]):
    """(parsed Args or None, the error line or None) of the command line BASE + argv through the parser and
    validate(world size 1)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ns = PARSER.parse_args(BASE + argv)
            args = Args(**{name: dataclass_from_args(cls, ns) for name, cls in SECTIONS.items()})
            validate(args, 1)
    except SystemExit as e:
        lines = err.getvalue().splitlines()
        assert e.code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (argv, e.code, lines)
        return None, lines[0]
    except ConfigError as e:
        assert "\n" not in str(e) and err.getvalue() == "", (argv, str(e))
        return None, f"error: {e}"
    assert err.getvalue() == ""
    return args, None


def value_of(args: Args, flag: str):
    dest = next(a.dest for a in PARSER._actions if flag in a.option_strings)
    section = next(name for name, cls in SECTIONS.items() if dest.startswith(cls.__name__ + "."))
    return getattr(getattr(args, section), dest.split(".", 1)[1])


def texts(kind):
    integers = st.one_of(st.integers(-10, 10), st.integers(-(2**70), 2**70),
                         st.sampled_from([2**31 - 1, 2**32 - 1, 2**32, 2**63, 164, 165]))
    floats = st.one_of(st.floats(), st.floats(-2, 2), st.sampled_from([0.0, -0.0, 1.0, 1e6, 1e300, 5e-324]))
    odd = st.sampled_from(["", "nan", "inf", "-inf", "1.5", "1e3", "0x10", "abc", " 3 "])
    if kind is int:
        return st.one_of(integers.map(str), odd)
    return st.one_of(floats.map(repr), integers.map(str), odd)


def test_the_table_covers_every_numeric_flag():
    numeric = {a.option_strings[0] for a in PARSER._actions
               if getattr(a.type, "__name__", None) in ("int", "float") and a.help != "==SUPPRESS=="}
    assert numeric == set(TABLE)


@pytest.mark.parametrize("flag", sorted(TABLE))
def test_any_value_is_accepted_in_range_or_refused_in_one_line(flag):
    kind, allowed = TABLE[flag]

    @SETTINGS
    @given(text=texts(kind), joined=st.booleans())
    def check(text, joined):
        args, error = run([f"{flag}={text}"] if joined else [flag, text])
        if args is not None:
            value = value_of(args, flag)
            value = value[0] if isinstance(value, list) else value  # a flag of several values, given one
            assert isinstance(value, kind) and math.isfinite(value) and allowed(value), (flag, text, value)
            return
        try:
            in_range = math.isfinite(kind(text)) and allowed(kind(text))
        except ValueError:
            in_range = False
        if not in_range:  # refused for its own value: the line names the flag
            assert flag in error, (text, error)

    for edge in EDGES:
        check = example(text=edge, joined=True)(check)
    check()


@pytest.mark.parametrize("argv", [
    ["--lr", "0", "--min-lr", "0"], ["--clip-grad", "0"], ["--weight-decay", "0"], ["--adam-beta1", "0"],
    ["--adam-beta2", "0.9999"], ["--seed", "0"], ["--seed", str(2**32 - 1)], ["--num-workers", "0"],
    ["--eval-iters", "0"], ["--eval-interval", "0"], ["--save-interval", "0"], ["--lr-warmup-fraction", "1"],
    ["--hidden-dropout", "0", "--attention-dropout", "0.99"], ["--eval-humaneval-tasks", "164"],
    ["--max-consecutive-skipped-iterations", "0"], ["--distributed-timeout-minutes", "1e6"],
    ["--peak-tflops", "0.001"], ["--exit-duration-in-mins", "0.01"], ["--layernorm-epsilon", "1e-12"],
    ["--split", "1"], ["--split", "98,2"], ["--split", "969/30/1"], ["--split", "0,1,0"], ["--split", "0.5, 0.5"],
], ids=lambda argv: " ".join(argv))
def test_boundary_values_are_accepted(argv):
    args, error = run(argv)
    assert error is None


@pytest.mark.parametrize("split", ["0,0,0", "a,b", "1,,2", "1,2,", "1,2,3,4", "nan,1,1", "inf,1,1", "-1,2,1", "",
                                   "1e308,1e308", "1/2,3"])
def test_bad_splits_are_refused(split):
    assert split_problem(split) is not None
    args, error = run([f"--split={split}"])
    assert error.startswith(f"error: --split {split!r} must be 1 to 3 non-negative numbers"), error


@SETTINGS
@given(weights=st.lists(st.one_of(st.floats(), st.integers(-5, 1000)), min_size=0, max_size=5),
       sep=st.sampled_from([",", "/"]))
def test_split_accepted_only_when_megatron_could_use_it(weights, sep):
    text = sep.join(map(str, weights))
    ok = (1 <= len(weights) <= 3 and all(math.isfinite(w) and w >= 0 for w in weights)
          and 0 < sum(map(float, weights)) < math.inf)
    assert (split_problem(text) is None) == ok, text
