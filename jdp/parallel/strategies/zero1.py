"""zero1: ZeRO stage 1 (PyTorch's ZeroRedundancyOptimizer, MaxText's shard_optimizer_over_data). ddp's backward
and buckets, but each bucket is reduce-scattered, each device updates the optimizer state of its 1/N slice of
every parameter, and the updated slices are all-gathered: the same bytes as one all-reduce, 1/N of the
optimizer state per device."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jdp.parallel.buckets import Bucket, bucket_plan
from jdp.parallel.comm_hooks import CommHook
from jdp.parallel.costs import Buckets, Collectives, Memory, Traffic, tree_bytes
from jdp.parallel.guards import RefusingDonated, check_batch
from jdp.parallel.mesh import AXIS, Batch, replicated, split_spec
from jdp.parallel.step import LossFn, OptLayout, TrainState, apply_update, keep_if, local_sums, micro_spec, reduced_sums

__all__ = ["LAYOUT", "Slices", "layout", "make_step", "make_train_step", "opt_shardings", "state_bytes", "traffic"]


@dataclass(frozen=True)
class Slices(OptLayout):
    """zero1's layout: the optimizer sees each parameter flattened into its last axis, zero-padded to a multiple of
    `shards`, with its rank kept (a (768, 3072) kernel is seen as (1, 2359296), so masks written as `ndim >= 2`
    still pick the matrices), and device d holds elements [d*s, (d+1)*s) of that axis in every such leaf of the
    state (s = padded size / shards). Scalars (Adam's count) are replicated. The parameters stay whole."""

    flat: ClassVar[bool] = True

    @classmethod
    def reads(cls, saved: dict) -> bool:
        return bool(int(saved.get("shards", 0))) and not saved.get("rows", False)

    def describe(self) -> str:
        return f"zero1's slices over {self.shards} devices"

    def view(self, params):
        return jax.tree.map(lambda x: jnp.pad(x.ravel(), (0, -x.size % self.shards)).reshape(self.shape(x)), params)

    def shape(self, x) -> tuple[int, ...]:
        padded = x.size + -x.size % self.shards
        return (1,) * (x.ndim - 1) + (padded,)

    def whole(self, x, shape: tuple[int, ...]):
        return x.reshape(-1)[: math.prod(shape)].reshape(shape)

    def shardings(self, shapes, mesh: jax.sharding.Mesh):
        n = self.shards
        return jax.tree.map(
            lambda x: NamedSharding(mesh, split_spec(x.ndim)) if x.ndim >= 1 and x.shape[-1] % n == 0
            else replicated(mesh), shapes)  # fmt: skip

    def check(self, optimizer: optax.GradientTransformation, params) -> None:
        self.check_elementwise(optimizer, params, "zero1")

    def param_bytes(self, state) -> tuple[int, int, str]:
        own, _, _ = super().param_bytes(state)
        padded = sum(x.dtype.itemsize * (x.size + -x.size % self.shards) for x in jax.tree.leaves(state.param_shapes()))
        return own, padded, f"; {padded:,} padded to multiples of {self.shards}"


LAYOUT = Slices


def layout(mesh: jax.sharding.Mesh) -> Slices:
    """Every parameter flat and padded to a multiple of the devices, each device holding its slice."""
    return Slices(mesh.shape[AXIS])


def opt_shardings(shapes, mesh: jax.sharding.Mesh):
    return layout(mesh).shardings(shapes, mesh)


def state_bytes(
    params, opt_state, optimizer: optax.GradientTransformation, n: int, grad_accum: int, bucket: int = 0
) -> Memory:
    """ddp's, but of the optimizer state each device holds its slice of every leaf (padded to a multiple of n,
    exactly what layout places) and the scalars whole; in flight at the end of backward, a bucket's scattered slice
    and its updated slice (2/n of it)."""
    p = tree_bytes(params)
    shapes = Slices(n).shapes(optimizer, params)
    split = [x for x in jax.tree.leaves(shapes) if x.ndim >= 1 and x.shape[-1] % n == 0]
    opt = tree_bytes(shapes) - tree_bytes(split) + tree_bytes(split) // n
    in_flight = 2 * bucket // n if grad_accum == 1 else 0
    return Memory(p, p, p if grad_accum > 1 else 0, opt, opt_note=f"this device's 1/{n}", in_flight=in_flight)


def traffic(buckets: Buckets, n: int, grad_accum: int) -> Traffic:
    """ddp's bytes as two halves: a reduce-scatter per bucket, hidden behind backward as ddp's all-reduces are, and
    an all-gather per bucket of the updated parameters, which cannot start before the whole gradient's norm is
    known (clipping, the skip guard), so all of it shows."""
    overlaps = "backward" if grad_accum == 1 else ""
    scatter = Collectives("reduce-scatter", f"{buckets.reduce_dtype} gradients", buckets.grads, overlaps)
    gather = Collectives("all-gather", "parameters", buckets.params)
    exposed = "the reduce-scatters backward cannot hide, and every all-gather (they wait for the whole gradient's norm)"
    return Traffic((scatter, gather), exposed)


def _scatter_buckets(grads, buckets: list[Bucket], reduce_dtype: str, n: int):
    """Sum of the gradients over `data`, each device receiving its slice only: one reduce-scatter per bucket.

    A bucket is laid out as an (n, columns) matrix whose row d holds device d's slice of every gradient in it
    (each flattened and zero-padded to a multiple of n), so one tiled psum_scatter hands each device its row.
    Returns, per leaf, this device's slice of the flat padded summed gradient (OptLayout's view, rank kept).
    """
    leaves, tree = jax.tree.flatten(grads)
    out = list(leaves)
    for bucket in buckets:
        rows = [jnp.pad(leaves[k].astype(reduce_dtype).ravel(), (0, -leaves[k].size % n)).reshape(n, -1)
                for k in bucket.leaves]  # fmt: skip
        mine = jax.lax.psum_scatter(jnp.concatenate(rows, axis=1), AXIS, scatter_dimension=0, tiled=True)[0]
        offset = 0
        for k, row in zip(bucket.leaves, rows, strict=True):
            width = row.shape[1]
            out[k] = (
                mine[offset : offset + width]
                .astype(leaves[k].dtype)
                .reshape(Slices(n).shape(leaves[k])[:-1] + (width,))
            )
            offset += width
    return jax.tree.unflatten(tree, out)


def _gather_buckets(slices, like, buckets: list[Bucket], n: int):
    """Every device's slice of the flat padded parameters -> the full parameters on every device: one all-gather
    per bucket (the same buckets as the gradients); the padding is cut off here and reaches no parameter."""
    leaves, tree = jax.tree.flatten(slices)
    shapes = jax.tree.leaves(like)
    out = list(leaves)
    for bucket in buckets:
        every = jax.lax.all_gather(jnp.concatenate([leaves[k].ravel() for k in bucket.leaves]), AXIS, tiled=False)
        offset = 0
        for k in bucket.leaves:
            width = leaves[k].shape[-1]
            out[k] = every[:, offset : offset + width].ravel()[: shapes[k].size].reshape(shapes[k].shape)
            offset += width
    return jax.tree.unflatten(tree, out)


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
    """ZeRO stage 1 (PyTorch's ZeroRedundancyOptimizer, MaxText's shard_optimizer_over_data): each device keeps
    the optimizer state of 1/N of every parameter.

    Backward is ddp's, buckets included; each bucket is reduce-scattered instead of all-reduced, so a device
    receives the mean gradient of its slice only. The optimizer update runs on the slices (jit places it where
    the slices are: optax's global norm for clipping and `grad_norm` still covers the whole gradient, a scalar
    all-reduce), and the updated slices are all-gathered bucket by bucket, so every device again holds identical
    full parameters. Reduce-scatter plus all-gather move the same bytes as one all-reduce.
    """
    step = make_step(graphdef, loss_fn, optimizer, mesh, grad_accum, schedule, bucket_mb=bucket_mb,
                     reduce_dtype=reduce_dtype, comm_hook=comm_hook)  # fmt: skip
    return RefusingDonated(jax.jit(step, donate_argnums=0))


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
    """make_train_step's (state, batch) -> (state, metrics), not jitted, its collectives and placements over the
    mesh's `data` axis only: DiLoCo runs it in every group at once (jax.vmap over the `group` axis)."""
    if comm_hook is not None:
        raise ValueError("a communication hook reduces ddp's buckets; strategy='zero1' has none to hook")
    n = mesh.shape[AXIS]
    layout = Slices(n)
    sums = local_sums(graphdef, loss_fn, grad_accum)

    def step(state: TrainState, batch: Batch):
        check_batch(batch, n, grad_accum)
        expected = layout.shapes(optimizer, state.params)
        if [x.shape for x in jax.tree.leaves(state.opt_state)] != [x.shape for x in jax.tree.leaves(expected)]:
            raise ValueError(
                "the optimizer state is not laid out for zero1 on this mesh: build it with "
                "init_state(model, optimizer, mesh, strategy='zero1') (or move it with relayout)"
            )
        planned = []  # the buckets, planned per device: the loss may use the `data` axis (SyncBatchNorm)

        def grads_of(params, rest, step, batch):
            micro = micro_spec(batch, 1, grad_accum)
            planned.append(buckets := bucket_plan(graphdef, loss_fn, params, rest, micro, bucket_mb, reduce_dtype))
            grads_sum, loss_sum, weight_sum, new_rest, extra = sums(params, rest, batch, step)
            loss, weight, extra = reduced_sums(loss_sum, weight_sum, extra)
            # The reduce-scatter sums over devices; dividing by the global token weight gives exactly the
            # gradient of the global token-weighted mean loss, as ddp's pmean times n / weight does.
            scale = jnp.where(weight > 0, 1.0 / weight, 0.0)
            mine = jax.tree.map(lambda g: g * scale, _scatter_buckets(grads_sum, buckets, reduce_dtype, n))
            return mine, loss, weight, new_rest, extra

        specs = jax.tree.map(lambda x: split_spec(max(x.ndim, 1)), state.params)
        scatter = jax.shard_map(
            grads_of, mesh=mesh, in_specs=(P(), P(), P(), P(AXIS)), out_specs=(specs, P(), P(), P(), P()),
            check_vma=check_vma,
        )
        grads, loss, weight, rest, extra = scatter(state.params, state.rest, state.step, batch)
        buckets = planned[-1]
        split = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)
        params = jax.lax.with_sharding_constraint(layout.view(state.params), split)  # each device's own slice
        params, opt_state, metrics = apply_update(
            optimizer, schedule, state.step, params, state.opt_state, grads, loss, weight, layout, state.params, mesh,
            extra,
        )
        opt_state = jax.lax.with_sharding_constraint(opt_state, layout.shardings(expected, mesh))  # stays split
        # check_vma=False: all_gather's result is typed per-device, but every device holds the same values.
        gather = jax.shard_map(
            lambda p: _gather_buckets(p, state.params, buckets, n),
            mesh=mesh, in_specs=(specs,), out_specs=P(), check_vma=False,
        )  # fmt: skip
        rest = keep_if(metrics["skipped"] == 0, rest, state.rest)
        return TrainState(state.step + 1, gather(params), opt_state, rest), metrics

    return step
