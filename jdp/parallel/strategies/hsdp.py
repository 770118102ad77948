"""hsdp: hybrid sharding (PyTorch's HSDP, MaxText's `fsdp` inside a slice and `data` across). The devices form
groups of `parallel.shard_size` (a node's GPUs) on a (`replica`, `shard`) mesh (jdp.make_mesh(shard_size=K)):
inside each group the state is split as fsdp splits it over all devices, and every group holds a whole copy.
Each block's rows are all-gathered inside the group (the fast link), its gradients reduce-scattered inside the
group and the shard then all-reduced across the groups (1/K of the gradient bytes on the slow link). The batch is
split over every device, in the 1-D mesh's order, so the data order is ddp's and fsdp's on the same devices.
fsdp's code runs it (fsdp.py: split_step), with these axes."""

from __future__ import annotations

import jax
import optax

from jdp.parallel.comm_hooks import CommHook
from jdp.parallel.costs import Buckets, Collectives, Memory, Traffic
from jdp.parallel.mesh import GROUP, REPLICA, SHARD
from jdp.parallel.step import LossFn
from jdp.parallel.strategies import fsdp

__all__ = [
    "LAYOUT",
    "base_bytes",
    "block_policy",
    "layout",
    "make_eval_step",
    "make_step",
    "make_train_step",
    "opt_shardings",
    "report_base",
    "report_units",
    "state_bytes",
    "traffic",
]

LAYOUT, layout = fsdp.LAYOUT, fsdp.layout
opt_shardings = fsdp.opt_shardings
make_eval_step = fsdp.make_eval_step
report_units, report_base = fsdp.report_units, fsdp.report_base
block_policy = fsdp.block_policy


def _check_mesh(mesh: jax.sharding.Mesh, shard_size: int) -> None:
    if tuple(mesh.axis_names) != (REPLICA, SHARD):
        raise ValueError(
            f"strategy='hsdp' runs on a mesh of groups, axes ('{REPLICA}', '{SHARD}'): build it with "
            f"jdp.make_mesh(shard_size=K) (this one has axes {tuple(mesh.axis_names)})"
        )
    if shard_size and mesh.shape[SHARD] != shard_size:
        raise ValueError(
            f"parallel.shard_size={shard_size} but the mesh's groups hold {mesh.shape[SHARD]} devices: build it with "
            f"jdp.make_mesh(shard_size={shard_size})"
        )


def make_train_step(
    graphdef,
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    mesh: jax.sharding.Mesh,
    grad_accum: int = 1,
    schedule: optax.Schedule | None = None,
    *,
    bucket_mb: float = 25.0,
    reduce_dtype: str = "float32",
    comm_hook: CommHook | None = None,
    reshard_after_forward: bool = True,
    accumulate_unsharded: bool = False,
    shard_size: int = 0,
):
    """fsdp's step inside each group of `shard_size` devices, the gradient shards all-reduced across the groups."""
    _check_mesh(mesh, shard_size)
    return fsdp.split_step(graphdef, loss_fn, optimizer, mesh, grad_accum, schedule, reduce_dtype, comm_hook,
                           reshard_after_forward, "hsdp", accumulate_unsharded)  # fmt: skip


def make_step(
    graphdef,
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    mesh: jax.sharding.Mesh,
    grad_accum: int = 1,
    schedule: optax.Schedule | None = None,
    *,
    bucket_mb: float = 25.0,
    reduce_dtype: str = "float32",
    comm_hook: CommHook | None = None,
    check_vma: bool = True,
    reshard_after_forward: bool = True,
    accumulate_unsharded: bool = False,
    shard_size: int = 0,
):
    """make_train_step's (state, batch) -> (state, metrics), not jitted, on DiLoCo's (`group`, `replica`, `shard`)
    mesh: one group's hsdp step, its collectives over `replica` and `shard` only (DiLoCo maps it over the groups)."""
    if tuple(mesh.axis_names) != (GROUP, REPLICA, SHARD):
        raise ValueError(f"hsdp's step inside DiLoCo's groups runs on a ('{GROUP}', '{REPLICA}', '{SHARD}') mesh "
                         f"(this one has axes {tuple(mesh.axis_names)})")  # fmt: skip
    if shard_size and mesh.shape[SHARD] != shard_size:
        raise ValueError(f"parallel.shard_size={shard_size} but the mesh's shards hold {mesh.shape[SHARD]} devices")
    return fsdp.split_step(graphdef, loss_fn, optimizer, mesh, grad_accum, schedule, reduce_dtype, comm_hook,
                           reshard_after_forward, "hsdp", accumulate_unsharded, jitted=False,
                           check_vma=check_vma)  # fmt: skip


NODE = 8  # the group the planner assumes when parallel.shard_size is not set: one node of 8 GPUs


def _group(n: int, shard_size: int) -> int:
    """The devices of one group on n devices: shard_size (a node of 8 when unset) where it divides n, else all."""
    k = shard_size or NODE
    return k if k <= n and n % k == 0 else n


def state_bytes(
    params, opt_state, optimizer: optax.GradientTransformation, n: int, grad_accum: int,
    reshard_after_forward: bool = True, accumulate_unsharded: bool = False, shard_size: int = 0, **_,
) -> Memory:  # fmt: skip
    """fsdp's bytes with the state split over a group of shard_size devices instead of all n (not set: a node of
    8, where n allows)."""
    return fsdp.state_bytes(params, opt_state, optimizer, _group(n, shard_size), grad_accum, reshard_after_forward,
                            accumulate_unsharded)  # fmt: skip


def base_bytes(base, n: int, compute, reshard_after_forward: bool = True, shard_size: int = 0, **_) -> int:
    """fsdp's, with the base in rows over a group of shard_size devices."""
    return fsdp.base_bytes(base, _group(n, shard_size), compute, reshard_after_forward)


def traffic(
    buckets: Buckets, n: int, grad_accum: int, reshard_after_forward: bool = True, accumulate_unsharded=False,
    shard_size: int = 0,
) -> Traffic:  # fmt: skip
    """fsdp's gathers and reduce-scatters inside each group of shard_size devices (a node: the fast link), and an
    all-reduce of each reduce-scattered shard (1/K of the gradient bytes) across the n/K groups, over one device of
    each group (the network), behind backward as the scatters are."""
    k = _group(n, shard_size)
    inside = fsdp.traffic(buckets, k, grad_accum, reshard_after_forward, accumulate_unsharded)
    shard = tuple(b // k for b in buckets.grads)
    once = accumulate_unsharded and grad_accum > 1  # reduced once a step, after the last micro-batch
    across = Collectives(
        "all-reduce", f"{buckets.reduce_dtype} gradient shards across groups", shard * (1 if once else grad_accum),
        "" if once else "backward", devices=n // k, apart=k,
    )  # fmt: skip
    group = tuple(
        Collectives(c.kind, c.what, c.nbytes, c.overlaps, c.calls, devices=k, apart=1) for c in inside.collectives
    )
    return Traffic((*group, across), inside.exposed + "; the last all-reduce across groups")
