"""This process's own start-up as a worker: it never outlives the launcher that started it (`jdp launch`), and
its output is line-buffered and never breaks its process when the reader is gone."""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from jdp.log import logger, speaks

__all__ = [
    "INTERRUPTED_EXIT", "LAUNCHER_GRACE_S", "LAUNCHER_PID", "Interrupted", "StartupInterrupts", "flush_every_line",
    "startup_interrupts", "tolerate_broken_pipes", "watch_launcher",
]  # fmt: skip

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


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) while `phase`: `jdp` says `jdp: interrupted while <phase>` and exits 130. A
    KeyboardInterrupt, so a library user's `except KeyboardInterrupt` still catches it."""

    def __init__(self, phase: str):
        super().__init__(phase)
        self.phase = phase


INTERRUPTED_EXIT = 130  # 128 + SIGINT, as a shell reports a command ended by Ctrl-C
_current: StartupInterrupts | None = None  # the one installed (the command line's), if any


def startup_interrupts() -> StartupInterrupts | None:
    """The StartupInterrupts in force (the `jdp` command's, from its first line), or None."""
    return _current


class StartupInterrupts:
    """SIGINT before the training loop takes the signals over (it stops at an agreed step and saves there).

    Python raises KeyboardInterrupt at the next bytecode of the main thread, which goes wrong in two ways during
    start-up: raised inside a `__del__` (datasets' objects have them) it is printed as "Exception ignored" and
    dropped, and the run trains on; raised while the main thread is in C++ (XLA compiling), it waits until that
    returns, seconds later. Here the interrupt is remembered and raised again at the next phase (`check`), and a
    thread woken by the signal itself (`signal.set_wakeup_fd`) ends the process if the main thread has not
    answered within `answer_s` (or at once on a second Ctrl-C): `jdp: interrupted while <phase>`, `cleanup()`,
    exit 130. Main thread only; the command line's runs (the library leaves a user's signals alone)."""

    def __init__(self, phase, cleanup=lambda: None, answer_s: float = 2.0, check_on_exit: bool = True):
        self.phase, self.cleanup, self.answer_s, self.check_on_exit = phase, cleanup, answer_s, check_on_exit
        self.count, self.answered = 0, threading.Event()
        self._previous = self._pipe = None
        self.active = False

    def __enter__(self) -> StartupInterrupts:
        global _current
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # nohup, `cmd &`: Ctrl-C is not for this process
            return self
        self._previous = signal.signal(signal.SIGINT, self._on_signal)
        self._pipe = os.pipe()
        os.set_blocking(self._pipe[1], False)
        self._wakeup = signal.set_wakeup_fd(self._pipe[1], warn_on_full_buffer=False)
        threading.Thread(target=self._watch, daemon=True, name="jdp-interrupt-watch").start()
        self._hook = sys.unraisablehook
        sys.unraisablehook = self._unraisable
        self.active, _current = True, self
        return self

    def _unraisable(self, unraisable) -> None:
        """Python's report of the interrupt it dropped (raised inside a `__del__` or a gc callback): not printed,
        as it is not lost here (`check`, the watch thread); anything else goes to the hook there was."""
        if not isinstance(unraisable.exc_value, KeyboardInterrupt):
            self._hook(unraisable)

    def __exit__(self, kind, error, tb) -> None:
        self.hand_over(check=kind is None and self.check_on_exit)

    def hand_over(self, check: bool = True) -> None:
        """Give SIGINT back (to the training loop's own handling, or to what was there before); `check`: raise the
        interrupt a `__del__` dropped since the last phase began, if there was one."""
        global _current
        if self.active:
            signal.set_wakeup_fd(self._wakeup)
            signal.signal(signal.SIGINT, self._previous)
            if sys.unraisablehook == self._unraisable:
                sys.unraisablehook = self._hook
            self.answer()
            os.close(self._pipe[1])  # the watch thread's select wakes, reads b"" and ends
            self.active, _current = False, None
        if check:
            self.check()

    @contextmanager
    def until_the_loop(self) -> Iterator[StartupInterrupts]:
        """The trainer's part of start-up: on leaving it without an error, SIGINT goes to the loop."""
        yield self
        self.hand_over()

    def _on_signal(self, sig, frame) -> None:
        self.count += 1
        raise Interrupted(self.phase())

    def answer(self) -> None:
        """The main thread has the interrupt in hand (it is unwinding): the watch thread leaves the exit to it."""
        self.answered.set()

    def check(self) -> None:
        """Raise the interrupt the main thread dropped (inside a __del__), if there was one."""
        if self.count:
            raise Interrupted(self.phase())

    def _watch(self) -> None:
        read, seen, deadline = self._pipe[0], 0, None
        try:
            while not self.answered.is_set():
                wait = None if deadline is None else max(0.0, deadline - time.monotonic())
                if select.select([read], [], [], wait)[0]:
                    if not (data := os.read(read, 64)):
                        return
                    seen += data.count(bytes([signal.SIGINT]))
                    if seen == 1 and deadline is None:
                        deadline = time.monotonic() + self.answer_s
                        continue
                if self.answered.is_set():
                    return
                if seen >= 2 or (deadline is not None and time.monotonic() >= deadline):
                    # no answer in time (the main thread is in C++, or dropped it and reached no phase), or a
                    # second Ctrl-C: end here
                    if speaks():  # rank 0 says it for the job, as the loop's lines are said
                        sys.stderr.write(f"jdp: interrupted while {self.phase()}\n")
                        sys.stderr.flush()
                    try:
                        self.cleanup()
                    finally:
                        os._exit(INTERRUPTED_EXIT)
        finally:
            os.close(read)
