"""Coordination during a run, across processes: the agreed stop step and the step watchdog.

The only module that touches jax.distributed's key-value store.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import jax


def _kv():
    """jax.distributed's key-value store (on the coordinator), or None in a single-process run."""
    from jax._src import distributed

    return distributed.global_state.client if jax.process_count() > 1 else None


class StopAgreement:
    """SIGTERM or SIGINT to any process makes every process stop after the same step (then save and exit 0).

    The process that gets the signal proposes "stop after step s + margin" in jax.distributed's key-value
    store; every process reads it before each step. Processes of a data-parallel job are never more than a
    step or two apart (each step's metrics fetch waits for everyone's previous step), so the margin of 3
    leaves every process room to reach the agreed step. A second signal exits at once.
    """

    MARGIN = 3
    KEY = "jdp/stop_after_step"

    def __init__(self):
        self.stop_at: int | None = None
        self.signals = 0
        self._pending: int | None = None
        self._previous = {sig: signal.signal(sig, self._handler) for sig in (signal.SIGTERM, signal.SIGINT)}

    def _handler(self, sig, frame) -> None:
        self.signals += 1
        if self.signals > 1:
            print(f"jdp: second {signal.Signals(sig).name}: exiting now, without saving", file=sys.stderr, flush=True)
            os._exit(128 + sig)
        self._pending = sig

    def should_stop(self, done: int) -> bool:
        """Called before each step with the number of steps done: True once the agreed step is reached."""
        kv = _kv()
        if self._pending is not None and self.stop_at is None:
            proposal = done + (self.MARGIN if kv else 0)
            name = signal.Signals(self._pending).name
            if kv:
                try:
                    kv.key_value_set(self.KEY, str(proposal))
                except Exception:
                    pass  # another process proposed first; its step is the one everybody reads
            print(
                f"jdp: process {jax.process_index()} got {name}: every process will stop at an agreed step and "
                f"save (send it again to exit at once)",
                file=sys.stderr,
                flush=True,
            )
            if not kv:
                self.stop_at = proposal
        if kv and self.stop_at is None:
            try:
                self.stop_at = int(kv.key_value_try_get(self.KEY))
            except Exception:
                pass  # no proposal yet
        return self.stop_at is not None and done >= self.stop_at

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class Watchdog:
    """Exits this process, with a message, when no step finishes for `timeout_s` (a stalled or dead peer).

    Each process records its last finished step in the key-value store, so the message names the
    processes that are behind.
    """

    def __init__(self, timeout_s: float):
        self.timeout_s, self.step, self.last = timeout_s, 0, time.monotonic()
        self.armed = False
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True, name="jdp-watchdog").start()

    def progress(self, step: int) -> None:
        self.step, self.last, self.armed = step, time.monotonic(), True
        kv = _kv()
        if kv:
            kv.key_value_set(f"jdp/progress/{jax.process_index()}", str(step), allow_overwrite=True)

    def pause(self) -> None:
        """Stop watching (the final wait for a checkpoint); progress() re-arms."""
        self.armed = False

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Not watching during a long, legitimate wait (evaluation, a checkpoint save); watching again after it,
        from the time it ended, if it was watching before."""
        armed, self.armed = self.armed, False
        try:
            yield
        finally:
            self.last, self.armed = time.monotonic(), armed

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            if self.armed and time.monotonic() - self.last > self.timeout_s:
                behind = ""
                try:
                    kv = _kv()
                    if kv:
                        steps = {int(k.rsplit("/", 1)[1]): int(v) for k, v in kv.key_value_dir_get("jdp/progress/")}
                        lagging = sorted(
                            p for p in range(jax.process_count()) if steps.get(p, -1) < max(steps.values())
                        )
                        behind = f"; processes behind the others: {lagging or 'none'} (last steps: {steps})"
                except Exception as e:
                    behind = f"; could not reach the coordinator to ask the others ({type(e).__name__})"
                print(
                    f"jdp: error: process {jax.process_index()} of {jax.process_count()}: no step finished for "
                    f"{self.timeout_s:g} s after step {self.step} (train.step_timeout_s){behind}. A peer is "
                    f"stalled or dead; exiting instead of waiting forever.",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(4)

    def close(self) -> None:
        self._stop.set()
