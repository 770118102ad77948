"""ddp: jdp's design, PyTorch DDP's. Every device keeps the whole state; each computes the gradients of its own
rows, they are averaged by one all-reduce per bucket (or a communication hook's reduction), and every replica
applies the identical update, so the replicas stay bit-identical without ever shipping weights."""

from __future__ import annotations

import dataclasses

import jax
import optax
from jax.sharding import PartitionSpec as P

from jdp.parallel.comm_hooks import CommHook
from jdp.parallel.costs import Buckets, Collectives, Memory, Traffic, tree_bytes
from jdp.parallel.guards import RefusingDonated, checking_rows
from jdp.parallel.mesh import AXIS, Batch
from jdp.parallel.step import LossFn, OptLayout, TrainState, global_grads, hook_states, update

__all__ = ["LAYOUT", "layout", "make_step", "make_train_step", "opt_shardings", "state_bytes", "traffic"]

LAYOUT = OptLayout  # whole copies


def layout(mesh: jax.sharding.Mesh) -> OptLayout:
    """The optimizer state shaped as the parameters, whole on every device."""
    return OptLayout()


def opt_shardings(shapes, mesh: jax.sharding.Mesh):
    return layout(mesh).shardings(shapes, mesh)


def state_bytes(
    params, opt_state, optimizer: optax.GradientTransformation, n: int, grad_accum: int, bucket: int = 0
) -> Memory:
    """What each device holds (shapes only): the parameters, their gradients (and their running sum with
    grad_accum > 1), the whole optimizer state; at the end of backward a bucket of `bucket` bytes concatenated for
    its all-reduce beside the gradients (with grad_accum > 1 the micro-batch's gradients are gone by then)."""
    p = tree_bytes(params)
    in_flight = bucket if grad_accum == 1 else 0
    return Memory(p, p, p if grad_accum > 1 else 0, tree_bytes(opt_state), in_flight=in_flight)


def traffic(buckets: Buckets, n: int, grad_accum: int) -> Traffic:
    """One all-reduce per bucket (or a communication hook's collectives), each issued as backward finishes its
    bucket; with grad_accum > 1 jdp reduces once after the accumulation loop, where nothing hides them (DDP would
    overlap the last micro-batch's backward)."""
    overlaps = "backward" if grad_accum == 1 else ""
    if buckets.wire:
        sent = Collectives("all-reduce", buckets.wire_what, buckets.wire, overlaps, buckets.wire_calls)
    else:
        sent = Collectives("all-reduce", f"{buckets.reduce_dtype} gradients", buckets.grads, overlaps)
    exposed = (
        "the last bucket, or what does not fit inside backward (2/3 of compute)"
        if grad_accum == 1
        else f"all of it: with train.grad_accum={grad_accum} jdp reduces after the accumulation loop"
    )
    return Traffic((sent,), exposed)


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
):
    """The ddp step: gradients averaged by all-reduces of about bucket_mb MiB, or through `comm_hook` (comm_hooks.py;
    build the state with init_state(..., comm_hook=the same hook))."""
    step = make_step(graphdef, loss_fn, optimizer, mesh, grad_accum, schedule, bucket_mb=bucket_mb,
                     reduce_dtype=reduce_dtype, comm_hook=comm_hook)  # fmt: skip
    return RefusingDonated(jax.jit(checking_rows(step, mesh.devices.size, grad_accum), donate_argnums=0))


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
):
    """make_train_step's (state, batch) -> (state, metrics), not jitted, its collectives over the mesh's `data` axis
    only: DiLoCo runs it in every group at once (jax.vmap over the `group` axis, with check_vma=False: JAX 0.12
    fails to batch the update's lax.cond inside a checked shard_map)."""
    n = mesh.shape[AXIS]
    if comm_hook is None:
        grads_of = global_grads(graphdef, loss_fn, n, grad_accum, bucket_mb, reduce_dtype)

        def step(state: TrainState, batch: Batch):
            grads, loss, weight, rest, extra = grads_of(state.params, state.rest, batch, state.step)
            # Every replica applies the identical update to identical parameters: they stay bit-identical.
            return update(optimizer, schedule, state, grads, loss, weight, rest, extra=extra)

        return jax.shard_map(step, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=(P(), P()), check_vma=check_vma)

    grads_of = global_grads(graphdef, loss_fn, n, grad_accum, bucket_mb, reduce_dtype, comm_hook)

    def hooked(state: TrainState, batch: Batch):
        expected = sorted(jax.eval_shape(lambda: hook_states(comm_hook, state.params)), key=int)
        if sorted(state.comm or {}, key=int) != expected:
            raise ValueError(
                f"{comm_hook.describe()['hook']} keeps state for parameters {expected[:5]}..., but the train state "
                f"holds {'none' if state.comm is None else sorted(state.comm, key=int)[:5]}: build it with "
                f"init_state(..., comm_hook=the same hook)"
            )
        # Each device sees its own hook states with a leading axis of 1.
        mine = jax.tree.map(lambda x: x[0], state.comm)
        grads, loss, weight, rest, extra, comm = grads_of(state.params, state.rest, batch, state.step, mine)
        mine = dataclasses.replace(state, comm=mine)
        new, metrics = update(optimizer, schedule, mine, grads, loss, weight, rest, comm, extra)
        return dataclasses.replace(new, comm=jax.tree.map(lambda x: x[None], new.comm)), metrics

    spec = TrainState(P(), P(), P(), P(), P(AXIS))
    return jax.shard_map(hooked, mesh=mesh, in_specs=(spec, P(AXIS)), out_specs=(spec, P()), check_vma=check_vma)
