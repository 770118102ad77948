"""The data parallelism: how every device keeps its replica (or its part of the state) and how a step runs on them.

The modules, in the order data flows: mesh.py (the `data` mesh, each process's rows, global batches), buckets.py
(which gradients travel together), comm_hooks.py (what turns one bucket's local gradients into their average: the
mean, PowerSGD or a user's), step.py (what every step is made of: gradient sums, the bucketed mean, the update and
its skip guard, the eval step, replica checks), strategies/ (ddp, zero1, fsdp, hsdp, dp: one module each, one
registry) and parallelize.py, which library users and the trainer call: state placed for a strategy, the train
step it runs, a state moved between strategies. costs.py says what a strategy costs in the planner's terms, and
guards.py what a library user can get wrong with the steps. Every collective is in these modules, and nothing
outside this package tells strategies or layouts apart (tests/test_shape.py checks both).

The names below (`jdp.parallel.init_state`, ...) load on first use, so the strategy registry, which the config
asks, starts without JAX.
"""

from __future__ import annotations

import importlib
import importlib.util

_EXPORTS = {
    **dict.fromkeys(
        ("AXIS", "Batch", "batch_sharding", "make_mesh", "process_rows", "replicate", "replicated", "shard_batch"),
        "jdp.parallel.mesh",
    ),
    **dict.fromkeys(
        ("LossFn", "OptLayout", "TrainState", "comm_record", "make_eval_step", "make_grad_fn", "make_replica_digest",
         "nonfinite_leaves", "param_names", "replica_digest_mismatches", "replica_mismatches"),  # fmt: skip
        "jdp.parallel.step",
    ),
    **dict.fromkeys(
        ("Assembled", "assemble", "configured_train_step", "init_state", "init_state_from", "layout_of", "make_strategy_eval_step",
         "make_train_step", "mesh_for", "opt_layout", "relayout", "restore_target"),  # fmt: skip
        "jdp.parallel.parallelize",
    ),
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif importlib.util.find_spec(f"{__name__}.{name}") is not None:  # a module: jdp.parallel.strategies, ...
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
