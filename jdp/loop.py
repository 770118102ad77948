"""The training loop: each step, the periodic work between steps, and the end of a run (last step or preemption)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

from jdp import parallel
from jdp.checkpoint import Checkpoints
from jdp.config import Config, Derived
from jdp.coordination import StopAgreement, Watchdog
from jdp.data import Data, Prefetcher, eval_batches
from jdp.faults import Faults
from jdp.metrics import GOODPUT_PARTS, MetricsLog, StepMeter, describe_goodput, goodput
from jdp.rundir import RunDir


class Phases:
    """What the run is doing now (the phase named when it fails), and the goodput account: seconds spent per kind
    of work. One `with phases(...)` block sets the phase, times it, and pauses the step watchdog where asked."""

    def __init__(self):
        self.now = "setting up"
        self.started = time.time()
        self.spent = dict.fromkeys(GOODPUT_PARTS, 0.0)
        self.watchdog: Watchdog | None = None

    @contextmanager
    def __call__(self, name: str, account: str | None = None, pause_watchdog: bool = False) -> Iterator[None]:
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


@dataclass
class Setup:
    """What setting up a run hands the loop."""

    cfg: Config
    derived: Derived
    mesh: jax.sharding.Mesh
    data: Data
    graphdef: Any
    state: parallel.TrainState
    train_step: Callable
    eval_step: Callable
    digest: Callable  # parallel.make_replica_digest
    run_dir: RunDir
    ckpts: Checkpoints
    start: int  # the step this run starts from: 0, or the checkpoint it resumed from
    resumed_from: int | None
    lost_steps: int  # steps a previous attempt ran past that checkpoint
    log: MetricsLog
    peak: float  # FLOP/s, for MFU
    phases: Phases
    faults: Faults
    comm: dict | None = None  # what checkpoints record of the communication hook's state (parallel.comm_record)


@dataclass
class Result:
    state: parallel.TrainState
    done: int  # steps done
    preempted: bool
    last: dict[str, Any]  # the last metrics record and eval_loss
    skipped_total: int
    goodput: dict


def evaluate(eval_step, state, stream: np.ndarray, cfg: Config, mesh, rows: slice) -> tuple[float, float]:
    """Mean loss over every validation token on every device: (sum of losses) / (sum of weights)."""
    loss_sum, weight_sum = 0.0, 0.0
    pending = []
    for local in eval_batches(stream, cfg.data.seq_len, cfg.train.batch_size, rows):
        pending.append(eval_step(state, parallel.shard_batch(local, mesh, cfg.train.batch_size)))
    for loss, weight in jax.device_get(pending):
        loss_sum += float(loss)
        weight_sum += float(weight)
    return loss_sum / max(weight_sum, 1.0), weight_sum


class Loop:
    """Runs the steps of one attempt. Periodic work is a list of (every, action); each action owns its phase."""

    def __init__(self, s: Setup):
        t = s.cfg.train
        self.s, self.t, self.state, self.done = s, t, s.state, s.start
        self.is_main = jax.process_index() == 0
        self.do_eval = s.cfg.data.val_tokens > 0
        self.saved = set(s.ckpts.steps())
        self.pending: tuple[int, dict] | None = None  # a dispatched step whose metrics are not fetched yet
        self.positions: dict[int, object] = {}  # streaming: the loader's position after each step's batch
        self.last: dict[str, Any] = {}
        self.meter = StepMeter(s.cfg, s.derived.tokens_per_step, s.peak, s.data.train.epoch)
        self.periodic = [
            (t.check_replicas_every, self.check_replicas),
            (t.eval_every if self.do_eval else 0, self.evaluate),
            (t.ckpt_every, self.save),
        ]

    def run(self) -> Result:
        s, t = self.s, self.t
        self.check_replicas(s.start, account=None)  # part of start-up
        self.bar = tqdm(
            total=t.steps, initial=s.start, disable=not (self.is_main and t.progress), unit="step", dynamic_ncols=True,
            mininterval=1.0,
        )  # fmt: skip
        self.loader = Prefetcher(
            lambda i: (s.data.local_batch(i), s.data.position()), s.start, t.steps, s.cfg.data.prefetch
        )
        stop, s.phases.watchdog = StopAgreement(), Watchdog(t.step_timeout_s)
        loop_start = time.time()
        try:
            preempted = self.steps(stop)
            self.end(preempted)
        finally:
            s.phases.watchdog.close()
            stop.close()
            self.bar.close()
        s.ckpts.close()
        account = goodput(
            loop_start - s.phases.started, s.phases.spent, time.time() - loop_start, self.loader.wait_s,
            self.done - s.start, s.lost_steps,
        )  # fmt: skip
        s.log.write({"step": self.done, "goodput": account})
        if self.is_main:
            print(describe_goodput(account), flush=True)
        s.log.close()
        return Result(self.state, self.done, preempted, self.last, self.meter.bad_total, account)

    def steps(self, stop: StopAgreement) -> bool:
        """Every step up to train.steps, or until the processes agree to stop (then True: preempted)."""
        s, preempted = self.s, False
        try:
            for step, (local, position) in self.loader:
                if preempted := stop.should_stop(self.done):
                    break
                self.step(step + 1, local, position)
                self.check_background_save()
                for every, action in self.periodic:
                    if every and self.done % every == 0 and self.done < self.t.steps:
                        self.flush()
                        action(self.done)
                s.faults.after_step(self.done, before_dying=self.flush)
            self.flush()
            return preempted
        except BaseException:
            # A checkpoint already being written holds good parameters: let it complete. With several processes a
            # dead peer could block that forever, so only a single process waits.
            if jax.process_count() == 1:
                s.ckpts.wait()
            raise
        finally:
            self.loader.close()

    def step(self, step: int, local: dict, position) -> None:
        """Dispatch step `step` (1-based), then fetch the previous step's metrics: the device never waits on us."""
        s = self.s
        local = s.faults.batch(step, local)
        self.positions[step] = position
        with s.phases(f"running step {step}", "compile_s" if step == s.start + 1 else None):  # the first compiles
            self.state, metrics = s.train_step(self.state, parallel.shard_batch(local, s.mesh, self.t.batch_size))
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
        self.s.phases.watchdog.progress(step)
        self.meter.count(m)
        if m["skipped"] and self.is_main:
            self.bar.write(
                f"step {step}: non-finite loss or gradient (loss {m['loss']}, grad_norm {m['grad_norm']}): update skipped"
            )
        if self.meter.bad_run > self.t.max_bad_steps:
            raise RuntimeError(
                f"{self.meter.bad_run} non-finite steps in a row (more than train.max_bad_steps={self.t.max_bad_steps}),"
                f" the last at step {step}; the parameters were never updated with them and the newest checkpoint "
                f"is step {self.newest_checkpoint_before(step)}. Lower optim.lr or check the data"
            )
        if record := self.meter.record(step, m, self.loader.wait_s):
            self.s.faults.at("log", step)
            self.s.log.write(record)
            self.last.update(record)
        tps = f"{self.meter.tps:,.0f}" if self.meter.tps else "-"
        self.bar.set_postfix(loss=f"{m['loss']:.4f}", tok_s=tps, refresh=False)
        self.bar.update(1)

    def check_replicas(self, step: int, account: str | None = "replica_checks_s") -> None:
        s = self.s
        with s.phases(f"checking the replicas at step {step}", account):
            self.state.params = s.faults.replicas(step, self.state.params)
            if bad := parallel.replica_digest_mismatches(s.digest, self.state.params, s.mesh):
                raise RuntimeError(
                    f"replicas diverged at step {step}: the parameters on {', '.join(bad)} differ from device 0's"
                )

    def evaluate(self, step: int) -> None:
        s = self.s
        with s.phases(f"evaluating at step {step}", "eval_s", pause_watchdog=True):
            s.faults.at("eval", step)
            loss, n_tok = evaluate(s.eval_step, self.state, s.data.tokens.val, s.cfg, s.mesh, s.data.rows)
            s.log.write({"step": step, "eval_loss": loss, "eval_tokens": n_tok})
            self.last.update(eval_loss=loss)
            if self.is_main:
                self.bar.write(f"step {step}: eval_loss {loss:.4f} over {n_tok:,.0f} tokens")
        self.meter.restart()  # evaluation time is not training throughput

    def save(self, step: int) -> None:
        s = self.s
        self.check_background_save(wait=True)  # the previous save's error names its own step, not this one
        with s.phases(f"saving the checkpoint at step {step}", "checkpoint_s", pause_watchdog=True):
            s.faults.at("save", step)
            if s.cfg.data.streaming:  # each process's own stream position, beside the checkpoint
                where = s.run_dir.data_state(step, jax.process_index())
                where.parent.mkdir(parents=True, exist_ok=True)
                where.write_text(json.dumps(self.positions[step]))
            if bad := parallel.nonfinite_leaves(self.state.params):  # a checkpoint never holds a NaN or an Inf
                raise RuntimeError(
                    f"step {step}: the parameters hold NaN or Inf ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}"
                    f") although every loss and gradient was finite: the optimizer update overflowed. Not saved; the "
                    f"newest checkpoint is step {self.newest_checkpoint_before(step)}. Lower optim.lr"
                )
            record = {"step": step, "config": json.loads(json.dumps(s.cfg.to_dict()))}
            record["data"] = {"seed": self.t.seed, "step": step}
            record["rng"] = "none: the train step draws no random numbers; data order derives from (train.seed, step)"
            record["optimizer_layout"] = parallel.OptLayout.of(s.cfg.parallel.strategy, s.mesh).to_record()
            if s.comm is not None:
                record["comm"] = s.comm
            s.ckpts.save(step, self.state, record)
            self.saved.add(step)
            s.faults.after_save_started(step)

    def check_background_save(self, wait: bool = False) -> None:
        """Stop at this step boundary if the checkpoint being written in the background failed (or `wait` for it)."""
        s = self.s
        if (step := s.ckpts.writing) is None or not (wait or s.ckpts.ended()):
            return
        before, doing = s.phases.now, "waiting for" if wait else "writing"
        with s.phases(f"{doing} the checkpoint at step {step}", "checkpoint_s", pause_watchdog=wait):
            s.ckpts.wait()
        s.phases.now = before  # it was written: an error after this is named by the phase it happens in

    def newest_checkpoint_before(self, step: int) -> int | str:
        return max((c for c in self.s.ckpts.steps() if c < step), default="none")

    def end(self, preempted: bool) -> None:
        """After the last step: evaluate and save it; after a preemption: save where every process stopped."""
        self.check_background_save()
        if not preempted and self.do_eval:
            self.evaluate(self.t.steps)
        if self.done not in self.saved:
            self.save(self.done)
        self.check_background_save(wait=True)
        if preempted and self.is_main:
            print(
                f"\njdp | stopped by a signal after step {self.done}; checkpoint saved. Run the same command to resume."
            )
