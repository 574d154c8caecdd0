"""``--config`` against the command line (hypothesis): a YAML document of flags of every kind (ints, floats, switches,
choices, paths, lists), written well or hostilely (YAML 1.1 number and boolean forms, list items that look like
flags, a key given twice in one of its spellings, nesting, odd scalars, bytes that are not UTF-8), either gives
exactly the ``Args`` of the same flags on the command line, or is one ``error: --config FILE: ...`` line with exit
status 2: never a traceback, never a silently different value. A document written only in clean forms whose command
line is accepted must be accepted too (so a reader that refuses everything fails). Pure logic, no process group.

The model of "the same flags": a plain scalar is the command-line word it spells (YAML 1.2 core: ``null``/``~``/empty
leave the flag unset, ``true``/``false`` are a switch's on and off); a list is the flag followed by its items, each of
which must be a value (``--flag ITEM`` alone gives it); a key given twice has no single meaning and must be refused.
"""

import contextlib
import io
import json
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from codegeex_train.config.arguments import SECTIONS, parse_args, parser
from codegeex_train.config.options import out_of_range

# (section, field, kind, the key's spellings): a representative flag of every kind.
FLAGS = [
    ("model", "num_layers", "int", ("num_layers", "num-layers")),
    ("train", "seq_length", "int", ("seq_length", "seq-length")),
    ("train", "micro_batch_size", "int", ("micro_batch_size",)),
    ("train", "seed", "int", ("seed",)),
    ("train", "eval_humaneval_interval", "int", ("eval_humaneval_interval",)),
    ("train", "zero_stage", "int", ("zero_stage",)),  # with choices 0, 1, 2
    ("optim", "lr", "float", ("lr", "learning_rate", "learning-rate")),
    ("optim", "adam_beta1", "float", ("adam_beta1",)),
    ("model", "hidden_dropout", "float", ("hidden_dropout",)),
    ("train", "fp16", "switch", ("fp16",)),
    ("train", "unsafe_no_sandbox", "switch", ("unsafe_no_sandbox", "unsafe-no-sandbox")),
    ("model", "top_query_layer", "switch", ("top_query_layer",)),  # --x / --no-x
    ("logging", "progress_bar", "switch", ("progress_bar",)),
    ("optim", "lr_decay_style", "choice", ("lr_decay_style",)),
    ("model", "activation", "choice", ("activation",)),
    ("train", "save", "str", ("save",)),
    ("data", "tokenizer_model", "str", ("tokenizer_model", "tokenizer-model")),
    ("data", "data_path", "list", ("data_path", "data-path")),
    ("train", "eval_humaneval_languages", "list", ("eval_humaneval_languages",)),
    ("logging", "profile_ranks", "list", ("profile_ranks",)),
]
F = {f[1]: f for f in FLAGS}
FLAG = {name: "--" + name.replace("_", "-") for name in F}
NEGATABLE = ("top_query_layer", "progress_bar")
NULL_WORDS, TRUE_WORDS, FALSE_WORDS = ("~", "null", "Null", "NULL"), ("true", "True", "TRUE"), ("false", "False",
                                                                                                   "FALSE")
ERROR = "error"

# Clean words are what a careful user writes, each in the range of every flag of its kind here (so a clean document
# is accepted); the hostile ones below are what a careless or malicious one writes.
clean_int = st.integers(1, 3000).map(str)
clean_float = st.one_of(st.floats(0, 0.99).map(repr), st.sampled_from(["2e-3", "1.0e-05", ".5", "0.", "1e-4"]))
clean_path = st.from_regex(r"[a-z]{1,5}/[a-z0-9_.]{0,5}", fullmatch=True)
choices = {"lr_decay_style": ["constant", "linear", "cosine"], "activation": ["gelu", "gelu_tanh", "fast_gelu"]}
hostile = st.one_of(
    st.from_regex(r"0[0-7]{1,3}", fullmatch=True),  # octal to YAML 1.1
    st.from_regex(r"[1-9][0-9]?:[0-5][0-9]", fullmatch=True),  # sexagesimal to YAML 1.1
    st.from_regex(r"[1-9]:[0-5][0-9]\.[0-9]", fullmatch=True),
    st.from_regex(r"0x[0-9A-F]{1,3}|0b[01]{1,4}|0o[0-7]{1,3}|[1-9]_[0-9]{3}|1_0\.5", fullmatch=True),
    st.sampled_from(["yes", "no", "on", "off", "Yes", "OFF", "y", "n", "1", "0", "-1", "+5", "1e3", "1e400", ".inf",
                     "-.inf", ".nan", "-.nan", "+.5", "1.0", "0.5e+1", "2024-01-01", "=", "<<", "a b", "nan", "inf",
                     "", "~", "null", "true", "false", "#x", "x #y", "a: b", "[", "&a", "*a", "!x", "é", "\t",
                     " padded ", "python", "go", "9" * 30, "9" * 5000]),
)
_OPTIONS = parser()._option_string_actions
flag_like = st.one_of(  # list items that argparse would read as flags: switches above all (they take no value)
    st.sampled_from(["--unsafe-no-sandbox", "--eval-humaneval-interval", "--help", "--", "-x", "-1", "-", "--lr=1",
                     "--config", "--no-top-query-layer", "-h"]),
    st.sampled_from(sorted(o for o, action in _OPTIONS.items() if action.nargs == 0)),
    st.sampled_from(sorted(_OPTIONS)))
clean_words = {"int": clean_int, "float": clean_float, "str": clean_path, "list": clean_path}


@st.composite
def clean_word(draw, flag):
    """(text, quoted, clean=True) of one scalar a careful user writes for ``flag``."""
    _, field, kind, _ = flag
    if kind == "switch":
        return draw(st.sampled_from(TRUE_WORDS + FALSE_WORDS + NULL_WORDS)), False, True
    if kind == "choice":
        return draw(st.sampled_from(choices[field])), draw(st.booleans()), True
    if field in ("profile_ranks", "zero_stage"):
        return draw(st.sampled_from(["0", "1", "2"])), False, True
    quoted = kind in ("str", "list") and draw(st.booleans())  # a quoted number is text, the same word
    return draw(clean_words[kind]), quoted, True


def clean_value(flag):
    """("word", text, quoted, clean) or, for a list flag, ("list", [(text, quoted, clean)], clean)."""
    if flag[2] == "list":
        return st.lists(clean_word(flag), min_size=1, max_size=4).map(lambda items: ("list", items, True))
    return clean_word(flag).map(lambda w: ("word", *w))


@st.composite
def _with(draw, items, extra):
    """``items`` with ``extra`` inserted somewhere, after the last item the likeliest (where a flag is not refused
    for want of the list's values)."""
    at = len(items) - draw(st.integers(0, len(items)))
    return items[:at] + extra + items[at:]


FAULTS = [None, "word", "item", "shape", "duplicate", "bytes"]


@st.composite
def documents(draw, fault):
    """(the file's bytes, the entries [(flag, key, value)], duplicated?, garbled: None | 'bom' | an error kind,
    clean?). Every value is clean but for one ``fault`` (None: none): a hostile scalar ("word"), a list item that
    looks like a flag ("item"), a value of the wrong shape (nested, a mapping, a list for a one-value flag), a key
    given twice ("duplicate", in one of its spellings or the same, or its section's header twice), or bytes."""
    picks = draw(st.permutations(FLAGS))[:draw(st.integers(1, 6))]
    entries = [[f, draw(st.sampled_from(f[3])), draw(clean_value(f))] for f in picks]
    if fault == "item" and not any(f[2] == "list" for f in picks):
        entries.append([F["data_path"], "data_path", draw(clean_value(F["data_path"]))])
    i = draw(st.integers(0, len(entries) - 1))
    wanted = {"item": lambda f: f[2] == "list", "duplicate": lambda f: len(f[3]) > 1}.get(fault)
    if wanted and any(wanted(e[0]) for e in entries):  # a list flag for "item"; one of several spellings if any
        i = next(j for j in range(i, i + len(entries)) if wanted(entries[j % len(entries)][0])) % len(entries)
    entry = entries[i]
    flag, duplicate, garble = entry[0], None, None
    if fault == "word":
        bad = (draw(hostile), draw(st.booleans()), False)
        entry[2] = ("word", *bad) if flag[2] != "list" else ("list", draw(_with(entry[2][1], [bad])), False)
    elif fault == "item":
        extra = [(draw(flag_like), False, False)] + [(draw(clean_int), draw(st.booleans()), True)] * draw(st.booleans())
        entry[2] = ("list", draw(_with(entry[2][1], extra)), False)
    elif fault == "shape":
        shapes = [("nest", 2), ("nest", 3), ("nest", 9), ("nest", 40), ("map",)]  # (3000 levels: bytes "deep")
        if flag[2] != "list":
            shapes.append(("list", [draw(clean_word(flag))] * draw(st.integers(0, 2)), False))
        entry[2] = draw(st.sampled_from(shapes))
    elif fault == "duplicate":
        duplicate = draw(st.sampled_from(["spelling", "same key", "section"]))
        other = [k for k in flag[3] if k != entry[1]] if duplicate == "spelling" else []
        entries.append([flag, other[0] if other else entry[1], draw(clean_value(flag))])
    elif fault == "bytes":
        garble = draw(st.sampled_from(["bom", "latin-1", "nul", "deep"]))
    blocks: dict[str, list[str]] = {}
    for (section, *_), key, v in entries[:len(entries) - bool(duplicate)]:
        blocks.setdefault(section, []).append(f"  {key}: {_render(v)}\n")
    again = ""
    if duplicate:
        (section, *_), key, v = entries[-1]
        if duplicate == "section":  # the section's header written a second time
            again = f"{section}:\n  {key}: {_render(v)}\n"
        else:
            blocks[section].append(f"  {key}: {_render(v)}\n")
    raw = ("".join(f"{section}:\n" + "".join(lines) for section, lines in blocks.items()) + again).encode()
    if garble == "bom":
        raw = b"\xef\xbb\xbf" + raw
    elif garble == "latin-1":
        raw += b"# caf\xe9\n"
    elif garble == "nul":
        raw += b"x: \x00\n"
    elif garble == "deep":
        raw += b"y: " + b"[" * 3000 + b"]" * 3000 + b"\n"
    return raw, [tuple(e) for e in entries], bool(duplicate), garble, fault is None or garble == "bom"


def _special(text, quoted):
    """A plain null or boolean word (not a value of a list)."""
    return not quoted and text in NULL_WORDS + TRUE_WORDS + FALSE_WORDS + ("",)


def _plain_ok(text: str) -> bool:
    """Whether ``text`` written plain, in a block mapping and in a flow list, is that very scalar."""
    for doc in (f"k: {text}\n", f"k: [{text}]\n"):
        try:
            node = yaml.compose(doc)
        except yaml.YAMLError:
            return False
        inner = node.value[0][1]
        inner = inner.value[0] if isinstance(inner, yaml.SequenceNode) and inner.value else inner
        if not isinstance(inner, yaml.ScalarNode) or inner.style is not None or inner.value != text:
            return False
    return True


def _scalar(text: str, quoted: bool) -> tuple[str, bool]:
    """(YAML source, quoted) of a word: plain where it survives plain, else double-quoted (JSON's escapes)."""
    if not quoted and (text == "" or text.isdigit() or len(text) < 100 and _plain_ok(text)):
        return text, False
    return json.dumps(text), True


def _render(v) -> str:
    if v[0] == "word":
        return _scalar(v[1], v[2])[0]
    if v[0] == "list":
        return "[" + ", ".join(_scalar(text, quoted)[0] for text, quoted, _ in v[1]) + "]"
    if v[0] == "nest":
        return "[" * v[1] + "1" + "]" * v[1]
    return "{a: 1}"


def _parse(argv):
    """parse_args(argv), or ERROR with the stderr and exit status; any other exception propagates (a traceback)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            return parse_args(argv), None
        except SystemExit as e:
            return ERROR, (e.code, err.getvalue())


def _tokens(field, kind, v):
    """The command-line words the model says ``v`` stands for, or ERROR where the command line cannot say it."""
    flag = FLAG[field]
    if v[0] == "word":
        text, quoted = v[1], _scalar(v[1], v[2])[1]
        if not quoted and text in NULL_WORDS + ("",):
            return []
        if not quoted and text in TRUE_WORDS + FALSE_WORDS:
            if kind != "switch":
                return ERROR  # a boolean for a flag that takes a value
            return [flag] if text in TRUE_WORDS else [f"--no-{flag[2:]}"] if field in NEGATABLE else []
        return ERROR if kind == "switch" else [flag, text]
    if v[0] == "list" and kind == "list":
        items = []
        for text, quoted, _ in v[1]:
            if _special(text, _scalar(text, quoted)[1]):
                return ERROR  # null and booleans are not values of a list
            alone = _alone(flag, text)  # the item is a value: `--flag ITEM` alone gives it
            if alone is ERROR or len(alone) != 1 or field != "profile_ranks" and alone != [text]:
                return ERROR
            items.append(text)
        return [flag, *items] if items else ERROR
    return ERROR  # a list for a one-value flag, a nested list, a mapping


_PARSER = parser()


def _alone(flag, text):
    """What ``flag text`` alone sets the flag to on the command line, or ERROR."""
    with contextlib.redirect_stderr(io.StringIO()):
        try:
            namespace = _PARSER.parse_args([flag, text])
        except SystemExit:
            return ERROR
    return next(v for dest, v in vars(namespace).items() if dest.endswith("." + flag[2:].replace("-", "_")))


def _expected(entries, duplicate, garble):
    """The Args of the same flags on the command line, or ERROR where it cannot say them or refuses them."""
    if duplicate or garble not in (None, "bom"):
        return ERROR
    argv = []
    for (_, field, kind, _), _, v in entries:
        tokens = _tokens(field, kind, v)
        if tokens is ERROR:
            return ERROR
        argv += tokens
    args, _ = _parse(argv)
    if args is ERROR or any(out_of_range(getattr(args, s)) for s in SECTIONS):
        return ERROR  # the command line refuses it (at parse_args, or validate()'s range check)
    return args


# Each fault its own budget, so that every kind is drawn whatever hypothesis favours (a few seconds in all).
SETTINGS = settings(derandomize=True, database=None, max_examples=25, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def _check(doc):
    """The property: the command line's Args, or one `error: --config FILE: ...` line (exit 2); nothing else."""
    raw, entries, duplicate, garble, clean = doc
    expected = _expected(entries, duplicate, garble)
    shown = raw.decode(errors="replace")
    assert expected is not ERROR or not clean, f"the command line refuses a clean document (the test's fault):\n{shown}"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "c.yaml")
        path.write_bytes(raw)
        got, failure = _parse(["--config", str(path)])
    if got is ERROR:
        code, err = failure
        assert code == 2 and err.count("\n") == 1 and err.startswith(f"error: --config {path}: "), (err, shown)
        assert expected is ERROR or not clean, f"a clean document refused: {err}{shown}"
    else:
        assert expected is not ERROR, f"accepted what the command line cannot say:\n{shown}"
        assert got == expected, f"a silently different value:\n{shown}"


@pytest.mark.parametrize("fault", FAULTS)
@SETTINGS
@given(data=st.data())
def test_a_config_file_is_the_command_line_or_one_error_line(fault, data):
    _check(data.draw(documents(fault), label="document"))


def _doc(text: str, *entries, duplicate=False, clean=False):
    """An explicit document: (bytes, [(flag, key, value)], ...) as ``documents`` draws them."""
    return text.encode(), [(F[key.replace("-", "_")], key, v) for key, v in entries], duplicate, None, clean


@pytest.mark.parametrize("doc", [
    _doc('data:\n  data_path: [D, --unsafe-no-sandbox, --eval-humaneval-interval, "100"]\n',
         ("data_path", ("list", [("D", False, True), ("--unsafe-no-sandbox", False, False),
                                 ("--eval-humaneval-interval", False, False), ("100", True, True)], False))),
    _doc("train:\n  seq_length: 0100\n", ("seq_length", ("word", "0100", False, False))),
    _doc("train:\n  micro_batch_size: 1:00\n", ("micro_batch_size", ("word", "1:00", False, False))),
    _doc("model:\n  num_layers: 4\n  num-layers: 6\n", ("num_layers", ("word", "4", False, True)),
         ("num-layers", ("word", "6", False, True)), duplicate=True),
    _doc("model:\n  num_layers: 4\ntrain:\n  fp16: true\n", ("num_layers", ("word", "4", False, True)),
         ("fp16", ("word", "true", False, True)), clean=True),
], ids=["flags-in-a-list", "octal", "sexagesimal", "spellings-twice", "clean"])
def test_the_issue_documents(doc):
    _check(doc)
