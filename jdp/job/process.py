"""This process's own start-up as a worker: it never outlives the launcher that started it (`jdp launch`), and
its output is line-buffered and never breaks its process when the reader is gone."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Mapping

from jdp.log import logger

__all__ = ["LAUNCHER_GRACE_S", "LAUNCHER_PID", "flush_every_line", "tolerate_broken_pipes", "watch_launcher"]

log = logger("jdp.process")


LAUNCHER_PID, LAUNCHER_GRACE_S = "JDP_LAUNCHER_PID", "JDP_LAUNCHER_GRACE_S"  # what `jdp launch` tells its workers


_watching = False


def watch_launcher(environ: Mapping[str, str] | None = None, poll_s: float = 0.5) -> bool:
    """In a worker of `jdp launch`: when the launcher dies (SIGKILL, OOM, scancel), stop too, never outlive it.

    The worker sends itself SIGTERM, which the training loop turns into a stop at a step every worker agrees on
    (they all lose the launcher at once) and a checkpoint; if it has not exited after the launcher's grace
    period, it exits anyway. True if this process is such a worker.
    """
    global _watching
    environ = os.environ if environ is None else environ
    if not environ.get(LAUNCHER_PID, "").isdigit():
        return False
    if _watching:  # once per process: the command line and the trainer both ask
        return True
    _watching = True
    launcher, grace_s = int(environ[LAUNCHER_PID]), float(environ.get(LAUNCHER_GRACE_S, "30"))

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(poll_s)
        log.error(
            f"the launcher (pid {launcher}) is gone; stopping this worker at a step the workers agree on (exiting "
            f"in at most {grace_s:g} s)"
        )
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        log.error(f"still running {grace_s:g} s after the launcher died; exiting")
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="jdp-launcher-watch").start()
    return True


class _Unbreakable:
    """A text stream whose writes never raise once its reader is gone (a dead launcher, a closed pipe): the
    output is lost, the process goes on (and so never dies in a way that strands its peers)."""

    def __init__(self, stream):
        self._stream, self.broken = stream, False

    def write(self, text: str) -> int:
        if not self.broken:
            try:
                return self._stream.write(text)
            except (BrokenPipeError, ConnectionResetError, ValueError):  # ValueError: written after close
                self.broken = True
        return len(text)

    def flush(self) -> None:
        if not self.broken:
            try:
                self._stream.flush()
            except (BrokenPipeError, ConnectionResetError, ValueError):
                self.broken = True

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def flush_every_line() -> None:
    """Line-buffer sys.stdout and sys.stderr: output to a file is otherwise held in a block buffer, and a process
    killed by SIGKILL (an OOM kill) would leave no line of what it was doing."""
    for stream in (sys.stdout, sys.stderr):
        if (reconfigure := getattr(stream, "reconfigure", None)) is not None:
            reconfigure(line_buffering=True)


def tolerate_broken_pipes() -> None:
    """Make sys.stdout and sys.stderr writes that find their pipe closed harmless (the output is dropped)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _Unbreakable):
            setattr(sys, name, _Unbreakable(stream))
