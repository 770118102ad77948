"""What every strategy's step is made of: the train state, the optimizer state's layout, each device's gradient
sums (with the model's other variables and random streams), the bucketed mean, the optimizer update with its skip
guard, and the eval step and replica checks. The strategies (strategies/) assemble their steps from these."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jdp import adapters, muon
from jdp.errors import ConfigError
from jdp.nn import RowIds, RowKey
from jdp.parallel.buckets import Bucket, bucket_plan
from jdp.parallel.comm_hooks import CommHook, GradBucket, Mean, varying
from jdp.parallel.guards import RefusingDonated, check_batch, checked_loss, checking_rows
from jdp.parallel.mesh import AXIS, Batch, batch_axes, replicate, replicated, shard_axis

__all__ = [
    "LossFn",
    "OptLayout",
    "TrainState",
    "apply_update",
    "comm_record",
    "global_grads",
    "hook_states",
    "init_comm",
    "keep_if",
    "leaf_digest",
    "local_sums",
    "make_eval_step",
    "make_grad_fn",
    "make_replica_digest",
    "micro_spec",
    "nonfinite_leaves",
    "param_names",
    "replica_digest_mismatches",
    "replica_mismatches",
    "update",
]

# loss_fn(model, batch) -> (sum of per-token losses, sum of token weights) on one device's slice.
# loss_fn(model, batch) -> (sum of per-token losses, sum of token weights) on one device's slice.
LossFn = Callable[[nnx.Module, dict[str, jax.Array]], tuple[jax.Array, jax.Array]]


@jax.tree_util.register_dataclass
@dataclass
class TrainState:
    """Everything the step updates. Every leaf is replicated (one identical copy per device), except the optimizer
    state under zero1 (flat and split over the devices: OptLayout) and dp (on the master device), the parameters
    and optimizer state under fsdp (padded along their first axis and split over the devices), and the
    communication hook's state, which each device keeps its own of (leading axis: the devices)."""

    step: jax.Array
    params: nnx.State  # the model's nnx.Param variables
    opt_state: optax.OptState
    rest: nnx.State  # every other model variable (BatchNorm statistics, rng keys): updated by the step (local_sums)
    comm: Any = None  # the hook's per-parameter states, {leaf index: state}; None when it keeps none (the mean)
    # The parameters' own shapes, in leaf order, when `params` holds them padded (fsdp); None when it holds them as
    # they are. Static: part of the state's structure, known while a step is traced.
    shapes: tuple | None = field(default=None, metadata={"static": True})
    # parallel.sync=diloco: each group's own state between syncs, {"params", "opt_state", "rest"}, every leaf with a
    # leading axis of the groups (split over the mesh's `group` axis); `params` and `opt_state` above are then the
    # round's parameters (the model every group agreed on at the last sync) and the outer optimizer's state.
    inner: Any = None

    def groups(self) -> int | None:
        """How many DiLoCo groups' states it holds (`inner`'s leading axis); None when every step agrees."""
        return None if self.inner is None else int(jax.tree.leaves(self.inner)[0].shape[0])

    def param_shapes(self):
        """The parameters' own shapes and dtypes (without fsdp's padding), as a tree shaped like `params`."""
        if self.shapes is None:
            return _shapes(self.params)
        leaves, tree = jax.tree.flatten(self.params)
        return jax.tree.unflatten(
            tree, [jax.ShapeDtypeStruct(s, x.dtype) for s, x in zip(self.shapes, leaves, strict=True)]
        )


def init_comm(hook: CommHook | None, params, mesh: jax.sharding.Mesh):
    """The hook's initial per-parameter states, one copy per device ({leaf index: state}), or None if it keeps none.

    Each device's copy is the same at start (the hook's init sees only the parameter's index, name and shape)."""
    if hook is None:
        return None
    n = mesh.devices.size

    def make():
        states = hook_states(hook, params)
        return {k: jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *x.shape)), v) for k, v in states.items()} or None

    shapes = jax.eval_shape(make)
    if shapes is None:
        return None
    per_device = jax.tree.map(lambda x: NamedSharding(mesh, P(AXIS, *[None] * (x.ndim - 1))), shapes)
    return jax.jit(make, out_shardings=per_device)()


def hook_states(hook: CommHook, params) -> dict:
    """{leaf index: the hook's initial state} for the parameters it keeps state for."""
    states = {}
    for k, (name, leaf) in enumerate(zip(param_names(params), jax.tree.leaves(params), strict=True)):
        if (state := hook.init(k, name, tuple(leaf.shape))) is not None:
            states[str(k)] = state
    return states


def param_names(params) -> list[str]:
    """The parameters' names in leaf order, as buckets and hooks see them ("blocks.0.attn.qkv.kernel")."""
    return [
        jax.tree_util.keystr(path, simple=True, separator=".").removesuffix(".value")
        for path, _ in jax.tree_util.tree_leaves_with_path(params)
    ]


def comm_record(hook: CommHook | None, state: TrainState) -> dict | None:
    """What a checkpoint records of the hook's state: a resumed run keeps that state only when this matches."""
    if state.comm is None:
        return None
    n = jax.tree.leaves(state.comm)[0].shape[0]
    return {**hook.describe(), "devices": n, "leaves": sorted(state.comm, key=int)}


@dataclass(frozen=True)
class OptLayout:
    """How the optimizer state (and under fsdp the parameters) lie. This base is whole copies, shaped as the
    parameters (ddp, dp); a strategy that splits the state brings its own subclass, which views, shapes, places and
    checks it its way (zero1's Slices, fsdp's and hsdp's Rows, each in its strategy's module), so nothing outside
    the strategies asks which layout it holds. `shards`: the devices the state is split over (0: none).

    Where a split layout pads (zero1's flat leaves, fsdp's first axes), the padding is zeros in the gradients and
    the parameters, so an elementwise optimizer leaves it zero, and it is cut off before a value reaches a
    parameter; row-major, it is the last elements, so a checkpoint's checksums do not change with it and the layouts
    convert by cutting or adding zeros at the end (parallel.relayout). Optimizers whose state is not elementwise
    (factored ones such as Adafactor) would see other shapes; the split layouts refuse them (check).
    """

    shards: int = 0
    splits_parameters: ClassVar[bool] = False  # the parameters are split too (made inside jit: init_state_from)
    flat: ClassVar[bool] = False  # the optimizer state is not shaped as the parameters (relayout moves it)

    @classmethod
    def reads(cls, saved: dict) -> bool:
        """Whether a checkpoint record's `optimizer_layout` is of this kind (older records have none: whole)."""
        return not int(saved.get("shards", 0))

    def to_record(self) -> dict:
        return {"shards": self.shards, "rows": self.splits_parameters, "what": self.describe()}

    def describe(self) -> str:
        return "whole copies (ddp, dp)"

    def reads_into(self, other: OptLayout) -> bool:
        """Whether a checkpoint in this layout restores straight into `other`: the same layout, or both shaped as
        the parameters (a padding of rows is cut or added as each device reads its own)."""
        return self == other or not (self.flat or other.flat)

    def view(self, params):
        """The parameters as the optimizer sees them."""
        return params

    def shape(self, x) -> tuple[int, ...]:
        """A leaf's shape as the optimizer sees it in this layout."""
        return tuple(x.shape)

    def whole(self, x, shape: tuple[int, ...]):
        """A leaf as this layout views it (`view`) -> the parameter of `shape` whole again."""
        return x

    def gathered(self, x, shape: tuple[int, ...], mesh: jax.sharding.Mesh):
        """A leaf of this layout's view -> its parameter whole on every device of `mesh` (one all-gather): what
        Muon's Newton-Schulz needs (jdp/muon.py). Replicated in and out: left to itself, XLA split each iteration's
        matmuls over the devices and gathered between them (8x the matrix's bytes, measured under zero1)."""
        return jax.lax.with_sharding_constraint(self.whole(x, shape), replicated(mesh))

    def scattered(self, whole, like, mesh: jax.sharding.Mesh):
        """A parameter whole on every device -> this layout's view of it, placed as `like` (each device keeps its
        own part: a slice, no collective)."""
        part = self.shardings(jax.ShapeDtypeStruct(like.shape, like.dtype), mesh)
        return jax.lax.with_sharding_constraint(self.view(jax.lax.with_sharding_constraint(whole, replicated(mesh))), part)

    def shapes(self, optimizer: optax.GradientTransformation, params):
        """The optimizer state's shapes in this layout (nothing is computed)."""
        return jax.eval_shape(lambda p: optimizer.init(self.view(p)), _shapes(params))

    def shardings(self, shapes, mesh: jax.sharding.Mesh):
        """Where each leaf of a state of these shapes lives on `mesh`: whole on every device."""
        return jax.tree.map(lambda x: replicated(mesh), shapes)

    def place(self, params, mesh: jax.sharding.Mesh):
        """The parameters placed on `mesh` for this layout: replicated."""
        return replicate(params, mesh)

    def rest_specs(self, rest, mesh: jax.sharding.Mesh):
        """Where each of the model's other variables lives on `mesh`, as a spec per variable: whole on every device
        (fsdp's and hsdp's Rows split a frozen base, adapters.py, in rows)."""
        return _map_variables(lambda _: P(), rest)

    def rest_shardings(self, rest, mesh: jax.sharding.Mesh):
        return jax.tree.map(lambda s: NamedSharding(mesh, s), self.rest_specs(rest, mesh))

    def place_rest(self, rest, mesh: jax.sharding.Mesh):
        """The model's other variables placed on `mesh` as rest_specs lays them out."""
        split = lambda v, s: jax.device_put(v, NamedSharding(mesh, s)) if s != P() else replicate(v, mesh)  # noqa: E731
        return _map_variables(split, rest, self.rest_specs(rest, mesh))

    def check(self, optimizer: optax.GradientTransformation, params) -> None:
        """Refuse what this layout cannot hold (whole copies hold any optimizer's state)."""

    def param_bytes(self, state) -> tuple[int, int, str]:
        """(the parameters' bytes, as this layout pads them, a few words on that padding)."""
        own = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(state.param_shapes()))
        return own, own, ""

    def check_elementwise(self, optimizer: optax.GradientTransformation, params, name: str) -> None:
        """A split layout's refusal of an optimizer whose state is not elementwise: its state would change meaning
        when flattened or padded."""
        canonical, split = OptLayout().shapes(optimizer, params), self.shapes(optimizer, params)
        matrixwise = lambda x: isinstance(x, optax.contrib.MuonState)  # noqa: E731
        if any(matrixwise(x) for x in jax.tree.leaves(canonical, is_leaf=matrixwise)):
            raise ValueError(
                f"optax.contrib.muon orthogonalises each leaf it is given, and strategy='{name}' gives it its split "
                f"views of the parameters, not the matrices: it would train something else. Use jdp's Muon "
                f"(jdp.muon.muon, or optim.name=muon through jdp.make_optimizer), which asks the layout for each "
                f"matrix whole, or strategy='ddp'"
            )
        odd = []
        if jax.tree.structure(canonical) != jax.tree.structure(split):
            odd.append("its state has another structure")
        else:
            for (path, c), f in zip(
                jax.tree_util.tree_leaves_with_path(canonical), jax.tree.leaves(split), strict=True
            ):
                if c.shape != f.shape and f.shape != self.shape(c):
                    odd.append(f"{jax.tree_util.keystr(path)}: {c.shape} as parameters, {f.shape} in {name}'s layout")
        if odd:
            raise ValueError(
                f"strategy='{name}' splits the optimizer state elementwise (as AdamW, SGD, Lion keep it), but this "
                f"optimizer's state depends on the parameters' shapes: {'; '.join(odd[:3])}. Use strategy='ddp'"
            )


def _shapes(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _varying(tree, axes=AXIS):
    return varying(tree, axes)


# Variables the step sets for each forward and puts back afterwards, so that they stay replicated and a resumed
# run draws the same numbers: nnx's rng streams (key and count) and RowDropout's key and rows (nn.py).
_SEEDED = (nnx.RngKey, nnx.RngCount, RowKey, RowIds)


def _map_variables(fn, *trees):
    return jax.tree.map(fn, *trees, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _seeded(rest, step, micro, rows, axes=AXIS):
    """`rest` as one forward sees it. Every nnx rng stream's key becomes fold_in(key, step, device[, micro]):
    a fresh stream for each step, device and micro-batch (the same mask on every replica would be N copies of
    one batch's dropout), a pure function of the seed and the step, so a resumed run draws the same masks.
    RowDropout's key gets the step only, and its rows the global rows of this forward (nn.py)."""
    device = jax.lax.axis_index(axes)

    def seed(v):
        if isinstance(v, nnx.RngKey):
            key = jax.random.fold_in(jax.random.fold_in(v[...], step), device)
            return v.replace(key if micro is None else jax.random.fold_in(key, micro))
        if isinstance(v, RowKey):
            return v.replace(jax.random.fold_in(v[...], step))
        if isinstance(v, RowIds):
            return v.replace(rows.astype(jnp.int32))
        return v

    return _map_variables(seed, rest)


def _unseeded(new, old):
    """The variables a forward left, with the seeded ones put back as they were (counts included)."""
    return _map_variables(lambda n, o: o if isinstance(o, _SEEDED) else n, new, old)


def _per_device(tree, axes=AXIS):
    """`tree` typed as differing between devices, whether it was or not (a scan's carry needs one type)."""
    differs = _varying(jnp.bool_(True), axes)
    return jax.tree.map(lambda x: jax.lax.select(differs, x, x), tree)


def _replicated(new, old, axes=AXIS):
    """The variables after a step, identical on every device: floating-point ones (BatchNorm's running mean and
    variance) are *averaged* over `data` (not DDP's broadcast_buffers, which copies rank 0's buffers and drops
    the others' batches); integer ones and keys are the same on every device already (the seeded ones are put
    back; others are computed alike), and pmax only re-types them as replicated."""

    def one(n, o):
        if isinstance(o, _SEEDED):
            return o
        x = _per_device(n[...] if isinstance(n, nnx.Variable) else n, axes)
        if jnp.issubdtype(x.dtype, jnp.inexact):
            x = jax.lax.pmean(x, axes)
        elif jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.wrap_key_data(jax.lax.pmax(jax.random.key_data(x), axes), impl=jax.random.key_impl(x))
        else:
            x = jax.lax.pmax(x.astype(jnp.int32) if x.dtype == jnp.bool_ else x, axes).astype(x.dtype)
        return n.replace(x) if isinstance(n, nnx.Variable) else x

    return _map_variables(one, new, old)


def keep_if(ok, new, old):
    """new where ok (the update was applied), else old: a skipped step leaves every variable as it was."""
    return jax.tree.map(lambda n, o: jax.lax.select(ok, n, o), new, old)


def local_sums(graphdef, loss_fn: LossFn, grad_accum: int, forward=None, axes=AXIS):
    """Per device: (params, rest, rows, step) -> (grad of loss sum, loss sum, weight sum, new rest, metric sums) over
    its rows, in grad_accum micro-batches (metric sums: the loss's own, guards.checked_loss). Every forward updates
    the model's other variables (BatchNorm's running statistics), the micro-batches one after the other, as
    PyTorch's would; the new rest is replicated.

    forward(loss_fn, params, rest, micro) -> (loss, (weight, new rest, metric sums)), if given, runs each forward
    from this device's parameters (fsdp's: its rows, gathered block by block); they are this device's own already,
    so no per-device view is taken. axes: the mesh axes the batch is split over (hsdp's: `replica` and `shard`)."""
    if not isinstance(grad_accum, int | np.integer) or grad_accum < 1:
        raise ConfigError(f"grad_accum={grad_accum!r} must be a whole number of micro-batches per step, 1 or more")
    loss_fn = checked_loss(loss_fn)

    def loss_of(params, rest, micro, base):
        # `base`: the frozen parameters (nn.Frozen: LoRA's, adapters.py), or None. A constant of the forward: it is
        # not differentiated, not carried through the micro-batches, not averaged over the devices with the other
        # variables; `sums` puts it back into the state untouched.
        whole = rest if base is None else nnx.merge_state(base, rest)
        if forward is not None:
            loss, (weight, new, extra) = forward(loss_fn, params, whole, micro)
        else:
            # New variables, made in this trace (copy=True): the forward may write them (BatchNorm's statistics, the
            # rng counts), and NNX refuses writes to variables that come from an outer trace.
            model = nnx.merge(graphdef, params, whole, copy=True)
            loss, weight, extra = loss_fn(model, micro)
            new = nnx.split(model, nnx.Param, ...)[2]
        return loss, (weight, new if base is None else adapters.split_frozen(new)[1], extra)

    grad_fn = jax.value_and_grad(loss_of, has_aux=True)

    def sums(params, rest, batch, step):
        base, others = adapters.split_frozen(rest)
        if not jax.tree.leaves(base):
            return trained(params, rest, batch, step, None)
        grads, loss, weight, new, extra = trained(params, others, batch, step, base)
        return grads, loss, weight, adapters.with_frozen(rest, new), extra

    def trained(params, rest, batch, step, base):
        # Differentiate with respect to a per-device ("varying") view of the replicated parameters.
        # Differentiating the replicated value itself would make shard_map's autodiff insert a psum,
        # silently giving the *sum* over devices: the classic N-times-too-large gradient.
        if forward is None:
            params = _varying(params, axes)
        rows = jax.tree.leaves(batch)[0].shape[0]
        first = jax.lax.axis_index(axes) * rows  # this device's first row in the global batch
        if grad_accum == 1:
            # No loop: the gradients leave backward one layer at a time, so each bucket's all-reduce can start
            # while earlier layers are still being differentiated.
            seeded = _seeded(rest, step, None, first + jnp.arange(rows), axes)
            (loss, (weight, new, extra)), grads = grad_fn(params, seeded, batch, base)
            return grads, loss, weight, _replicated(_unseeded(new, rest), rest, axes), extra
        # Micro-batch m holds rows m, m + grad_accum, m + 2 grad_accum, ... of each device: over the devices,
        # the global rows congruent to m, whatever the device count, so batch statistics (SyncBatchNorm) and
        # RowDropout's masks are those of one device running the same global batch.
        micro = jax.tree.map(lambda x: x.reshape(x.shape[0] // grad_accum, grad_accum, *x.shape[1:]).swapaxes(0, 1),
                             batch)  # fmt: skip
        strided = grad_accum * jnp.arange(rows // grad_accum)

        def one(carry, xs):
            mb, m = xs
            g_acc, l_acc, w_acc, state = carry
            seeded = _seeded(state, step, m, first + m + strided, axes)
            (loss, (weight, new, extra)), grads = grad_fn(params, seeded, mb, base)
            new = _per_device(_unseeded(new, state), axes)
            return (jax.tree.map(jnp.add, g_acc, grads), l_acc + loss, w_acc + weight, new), extra

        zero = (
            jax.tree.map(jnp.zeros_like, params),
            _varying(jnp.zeros((), jnp.float32), axes),
            _varying(jnp.zeros((), jnp.float32), axes),
            _per_device(rest, axes),
        )
        # Micro-batches accumulate locally: no collective inside the loop (DDP's no_sync).
        (grads, loss, weight, new), extras = jax.lax.scan(one, zero, (micro, jnp.arange(grad_accum)))
        extra = {k: jnp.sum(v, axis=0) for k, v in extras.items()}  # the loss's metric sums, each micro-batch's
        return grads, loss, weight, _replicated(new, rest, axes), extra

    return sums


def _reduce_buckets(grads, buckets: list[Bucket], hook: CommHook, comm, step, n_devices: int):
    """The mean of the gradients over `data`, bucket by bucket through the communication hook (DDP's buckets:
    with the mean, one all-reduce of one flat buffer per bucket). comm: this device's hook states, or None.
    Returns (averaged gradients, new hook states)."""
    leaves, tree = jax.tree.flatten(grads)
    out, new_comm = list(leaves), dict(comm or {})
    for i, bucket in enumerate(buckets):
        view = GradBucket(i, bucket.leaves, bucket.names, AXIS, n_devices)
        states = [new_comm.get(str(k)) for k in bucket.leaves]
        averaged, states = hook.reduce(view, [leaves[k] for k in bucket.leaves], states, step)
        for k, g, state in zip(bucket.leaves, averaged, states, strict=True):
            out[k] = g
            if state is not None:
                new_comm[str(k)] = state
    return jax.tree.unflatten(tree, out), (new_comm if comm is not None else None)


def reduced_sums(loss_sum, weight_sum, extra: dict, axes=AXIS):
    """One small all-reduce of the loss sum, the weight sum and the loss's metric sums: (global mean loss, global
    weight, each metric's global mean per unit of weight)."""
    names = sorted(extra)
    total = jax.lax.psum(jnp.stack([loss_sum, weight_sum, *(jnp.asarray(extra[k], jnp.float32) for k in names)]), axes)
    weight = total[1]
    return total[0] / weight, weight, {k: total[2 + i] / weight for i, k in enumerate(names)}


def global_grads(
    graphdef, loss_fn: LossFn, n_devices: int, grad_accum: int, bucket_mb: float, reduce_dtype: str,
    hook: CommHook | None = None,
):  # fmt: skip
    """Per-device function: (params, rest, local rows, step[, hook states]) -> (gradient of the global mean loss,
    loss, weight, new rest, metrics[, new hook states])."""
    sums = local_sums(graphdef, loss_fn, grad_accum)
    stateful = hook is not None
    hook = hook or Mean(reduce_dtype)

    def grads_of(params, rest, batch, step, comm=None):
        grads_sum, loss_sum, weight_sum, new_rest, extra = sums(params, rest, batch, step)
        micro = {k: jax.ShapeDtypeStruct((v.shape[0] // grad_accum, *v.shape[1:]), v.dtype) for k, v in batch.items()}
        buckets = bucket_plan(graphdef, loss_fn, params, rest, micro, bucket_mb, reduce_dtype)
        # Loss, token count and the loss's metrics travel together in one small all-reduce.
        loss, weight, extra = reduced_sums(loss_sum, weight_sum, extra)
        # The gradient all-reduces of the step, one per bucket. Each device holds the gradient of the *sum*
        # of the losses on its own rows; pmean gives sum_over_devices / n, so multiplying by n / (global
        # token weight) yields exactly the gradient of the global token-weighted mean loss, the same as one
        # device computing the whole batch, whatever the device count or the spread of padding.
        scale = jnp.where(weight > 0, n_devices / weight, 0.0)
        averaged, comm = _reduce_buckets(grads_sum, buckets, hook, comm, step, n_devices)
        grads = jax.tree.map(lambda g: g * scale, averaged)
        return (grads, loss, weight, new_rest, extra, comm) if stateful else (grads, loss, weight, new_rest, extra)

    return grads_of


def update(optimizer, schedule, state: TrainState, grads, loss, weight, rest, comm=None, extra=None):
    """The optimizer step on (globally averaged) gradients: new state and metrics. Shared by ddp and dp.
    rest: the model's other variables after the forward; comm: the hook's new states. Both are kept only if the
    update is applied (a skipped step leaves them as they were, like the parameters). extra: the loss's metrics."""
    params, opt_state, metrics = apply_update(
        optimizer, schedule, state.step, state.params, state.opt_state, grads, loss, weight, extra=extra
    )
    ok = metrics["skipped"] == 0
    rest = keep_if(ok, rest, state.rest)
    if comm is not None:
        comm = jax.tree.map(lambda new, old: jnp.where(ok, new, old), comm, state.comm)
    return TrainState(state.step + 1, params, opt_state, rest, comm), metrics


def apply_update(optimizer, schedule, step, params, opt_state, grads, loss, weight, layout=None, shapes=None,
                 mesh=None, extra=None):  # fmt: skip
    """optax's update and the skip guard: (new params, new optimizer state, metrics). Under zero1 and fsdp the
    arrays are `layout`'s views (OptLayout) of parameters shaped `shapes`, split over `mesh`; the norm is still
    the whole gradient's, and an optimizer that needs whole matrices (Muon) asks the layout for them. extra: the
    loss's own metrics (global means), reported beside jdp's."""
    grad_norm = optax.tree.norm(grads)
    # A non-finite loss or gradient skips the update (as PyTorch's GradScaler does). These values come after
    # the all-reduce, so every replica takes the same decision; the batch still counts as consumed (state.step
    # advances). A lax.cond, not a jnp.where of the new state and the old: to keep the old values for a where,
    # XLA copies the whole optimizer state at the start of the step (measured on XLA:CPU: AdamW's two moments,
    # twice the parameters' bytes, alive through forward and backward); the cond updates it in place. The new
    # parameters are not checked here: that would cost one more pass over parameters and optimizer state every
    # step (docs/performance.md); the loop checks them before every checkpoint instead (nonfinite_leaves).
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

    def updated(params, opt_state):
        with muon.laid_out(layout, shapes, mesh) if layout is not None else contextlib.nullcontext():
            updates, new_opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_opt_state

    new_params, new_opt_state = jax.lax.cond(ok, updated, lambda p, o: (p, o), params, opt_state)
    metrics = {**(extra or {}), "loss": loss, "grad_norm": grad_norm, "tokens": weight,
               "skipped": 1 - ok.astype(jnp.int32)}  # fmt: skip
    if schedule is not None:
        metrics["lr"] = jnp.asarray(schedule(step), jnp.float32)
    elif (lr := injected_lr(new_opt_state)) is not None:  # optax.inject_hyperparams: the rate this update used
        metrics["lr"] = jnp.asarray(lr, jnp.float32)
    return new_params, new_opt_state, metrics


def injected_lr(opt_state):
    """The learning rate an `optax.inject_hyperparams(...)` optimizer keeps in its state, or None."""
    injected = lambda x: isinstance(getattr(x, "hyperparams", None), dict)  # noqa: E731  (optax's two such states)
    rates = [s.hyperparams["learning_rate"] for s in jax.tree.leaves(opt_state, is_leaf=injected)
             if injected(s) and "learning_rate" in s.hyperparams]  # fmt: skip
    return rates[0] if rates else None


def micro_spec(batch: Batch, n_devices: int, grad_accum: int) -> dict:
    """One device's micro-batch shapes, from a global batch (arrays or shapes)."""
    return {
        k: jax.ShapeDtypeStruct((v.shape[0] // n_devices // grad_accum, *v.shape[1:]), v.dtype)
        for k, v in batch.items()
    }


def make_grad_fn(
    graphdef, loss_fn: LossFn, mesh: jax.sharding.Mesh, grad_accum: int = 1, bucket_mb: float = 25.0,
    reduce_dtype: str = "float32",
):  # fmt: skip
    """(state, global batch) -> (averaged gradients, loss, token weight): the train step without the update."""
    grads_of = global_grads(graphdef, loss_fn, mesh.devices.size, grad_accum, bucket_mb, reduce_dtype)
    sharded = jax.shard_map(
        lambda state, batch: grads_of(state.params, state.rest, batch, state.step)[:3],
        mesh=mesh,
        in_specs=(P(), P(AXIS)),
        out_specs=(P(), P(), P()),
    )
    return RefusingDonated(jax.jit(checking_rows(sharded, mesh.devices.size, grad_accum)))


def make_eval_step(graphdef, loss_fn: LossFn, mesh: jax.sharding.Mesh, model_of=None, layout: OptLayout | None = None,
                   per_row: bool = False):  # fmt: skip
    """(state, global batch) -> (loss sum, weight sum) over the whole global batch; nothing is updated (the
    model's other variables neither: BatchNorm statistics stay as trained).

    Evaluation mode is the caller's: pass the graphdef of a model after model.eval() (BatchNorm's running
    averages, no dropout). A batch with a key "valid" (float, one per row: 1 a real row, 0 padding that fills
    the last batch up to a multiple of the devices) counts the valid rows only: the loss is computed row by row
    (each row a batch of one, without "valid") and the rows' sums are weighted by it.

    model_of(shapes, params, rest) -> ((params, rest) -> model), if given, builds the model from each device's split
    parameters (fsdp's, whose state.shapes are their own shapes); else the parameters are replicated. `layout`: where
    the model's other variables lie (its rest_specs: fsdp's frozen base in rows); None: whole on every device.
    per_row=True: `loss_fn(model, rows)` returns one value per row (an array with the rows' leading axis, any
    pytree), and the step returns it for every row of the global batch, in order (the preference objectives'
    reference log-probabilities, computed once: jdp/preference.py)."""
    loss_fn = checked_loss(loss_fn) if not per_row else loss_fn
    axes = batch_axes(mesh)

    def run(params, rest, batch, shapes):
        merge = (lambda p, r: nnx.merge(graphdef, p, r)) if model_of is None else model_of(shapes, params, rest)

        def step(params, rest, batch: Batch):
            if per_row:
                return loss_fn(merge(params, rest), batch)
            if "valid" not in batch:
                loss, weight, extra = loss_fn(merge(params, rest), batch)
            else:
                rows = {k: v for k, v in batch.items() if k != "valid"}
                # The model is built inside the per-row function, so a layer that writes a variable writes its own
                # copy.
                one = lambda row: loss_fn(merge(params, rest), jax.tree.map(lambda x: x[None], row))  # noqa: E731
                losses, weights, extras = jax.vmap(one)(rows)
                valid = batch["valid"].astype(jnp.float32) > 0
                kept = lambda x: jnp.sum(jnp.where(valid, x, 0.0))  # noqa: E731  (a padding row's, even NaN, never counts)
                loss, weight, extra = kept(losses), kept(weights), {k: kept(v) for k, v in extras.items()}
            if not extra:  # (loss sum, weight sum), as it always was
                return jax.lax.psum(loss, axes), jax.lax.psum(weight, axes)
            return jax.lax.psum(loss, axes), jax.lax.psum(weight, axes), jax.lax.psum(extra, axes)

        spec = P() if shapes is None else jax.tree.map(lambda x: P(shard_axis(mesh)) if x.ndim else P(), params)
        rest_spec = P() if layout is None else layout.rest_specs(rest, mesh)
        sharded = jax.shard_map(step, mesh=mesh, in_specs=(spec, rest_spec, P(axes)), out_specs=P(axes) if per_row else P())
        return sharded(params, rest, batch)

    def eval_step(params, rest, batch, shapes):
        return run(params, rest, batch, shapes)

    eval_step.__name__ = "step"  # the compilation cache and `jdp allreduce` know it by the name it always had
    jitted = jax.jit(eval_step, static_argnums=3)
    n = mesh.devices.size

    def call(state, batch):  # no optimizer state needed
        check_batch(batch, n, 1, "eval step")
        return jitted(state.params, state.rest, batch, getattr(state, "shapes", None))

    return RefusingDonated(call)


def leaf_digest(leaf) -> jax.Array:
    """One array's bits as a uint32 (exact: floats by their bits, integers as themselves, keys by their data; the
    position of each element counts, not just the multiset): what replica checks compare between devices."""
    if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        leaf = jax.random.key_data(leaf)
    if jnp.issubdtype(leaf.dtype, jnp.floating):  # 16-bit floats widen exactly; 64-bit ones give 2 words
        bits = jax.lax.bitcast_convert_type(leaf if leaf.dtype.itemsize == 8 else leaf.astype(jnp.float32), jnp.uint32)
    else:
        bits = leaf.astype(jnp.uint32)
    bits = bits.ravel()
    return jnp.sum(bits * jnp.arange(1, bits.size + 1, dtype=jnp.uint32), dtype=jnp.uint32)


def make_replica_digest(mesh: jax.sharding.Mesh):
    """tree -> one uint32 digest per device of its own copy of the tree (exact, bit-level): the parameters, or
    any replicated pytree ({"params": ..., "rest": ...}): floats by their bits, integers as themselves, keys by
    their data. A leaf split over the devices (fsdp's parameters) has no copies to compare: each device digests
    its rows and every device folds in all of them, so the digest is the one logical leaf's."""

    def digest(split, tree):
        total = jnp.zeros((), jnp.uint32)
        for leaf, over in zip(jax.tree.leaves(tree), split, strict=True):
            one = leaf_digest(leaf)
            if over:  # the axes it is split over: fold in every part of it (hsdp: within this group)
                for part in jax.lax.all_gather(one, over):
                    total = total * jnp.uint32(31) + part
            else:
                total = total * jnp.uint32(31) + one
        return total[None]

    compiled: dict = {}

    def call(tree):
        specs = jax.tree.map(lambda x: x.sharding.spec if isinstance(x.sharding, NamedSharding) else P(), tree)
        split = tuple(tuple(a for a in spec if a is not None) for spec in jax.tree.leaves(specs, is_leaf=_is_spec))
        key = (jax.tree.structure(tree), split)
        if key not in compiled:
            # check_vma=False: each device digests its own copy, which is exactly what must be compared.
            fn = functools.partial(digest, split)
            compiled[key] = jax.jit(
                jax.shard_map(fn, mesh=mesh, in_specs=(specs,), out_specs=P(batch_axes(mesh)), check_vma=False)
            )
        return compiled[key](tree)

    return call


def _is_spec(x) -> bool:
    return isinstance(x, P)


def replica_digest_mismatches(digest_fn, tree, mesh: jax.sharding.Mesh) -> list[str]:
    """Devices (of every process) whose digest of `tree` (the parameters, or any replicated pytree) differs from
    the first device's."""
    from jax.experimental import multihost_utils

    digests = np.asarray(multihost_utils.process_allgather(digest_fn(tree), tiled=True))
    devices = list(mesh.devices.flat)
    return [f"{devices[i]} (process {devices[i].process_index})" for i in np.flatnonzero(digests != digests[0])]


@jax.jit
def _finite_leaves(tree) -> list[jax.Array]:
    return [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]


def nonfinite_leaves(tree) -> list[str]:
    """Paths of the leaves that hold a NaN or an Inf, checked on device (only the answers are fetched)."""
    flags = jax.device_get(_finite_leaves(tree))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]
    return [path for path, finite in zip(paths, flags, strict=True) if not finite]


def replica_mismatches(tree) -> list[str]:
    """Leaves whose copies on this process's devices are not bit-identical, named with the device (keys compared
    by their data; leaves split over the devices have none)."""
    problems = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if not leaf.sharding.is_fully_replicated:  # split over the devices (fsdp): no copies to compare
            continue
        if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        shards = [(s.device, np.asarray(s.data)) for s in leaf.addressable_shards]
        first_dev, first = shards[0]
        for dev, data in shards[1:]:
            if data.tobytes() != first.tobytes():
                problems.append(f"{jax.tree_util.keystr(path)}: {dev} differs from {first_dev}")
    return problems
