"""Periodic work between steps, as a list of callbacks that own their cadence (Levanter's `add_hook(fn, every=n)`).

The loop calls every callback after every step, in order, and once more at the end of a run; each decides for
itself whether it has work then. jdp's own (replica checks, evaluation, checkpoints) are callbacks like a user's:
`jdp.every(500, fn)` runs `fn(info)` every 500 steps. Each runs inside one `with phases(...)` block, which names it
in errors, times it for the goodput account and pauses the step watchdog where the work may legitimately be long.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import jax

from jdp import parallel
from jdp.config import Config
from jdp.data.dataset import Source
from jdp.errors import ConfigError

__all__ = [
    "POINTS",
    "Callback",
    "Checkpoint",
    "Evaluate",
    "Every",
    "Loop",
    "Periodic",
    "ReplicaCheck",
    "RunView",
    "StepInfo",
    "every",
    "imported",
]


@dataclass
class StepInfo:
    """What a callback sees: the step just done, the train state after it, and the last logged metrics."""

    step: int
    state: parallel.TrainState
    graphdef: Any
    metrics: dict[str, Any]
    run_dir: Any  # rundir.RunDir
    is_main: bool  # process 0: the one that writes files and prints

    @property
    def model(self):
        """The model as a plain NNX module (a copy merged from the state: changing it changes nothing)."""
        from flax import nnx

        return nnx.merge(self.graphdef, self.state.params, self.state.rest)


class RunView(Protocol):
    """What a callback sees of how the run was set up (jdp.loop.Run is one)."""

    cfg: Config
    mesh: jax.sharding.Mesh
    eval_data: Source | None  # None: no evaluation
    eval_step: Callable | None  # (state, global batch) -> (loss sum, weight sum)
    digest: Callable  # parallel.make_replica_digest(mesh)
    graphdef: Any
    run_dir: Any  # rundir.RunDir
    unit: str  # what the loss weight counts: tokens, examples

    @property
    def batch_size(self) -> int: ...


class Loop(Protocol):
    """What a callback sees of the running loop (jdp.loop.Loop is one): the state, what was saved, and the few
    things a callback may do to the run. Nothing else of the loop (its progress bar, its meter) is a callback's."""

    run: RunView
    state: parallel.TrainState  # after `done` steps; a callback may replace it (tests/inject.py does)
    done: int  # the steps done
    saved: set[int]  # the steps checkpointed, by this attempt or before it
    is_main: bool  # process 0: the one that writes files and prints
    last: dict[str, Any]  # the last metrics record, and eval_loss: what StepInfo.metrics and the result hold
    phases: Callable[..., AbstractContextManager]  # phases(name, account=None, pause_watchdog=False): loop.Phases

    def notify(self, point: str, step: int) -> None:
        """Every callback's `at(loop, point, step)`: one of POINTS has been reached."""

    def info(self, step: int) -> StepInfo: ...

    def flush(self) -> None:
        """Fetch and log the metrics of the step dispatched last."""

    def write(self, record: dict) -> None:
        """One record into metrics.jsonl and the trackers."""

    def say(self, text: str) -> None:
        """A line above the progress bar, on the main process."""

    def not_training(self) -> None:
        """The time since the last step was not training: throughput is measured afresh from here."""

    def save(self, step: int) -> None:
        """Write checkpoint `step` in the background."""

    def check_background_save(self, wait: bool = False) -> None: ...


class Callback:
    """Work between steps. `begin(loop)` runs before the first step; `due(step, last)` says whether to run after
    `step` (`last`: the run's final step) and `run(loop, step)` does it; `end(loop, preempted)` runs once after the
    last step (or the agreed step of a preemption).

    Two more ways in, for work that must happen at a precise point rather than between steps: `on_batch(loop,
    step, local)` sees (and returns) this process's rows of step `step` before it runs, and `at(loop, point, step)`
    is called at each of the loop's named POINTS. jdp's own tests inject their faults this way (tests/inject.py);
    a callback is registered with `Trainer(callbacks=[...])` or, for `jdp train`, `train.callbacks=module:name`.
    """

    name = "a callback"
    account: str | None = None  # the goodput part its time counts to (None: training time)
    pause_watchdog = False

    def due(self, step: int, last: int) -> bool:
        return False

    def phase(self, loop: Loop, step: int):
        """The phase it runs in: named in errors, timed in its goodput account, the watchdog paused if asked."""
        return loop.phases(f"{self.name} at step {step}", self.account, self.pause_watchdog)

    def begin(self, loop: Loop) -> None:
        """Before the first step (part of start-up)."""

    def run(self, loop: Loop, step: int) -> None:
        pass

    def end(self, loop: Loop, preempted: bool) -> None:
        pass

    def on_batch(self, loop: Loop, step: int, local: dict) -> dict:
        """This process's rows of step `step` (1-based), just before the step runs: return them (or others)."""
        return local

    def at(self, loop: Loop, point: str, step: int) -> None:
        """At one of POINTS of step `step`."""


POINTS = {
    "log": "the step's metrics are about to be written",
    "eval": "evaluation is about to start",
    "replicas": "the replica check is about to compare the devices' digests (loop.state may still be changed)",
    "save": "the checkpoint is about to be written",
    "saving": "the checkpoint's background write has just started",
    "step_end": "every callback due after the step has run",
}


def imported(spec: str) -> list[Callback]:
    """The callbacks `train.callbacks` names: `module:name[,module:name...]`, each name a Callback subclass or a
    function of no arguments returning a Callback. Every problem is a ConfigError, before any compute."""
    import importlib

    out = []
    for item in (part.strip() for part in spec.split(",") if part.strip()):
        where = f"train.callbacks={spec!r}"
        module_name, _, attr = item.partition(":")
        if not module_name or not attr:
            raise ConfigError(f"{where}: {item!r} is not module:name (e.g. mypackage.hooks:SampleText)")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ConfigError(f"{where}: cannot import {module_name!r} ({e}); is it on PYTHONPATH?") from e
        except SyntaxError as e:
            raise ConfigError(f"{where}: {e.filename}, line {e.lineno}: {e.msg} (a syntax error in the module)") from e
        except Exception as e:
            raise ConfigError(f"{where}: importing {module_name!r} raised {type(e).__name__}: {e}") from e
        if not callable(factory := getattr(module, attr, None)):
            raise ConfigError(f"{where}: module {module_name!r} has no callable {attr!r}")
        try:
            callback = factory()
        except TypeError as e:
            raise ConfigError(
                f"{where}: {item}() cannot be called without arguments ({e}); name a Callback subclass or a function "
                f"of no arguments that returns one"
            ) from e
        if not isinstance(callback, Callback):
            raise ConfigError(
                f"{where}: {item}() returned a {type(callback).__name__}, not a jdp.Callback (subclass jdp.Callback)"
            )
        out.append(callback)
    return out


class Periodic(Callback):
    """Due after every `every`-th step before the last (0: never between steps; `end` covers the last)."""

    def __init__(self, every: int):
        self.every = every

    def due(self, step: int, last: int) -> bool:
        return bool(self.every) and step % self.every == 0 and step < last


class Every(Periodic):
    """A user's function run every `n` steps (and after the last step, with `at_end`): fn(StepInfo)."""

    def __init__(self, n: int, fn: Callable[[StepInfo], None], at_end: bool = False, name: str = ""):
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"every(n={n!r}, ...): n must be a whole number of steps, 1 or more")
        super().__init__(n)
        self.fn, self.at_end = fn, at_end
        self.name = name or getattr(fn, "__name__", "a callback")

    def run(self, loop: Loop, step: int) -> None:
        self.fn(loop.info(step))

    def end(self, loop: Loop, preempted: bool) -> None:
        if self.at_end and not preempted:
            with self.phase(loop, loop.done):
                self.fn(loop.info(loop.done))


def every(n: int, fn: Callable[[StepInfo], None], *, at_end: bool = False, name: str = "") -> Callback:
    """Run `fn(info)` every `n` steps (and once after the last step if `at_end`); `info` is a StepInfo."""
    return Every(n, fn, at_end, name)


class ReplicaCheck(Periodic):
    """Every `every` steps (and at start): a digest of every device's copy of the parameters and other model state
    must be the same bits on every device, else the run stops naming the devices that differ."""

    name, account = "checking the replicas", "replica_checks_s"

    def begin(self, loop: Loop) -> None:
        with loop.phases(f"{self.name} at step {loop.done}"):  # part of start-up, not of the goodput account
            self.run(loop, loop.done)

    def run(self, loop: Loop, step: int) -> None:
        run = loop.run
        loop.notify("replicas", step)
        tree = {"params": loop.state.params, "rest": loop.state.rest}
        if bad := parallel.replica_digest_mismatches(run.digest, tree, run.mesh):
            raise RuntimeError(
                f"replicas diverged at step {step}: the parameters on {', '.join(bad)} differ from device 0's"
            )


class Evaluate(Periodic):
    """Every `every` steps and after the last: the mean loss over every validation example on every device."""

    name, account, pause_watchdog = "evaluating", "eval_s", True

    def run(self, loop: Loop, step: int) -> None:
        run = loop.run
        loop.notify("eval", step)
        sets = run.eval_data.eval_sets()
        record, loss_sum, weight, sums = {"step": step}, 0.0, 0.0, {}
        for label, batches in sets:  # a mixture's sources one by one, each named; the overall loss over all of them
            loss_k, weight_k, extra_k = evaluate(run.eval_step, loop.state, batches, run.mesh, run.batch_size)
            loss_sum, weight = loss_sum + loss_k * weight_k, weight + weight_k
            for k, v in extra_k.items():
                sums[k] = sums.get(k, 0.0) + v * weight_k
            if label:
                record.update({f"eval_loss/{label}": loss_k, f"eval_{run.unit}/{label}": weight_k})
        loss = loss_sum / max(weight, 1.0)
        extra = {f"eval_{k}": v / max(weight, 1.0) for k, v in sums.items()}  # the loss's metrics (TRL's eval_rewards/...)
        loop.write({**record, "eval_loss": loss, f"eval_{run.unit}": weight, **extra})
        loop.last.update(eval_loss=loss)
        loop.say(f"step {step}: eval_loss {loss:.4f} over {weight:,.0f} {run.unit}")
        loop.not_training()  # evaluation time is not training throughput

    def end(self, loop: Loop, preempted: bool) -> None:
        if not preempted:
            with self.phase(loop, loop.done):
                self.run(loop, loop.done)


def evaluate(eval_step, state, batches, mesh, batch_size: int) -> tuple[float, float, dict[str, float]]:
    """Mean loss over every validation row on every device: (sum of losses) / (sum of weights), the weight, and the
    mean of each of the loss's own metrics (its third value, if any) per unit of weight."""
    pending = [eval_step(state, parallel.shard_batch(local, mesh, batch_size)) for local in batches]
    loss_sum = weight_sum = 0.0
    sums: dict[str, float] = {}
    for loss, weight, *extra in jax.device_get(pending):
        loss_sum += float(loss)
        weight_sum += float(weight)
        for k, v in (extra[0] if extra else {}).items():
            sums[k] = sums.get(k, 0.0) + float(v)
    return loss_sum / max(weight_sum, 1.0), weight_sum, {k: v / max(weight_sum, 1.0) for k, v in sums.items()}


class Checkpoint(Periodic):
    """Every `every` steps and at the end (after a preemption too): the train state and every component's state,
    written in the background (checkpoint.py owns the format). A failed background save stops the run at the next
    step boundary, naming its step."""

    name, account, pause_watchdog = "saving the checkpoint", "checkpoint_s", True

    def run(self, loop: Loop, step: int) -> None:
        loop.save(step)

    def end(self, loop: Loop, preempted: bool) -> None:
        if loop.done not in loop.saved:
            with self.phase(loop, loop.done):
                loop.save(loop.done)
        loop.check_background_save(wait=True)
