"""Fault injection for jdp's own tests: off unless JDP_TEST_* variables are set, and then only at a few named points.

- JDP_TEST_NAN_STEPS=3,4: NaN weights in those steps' batches;
- JDP_TEST_KILL=STEP: SIGKILL process 0 after that step; STEP:save: just after it starts that step's save;
- JDP_TEST_TERM=STEP:save: SIGTERM process 0 just after it starts the save at STEP;
- JDP_TEST_DIVERGE=STEP: perturb the last device's replica before the replica check at STEP;
- JDP_TEST_STALL=STEP:PROCESS: that process stops before that step;
- JDP_TEST_FAIL=STEP:WHERE:PROCESS: that process raises an error at step STEP where it logs the step's metrics
  (log), starts evaluating (eval) or starts saving (save): a process leaving the job outside a step.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Mapping

import jax
import numpy as np

__all__ = ["Faults"]


class Faults:
    """The faults the environment asks for. Every method is a no-op unless its variable is set."""

    def __init__(self, environ: Mapping[str, str] | None = None):
        env = os.environ if environ is None else environ
        self.nan_steps = {int(s) for s in env.get("JDP_TEST_NAN_STEPS", "").split(",") if s.strip()}
        self.kill = env.get("JDP_TEST_KILL", "")
        self.term = env.get("JDP_TEST_TERM", "")
        self.diverge = env.get("JDP_TEST_DIVERGE", "")
        self.stall = env.get("JDP_TEST_STALL", "")
        self.fail = env.get("JDP_TEST_FAIL", "")

    def batch(self, step: int, local: dict) -> dict:
        """Before step `step` (1-based) runs on this process's rows `local`: stall, or poison the batch."""
        if self.stall == f"{step}:{jax.process_index()}":
            time.sleep(10**6)  # a process that stops making progress
        if step in self.nan_steps:
            return {**local, "weights": local["weights"] * np.float32("nan")}
        return local

    def at(self, where: str, step: int) -> None:
        """At a named point of step `step` (log, eval, save): raise, as a bug or a full disk would there."""
        if self.fail == f"{step}:{where}:{jax.process_index()}":
            raise RuntimeError(f"injected failure at step {step} ({where})")

    def after_step(self, step: int, before_dying: Callable[[], None]) -> None:
        """After step `step`: die, once `before_dying` has logged what the step produced."""
        if self.kill == str(step) and jax.process_index() == 0:
            before_dying()
            os.kill(os.getpid(), signal.SIGKILL)

    def after_save_started(self, step: int) -> None:
        """Just after the asynchronous save of `step` started: a signal while it is being written."""
        if jax.process_index() != 0:
            return
        if self.kill == f"{step}:save":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.term == f"{step}:save":
            os.kill(os.getpid(), signal.SIGTERM)

    def replicas(self, step: int, params):
        """Before the replica check at `step`: add 1e-3 to the first parameter on the mesh's last device only."""
        if self.diverge != str(step):
            return params
        leaf = jax.tree.leaves(params)[0]
        last = leaf.sharding.mesh.devices.flat[-1]
        shards = [
            jax.device_put(np.asarray(s.data) + (1e-3 if s.device == last else 0.0), s.device)
            for s in leaf.addressable_shards
        ]
        new = jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, shards)
        flat, tree = jax.tree.flatten(params)
        return jax.tree.unflatten(tree, [new, *flat[1:]])
