"""dp: PyTorch DataParallel's design, which jdp exists to avoid, kept as a measurable baseline. One process;
every device's gradients are gathered onto the master (the mesh's first device), which alone keeps the optimizer
state and updates; the new parameters are broadcast to every device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from jdp.parallel.comm_hooks import CommHook
from jdp.parallel.costs import Memory, tree_bytes
from jdp.parallel.guards import RefusingDonated, checking_rows
from jdp.parallel.mesh import AXIS, Batch, master_device, replicated
from jdp.parallel.step import LossFn, OptLayout, TrainState, local_sums, update

__all__ = ["LAYOUT", "layout", "make_train_step", "opt_shardings", "state_bytes"]

LAYOUT = OptLayout  # whole copies


def layout(mesh: jax.sharding.Mesh) -> OptLayout:
    """The optimizer state shaped as the parameters, on the master only."""
    return OptLayout()


def opt_shardings(shapes, mesh: jax.sharding.Mesh):
    return jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(master_device(mesh)), shapes)


def state_bytes(params, opt_state, optimizer: optax.GradientTransformation, n: int, grad_accum: int, **_) -> Memory:
    """What the master holds: every device's gradients, gathered, and the only optimizer state; each other device
    its parameters and its own gradients. (No `traffic`: the planner models collectives, and dp has none.)"""
    p = tree_bytes(params)
    accumulator = p if grad_accum > 1 else 0
    others = Memory(params=p, grads=p, accumulator=accumulator, opt_state=0)
    return Memory(p, p * n, accumulator, tree_bytes(opt_state), others=others)


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
    """PyTorch DataParallel's design, which jdp exists to avoid, as a measurable baseline.

    Each device computes the gradient of its rows; all of them are gathered onto the master (the mesh's
    first device), which sums them and computes the update alone; the new parameters are then broadcast
    to every device. The optimizer state lives on the master only (opt_shardings). One
    process only: DataParallel is single-process.
    """
    if comm_hook is not None:
        raise ValueError("a communication hook reduces ddp's buckets; strategy='dp' has none to hook")
    sums = local_sums(graphdef, loss_fn, grad_accum)
    master = jax.sharding.SingleDeviceSharding(master_device(mesh))

    def per_device(params, rest, step, batch):
        grads, loss, weight, rest, extra = sums(params, rest, batch, step)
        stacked = jax.tree.map(lambda x: x[None], (grads, loss, weight, extra))  # stacked along `data`, not reduced
        return stacked, rest  # the model's other variables, already averaged (step.local_sums)

    local = jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P(), P(), P(AXIS)), out_specs=(P(AXIS), P()))
    local = jax.jit(checking_rows(local, mesh.devices.size, grad_accum))

    def on_master(state: TrainState, stacked, rest):
        grads, loss, weight, extra = jax.tree.map(lambda x: jnp.sum(x, axis=0), stacked)  # the master sums them
        scale = jnp.where(weight > 0, 1.0 / weight, 0.0)
        grads = jax.tree.map(lambda g: g * scale, grads)
        extra = {k: v / weight for k, v in extra.items()}
        return update(optimizer, schedule, state, grads, loss / weight, weight, rest, extra=extra)

    on_master = jax.jit(on_master, donate_argnums=0)

    def step(state: TrainState, batch: Batch):
        stacked, new_rest = local(state.params, state.rest, state.step, batch)
        gathered = jax.device_put((stacked, new_rest), master)  # every device's gradients copied to the master
        step_, params, rest = jax.device_put((state.step, state.params, state.rest), master)  # its own replica
        new, metrics = on_master(TrainState(step_, params, state.opt_state, rest), *gathered)
        # Broadcast: the new parameters (and step) go from the master to every device.
        params, step_, rest = jax.device_put((new.params, new.step, new.rest), replicated(mesh))
        return TrainState(step_, params, new.opt_state, rest), metrics

    return RefusingDonated(step)
