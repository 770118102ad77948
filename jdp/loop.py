"""The training loop: each step, the callbacks between steps, and the end of a run (last step or preemption)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import jax
from tqdm import tqdm

from jdp import parallel
from jdp.callbacks import Callback, StepInfo
from jdp.checkpoint import Checkpoints
from jdp.config import Config
from jdp.data.dataset import Prefetcher, Source
from jdp.job.coordination import StopAgreement, Watchdog
from jdp.log import logger
from jdp.metrics import GOODPUT_PARTS, MetricsLog, StepMeter, describe_goodput, goodput
from jdp.parallel import sync
from jdp.rundir import RunDir

__all__ = ["Loop", "Phases", "Result", "Run"]

log = logger("jdp.loop")


class Phases:
    """What the run is doing now (the phase named when it fails), and the goodput account: seconds spent per kind
    of work. One `with phases(...)` block sets the phase, times it, and pauses the step watchdog where asked."""

    def __init__(self):
        self.now = "setting up"
        self.started = time.time()
        self.spent = dict.fromkeys(GOODPUT_PARTS, 0.0)
        self.watchdog: Watchdog | None = None
        self.check: Callable[[], None] = lambda: None  # raises an interrupt dropped since the last phase began

    @contextmanager
    def __call__(self, name: str, account: str | None = None, pause_watchdog: bool = False) -> Iterator[None]:
        self.check()
        self.now = name
        paused = self.watchdog.paused() if pause_watchdog and self.watchdog else _nothing()
        start = time.time()
        try:
            with paused:
                yield
        finally:
            if account:
                self.spent[account] += time.time() - start


@contextmanager
def _nothing() -> Iterator[None]:
    yield


@dataclass(kw_only=True)
class Run:
    """What setting up a run hands the loop (trainer.py builds it, by name)."""

    cfg: Config
    mesh: jax.sharding.Mesh
    data: Source  # what the trainer asks of data (dataset.py)
    eval_data: Source | None  # None: no evaluation
    graphdef: Any
    state: parallel.TrainState
    train_step: Callable
    eval_step: Callable | None
    digest: Callable  # parallel.make_replica_digest
    run_dir: RunDir
    ckpts: Checkpoints
    record: Callable[[int], dict]  # step -> the checkpoint record: every component's state (checkpoint.py)
    start: int  # the step this run starts from: 0, or the checkpoint it resumed from
    resumed_from: int | None
    lost_steps: int  # steps a previous attempt ran past that checkpoint
    log: MetricsLog
    meter: StepMeter
    phases: Phases
    callbacks: list[Callback] = field(default_factory=list)
    unit: str = "tokens"  # what the loss weight counts: tokens, examples
    handle_signals: bool = True  # SIGTERM/SIGINT stop every process at an agreed step and save there

    @property
    def batch_size(self) -> int:
        return self.cfg.train.batch_size


@dataclass
class Result:
    state: parallel.TrainState
    done: int  # steps done
    preempted: bool
    last: dict[str, Any]  # the last metrics record and eval_loss
    skipped_total: int
    goodput: dict


class Loop:
    """Runs the steps of one attempt; after each, every callback that is due (each in its own phase). Callbacks see
    it as callbacks.Loop: what they may read and do."""

    def __init__(self, run: Run):
        self.run, self.t, self.state, self.done = run, run.cfg.train, run.state, run.start
        self.phases, self.meter, self.is_main = run.phases, run.meter, jax.process_index() == 0
        self.saved = set(run.ckpts.steps())
        self.pending: tuple[int, dict] | None = None  # a dispatched step whose metrics are not fetched yet
        self.positions: dict[int, object] = {}  # a loader's own position after each step's batch (streaming)
        self.last: dict[str, Any] = {}

    def go(self) -> Result:
        run, t = self.run, self.t
        for callback in run.callbacks:
            callback.begin(self)
        # SIGINT/SIGTERM from here on: stop at a step every process agrees on. Taken over from the start-up's handling
        # (job/process.py) only now, with no moment without a handler: the replica check at step 0 is start-up.
        every, lag = sync.get(run.cfg.parallel.sync).apart(run.cfg.parallel)  # how far the groups may run apart
        stop = StopAgreement(run.handle_signals, every, lag)
        try:  # (its handlers given back if what follows fails)
            # On a terminal a progress bar; into a file or a pipe (a log), a plain line per logged step instead of
            # the bar's carriage returns, which make one endless line of a log file
            self.lines = self.is_main and t.progress and not sys.stderr.isatty()
            self.bar = tqdm(total=t.steps, initial=run.start, disable=not (self.is_main and t.progress) or self.lines,
                            unit="step", dynamic_ncols=True, mininterval=1.0)  # fmt: skip
            self.loader = Prefetcher(lambda i: (run.data.local_batch(i), run.data.position()), run.start, t.steps,
                                     run.cfg.data.prefetch)  # fmt: skip
        except BaseException:
            stop.close()
            raise
        run.phases.watchdog = Watchdog(t.step_timeout_s)
        loop_start = time.time()
        try:
            preempted = self.steps(stop)
            self.end(preempted)
        finally:
            run.phases.watchdog.close()
            stop.close()
            self.bar.close()
        run.ckpts.close()
        account = goodput(loop_start - run.phases.started, run.phases.spent, time.time() - loop_start,
                          self.loader.wait_s, self.done - run.start, run.lost_steps)  # fmt: skip
        run.log.write({"step": self.done, "goodput": account})
        for line in describe_goodput(account):
            log.info(line)
        run.log.close()
        return Result(self.state, self.done, preempted, self.last, self.meter.bad_total, account)

    def steps(self, stop: StopAgreement) -> bool:
        """Every step up to train.steps, or until the processes agree to stop (then True: preempted)."""
        run, preempted = self.run, False
        try:
            for step, (local, position) in self.loader:
                if preempted := stop.should_stop(self.done):
                    break
                self.step(step + 1, local, position)
                self.check_background_save()
                for callback in run.callbacks:
                    if callback.due(self.done, self.t.steps):
                        self.flush()
                        with callback.phase(self, self.done):
                            callback.run(self, self.done)
                self.notify("step_end", self.done)
            self.flush()
            if not preempted and self.done > run.start and self.meter.bad_run >= self.done - run.start:
                raise RuntimeError(
                    f"every step of this run ({run.start + 1}-{self.done}) had a non-finite loss or gradient and was "
                    f"skipped: the parameters were never updated (train.max_bad_steps={self.t.max_bad_steps} allows "
                    f"that many in a row). Lower optim.lr or check the data and the loss"
                )
            return preempted
        except BaseException:
            # A checkpoint already being written holds good parameters: let it complete. With several processes a
            # dead peer could block that forever, so only a single process waits.
            if jax.process_count() == 1:  # its failure (a full disk) is named as the checkpoint's, not this step's
                self.check_background_save(wait=True)
            raise
        finally:
            self.loader.close()

    def step(self, step: int, local: dict, position) -> None:
        """Dispatch step `step` (1-based), then fetch the previous step's metrics: the device never waits on us."""
        run = self.run
        for callback in run.callbacks:
            local = callback.on_batch(self, step, local)
        self.positions[step] = position
        with self.phases(f"running step {step}", "compile_s" if step == run.start + 1 else None):  # the first compiles
            self.state, metrics = run.train_step(self.state, parallel.shard_batch(local, run.mesh, self.t.batch_size))
        self.done = step
        self.flush()
        self.pending = (step, metrics)
        self.positions.pop(step - 1, None)

    def flush(self) -> None:
        """Fetch the dispatched step's metrics (it has finished by then), count it and log it."""
        if self.pending is None:
            return
        (step, metrics), self.pending = self.pending, None
        m = {k: float(v) for k, v in jax.device_get(metrics).items()}
        self.phases.watchdog.progress(step)
        self.meter.count(m)
        if m["skipped"]:
            self.say(f"step {step}: non-finite loss or gradient (loss {m['loss']}, grad_norm {m['grad_norm']}): update skipped")
        if self.meter.bad_run > self.t.max_bad_steps:
            raise RuntimeError(
                f"{self.meter.bad_run} non-finite steps in a row (more than train.max_bad_steps={self.t.max_bad_steps}),"
                f" the last at step {step}; the parameters were never updated with them and the newest checkpoint "
                f"is step {self.newest_checkpoint_before(step)}. Lower optim.lr or check the data"
            )
        tps = f"{self.meter.tps:,.0f}" if self.meter.tps else "-"
        if record := self.meter.record(step, m, self.loader.wait_s):
            self.notify("log", step)
            self.run.log.write(record)
            self.last.update(record)
            if self.lines:
                self.say(f"step {step}/{self.t.steps}: loss {m['loss']:.4f}, {self.run.unit}/s {tps}")
        self.bar.set_postfix({"loss": f"{m['loss']:.4f}", f"{self.run.unit}/s": tps}, refresh=False)
        self.bar.update(1)

    def write(self, record: dict) -> None:
        self.run.log.write(record)

    def say(self, text: str) -> None:
        if self.is_main:
            self.bar.write(text)

    def not_training(self) -> None:
        self.meter.restart()

    def notify(self, point: str, step: int) -> None:
        """Every callback's `at(self, point, step)`: one of callbacks.POINTS has been reached."""
        for callback in self.run.callbacks:
            callback.at(self, point, step)

    def info(self, step: int) -> StepInfo:
        return StepInfo(step, self.state, self.run.graphdef, dict(self.last), self.run.run_dir, self.is_main)

    def save(self, step: int) -> None:
        """Write checkpoint `step` in the background (never one holding a NaN or an Inf)."""
        run = self.run
        self.check_background_save(wait=True)  # the previous save's error names its own step, not this one
        self.notify("save", step)
        if bad := parallel.nonfinite_leaves(self.state.params):  # a checkpoint never holds a NaN or an Inf
            raise RuntimeError(
                f"step {step}: the parameters hold NaN or Inf ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}"
                f") although every loss and gradient was finite: the optimizer update overflowed. Not saved; the "
                f"newest checkpoint is step {self.newest_checkpoint_before(step)}. Lower optim.lr"
            )
        run.ckpts.save(step, self.state, run.record(step), self.positions.get(step))
        self.saved.add(step)
        self.notify("saving", step)

    def check_background_save(self, wait: bool = False) -> None:
        """Stop at this step boundary if the checkpoint being written in the background failed (or `wait` for it)."""
        ckpts = self.run.ckpts
        if (step := ckpts.writing) is None or not (wait or ckpts.ended()):
            return
        before, doing = self.phases.now, "waiting for" if wait else "writing"
        with self.phases(f"{doing} the checkpoint at step {step}", "checkpoint_s", pause_watchdog=wait):
            ckpts.wait()
        self.phases.now = before  # it was written: an error after this is named by the phase it happens in

    def newest_checkpoint_before(self, step: int) -> int | str:
        return max((c for c in self.run.ckpts.steps() if c < step), default="none")

    def end(self, preempted: bool) -> None:
        """After the last step, or where every process agreed to stop: each callback's end (evaluate, save)."""
        self.check_background_save()
        for callback in self.run.callbacks:
            callback.end(self, preempted)
        if preempted:  # the newline ends the progress bar's line
            log.info(f"\nstopped by a signal after step {self.done}; checkpoint saved. Run the same command to resume.")
