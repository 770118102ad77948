"""Fault injection for jdp's tests: a jdp.Callback that only the tests register (jdp itself has no fault code).

`register(env, JDP_TEST_KILL="8:save")` gives the environment and the `train.callbacks=inject:Faults` override
for a `jdp train` (or `jdp launch`, or example script) subprocess; in-process tests add `inject.OVERRIDE` to the
config. The faults, each off unless its variable is set:

- JDP_TEST_NAN_STEPS=3,4: NaN weights in those steps' batches;
- JDP_TEST_KILL=STEP: SIGKILL process 0 after that step; STEP:save: just after it starts that step's save;
- JDP_TEST_TERM=STEP:save: SIGTERM process 0 just after it starts the save at STEP;
- JDP_TEST_DIVERGE=STEP: perturb the last device's replica before the replica check at STEP; STEP:end: at the end
  of that step (DiLoCo: the round's parameters between syncs, which the next sync's check finds);
- JDP_TEST_STALL=STEP:PROCESS: that process stops before that step; the others come to it half a
  train.step_timeout_s later, their watchdog paused meanwhile (as for an evaluation), so the stalled process's
  watchdog is the first to fire and its stack is printed (when both fired in the same second, the other's exit could
  take the coordination service down with the stalled process before it printed anything);
- JDP_TEST_KILL_ONCE=STEP:PROCESS:FILE: SIGKILL that process after that step, once the newest checkpoint before it
  is on disk (complete), unless FILE exists (it makes FILE first): a restarted job passes the step;
- JDP_TEST_FAIL=STEP:WHERE:PROCESS: that process raises an error at step STEP where it logs the step's metrics
  (log), starts evaluating (eval) or starts saving (save): a process leaving the job outside a step.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import jax
import numpy as np

import jdp

TESTS = str(Path(__file__).resolve().parent)
OVERRIDE = "train.callbacks=inject:Faults"


def register(env: dict, **faults: str) -> tuple[dict, str]:
    """(environment, override) for a subprocess with these JDP_TEST_* faults: tests/ on its PYTHONPATH."""
    path = os.pathsep.join(p for p in (TESTS, env.get("PYTHONPATH", "")) if p)
    return {**env, "PYTHONPATH": path, **faults}, OVERRIDE


class Faults(jdp.Callback):
    """The faults the environment asks for, at the loop's named points (jdp.callbacks.POINTS)."""

    name = "injecting faults"

    def __init__(self):
        env = os.environ
        self.nan_steps = {int(s) for s in env.get("JDP_TEST_NAN_STEPS", "").split(",") if s.strip()}
        self.kill, self.term = env.get("JDP_TEST_KILL", ""), env.get("JDP_TEST_TERM", "")
        self.diverge, self.stall = env.get("JDP_TEST_DIVERGE", ""), env.get("JDP_TEST_STALL", "")
        self.fail = env.get("JDP_TEST_FAIL", "")
        self.kill_once = env.get("JDP_TEST_KILL_ONCE", "")

    def on_batch(self, loop, step: int, local: dict) -> dict:
        if self.stall == f"{step}:{jax.process_index()}":
            time.sleep(10**6)  # a process that stops making progress
        if self.stall.startswith(f"{step}:"):  # the others: later to the step it never reaches
            with loop.phases(f"waiting before step {step}", pause_watchdog=True):
                time.sleep(loop.run.cfg.train.step_timeout_s / 2)
        if step in self.nan_steps:
            return {**local, "weights": local["weights"] * np.float32("nan")}
        return local

    def at(self, loop, point: str, step: int) -> None:
        if self.fail == f"{step}:{point}:{jax.process_index()}":
            raise RuntimeError(f"injected failure at step {step} ({point})")
        if (point, self.diverge) in (("replicas", str(step)), ("step_end", f"{step}:end")):
            loop.state.params = _perturb_last_device(loop.state.params)
        if point == "step_end" and self.kill_once.startswith(f"{step}:{jax.process_index()}:"):
            marker = Path(self.kill_once.split(":", 2)[2])
            if not marker.exists():
                every = loop.run.cfg.train.ckpt_every
                saved = Path(loop.run.cfg.train.run_dir) / "checkpoints" / str(step - step % every) if every else None
                deadline = time.monotonic() + 120
                while saved is not None and not (saved / "record").exists() and time.monotonic() < deadline:
                    time.sleep(0.1)  # the others wait in the next step's collective; the save commits meanwhile
                marker.touch()
                os.kill(os.getpid(), signal.SIGKILL)
        if jax.process_index() != 0:
            return
        if point == "step_end" and self.kill == str(step):
            loop.flush()  # what the step produced is logged first
            os.kill(os.getpid(), signal.SIGKILL)
        if point == "saving" and self.kill == f"{step}:save":
            os.kill(os.getpid(), signal.SIGKILL)
        if point == "saving" and self.term == f"{step}:save":
            os.kill(os.getpid(), signal.SIGTERM)


def _perturb_last_device(params):
    """Add 1e-3 to the first parameter on the mesh's last device only."""
    leaf = jax.tree.leaves(params)[0]
    last = leaf.sharding.mesh.devices.flat[-1]
    shards = [
        jax.device_put(np.asarray(s.data) + (1e-3 if s.device == last else 0.0), s.device)
        for s in leaf.addressable_shards
    ]
    new = jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, shards)
    flat, tree = jax.tree.flatten(params)
    return jax.tree.unflatten(tree, [new, *flat[1:]])
