"""This process's own start-up as a worker: it never outlives the launcher that started it (`jdp launch`), and
its output is line-buffered and never breaks its process when the reader is gone."""

from __future__ import annotations

import atexit
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
    "INTERRUPTED_EXIT", "LAUNCHER_GRACE_S", "LAUNCHER_PID", "Interrupted", "StartupInterrupts", "exit_at_once",
    "flush_every_line",
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
    """SIGINT before the training loop takes the signals over (it stops at an agreed step and saves).

    Python raises KeyboardInterrupt at the next bytecode of the main thread, which goes wrong in two ways during
    start-up: raised inside a `__del__` (datasets' objects have them) it is printed as "Exception ignored" and
    dropped, and the run trains on; raised while the main thread is in C++ (XLA compiling), it waits until that
    returns, seconds later; and raised inside a C++ extension's Python callbacks it can crash the process (nanobind's
    initialization of jaxlib aborts, SIGABRT; a JAX call it cut short makes Python's finalization segfault on
    jaxlib 0.10). Here the interrupt is remembered and raised again at the next phase (`check`), and a thread woken
    by the signal itself (`signal.set_wakeup_fd`) ends the process if the main thread's handler has not run within
    `stuck_s` (it is in C), or has not answered within `answer_s` (it dropped it), or at once on a second Ctrl-C:
    `jdp: interrupted while <phase>`, `cleanup()`, exit 130. The command line's (`command=True`) never raises in
    the main thread: its watch thread ends the process at the first Ctrl-C, and a KeyboardInterrupt from elsewhere
    that leaves it ends the process after the command's line without Python's finalization. The training loop
    takes SIGINT over from it (`give_to_loop`) with no moment without a handler. Main thread only; the command
    line's runs (the library leaves a user's signals alone, unless its caller asks: handle_signals)."""

    def __init__(self, phase, cleanup=lambda: None, answer_s: float = 2.0, check_on_exit: bool = True,
                 stuck_s: float = 0.3, command: bool | None = None):  # fmt: skip
        """command: the command line's (default: check_on_exit=False, which only the command line's is)."""
        self.phase, self.cleanup, self.answer_s, self.check_on_exit = phase, cleanup, answer_s, check_on_exit
        self.stuck_s, self.command = stuck_s, (not check_on_exit) if command is None else command
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
        # An error after the interrupt was raised is its doing: a C extension whose initialization it broke raises
        # ImportError("Encountered an error while initializing the extension"), with no trace of the interrupt
        interrupted = kind is not None and (issubclass(kind, KeyboardInterrupt) or self.count > 0)
        if self.command and interrupted:
            atexit.register(exit_at_once, INTERRUPTED_EXIT)  # the command says its line and returns 130 first
        self.hand_over(check=kind is None and self.check_on_exit)
        if self.command and interrupted and not issubclass(kind, KeyboardInterrupt):
            raise Interrupted(self.phase()) from None

    def hand_over(self, check: bool = True) -> None:
        """Give SIGINT back (to what was there before); `check`: raise the interrupt a `__del__` dropped since the
        last phase began, if there was one."""
        if self.active:
            signal.set_wakeup_fd(self._wakeup)  # before the pipe closes: no signal is written to a closed fd
            signal.signal(signal.SIGINT, self._previous)
            self._release()
        if check:
            self.check()

    def give_to_loop(self) -> tuple:
        """The training loop has installed its own SIGINT handler and wakeup fd over this one's: stop watching and
        return what was there before this one (the handler, the wakeup fd), for the loop to restore at its end. Then
        `check`: an interrupt a `__del__` dropped is raised still."""
        previous = self._previous, self._wakeup
        self._release()
        return previous

    def _release(self) -> None:
        global _current
        if sys.unraisablehook == self._unraisable:
            sys.unraisablehook = self._hook
        self.answer()
        os.close(self._pipe[1])  # the watch thread's select wakes, reads b"" and ends
        self.active, _current = False, None

    @contextmanager
    def until_the_loop(self) -> Iterator[StartupInterrupts]:
        """The trainer's part of start-up. It stays in force until the training loop takes SIGINT over
        (`give_to_loop`, just before the first step: the replica check at step 0 is start-up too), or the command
        ends; leaving it without an error raises an interrupt a `__del__` dropped."""
        yield self
        self.check()

    def _on_signal(self, sig, frame) -> None:
        self.count += 1
        if not self.command:  # the command line's: the watch thread has ended the process, or is about to
            raise Interrupted(self.phase())

    def answer(self) -> None:
        """The main thread has the interrupt in hand (it is unwinding): the watch thread leaves the exit to it
        (unless a second Ctrl-C comes first)."""
        self.answered.set()

    def check(self) -> None:
        """Raise the interrupt the main thread dropped (inside a __del__), if there was one."""
        if self.count and not self.command:
            raise Interrupted(self.phase())

    def _deadline(self, since: float | None) -> float | None:
        """When the watch thread ends the process after a first Ctrl-C at `since`: soon if the main thread's
        handler has not run (it is in C, compiling), later if it has (it is unwinding, or dropped it in a __del__),
        never once it answered."""
        if since is None or self.answered.is_set():
            return None
        return since + (self.answer_s if self.count else self.stuck_s)

    def _watch(self) -> None:
        read, seen, since = self._pipe[0], 0, None
        try:
            while True:
                deadline = self._deadline(since)
                wait = None if deadline is None else max(0.0, deadline - time.monotonic())
                if select.select([read], [], [], wait)[0]:
                    if not (data := os.read(read, 64)):
                        return  # handed over
                    seen += data.count(bytes([signal.SIGINT]))
                    since = time.monotonic() if since is None and seen else since
                if (seen and self.command) or seen >= 2 or (deadline is not None and time.monotonic() >= deadline and not self.answered.is_set()):
                    self._end()
        finally:
            os.close(read)

    def _end(self) -> None:
        """No answer in time (the main thread is in C++, or dropped it and reached no phase), or a second Ctrl-C:
        end here."""
        if speaks():  # rank 0 says it for the job, as the loop's lines are said
            sys.stderr.write(f"jdp: interrupted while {self.phase()}\n")
        try:
            self.cleanup()
        finally:
            exit_at_once(INTERRUPTED_EXIT)


def exit_at_once(code: int) -> None:
    """Flush what was said and exit without Python's finalization: after an interrupt, XLA may be compiling or hold
    state the interrupted call left half made (finalization then crashed with SIGSEGV on jaxlib 0.10, or waited)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)
