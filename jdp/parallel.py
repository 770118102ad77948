"""The data-parallel program: the `data` mesh, global batches, and the shard_map train, gradient and eval steps.

The only module with axis names and collectives, but for the reduction of one gradient bucket, which is a
communication hook's (hooks.py: the mean, PowerSGD or a user's; they get the axis name from here). How a job
starts is world.py's, what its processes agree on while running is coordination.py's, and which gradients share a
bucket is buckets.py's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jdp.buckets import Bucket, bucket_plan
from jdp.config import ConfigError
from jdp.guards import RefusingDonated, check_batch, check_rows, checked_loss, checking_rows
from jdp.hooks import CommHook, GradBucket, Mean, varying
from jdp.nn import RowIds, RowKey

# Where the README of earlier versions told library users to find them; they live in world.py now.
from jdp.world import keep_scratch_memory, set_xla_flags  # noqa: F401

AXIS = "data"

# loss_fn(model, batch) -> (sum of per-token losses, sum of token weights) on one device's slice.
LossFn = Callable[[nnx.Module, dict[str, jax.Array]], tuple[jax.Array, jax.Array]]
Batch = dict[str, Any]


def make_mesh(devices: list | None = None) -> jax.sharding.Mesh:
    """A 1-D mesh with axis `data` over every device of every process (or the devices given)."""
    devices = jax.devices() if devices is None else list(devices)
    return jax.sharding.Mesh(np.asarray(devices), (AXIS,))


def replicated(mesh: jax.sharding.Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(AXIS))


def process_rows(global_batch: int, mesh: jax.sharding.Mesh) -> slice:
    """The rows of every global batch that this process materialises (its devices' rows, in mesh order)."""
    devices = list(mesh.devices.flat)
    per_device = global_batch // len(devices)
    mine = [i for i, d in enumerate(devices) if d.process_index == jax.process_index()]
    if mine != list(range(mine[0], mine[-1] + 1)):
        raise ValueError("this process's devices are not contiguous in the mesh; build it with make_mesh()")
    return slice(mine[0] * per_device, (mine[-1] + 1) * per_device)


def shard_batch(local: Batch, mesh: jax.sharding.Mesh, global_batch: int | None = None) -> Batch:
    """This process's rows (numpy, leading axis = rows) -> global jax.Arrays sharded along `data`."""
    sharding = batch_sharding(mesh)

    def put(path, x):
        x = np.asarray(x)
        rows = None if x.ndim == 0 else global_batch if global_batch is not None else x.shape[0] * jax.process_count()
        check_rows(path, rows, mesh.devices.size, 1, "shard_batch")
        return jax.make_array_from_process_local_data(sharding, x, (rows, *x.shape[1:]))

    return jax.tree_util.tree_map_with_path(put, local)


@jax.tree_util.register_dataclass
@dataclass
class TrainState:
    """Everything the step updates. Every leaf is replicated (one identical copy per device), except the optimizer
    state under zero1 (flat and split over the devices: OptLayout) and dp (on the master device), and the
    communication hook's state, which each device keeps its own of (leading axis: the devices)."""

    step: jax.Array
    params: nnx.State  # the model's nnx.Param variables
    opt_state: optax.OptState
    rest: nnx.State  # every other model variable (BatchNorm statistics, rng keys): updated by the step (_local_sums)
    comm: Any = None  # the hook's per-parameter states, {leaf index: state}; None when it keeps none (the mean)


def init_state(
    model: nnx.Module,
    optimizer: optax.GradientTransformation,
    mesh: jax.sharding.Mesh,
    strategy: str = "ddp",
    comm_hook: CommHook | None = None,
):
    """Split the model once; place the parameters, replicated, on every device of the mesh, the optimizer
    state as `strategy` keeps it: replicated (ddp), on the master (dp), or split over the devices (zero1), and
    the communication hook's initial state (pass the hook given to make_train_step)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params, rest = jax.device_put((params, rest), replicated(mesh))
    layout = OptLayout.of(strategy, mesh)
    layout.check(optimizer, params)
    shapes = layout.shapes(optimizer, params)
    init = lambda p: optimizer.init(layout.view(p))  # noqa: E731
    opt_state = jax.jit(init, out_shardings=layout.shardings(shapes, mesh, strategy))(params)
    step = jax.device_put(jnp.zeros((), jnp.int32), replicated(mesh))
    return graphdef, TrainState(step, params, opt_state, rest, init_comm(comm_hook, params, mesh))


def init_comm(hook: CommHook | None, params, mesh: jax.sharding.Mesh):
    """The hook's initial per-parameter states, one copy per device ({leaf index: state}), or None if it keeps none.

    Each device's copy is the same at start (the hook's init sees only the parameter's index, name and shape)."""
    if hook is None:
        return None
    n = mesh.devices.size

    def make():
        states = _hook_states(hook, params)
        return {k: jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *x.shape)), v) for k, v in states.items()} or None

    shapes = jax.eval_shape(make)
    if shapes is None:
        return None
    per_device = jax.tree.map(lambda x: NamedSharding(mesh, P(AXIS, *[None] * (x.ndim - 1))), shapes)
    return jax.jit(make, out_shardings=per_device)()


def _hook_states(hook: CommHook, params) -> dict:
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
    """How the optimizer state lies. shards=0: shaped as the parameters (ddp, dp). shards=N (zero1): the optimizer
    sees each parameter flattened into its last axis, zero-padded to a multiple of N, with its rank kept (a
    (768, 3072) kernel is seen as (1, 2359296), so masks written as `ndim >= 2` still pick the matrices), and
    device d holds elements [d*s, (d+1)*s) of that axis in every such leaf of the state (s = padded size / N).
    Scalars (Adam's count) are replicated.

    The padding is zeros in the gradients and the parameters, so an elementwise optimizer leaves it zero, and it is
    cut off before a value reaches a parameter. Optimizers whose state is not elementwise (factored ones such as
    Adafactor) would see other shapes; zero1 refuses them (check). Masks must not depend on sizes or dimensions.
    """

    shards: int = 0

    @staticmethod
    def of(strategy: str, mesh: jax.sharding.Mesh) -> OptLayout:
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy={strategy!r} must be one of {', '.join(STRATEGIES)}")
        return OptLayout(mesh.devices.size if strategy == "zero1" else 0)

    @staticmethod
    def of_record(record: dict) -> OptLayout:
        """The layout a checkpoint was written in (its JSON record; older records: as the parameters)."""
        return OptLayout(int(record.get("optimizer_layout", {}).get("shards", 0)))

    def to_record(self) -> dict:
        return {"shards": self.shards, "what": self.describe()}

    def describe(self) -> str:
        return f"zero1's slices over {self.shards} devices" if self.shards else "whole copies (ddp, dp)"

    def view(self, params):
        """The parameters as the optimizer sees them: unchanged, or flat and padded to a multiple of shards."""
        if not self.shards:
            return params
        return jax.tree.map(lambda x: jnp.pad(x.ravel(), (0, -x.size % self.shards)).reshape(self.shape(x)), params)

    def shape(self, x) -> tuple[int, ...]:
        """A leaf's shape as the optimizer sees it in this layout."""
        if not self.shards:
            return x.shape
        padded = x.size + -x.size % self.shards
        return (1,) * (x.ndim - 1) + (padded,)

    def shapes(self, optimizer: optax.GradientTransformation, params):
        """The optimizer state's shapes in this layout (nothing is computed)."""
        return jax.eval_shape(lambda p: optimizer.init(self.view(p)), _shapes(params))

    def shardings(self, shapes, mesh: jax.sharding.Mesh, strategy: str = "ddp"):
        """Where each leaf of a state of these shapes lives on `mesh`."""
        if strategy == "dp":
            return jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(master_device(mesh)), shapes)
        n = mesh.devices.size
        return jax.tree.map(
            lambda x: (
                NamedSharding(mesh, split_spec(x.ndim))
                if self.shards and x.ndim >= 1 and x.shape[-1] % n == 0
                else replicated(mesh)
            ),
            shapes,
        )

    def check(self, optimizer: optax.GradientTransformation, params) -> None:
        """Refuse an optimizer whose state is not elementwise: its state would change meaning when flattened."""
        if not self.shards:
            return
        canonical, flat = OptLayout().shapes(optimizer, params), self.shapes(optimizer, params)
        odd = []
        if jax.tree.structure(canonical) != jax.tree.structure(flat):
            odd.append("its state has another structure")
        else:
            for (path, c), f in zip(jax.tree_util.tree_leaves_with_path(canonical), jax.tree.leaves(flat), strict=True):
                if c.shape != f.shape and f.shape != self.shape(c):
                    odd.append(f"{jax.tree_util.keystr(path)}: {c.shape} as parameters, {f.shape} flat")
        if odd:
            raise ValueError(
                "strategy='zero1' shards the optimizer state elementwise (as AdamW, SGD, Lion keep it), but this "
                f"optimizer's state depends on the parameters' shapes: {'; '.join(odd[:3])}. Use strategy='ddp'"
            )


STRATEGIES = ("ddp", "zero1", "dp")


def split_spec(ndim: int) -> P:
    """The last axis split over `data` (OptLayout's flat leaves)."""
    return P(*([None] * (ndim - 1)), AXIS)


def _shapes(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def relayout(state: TrainState, optimizer, mesh: jax.sharding.Mesh, strategy: str) -> TrainState:
    """`state` with its optimizer state (in any layout) moved to the one `strategy` keeps on `mesh`: how a
    checkpoint of one strategy or device count continues under another. Values are unchanged, only placed anew."""
    dst = OptLayout.of(strategy, mesh)
    canonical, target = OptLayout().shapes(optimizer, state.params), dst.shapes(optimizer, state.params)

    def move(x, c, t):
        return jnp.pad(x.ravel()[: c.size], (0, t.size - c.size)).reshape(t.shape)

    shardings = dst.shardings(target, mesh, strategy)
    opt_state = jax.jit(lambda o: jax.tree.map(move, o, canonical, target), out_shardings=shardings)(state.opt_state)
    return dataclasses.replace(state, opt_state=opt_state)


def restore_target(state: TrainState, optimizer, mesh: jax.sharding.Mesh, strategy: str, saved: OptLayout):
    """What to restore a checkpoint written in layout `saved` into: `state` itself (shapes and shardings) when that
    is today's layout, else the saved shapes with the optimizer state replicated, for relayout to place."""
    if saved == OptLayout.of(strategy, mesh):
        return state
    opt = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated(mesh)),
        saved.shapes(optimizer, state.params),
    )
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    return dataclasses.replace(like, opt_state=opt)


def _varying(tree):
    return varying(tree, AXIS)


# Variables the step sets for each forward and puts back afterwards, so that they stay replicated and a resumed
# run draws the same numbers: nnx's rng streams (key and count) and RowDropout's key and rows (nn.py).
_SEEDED = (nnx.RngKey, nnx.RngCount, RowKey, RowIds)


def _map_variables(fn, *trees):
    return jax.tree.map(fn, *trees, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _seeded(rest, step, micro, rows):
    """`rest` as one forward sees it. Every nnx rng stream's key becomes fold_in(key, step, device[, micro]):
    a fresh stream for each step, device and micro-batch (the same mask on every replica would be N copies of
    one batch's dropout), a pure function of the seed and the step, so a resumed run draws the same masks.
    RowDropout's key gets the step only, and its rows the global rows of this forward (nn.py)."""
    device = jax.lax.axis_index(AXIS)

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


def _per_device(tree):
    """`tree` typed as differing between devices, whether it was or not (a scan's carry needs one type)."""
    differs = _varying(jnp.bool_(True))
    return jax.tree.map(lambda x: jax.lax.select(differs, x, x), tree)


def _replicated(new, old):
    """The variables after a step, identical on every device: floating-point ones (BatchNorm's running mean and
    variance) are *averaged* over `data` (not DDP's broadcast_buffers, which copies rank 0's buffers and drops
    the others' batches); integer ones and keys are the same on every device already (the seeded ones are put
    back; others are computed alike), and pmax only re-types them as replicated."""

    def one(n, o):
        if isinstance(o, _SEEDED):
            return o
        x = _per_device(n[...] if isinstance(n, nnx.Variable) else n)
        if jnp.issubdtype(x.dtype, jnp.inexact):
            x = jax.lax.pmean(x, AXIS)
        elif jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.wrap_key_data(jax.lax.pmax(jax.random.key_data(x), AXIS), impl=jax.random.key_impl(x))
        else:
            x = jax.lax.pmax(x.astype(jnp.int32) if x.dtype == jnp.bool_ else x, AXIS).astype(x.dtype)
        return n.replace(x) if isinstance(n, nnx.Variable) else x

    return _map_variables(one, new, old)


def _keep_if(ok, new, old):
    """new where ok (the update was applied), else old: a skipped step leaves every variable as it was."""
    return jax.tree.map(lambda n, o: jax.lax.select(ok, n, o), new, old)


def _local_sums(graphdef, loss_fn: LossFn, grad_accum: int):
    """Per device: (params, rest, rows, step) -> (grad of loss sum, loss sum, weight sum, new rest) over its rows,
    in grad_accum micro-batches. Every forward updates the model's other variables (BatchNorm's running
    statistics), the micro-batches one after the other, as PyTorch's would; the new rest is replicated."""
    if not isinstance(grad_accum, int | np.integer) or grad_accum < 1:
        raise ConfigError(f"grad_accum={grad_accum!r} must be a whole number of micro-batches per step, 1 or more")
    loss_fn = checked_loss(loss_fn)

    def loss_of(params, rest, micro):
        # New variables, made in this trace (copy=True): the forward may write them (BatchNorm's statistics, the
        # rng counts), and NNX refuses writes to variables that come from an outer trace.
        model = nnx.merge(graphdef, params, rest, copy=True)
        loss, weight = loss_fn(model, micro)
        return loss, (weight, nnx.split(model, nnx.Param, ...)[2])

    grad_fn = jax.value_and_grad(loss_of, has_aux=True)

    def sums(params, rest, batch, step):
        # Differentiate with respect to a per-device ("varying") view of the replicated parameters.
        # Differentiating the replicated value itself would make shard_map's autodiff insert a psum,
        # silently giving the *sum* over devices: the classic N-times-too-large gradient.
        params = _varying(params)
        rows = jax.tree.leaves(batch)[0].shape[0]
        first = jax.lax.axis_index(AXIS) * rows  # this device's first row in the global batch
        if grad_accum == 1:
            # No loop: the gradients leave backward one layer at a time, so each bucket's all-reduce can start
            # while earlier layers are still being differentiated.
            seeded = _seeded(rest, step, None, first + jnp.arange(rows))
            (loss, (weight, new)), grads = grad_fn(params, seeded, batch)
            return grads, loss, weight, _replicated(_unseeded(new, rest), rest)
        # Micro-batch m holds rows m, m + grad_accum, m + 2 grad_accum, ... of each device: over the devices,
        # the global rows congruent to m, whatever the device count, so batch statistics (SyncBatchNorm) and
        # RowDropout's masks are those of one device running the same global batch.
        micro = jax.tree.map(lambda x: x.reshape(x.shape[0] // grad_accum, grad_accum, *x.shape[1:]).swapaxes(0, 1),
                             batch)  # fmt: skip
        strided = grad_accum * jnp.arange(rows // grad_accum)

        def one(carry, xs):
            mb, m = xs
            g_acc, l_acc, w_acc, state = carry
            (loss, (weight, new)), grads = grad_fn(params, _seeded(state, step, m, first + m + strided), mb)
            new = _per_device(_unseeded(new, state))
            return (jax.tree.map(jnp.add, g_acc, grads), l_acc + loss, w_acc + weight, new), None

        zero = (
            jax.tree.map(jnp.zeros_like, params),
            _varying(jnp.zeros((), jnp.float32)),
            _varying(jnp.zeros((), jnp.float32)),
            _per_device(rest),
        )
        # Micro-batches accumulate locally: no collective inside the loop (DDP's no_sync).
        (grads, loss, weight, new), _ = jax.lax.scan(one, zero, (micro, jnp.arange(grad_accum)))
        return grads, loss, weight, _replicated(new, rest)

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


def _global_grads(
    graphdef, loss_fn: LossFn, n_devices: int, grad_accum: int, bucket_mb: float, reduce_dtype: str,
    hook: CommHook | None = None,
):  # fmt: skip
    """Per-device function: (params, rest, local rows, step[, hook states]) -> (gradient of the global mean loss,
    loss, weight, new rest[, new hook states])."""
    local_sums = _local_sums(graphdef, loss_fn, grad_accum)
    stateful = hook is not None
    hook = hook or Mean(reduce_dtype)

    def grads_of(params, rest, batch, step, comm=None):
        grads_sum, loss_sum, weight_sum, new_rest = local_sums(params, rest, batch, step)
        micro = {k: jax.ShapeDtypeStruct((v.shape[0] // grad_accum, *v.shape[1:]), v.dtype) for k, v in batch.items()}
        buckets = bucket_plan(graphdef, loss_fn, params, rest, micro, bucket_mb, reduce_dtype)
        # Loss and token count travel together in one small all-reduce.
        loss_total, weight = jax.lax.psum(jnp.stack([loss_sum, weight_sum]), AXIS)
        loss = loss_total / weight
        # The gradient all-reduces of the step, one per bucket. Each device holds the gradient of the *sum*
        # of the losses on its own rows; pmean gives sum_over_devices / n, so multiplying by n / (global
        # token weight) yields exactly the gradient of the global token-weighted mean loss, the same as one
        # device computing the whole batch, whatever the device count or the spread of padding.
        scale = jnp.where(weight > 0, n_devices / weight, 0.0)
        averaged, comm = _reduce_buckets(grads_sum, buckets, hook, comm, step, n_devices)
        grads = jax.tree.map(lambda g: g * scale, averaged)
        return (grads, loss, weight, new_rest, comm) if stateful else (grads, loss, weight, new_rest)

    return grads_of


def _update(optimizer, schedule, state: TrainState, grads, loss, weight, rest, comm=None):
    """The optimizer step on (globally averaged) gradients: new state and metrics. Shared by ddp and dp.
    rest: the model's other variables after the forward; comm: the hook's new states. Both are kept only if the
    update is applied (a skipped step leaves them as they were, like the parameters)."""
    params, opt_state, metrics = _apply(
        optimizer, schedule, state.step, state.params, state.opt_state, grads, loss, weight
    )
    ok = metrics["skipped"] == 0
    rest = _keep_if(ok, rest, state.rest)
    if comm is not None:
        comm = jax.tree.map(lambda new, old: jnp.where(ok, new, old), comm, state.comm)
    return TrainState(state.step + 1, params, opt_state, rest, comm), metrics


def _apply(optimizer, schedule, step, params, opt_state, grads, loss, weight):
    """optax's update and the skip guard: (new params, new optimizer state, metrics). Under zero1 the arrays are
    the flat views (OptLayout), split over the devices; the norm is still the whole gradient's."""
    grad_norm = optax.tree.norm(grads)
    updates, new_opt_state = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    # A non-finite loss or gradient skips the update (as PyTorch's GradScaler does). These values come after
    # the all-reduce, so every replica takes the same decision; the batch still counts as consumed (state.step
    # advances). Known before the update, the choice fuses into it. The new parameters are not checked here:
    # that would cost one more pass over parameters and optimizer state every step (docs/performance.md); the
    # loop checks them before every checkpoint instead (nonfinite_leaves).
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    new_params, new_opt_state = jax.tree.map(
        lambda new, old: jnp.where(ok, new, old), (new_params, new_opt_state), (params, opt_state)
    )
    metrics = {"loss": loss, "grad_norm": grad_norm, "tokens": weight, "skipped": 1 - ok.astype(jnp.int32)}
    if schedule is not None:
        metrics["lr"] = jnp.asarray(schedule(step), jnp.float32)
    return new_params, new_opt_state, metrics


def make_train_step(
    graphdef,
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    mesh: jax.sharding.Mesh,
    grad_accum: int = 1,
    schedule: optax.Schedule | None = None,
    *,
    strategy: str = "ddp",
    bucket_mb: float = 25.0,
    reduce_dtype: str = "float32",
    comm_hook: CommHook | None = None,
) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]]:
    """The data-parallel step: (state, global batch) -> (new state, metrics), state donated (passing a donated
    state again raises ConfigError; so do rows that do not split into devices x grad_accum and a loss_fn that does
    not return (loss_sum, weight_sum), while the step is traced).

    strategy="ddp" (jdp's design): every device computes its gradients, they are averaged by all-reduces
    of about bucket_mb MiB, and every replica applies the identical update; comm_hook replaces the mean of each
    bucket (hooks.py; build the state with init_state(..., comm_hook=the same hook)). strategy="zero1" splits
    the optimizer state over the devices (make_zero1_train_step; build the state with init_state(...,
    strategy="zero1")). strategy="dp" is PyTorch DataParallel's master pattern, kept as the baseline to
    measure against (see make_dp_train_step).

    Under every strategy the model's other variables (state.rest) are updated by the forward passes and kept
    replicated: floating-point ones (BatchNorm's running statistics) averaged over the devices; nnx rng streams
    (nnx.Dropout) drawn per step and device; RowDropout (nn.py) per step and global row (_local_sums).
    """
    if comm_hook is not None and strategy != "ddp":
        raise ValueError(f"a communication hook reduces ddp's buckets; strategy={strategy!r} has none to hook")
    if strategy == "dp":
        return make_dp_train_step(graphdef, loss_fn, optimizer, mesh, grad_accum, schedule)
    if strategy == "zero1":
        return make_zero1_train_step(graphdef, loss_fn, optimizer, mesh, grad_accum, schedule, bucket_mb, reduce_dtype)
    if strategy != "ddp":
        raise ValueError(f"strategy={strategy!r} must be one of {', '.join(STRATEGIES)}")
    if comm_hook is None:
        grads_of = _global_grads(graphdef, loss_fn, mesh.devices.size, grad_accum, bucket_mb, reduce_dtype)

        def step(state: TrainState, batch: Batch):
            grads, loss, weight, rest = grads_of(state.params, state.rest, batch, state.step)
            # Every replica applies the identical update to identical parameters: they stay bit-identical.
            return _update(optimizer, schedule, state, grads, loss, weight, rest)

        sharded = jax.shard_map(step, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=(P(), P()))
        return RefusingDonated(jax.jit(checking_rows(sharded, mesh.devices.size, grad_accum), donate_argnums=0))

    grads_of = _global_grads(graphdef, loss_fn, mesh.devices.size, grad_accum, bucket_mb, reduce_dtype, comm_hook)

    def hooked(state: TrainState, batch: Batch):
        expected = sorted(jax.eval_shape(lambda: _hook_states(comm_hook, state.params)), key=int)
        if sorted(state.comm or {}, key=int) != expected:
            raise ValueError(
                f"{comm_hook.describe()['hook']} keeps state for parameters {expected[:5]}..., but the train state "
                f"holds {'none' if state.comm is None else sorted(state.comm, key=int)[:5]}: build it with "
                f"init_state(..., comm_hook=the same hook)"
            )
        # Each device sees its own hook states with a leading axis of 1.
        mine = jax.tree.map(lambda x: x[0], state.comm)
        grads, loss, weight, rest, comm = grads_of(state.params, state.rest, batch, state.step, mine)
        mine = dataclasses.replace(state, comm=mine)
        new, metrics = _update(optimizer, schedule, mine, grads, loss, weight, rest, comm)
        return dataclasses.replace(new, comm=jax.tree.map(lambda x: x[None], new.comm)), metrics

    spec = TrainState(P(), P(), P(), P(), P(AXIS))
    sharded = jax.shard_map(hooked, mesh=mesh, in_specs=(spec, P(AXIS)), out_specs=(spec, P()))
    return RefusingDonated(jax.jit(checking_rows(sharded, mesh.devices.size, grad_accum), donate_argnums=0))


def _micro_spec(batch: Batch, n_devices: int, grad_accum: int) -> dict:
    """One device's micro-batch shapes, from a global batch (arrays or shapes)."""
    return {
        k: jax.ShapeDtypeStruct((v.shape[0] // n_devices // grad_accum, *v.shape[1:]), v.dtype)
        for k, v in batch.items()
    }


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
                .reshape(OptLayout(n).shape(leaves[k])[:-1] + (width,))
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


def make_zero1_train_step(
    graphdef,
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    mesh: jax.sharding.Mesh,
    grad_accum: int = 1,
    schedule: optax.Schedule | None = None,
    bucket_mb: float = 25.0,
    reduce_dtype: str = "float32",
):
    """ZeRO stage 1 (PyTorch's ZeroRedundancyOptimizer, MaxText's shard_optimizer_over_data): each device keeps
    the optimizer state of 1/N of every parameter.

    Backward is ddp's, buckets included; each bucket is reduce-scattered instead of all-reduced, so a device
    receives the mean gradient of its slice only. The optimizer update runs on the slices (jit places it where
    the slices are: optax's global norm for clipping and `grad_norm` still covers the whole gradient, a scalar
    all-reduce), and the updated slices are all-gathered bucket by bucket, so every device again holds identical
    full parameters. Reduce-scatter plus all-gather move the same bytes as one all-reduce.
    """
    n = mesh.devices.size
    layout = OptLayout(n)
    local_sums = _local_sums(graphdef, loss_fn, grad_accum)

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
            micro = _micro_spec(batch, 1, grad_accum)
            planned.append(buckets := bucket_plan(graphdef, loss_fn, params, rest, micro, bucket_mb, reduce_dtype))
            grads_sum, loss_sum, weight_sum, new_rest = local_sums(params, rest, batch, step)
            loss_total, weight = jax.lax.psum(jnp.stack([loss_sum, weight_sum]), AXIS)
            # The reduce-scatter sums over devices; dividing by the global token weight gives exactly the
            # gradient of the global token-weighted mean loss, as ddp's pmean times n / weight does.
            scale = jnp.where(weight > 0, 1.0 / weight, 0.0)
            mine = jax.tree.map(lambda g: g * scale, _scatter_buckets(grads_sum, buckets, reduce_dtype, n))
            return mine, loss_total / weight, weight, new_rest

        specs = jax.tree.map(lambda x: split_spec(max(x.ndim, 1)), state.params)
        scatter = jax.shard_map(
            grads_of, mesh=mesh, in_specs=(P(), P(), P(), P(AXIS)), out_specs=(specs, P(), P(), P())
        )
        grads, loss, weight, rest = scatter(state.params, state.rest, state.step, batch)
        buckets = planned[-1]
        split = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)
        params = jax.lax.with_sharding_constraint(layout.view(state.params), split)  # each device's own slice
        params, opt_state, metrics = _apply(
            optimizer, schedule, state.step, params, state.opt_state, grads, loss, weight
        )
        opt_state = jax.lax.with_sharding_constraint(opt_state, layout.shardings(expected, mesh))  # stays split
        # check_vma=False: all_gather's result is typed per-device, but every device holds the same values.
        gather = jax.shard_map(
            lambda p: _gather_buckets(p, state.params, buckets, n),
            mesh=mesh, in_specs=(specs,), out_specs=P(), check_vma=False,
        )  # fmt: skip
        rest = _keep_if(metrics["skipped"] == 0, rest, state.rest)
        return TrainState(state.step + 1, gather(params), opt_state, rest), metrics

    return RefusingDonated(jax.jit(step, donate_argnums=0))


def master_device(mesh: jax.sharding.Mesh):
    return mesh.devices.flat[0]


def make_dp_train_step(
    graphdef,
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    mesh: jax.sharding.Mesh,
    grad_accum: int = 1,
    schedule: optax.Schedule | None = None,
):
    """PyTorch DataParallel's design, which jdp exists to avoid, as a measurable baseline.

    Each device computes the gradient of its rows; all of them are gathered onto the master (the mesh's
    first device), which sums them and computes the update alone; the new parameters are then broadcast
    to every device. The optimizer state lives on the master only (place it with for_strategy). One
    process only: DataParallel is single-process.
    """
    local_sums = _local_sums(graphdef, loss_fn, grad_accum)
    master = jax.sharding.SingleDeviceSharding(master_device(mesh))

    def per_device(params, rest, step, batch):
        grads, loss, weight, rest = local_sums(params, rest, batch, step)
        stacked = jax.tree.map(lambda x: x[None], (grads, loss, weight))  # stacked along `data`, not reduced
        return stacked, rest  # the model's other variables, already averaged (_replicated)

    local = jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P(), P(), P(AXIS)), out_specs=(P(AXIS), P()))
    local = jax.jit(checking_rows(local, mesh.devices.size, grad_accum))

    def update(state: TrainState, stacked, rest):
        grads, loss, weight = jax.tree.map(lambda x: jnp.sum(x, axis=0), stacked)  # the master sums them
        scale = jnp.where(weight > 0, 1.0 / weight, 0.0)
        grads = jax.tree.map(lambda g: g * scale, grads)
        return _update(optimizer, schedule, state, grads, loss / weight, weight, rest)

    update = jax.jit(update, donate_argnums=0)

    def step(state: TrainState, batch: Batch):
        stacked, new_rest = local(state.params, state.rest, state.step, batch)
        gathered = jax.device_put((stacked, new_rest), master)  # every device's gradients copied to the master
        step_, params, rest = jax.device_put((state.step, state.params, state.rest), master)  # its own replica
        new, metrics = update(TrainState(step_, params, state.opt_state, rest), *gathered)
        # Broadcast: the new parameters (and step) go from the master to every device.
        params, step_, rest = jax.device_put((new.params, new.step, new.rest), replicated(mesh))
        return TrainState(step_, params, new.opt_state, rest), metrics

    return RefusingDonated(step)


def for_strategy(state: TrainState, strategy: str, mesh: jax.sharding.Mesh) -> TrainState:
    """dp keeps the optimizer state on the master device only; ddp keeps a replica of everything. (For zero1,
    build the state with init_state(..., strategy="zero1"), whose optimizer state has another shape.)"""
    if strategy != "dp":
        return state
    return dataclasses.replace(
        state, opt_state=jax.device_put(state.opt_state, jax.sharding.SingleDeviceSharding(master_device(mesh)))
    )


def make_grad_fn(
    graphdef, loss_fn: LossFn, mesh: jax.sharding.Mesh, grad_accum: int = 1, bucket_mb: float = 25.0,
    reduce_dtype: str = "float32",
):  # fmt: skip
    """(state, global batch) -> (averaged gradients, loss, token weight): the train step without the update."""
    grads_of = _global_grads(graphdef, loss_fn, mesh.devices.size, grad_accum, bucket_mb, reduce_dtype)
    sharded = jax.shard_map(
        lambda state, batch: grads_of(state.params, state.rest, batch, state.step)[:3],
        mesh=mesh,
        in_specs=(P(), P(AXIS)),
        out_specs=(P(), P(), P()),
    )
    return RefusingDonated(jax.jit(checking_rows(sharded, mesh.devices.size, grad_accum)))


def make_eval_step(graphdef, loss_fn: LossFn, mesh: jax.sharding.Mesh):
    """(state, global batch) -> (loss sum, weight sum) over the whole global batch; nothing is updated (the
    model's other variables neither: BatchNorm statistics stay as trained).

    Evaluation mode is the caller's: pass the graphdef of a model after model.eval() (BatchNorm's running
    averages, no dropout). A batch with a key "valid" (float, one per row: 1 a real row, 0 padding that fills
    the last batch up to a multiple of the devices) counts the valid rows only: the loss is computed row by row
    (each row a batch of one, without "valid") and the rows' sums are weighted by it."""
    loss_fn = checked_loss(loss_fn)

    def step(params, rest, batch: Batch):
        if "valid" not in batch:
            loss, weight = loss_fn(nnx.merge(graphdef, params, rest), batch)
        else:
            rows = {k: v for k, v in batch.items() if k != "valid"}
            # The model is built inside the per-row function, so a layer that writes a variable writes its own copy.
            one = lambda row: loss_fn(nnx.merge(graphdef, params, rest), jax.tree.map(lambda x: x[None], row))  # noqa: E731
            losses, weights = jax.vmap(one)(rows)
            valid = batch["valid"].astype(jnp.float32) > 0
            loss = jnp.sum(jnp.where(valid, losses, 0.0))  # a padding row's loss, even NaN, never counts
            weight = jnp.sum(jnp.where(valid, weights, 0.0))
        return jax.lax.psum(loss, AXIS), jax.lax.psum(weight, AXIS)

    sharded = jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P(AXIS)), out_specs=(P(), P()))
    jitted = jax.jit(checking_rows(sharded, mesh.devices.size, 1, "eval step"))
    return RefusingDonated(lambda state, batch: jitted(state.params, state.rest, batch))  # no optimizer state needed


def make_replica_digest(mesh: jax.sharding.Mesh):
    """tree -> one uint32 digest per device of its own copy of the tree (exact, bit-level): the parameters, or
    any replicated pytree ({"params": ..., "rest": ...}): floats by their bits, integers as themselves, keys by
    their data."""

    def bits_of(leaf):
        if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        if jnp.issubdtype(leaf.dtype, jnp.floating):  # 16-bit floats widen exactly; 64-bit ones give 2 words
            return jax.lax.bitcast_convert_type(
                leaf if leaf.dtype.itemsize == 8 else leaf.astype(jnp.float32), jnp.uint32
            )
        return leaf.astype(jnp.uint32)

    def digest(tree):
        total = jnp.zeros((), jnp.uint32)
        for leaf in jax.tree.leaves(tree):
            bits = bits_of(leaf).ravel()
            weights = jnp.arange(1, bits.size + 1, dtype=jnp.uint32)  # position matters, not just the multiset
            total = total * jnp.uint32(31) + jnp.sum(bits * weights, dtype=jnp.uint32)
        return total[None]

    # check_vma=False: each device digests its own copy, which is exactly what must be compared.
    return jax.jit(jax.shard_map(digest, mesh=mesh, in_specs=P(), out_specs=P(AXIS), check_vma=False))


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
    by their data)."""
    problems = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        shards = [(s.device, np.asarray(s.data)) for s in leaf.addressable_shards]
        first_dev, first = shards[0]
        for dev, data in shards[1:]:
            if data.tobytes() != first.tobytes():
                problems.append(f"{jax.tree_util.keystr(path)}: {dev} differs from {first_dev}")
    return problems
