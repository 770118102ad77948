"""Coordination during a run, across processes: where each process runs, the agreed stop step and the step
watchdog.

The only module that touches jax.distributed's key-value store.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import jax

from jdp import jax_private
from jdp.job.process import exit_at_once, startup_interrupts
from jdp.log import PLAIN, logger

__all__ = [
    "DEPARTED",
    "KeyValueStore",
    "PeerMonitor",
    "StopAgreement",
    "Watchdog",
    "announce_departure",
    "describe_hosts",
    "first_departure",
    "key_value_store",
    "leave_job",
    "missing_key_value_api",
    "published_by_every_process",
    "publish_host",
    "step_value",
]

log = logger("jdp.coordination")


class KeyValueStore:
    """jax.distributed's key-value store on the coordinator: the one place jdp reaches into JAX's private API.

    JAX has no public accessor for it (jax.distributed exports initialize, is_initialized and shutdown; JAX's
    own multihost_utils reads the same private client). The public preemption sync point
    (multihost_utils.reached_preemption_sync_point) covers SIGTERM only, not SIGINT, so StopAgreement keeps its
    own key. Values read back are validated by their users: a malformed one is ignored, never trusted.
    """

    METHODS = ("key_value_set", "key_value_try_get", "key_value_dir_get")  # what jdp calls on JAX's client

    def __init__(self, client):
        self._client = client

    def set(self, key: str, value: str, overwrite: bool = False) -> None:
        self._client.key_value_set(key, value, allow_overwrite=overwrite)

    def try_get(self, key: str) -> str | None:
        """The value, or None when nobody has set the key yet."""
        try:
            return self._client.key_value_try_get(key)
        except Exception:
            return None

    def dir_get(self, prefix: str) -> dict[str, str]:
        return dict(self._client.key_value_dir_get(prefix))


def missing_key_value_api() -> list[str]:
    """What jdp needs of JAX's private key-value store that this JAX lacks (empty when all is there)."""
    return jax_private.missing_key_value_api(KeyValueStore.METHODS)


_warned: set[str] = set()


def step_value(key: str, text: str) -> int | None:
    """A step number read back from the store, or None (with one warning per key) when it is not one: jdp wrote
    it, but anything that reaches the coordinator can write there, and a bad value must not stop the job."""
    value = int(text) if text.isascii() and text.isdigit() and len(text) < 19 else None
    if value is None and key not in _warned:
        _warned.add(key)
        log.warning(f"ignoring {key}={text[:40]!r} in the job's key-value store: not a step number")
    return value


def key_value_store() -> KeyValueStore | None:
    """The job's key-value store, or None in a single-process run."""
    if jax.process_count() == 1:
        return None
    client = jax_private.distributed_client()
    if client is None:
        raise RuntimeError(
            f"jax {jax.__version__} no longer exposes its key-value store where jdp looks for it "
            f"(jdp/jax_private.py's distributed_client; missing: {missing_key_value_api() or 'the client'}); "
            f"use a jax version in pyproject.toml's range"
        )
    return KeyValueStore(client)


HOSTS = "jdp/hosts/"  # each process's host: its name and the address it meets the others on


def publish_host(address: str) -> None:
    """Say where this process runs (its host's name and address), for the banner's list of hosts."""
    import socket

    kv = key_value_store()
    if kv is not None:
        kv.set(f"{HOSTS}{jax.process_index()}", f"{socket.gethostname()} {address}".strip(), overwrite=True)


def process_hosts() -> list[str]:
    """Where each process of the job runs ("host address", as each published it: publish_host), by process index,
    after a barrier that waits for every process to have published; [] for one process or without the store."""
    kv = key_value_store()
    if kv is None or jax.process_count() == 1:
        return []
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices("jdp: every process has published its host")
    where = {int(k.rsplit("/", 1)[-1]): v for k, v in kv.dir_get(HOSTS).items() if k.rsplit("/", 1)[-1].isdigit()}
    return [where.get(i, f"process {i}") for i in range(jax.process_count())]


SHARED = "jdp/shared/"  # what every process published to compare with the others' (published_by_every_process)


def published_by_every_process(name: str, value: str) -> list[str | None]:
    """Publish this process's `value` under `name` and, after a barrier, return every process's (by process index;
    None where one is missing): e.g. the resolved config, which processes started by a wrapper may not share.
    [value] for one process."""
    kv = key_value_store()
    if kv is None:
        return [value]
    from jax.experimental import multihost_utils

    kv.set(f"{SHARED}{name}/{jax.process_index()}", value, overwrite=True)
    multihost_utils.sync_global_devices(f"jdp: every process has published its {name}")
    found = {k.rsplit("/", 1)[-1]: v for k, v in kv.dir_get(f"{SHARED}{name}/").items()}
    return [found.get(str(i)) for i in range(jax.process_count())]


def describe_hosts() -> str:
    """'2 hosts: vm 10.213.7.1 (processes 0-1), vm 10.213.7.2 (processes 2-3)', from what every process published
    (call after a barrier that follows publish_host); '' for one process."""
    kv = key_value_store()
    if kv is None:
        return ""
    processes: dict[str, list[int]] = {}
    for key, where in sorted(kv.dir_get(HOSTS).items()):
        rank = key.rsplit("/", 1)[-1]
        if rank.isdigit():
            processes.setdefault(where, []).append(int(rank))
    parts = []
    for where, ranks in sorted(processes.items(), key=lambda kv: min(kv[1])):
        ranks.sort()
        span = f"{ranks[0]}-{ranks[-1]}" if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 1 else (
            ", ".join(map(str, ranks)))  # fmt: skip
        parts.append(f"{where} (process{'es' if len(ranks) > 1 else ''} {span})")
    return f"{len(parts)} host{'s' if len(parts) > 1 else ''}: " + ", ".join(parts)


DEPARTED = "jdp/departed"  # the first process to leave the job abnormally says who it was and why
POLL_S = 0.5


def announce_departure(why: str) -> None:
    """Tell every other process that this one is leaving the job, and why (best effort: the first to leave is
    the one named; its peers' PeerMonitor ends them within a second instead of leaving them to wait for it)."""
    try:
        kv = key_value_store()
        if kv is not None:
            kv.set(DEPARTED, f"process {jax.process_index()} {why}"[:2000])
    except Exception:
        pass  # another process left first (it is the one named), or the coordinator is gone


def first_departure() -> str | None:
    """Another process's departure notice, if one left the job before this one (None when it was this one)."""
    try:
        kv = key_value_store()
        notice = kv.try_get(DEPARTED) if kv is not None else None
    except Exception:
        return None
    if notice is None or notice.startswith(f"process {jax.process_index()} "):
        return None
    return "".join(c if c.isprintable() else "?" for c in notice[:500])


def leave_job(code: int) -> None:
    """Exit now, never through JAX's shutdown barrier (which would wait for peers that may be gone). Process 0
    first gives its peers' monitors time to read the departure notice, which lives in its coordinator (and
    JAX may abort it, after its own message, as they go)."""
    if jax.process_count() > 1 and jax.process_index() == 0:
        time.sleep(3 * POLL_S)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class PeerMonitor:
    """Ends this process, naming who left and why, within a second of another process announcing its departure:
    no process waits in a collective, a barrier or a checkpoint save for a peer that is gone."""

    def __init__(self):
        self._stop = threading.Event()
        self.kv = key_value_store()
        if self.kv is not None:
            threading.Thread(target=self._run, daemon=True, name="jdp-peer-monitor").start()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            if (shown := first_departure()) and not self._stop.is_set():
                log.error(
                    f"process {jax.process_index()} of {jax.process_count()}: stopping because {shown}; not waiting "
                    f"for it"
                )
                os._exit(5)

    def close(self) -> None:
        self._stop.set()


class StopAgreement:
    """SIGTERM or SIGINT to any process makes every process stop after the same step (then save and exit 0).

    The process that gets the signal proposes "stop after step s + margin" in jax.distributed's key-value
    store; every process reads it before each step. Processes of a data-parallel job are never more than a
    step or two apart (each step's metrics fetch waits for everyone's previous step), so the margin of 3
    leaves every process room to reach the agreed step. A second signal exits at once.

    Groups that agree only every `every` steps (parallel.sync=diloco) run up to a round apart: a process can be
    at most 2 steps past the next sync b that the proposer has not reached (the step after b waits for every group's
    part of it), so the proposal is b + 3, b the first sync after the proposer's step; and a process reads the
    store only 2 steps after each sync, when that sync has completed (so the proposer wrote before it): one read
    a round instead of one a step, which over a slow link is one round trip to the coordinator saved per step.
    A sync whose result is used `lag` steps later (streaming DiLoCo's delayed outer step) moves both by `lag`.
    """

    MARGIN = 3
    KEY = "jdp/stop_after_step"

    def __init__(self, handle_signals: bool = True, every: int = 1, lag: int = 0):
        """handle_signals=False: this process installs no handler (a library caller keeps its own), and stops only
        where another process of the job proposed. every: the steps between the groups' syncs (1: every step); lag:
        the steps after a sync that its result is first used.

        Each signal is answered at once by a thread it wakes (signal.set_wakeup_fd): Python runs a handler only
        when the main thread is between bytecodes, which it is not while XLA compiles the first step (10 s), and
        two signals in that time run it once: the line waited for the compile, and a second Ctrl-C was dropped.
        SIGINT is taken over from the start-up's StartupInterrupts with no moment without a handler; an interrupt
        it holds is raised here (Interrupted: exit 130, nothing trained)."""
        self.every, self.lag = every, lag
        self.stop_at: int | None = None
        self.signals = 0
        self._pending: int | None = None
        self._previous: dict = {}
        self._pipe: tuple[int, int] | None = None
        if handle_signals:
            self._take_signals()

    def _take_signals(self) -> None:
        self._pipe = os.pipe()
        os.set_blocking(self._pipe[1], False)
        self._wakeup = signal.set_wakeup_fd(self._pipe[1], warn_on_full_buffer=False)
        self._previous = {sig: signal.signal(sig, self._handler) for sig in (signal.SIGTERM, signal.SIGINT)}
        threading.Thread(target=self._watch, daemon=True, name="jdp-stop-watch").start()
        if (guard := startup_interrupts()) is not None:
            self._previous[signal.SIGINT], self._wakeup = guard.give_to_loop()
            try:
                guard.check()  # Ctrl-C'd before this, and dropped in a __del__
            except BaseException:
                self.close()
                raise
            if guard.count and self._pending is None:  # a SIGINT between the two installs: its wakeup byte came
                self._pending = signal.SIGINT  # here (the watch said it), the start-up's handler counted it

    def _handler(self, sig, frame) -> None:
        """In the main thread, when it next runs Python: the stop is proposed before the next step (the watch
        thread has said so, and exits at a second signal)."""
        self.signals += 1
        if self._pending is None:
            self._pending = sig

    def _watch(self) -> None:
        read, got = self._pipe[0], 0
        try:
            while data := os.read(read, 64):
                for sig in (s for s in data if s in self._previous):
                    got += 1
                    name = signal.Signals(sig).name
                    if got > 1:
                        log.warning(f"second {name}: exiting now, without saving", extra=PLAIN)
                        announce_departure(f"exited at a second {name}")
                        exit_at_once(128 + sig)  # XLA may be compiling: no finalization
                    log.warning(
                        f"process {jax.process_index()} got {name}: every process will stop at an agreed step and "
                        f"save (send it again to exit at once)",
                        extra=PLAIN,
                    )
        finally:
            os.close(read)

    def should_stop(self, done: int) -> bool:
        """Called before each step with the number of steps done: True once the agreed step is reached."""
        kv = key_value_store()
        if self._pending is not None and self.stop_at is None:
            # one process holds every group: they run in step, nothing to wait for
            ahead = done if self.every == 1 or not kv else (done // self.every + 1) * self.every  # the next sync
            proposal = ahead + (self.lag + self.MARGIN if kv else 0)
            if kv:
                try:
                    kv.set(self.KEY, str(proposal))
                except Exception:
                    pass  # another process proposed first; its step is the one everybody reads
            if not kv:
                self.stop_at = proposal
        due = self.every <= 2 or done % self.every == (self.lag + 2) % self.every
        if kv and due and self.stop_at is None and (agreed := kv.try_get(self.KEY)) is not None:
            self.stop_at = step_value(self.KEY, agreed)
            if self.stop_at is not None and self.stop_at < done:  # jdp proposes steps nobody has passed yet
                if "past:" + self.KEY not in _warned:
                    _warned.add("past:" + self.KEY)
                    log.warning(
                        f"ignoring {self.KEY}={self.stop_at} in the job's key-value store: this process has already "
                        f"done {done} steps, and jdp only proposes steps ahead of every process"
                    )
                self.stop_at = None
        return self.stop_at is not None and done >= self.stop_at

    def close(self) -> None:
        if self._pipe is None:
            return
        signal.set_wakeup_fd(self._wakeup)  # before the pipe closes: no signal is written to a closed fd
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        os.close(self._pipe[1])  # the watch thread reads b"" and ends
        self._pipe = None


class Watchdog:
    """Exits this process, with a message and each thread's Python stack, when no step finishes for `timeout_s` (a
    stalled or dead peer, or a call that never returns).

    Each process records its last finished step in the key-value store, so the message names the
    processes that are behind.
    """

    PREFIX = "jdp/progress/"

    def __init__(self, timeout_s: float):
        self.timeout_s, self.step, self.last = timeout_s, 0, time.monotonic()
        self.armed, self.published = False, 0
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True, name="jdp-watchdog").start()

    def progress(self, step: int) -> None:
        """Step `step` finished. The key-value store learns it from the watchdog's thread within a second, not here:
        a round trip to the coordinator each step would cost a step its latency over a slow link."""
        self.step, self.last, self.armed = step, time.monotonic(), True

    def publish(self) -> None:
        """Record this process's last finished step in the key-value store (the watchdog's thread does, each second)."""
        if self.step != self.published and (kv := key_value_store()):
            step = self.step
            kv.set(f"{self.PREFIX}{jax.process_index()}", str(step), overwrite=True)
            self.published = step

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
            try:
                self.publish()
            except Exception:
                pass  # the coordinator unreachable: the heartbeat and the timeout below speak for it
            if self.armed and time.monotonic() - self.last > self.timeout_s:
                try:
                    behind = self._behind()
                except Exception as e:
                    behind = f"; could not reach the coordinator to ask the others ({type(e).__name__})"
                log.error(
                    f"process {jax.process_index()} of {jax.process_count()}: no step finished for "
                    f"{self.timeout_s:g} s after step {self.step} (train.step_timeout_s){behind}. A peer is "
                    f"stalled or dead; exiting instead of waiting forever. Where each thread of this process waited:"
                )
                faulthandler.dump_traceback(all_threads=True)  # to stderr: what a hang's report needs first
                announce_departure(f"gave up: no step finished for {self.timeout_s:g} s after step {self.step}")
                os._exit(4)

    def _behind(self) -> str:
        """Which processes are behind, from the steps they last recorded (malformed records are ignored)."""
        kv = key_value_store()
        if not kv:
            return ""
        steps = {}
        for key, text in kv.dir_get(self.PREFIX).items():
            process, step = key.rsplit("/", 1)[-1], step_value(key, text)
            if process.isdigit() and int(process) < jax.process_count() and step is not None:
                steps[int(process)] = step
        lagging = sorted(p for p in range(jax.process_count()) if steps.get(p, -1) < max(steps.values(), default=0))
        return f"; processes behind the others: {lagging or 'none'} (last steps: {steps})"

    def close(self) -> None:
        self._stop.set()
