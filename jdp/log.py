"""jdp's messages through `logging`: a logger per module under "jdp", and the `jdp` command's look.

What jdp says while it works (the banner, notices, warnings, errors) is a record of a child of the "jdp" logger,
holding its text without a prefix. jdp's Handler gives records the command's look: `jdp | ...` on stdout for
notices (INFO), `jdp: warning: ...` and `jdp: error: ...` on stderr, each flushed at once; its RankFilter lets
process 0 speak for the job (notices from process 0 only, warnings and errors from every process). The handler is
added once, at jdp's first record (or by `install()`), unless the "jdp" logger has a handler by then: a program
that configured one keeps it alone. What a command prints as its result (`jdp plan`'s table, generated text) is
not a log message and stays a print. No JAX here: `jdp --help` starts without it, and ranks are told, not asked.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

__all__ = ["EVERY_RANK", "PLAIN", "Formatter", "Handler", "RankFilter", "install", "logger", "set_rank", "speaks"]

ROOT = "jdp"
EVERY_RANK = {"all_ranks": True}  # extra= for a notice each process gives about itself, not the job
PLAIN = {"prefix": "jdp: "}  # extra= for a message whose look names no level (`jdp: run already complete ...`)

_PREFIXES = ((logging.ERROR, "jdp: error: "), (logging.WARNING, "jdp: warning: "), (logging.NOTSET, "jdp | "))
_rank = 0  # this process's rank in the job: set once it is known (set_rank), never asked of JAX
_auto = True  # add jdp's handler at the first record (once per process)
_installing = threading.RLock()  # reentrant: a signal handler's record may arrive inside one


def set_rank(rank: int) -> None:
    """This process's rank in the job, for the RankFilter (jdp sets it where the process joins the job)."""
    global _rank
    _rank = int(rank)


def speaks() -> bool:
    """Whether this process speaks for the job: rank 0, or, before it has joined, not a worker `jdp launch`
    numbered otherwise (JAX_PROCESS_ID)."""
    launched = os.environ.get("JAX_PROCESS_ID", "")
    return _rank == 0 and not (launched.isdigit() and int(launched) > 0)


def logger(name: str) -> logging.Logger:
    """The logger of jdp module `name`, a child of "jdp" (modules pass their name as a literal: `python -m jdp.cli`
    would call cli.py's __name__ "__main__"). The first record of any of them adds jdp's handler if none is there."""
    log = logging.getLogger(name if name == ROOT or name.startswith(ROOT + ".") else f"{ROOT}.{name}")
    if _FIRST_RECORD not in log.filters:
        log.addFilter(_FIRST_RECORD)
    return log


class RankFilter(logging.Filter):
    """Adds `rank` to each record; passes warnings and errors from every process, notices (INFO and below) from
    process 0, and a notice that says `extra=EVERY_RANK` from every process (add it to your own handler to keep
    process 0's notices only: jdp's handler has it). A record given `extra={"rank": r}` keeps its rank."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "rank"):
            record.rank = _rank
        return record.levelno >= logging.WARNING or record.rank == 0 or getattr(record, "all_ranks", False)


class Formatter(logging.Formatter):
    """The `jdp` command's look: `jdp | ` before a notice, `jdp: warning: ` or `jdp: error: ` before the rest, or
    the record's own `prefix` (extra=PLAIN: `jdp: `; the launcher's `jdp launch: `). Newlines that open a message
    (ending a progress bar's line) come before the prefix; a traceback, if logged, follows the message."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        prefix = getattr(record, "prefix", None)
        if prefix is None:
            prefix = next(p for level, p in _PREFIXES if record.levelno >= level)
        body = text.lstrip("\n")
        return text[: len(text) - len(body)] + prefix + body


class Handler(logging.Handler):
    """Writes each record to sys.stdout (notices) or sys.stderr (warnings, errors, and records given
    `extra={"stderr": True}`) as they are when it is written, so redirected and wrapped streams are honoured,
    and flushes at once: a process killed a moment later leaves the line in its log."""

    def __init__(self, level: int = logging.NOTSET):
        super().__init__(level)
        self.setFormatter(Formatter())
        self.addFilter(RankFilter())

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
            err = record.levelno >= logging.WARNING or getattr(record, "stderr", False)
            stream = sys.stderr if err else sys.stdout
            stream.write(text + "\n")
            stream.flush()
        except RecursionError:
            raise
        except Exception:
            self.handleError(record)


def install() -> bool:
    """Give the "jdp" logger jdp's handler, unless it has a handler already, and stop its records reaching the root
    logger's handlers too (absl, under orbax, puts one there: each line would show twice). True if it added one."""
    global _auto
    with _installing:  # two threads' first records add one handler
        _auto = False
        log = logging.getLogger(ROOT)
        if log.handlers:
            return False
        log.addHandler(Handler())
        log.propagate = False
        return True


class _FirstRecord(logging.Filter):
    """On each jdp module's logger: the first record jdp emits installs jdp's handler, unless the program has
    given the "jdp" logger a handler (or called install()) before. Passes every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _auto:
            install()
        return True


_FIRST_RECORD = _FirstRecord()
if logging.getLogger(ROOT).level == logging.NOTSET:
    logging.getLogger(ROOT).setLevel(logging.INFO)  # jdp's notices are shown unless the program lowers them
