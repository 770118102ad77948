"""What every strategy's step is made of: the train state, the optimizer state's layout, each device's gradient
sums (with the model's other variables and random streams), the bucketed mean, the optimizer update with its skip
guard, and the eval step and replica checks. The strategies (strategies/) assemble their steps from these."""

from __future__ import annotations

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
from jdp.guards import RefusingDonated, checked_loss, checking_rows
from jdp.hooks import CommHook, GradBucket, Mean, varying
from jdp.mesh import AXIS, Batch, replicated, split_spec
from jdp.nn import RowIds, RowKey

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
    state under zero1 (flat and split over the devices: OptLayout) and dp (on the master device), and the
    communication hook's state, which each device keeps its own of (leading axis: the devices)."""

    step: jax.Array
    params: nnx.State  # the model's nnx.Param variables
    opt_state: optax.OptState
    rest: nnx.State  # every other model variable (BatchNorm statistics, rng keys): updated by the step (local_sums)
    comm: Any = None  # the hook's per-parameter states, {leaf index: state}; None when it keeps none (the mean)


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

    def shardings(self, shapes, mesh: jax.sharding.Mesh):
        """Where each leaf of a state of these shapes lives on `mesh`: split along `data` (the flat leaves of a
        split layout), else replicated."""
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


def _shapes(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


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


def keep_if(ok, new, old):
    """new where ok (the update was applied), else old: a skipped step leaves every variable as it was."""
    return jax.tree.map(lambda n, o: jax.lax.select(ok, n, o), new, old)


def local_sums(graphdef, loss_fn: LossFn, grad_accum: int):
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


def global_grads(
    graphdef, loss_fn: LossFn, n_devices: int, grad_accum: int, bucket_mb: float, reduce_dtype: str,
    hook: CommHook | None = None,
):  # fmt: skip
    """Per-device function: (params, rest, local rows, step[, hook states]) -> (gradient of the global mean loss,
    loss, weight, new rest[, new hook states])."""
    sums = local_sums(graphdef, loss_fn, grad_accum)
    stateful = hook is not None
    hook = hook or Mean(reduce_dtype)

    def grads_of(params, rest, batch, step, comm=None):
        grads_sum, loss_sum, weight_sum, new_rest = sums(params, rest, batch, step)
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


def update(optimizer, schedule, state: TrainState, grads, loss, weight, rest, comm=None):
    """The optimizer step on (globally averaged) gradients: new state and metrics. Shared by ddp and dp.
    rest: the model's other variables after the forward; comm: the hook's new states. Both are kept only if the
    update is applied (a skipped step leaves them as they were, like the parameters)."""
    params, opt_state, metrics = apply_update(
        optimizer, schedule, state.step, state.params, state.opt_state, grads, loss, weight
    )
    ok = metrics["skipped"] == 0
    rest = keep_if(ok, rest, state.rest)
    if comm is not None:
        comm = jax.tree.map(lambda new, old: jnp.where(ok, new, old), comm, state.comm)
    return TrainState(state.step + 1, params, opt_state, rest, comm), metrics


def apply_update(optimizer, schedule, step, params, opt_state, grads, loss, weight):
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
