"""Rank-aware console logging (distributed/log.py), in this process with no process group: what rank 0, another
rank and --log-all-ranks show at each level, on which stream, and the flags that set it. The 2-rank run that shows
it end to end is tests/training/test_pretrain.py::test_resume_is_exact."""

import contextlib
import io
import logging

import pytest

from codegeex_train.config.arguments import parse_args
from codegeex_train.distributed.log import get_logger, setup_logging

# A module's logger, as every module gets it (logging.getLogger(__name__)): the setup reaches it.
log = logging.getLogger("codegeex_train.training.trainer")


@pytest.fixture(autouse=True)
def restore_logging():
    """Each test sets the package's logger up its own way; put back what the rest of the suite had."""
    root = logging.getLogger("codegeex_train")
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def say_everything() -> None:
    log.debug("d")
    log.info("i\nsecond line")
    log.warning("w")
    log.error("e")


def shown(capsys, **setup) -> tuple[list[str], list[str]]:
    setup_logging(**setup)
    say_everything()
    out, err = capsys.readouterr()
    return out.splitlines(), err.splitlines()


def test_rank_zero_shows_info_as_the_bare_message_on_stdout(capsys):
    # What the prints before it showed: the message alone; warnings and errors on stderr, marked.
    assert shown(capsys, rank=0) == (["i", "second line"], ["warning: w", "error: e"])


def test_other_ranks_show_only_warnings_and_errors_with_their_rank(capsys):
    assert shown(capsys, rank=1) == ([], ["[rank 1] warning: w", "[rank 1] error: e"])
    assert shown(capsys, level="debug", rank=3) == ([], ["[rank 3] warning: w", "[rank 3] error: e"])


def test_all_ranks_prefix_every_line_of_every_rank(capsys):
    assert shown(capsys, rank=1, all_ranks=True) == (["[rank 1] i", "[rank 1] second line"],
                                                      ["[rank 1] warning: w", "[rank 1] error: e"])
    assert shown(capsys, rank=0, all_ranks=True)[0] == ["[rank 0] i", "[rank 0] second line"]


def test_levels(capsys):
    assert shown(capsys, level="debug") == (["debug: d", "i", "second line"], ["warning: w", "error: e"])
    assert shown(capsys, level="warning") == ([], ["warning: w", "error: e"])
    assert shown(capsys, level="error", rank=2) == ([], ["[rank 2] error: e"])
    with pytest.raises(ValueError, match="use one of debug, info, warning, error"):
        setup_logging(level="verbose")


def test_tools_send_info_to_stderr_and_later_redirections_are_followed(capsys):
    assert shown(capsys, info_stream="stderr") == ([], ["i", "second line", "warning: w", "error: e"])
    setup_logging()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # made after the setup, as a test or a caller may
        log.info("caught")
    assert out.getvalue() == "caught\n" and capsys.readouterr().out == ""


def test_get_logger_keeps_names_inside_the_package():
    assert get_logger("tools.generate").name == "codegeex_train.tools.generate"
    assert get_logger("codegeex_train.pretrain").name == "codegeex_train.pretrain"


@pytest.mark.parametrize("flags,level", [([], "info"), (["--log-level", "warning"], "warning"),
                                         (["--log-level", "DEBUG"], "debug"), (["--logging-level", "10"], "debug"),
                                         (["--logging-level", "20"], "info"), (["--logging-level", "40"], "error")])
def test_log_level_flags(flags, level):
    args = parse_args(["--data-path", "x", *flags])
    assert args.logging.log_level == level and args.logging.log_all_ranks is False
    assert parse_args(["--data-path", "x", "--log-all-ranks"]).logging.log_all_ranks is True


def test_a_bad_level_is_one_error_line(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--data-path", "x", "--logging-level", "25"])
    err = capsys.readouterr().err.splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: argument --log-level: invalid choice: "
                                                                     "'25'"), err
