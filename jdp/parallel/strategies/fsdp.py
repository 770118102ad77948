"""fsdp: ZeRO stage 3 (PyTorch FSDP2, MaxText's `fsdp` axis, the JAX scaling book's recipe). Every parameter, its
gradient and its optimizer state live split over the devices, padded along the first axis (Rows);
each device still trains on its own rows of the batch.

Each forward gathers one unit's parameters at a time: one all-gather per block of the model's repeated blocks (an
`nnx.List` of modules, `blocks.<i>` in GPT and Llama), and one for everything outside them (embeddings, final norm),
gathered first. The gather's backward is a reduce-scatter of that unit's gradients in `parallel.reduce_dtype`, so
each device receives the summed gradient of its own rows only, as backward finishes the block. With
`reshard_after_forward` (the default, ZeRO-3) a block's gathered parameters are dropped after its forward and
gathered again for its backward (jax.checkpoint saving the matrix products' outputs only, so what is recomputed
is the gather and the block's elementwise work; model.remat gives it another policy: parallel/remat.py); without it
they stay until backward (ZeRO-2-like: faster, one model's worth of parameters more). The optimizer update runs on the rows, as zero1's does on its slices.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jdp import adapters
from jdp.nn import Frozen
from jdp.parallel import remat
from jdp.parallel.comm_hooks import CommHook
from jdp.parallel.costs import Buckets, Collectives, Memory, Traffic, tree_bytes
from jdp.parallel.guards import RefusingDonated, check_batch
from jdp.parallel.mesh import GROUP, REPLICA, Batch, batch_axes, replicated, shard_axis, shard_count
from jdp.parallel.step import (
    LossFn,
    OptLayout,
    TrainState,
    apply_update,
    keep_if,
    local_sums,
    param_names,
    reduced_sums,
)

__all__ = [
    "LAYOUT", "Rows", "Units", "base_bytes", "base_rows", "block_policy", "layout", "make_eval_step", "make_step",
    "make_train_step", "opt_shardings", "report_base", "report_units", "state_bytes", "traffic",
]  # fmt: skip


@dataclass(frozen=True)
class Rows(OptLayout):
    """fsdp's and hsdp's layout: parameters and optimizer state keep their shapes but the first axis, zero-padded to
    a multiple of `shards` rows; device d holds rows [d*r, (d+1)*r) (r = padded rows / shards); hsdp's groups each
    hold the whole state so. Row-major, the padding is the last elements, as zero1's is."""

    splits_parameters: ClassVar[bool] = True

    @classmethod
    def reads(cls, saved: dict) -> bool:
        return bool(int(saved.get("shards", 0))) and bool(saved.get("rows", False))

    def describe(self) -> str:
        return f"fsdp's rows over {self.shards} devices"

    def view(self, params):
        """Padded along their first axis (parameters already padded are unchanged)."""
        return jax.tree.map(lambda x: jnp.pad(x, [(0, self.shape(x)[0] - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
                            if x.ndim else x, params)  # fmt: skip

    def shape(self, x) -> tuple[int, ...]:
        return (x.shape[0] + -x.shape[0] % self.shards, *x.shape[1:]) if x.ndim else tuple(x.shape)

    def whole(self, x, shape: tuple[int, ...]):
        return x[: shape[0]] if x.ndim else x

    def shardings(self, shapes, mesh: jax.sharding.Mesh):
        """Split in rows over `data`, or hsdp's `shard` (each group holding the whole state)."""
        k, axis = shard_count(mesh), shard_axis(mesh)
        return jax.tree.map(
            lambda x: NamedSharding(mesh, P(axis)) if x.ndim >= 1 and x.shape[0] % k == 0 else replicated(mesh),
            shapes,
        )

    def place(self, params, mesh: jax.sharding.Mesh):
        """Padded and split, each device receiving its rows only."""
        shardings = self.shardings(jax.eval_shape(self.view, _shapes(params)), mesh)
        if all(isinstance(x, np.ndarray) for x in jax.tree.leaves(params)):
            # Host values (an import read from files): each device receives its rows straight from the host array,
            # so no device ever holds a tensor whole (jit would first put each one whole on the default device).
            return jax.tree.map(lambda x, s: _rows_from_host(x, self.shape(x), s), params, shardings)
        return jax.jit(self.view, out_shardings=shardings)(params)

    def rest_specs(self, rest, mesh: jax.sharding.Mesh):
        """A frozen base (LoRA's, adapters.py) split in rows as the parameters are, over `data` (hsdp: `shard`), but
        not padded: each leaf of a module whose first axis the devices divide (every one of an 8B Llama's on 8,
        16 or 64 devices), so the base keeps its shapes everywhere outside the step (checkpoints leave it out, an
        export reads it whole). The others, and every other variable, whole on every device."""
        split = base_rows(rest, shard_count(mesh))
        return jax.tree_util.tree_map_with_path(
            lambda path, v: P(shard_axis(mesh)) if _key(path) in split else P(), rest,
            is_leaf=lambda x: isinstance(x, nnx.Variable),
        )  # fmt: skip

    def check(self, optimizer: optax.GradientTransformation, params) -> None:
        """Refuse a scalar parameter, which has no rows to split, and an optimizer whose state is not elementwise."""
        if scalars := [n for n, x in zip(param_names(params), jax.tree.leaves(params), strict=True) if x.ndim == 0]:
            raise ValueError(
                f"strategy='fsdp' splits every parameter along its first axis, but {', '.join(scalars[:3])} "
                f"{'is a scalar' if len(scalars) == 1 else 'are scalars'}: give it shape (1,), or use strategy='zero1'"
            )
        self.check_elementwise(optimizer, params, "fsdp")

    def param_bytes(self, state) -> tuple[int, int, str]:
        own, _, _ = super().param_bytes(state)
        padded = sum(x.nbytes for x in jax.tree.leaves(state.params))
        return own, padded, f"; {padded:,} with each first axis padded to a multiple of {self.shards} rows"


LAYOUT = Rows


def _rows_from_host(x: np.ndarray, padded: tuple, sharding) -> jax.Array:
    """A host array placed as `sharding` lays out its zero-padded shape `padded`: each of this process's devices
    gets the rows it holds (the padding made as zeros, only for the device whose rows it falls in)."""

    def rows(index):
        if not x.ndim:
            return x
        start, stop, _ = index[0].indices(padded[0])
        part = x[(slice(start, min(stop, x.shape[0])), *index[1:])]
        if stop > x.shape[0]:
            part = np.concatenate([part, np.zeros((stop - max(start, x.shape[0]), *part.shape[1:]), x.dtype)])
        return part

    where = sharding.addressable_devices_indices_map(padded)
    return jax.make_array_from_single_device_arrays(
        padded, sharding, [jax.device_put(rows(index), device) for device, index in where.items()]
    )


def _shapes(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _key(path) -> tuple[str, ...]:
    """A variable's path (a pytree path into an nnx.State, or a flat state's tuple) as names."""
    return tuple(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)


def base_rows(rest, n: int) -> dict[tuple[str, ...], tuple[int, ...]]:
    """{path: whole shape} of the frozen leaves split in rows over n devices (Rows.rest_specs): a module's (not the
    model's own attributes, which no unit gathers), whose first axis n divides."""
    return {
        _key(path): tuple(v.shape)
        for path, v in nnx.to_flat_state(adapters.frozen(rest))
        if len(path) > 1 and len(v.shape) and v.shape[0] % n == 0
    }


def _whole_base(rest, shapes: dict, axes: Axes):
    """`rest` with each frozen leaf of `shapes` (relative paths -> whole shapes) that is held in rows here gathered
    whole: one all-gather per dtype (as a unit's parameters), never differentiated (a constant of the step)."""
    flat = list(nnx.to_flat_state(rest))
    ks = [k for k, (path, v) in enumerate(flat)
          if isinstance(v, Frozen) and _key(path) in shapes and tuple(v.shape) != shapes[_key(path)]]  # fmt: skip
    if not ks:
        return rest
    whole = _gather([jax.lax.stop_gradient(flat[k][1].get_value()) for k in ks],
                    [shapes[_key(flat[k][0])] for k in ks], axes)  # fmt: skip
    for k, x in zip(ks, whole, strict=True):
        flat[k] = (flat[k][0], flat[k][1].replace(x))
    return nnx.from_flat_state(flat)


def _unit(path: tuple[str, ...]):
    """The unit a leaf at `path` is gathered with (Units): its block, (container path, index), or its module's name."""
    m = _BLOCK.match(".".join(path) + ".")
    return (m.group(1), int(m.group(2))) if m else path[0]


def _within(shapes: dict, prefix: tuple[str, ...]) -> dict:
    """The entries of `shapes` under `prefix`, keyed by their paths below it."""
    return {k[len(prefix) :]: s for k, s in shapes.items() if k[: len(prefix)] == prefix}


def layout(mesh: jax.sharding.Mesh) -> Rows:
    """Parameters and optimizer state padded along their first axis to a multiple of the devices they are split
    over (all of them; hsdp: a group's), split in rows."""
    return Rows(shard_count(mesh))


def opt_shardings(shapes, mesh: jax.sharding.Mesh):
    return layout(mesh).shardings(shapes, mesh)


def state_bytes(
    params, opt_state, optimizer: optax.GradientTransformation, n: int, grad_accum: int,
    reshard_after_forward: bool = True, accumulate_unsharded: bool = False, **_,
) -> Memory:  # fmt: skip
    """1/n of the (padded) parameters, their gradients and optimizer state, plus the largest unit's parameters
    gathered whole twice (a gather's output, and each leaf cut out of it: a copy, the devices' rows interleave) and
    its gradients whole before their reduce-scatter (in flight); without resharding every block's gathered
    parameters stay until backward, twice over as well (measured: tests/test_plan.py); accumulating unsharded
    (grad_accum > 1), the running sum is every gradient whole. The gradients' shards are made as backward frees the
    activations (late_grads). Its buckets are its units, counted here (ddp's `bucket` is not used)."""
    lay = Rows(n)
    padded = jax.tree.map(lambda x: jax.ShapeDtypeStruct(lay.shape(x), x.dtype), params)
    p = tree_bytes(padded) // n
    opt = tree_bytes(lay.shapes(optimizer, params)) // n
    unit = max(Units.of_names(param_names(params)).unit_bytes(params), default=0)
    gathered = 2 * (unit if reshard_after_forward else tree_bytes(params))
    accumulator = (tree_bytes(params) if accumulate_unsharded else p) if grad_accum > 1 else 0
    return Memory(p + gathered, p, accumulator, opt, opt_note=f"this device's 1/{n}", in_flight=unit, late_grads=True)


def base_bytes(base, n: int, compute, reshard_after_forward: bool = True, **_) -> int:
    """A frozen base's bytes on one device (adapters.py; `base`: its nnx.State of shapes): the leaves held in rows
    (base_rows) 1/n each, in their dtype, and the largest unit's gathered whole in the compute dtype, twice as the
    parameters' (without resharding every unit's); the others whole, with their copy converted to the compute dtype
    where they are held in another (as ddp's). Measured in tests/test_plan.py."""
    compute, split = jnp.dtype(compute), base_rows(base, n)
    held = 0
    units: dict = {}
    for path, v in nnx.to_flat_state(base):
        size, dtype = math.prod(v.shape), jnp.dtype(v.dtype)
        if _key(path) not in split:
            held += size * (dtype.itemsize + (compute.itemsize if dtype != compute else 0))
        else:
            held += size // n * dtype.itemsize
            units[_unit(_key(path))] = units.get(_unit(_key(path)), 0) + size * compute.itemsize
    gathered = 2 * (max(units.values(), default=0) if reshard_after_forward else sum(units.values()))
    return held + gathered


def block_policy(remat: str, reshard_after_forward: bool = True, **_) -> str:
    """The recomputation policy its blocks run under (plan.activation_bytes's names): model.remat's, or under
    model.remat=none with resharding, "saved_dots" (remat.RESHARD: every matrix product's output kept)."""
    return "saved_dots" if remat == "none" and reshard_after_forward else remat


def traffic(
    buckets: Buckets, n: int, grad_accum: int, reshard_after_forward: bool = True, accumulate_unsharded=False, **_
) -> Traffic:  # fmt: skip
    """Three parameter-sized transfers a step where ddp has two: the forward's all-gathers, the backward's
    all-gathers again (reshard_after_forward) and the gradients' reduce-scatters, each per block, each hidden behind
    the compute of the block before it except the first gather and the last scatter. Gathers run every micro-batch;
    so do the scatters, except accumulating unsharded (once a step, after the last micro-batch: all exposed)."""
    once = accumulate_unsharded and grad_accum > 1
    gather = Collectives("all-gather", "parameters (forward)", buckets.params * grad_accum, "forward")
    regather = Collectives("all-gather", "parameters (backward)", buckets.params * grad_accum, "backward")
    scatter = Collectives("reduce-scatter", f"{buckets.reduce_dtype} gradients",
                          buckets.grads * (1 if once else grad_accum), "" if once else "backward")  # fmt: skip
    exposed = "the first block's gather and the last block's reduce-scatter; the rest runs behind compute"
    if once:
        exposed = "the first block's gather and every reduce-scatter (once a step, after the last micro-batch)"
    return Traffic((gather, regather, scatter) if reshard_after_forward else (gather, scatter), exposed)


def report_units(graphdef, state: TrainState, reshard_after_forward: bool = True, **_) -> tuple[list, list]:
    """What `jdp allreduce` matches the compiled step's collectives against: (the reduce-scatters: one per unit,
    the all-gathers: one per unit, and each block once more when resharding), as buckets of padded elements."""
    from jdp.parallel.buckets import Bucket

    mesh = next(x.sharding.mesh for x in jax.tree.leaves(state.params) if x.ndim)
    names, leaves = param_names(state.params), jax.tree.leaves(state.params)
    units = Units.of_names(names, mesh, _abstract(graphdef, state.param_shapes(), state.rest))

    def bucket(ks):
        return Bucket(tuple(ks), tuple(names[k] for k in ks), sum(leaves[k].size for k in ks),
                      sum(leaves[k].nbytes for k in ks))  # fmt: skip

    scatters = [bucket(ks) for ks in units.all()]
    gathers = scatters + ([bucket(ks) for ks in units.blocks.values()] if reshard_after_forward else [])
    return scatters, gathers


def report_base(graphdef, state: TrainState, reshard_after_forward: bool = True, **_) -> list:
    """The frozen base's all-gathers `jdp allreduce` matches (adapters.py; base_rows): one per unit and use, as the
    parameters' (a block's again for its backward when resharding), as buckets of whole elements."""
    from jdp.parallel.buckets import Bucket

    mesh = next(x.sharding.mesh for x in jax.tree.leaves(state.params) if x.ndim)
    units: dict = {}
    for path, shape in base_rows(state.rest, shard_count(mesh)).items():
        names, size = units.setdefault(_unit(path), ([], [0]))
        names.append(".".join(path))
        size[0] += math.prod(shape)
    gathers = []
    for unit, (names, (size,)) in units.items():
        uses = 2 if reshard_after_forward and isinstance(unit, tuple) else 1
        gathers += [Bucket((), tuple(names), size, 0)] * uses
    return gathers


def _leaf_rows(shape: tuple, n: int) -> int:
    return (shape[0] + -shape[0] % n) // n


@dataclass(frozen=True)
class Axes:
    """Where the collectives run: the rows are gathered and the gradients reduce-scattered over `shard` (n devices:
    all of `data` for fsdp, a group for hsdp), the shards then summed over `replica` (hsdp), and `batch` are the
    axes the batch is split over (all of them)."""

    shard: str
    n: int
    replica: str | None
    batch: object
    checked: bool = True  # shard_map checks the values' types (check_vma): the rows' cast sums across `replica`

    @staticmethod
    def of(mesh: jax.sharding.Mesh, checked: bool = True) -> Axes:
        replica = REPLICA if REPLICA in mesh.axis_names else None
        return Axes(shard_axis(mesh), shard_count(mesh), replica, batch_axes(mesh, within_group=True), checked)


def _gather(shards: list, shapes: list, axes: Axes) -> list:
    """This device's rows of each leaf -> every leaf whole (padding cut off): one all-gather per dtype."""
    out = [None] * len(shards)
    n = axes.n
    for dtype in sorted({x.dtype for x in shards}, key=str):
        ks = [k for k, x in enumerate(shards) if x.dtype == dtype]
        every = jax.lax.all_gather(jnp.concatenate([shards[k].ravel() for k in ks]), axes.shard, tiled=False)
        offset = 0
        for k in ks:
            x, width = shards[k], shards[k].size
            out[k] = every[:, offset : offset + width].reshape(n * x.shape[0], *x.shape[1:])[: shapes[k][0]]
            offset += width
    return out


def _per_device(x, axes: Axes):
    """x typed as differing between every device of the batch, whether it already was (in part) or not."""
    if not hasattr(jax.lax, "pcast"):
        return x
    differs = jax.lax.pcast(jnp.bool_(True), axes.batch, to="varying")
    return jax.lax.select(jnp.broadcast_to(differs, x.shape), x, x)


def _scatter(grads: list, axes: Axes, reduce_dtype: str, dtypes: list) -> list:
    """Every leaf's gradient on this device -> the sum over the group's devices of this device's rows: one
    reduce-scatter (fsdp: the group is every device; hsdp: autodiff then sums the shard across the groups)."""
    n = axes.n
    rows = []
    for g in grads:
        g = _per_device(g.astype(reduce_dtype), axes)  # a gradient no row changed is typed as the same everywhere
        r = _leaf_rows(g.shape, n)
        rows.append(jnp.pad(g, [(0, n * r - g.shape[0])] + [(0, 0)] * (g.ndim - 1)).reshape(n, -1))
    mine = jax.lax.psum_scatter(jnp.concatenate(rows, axis=1), axes.shard, scatter_dimension=0, tiled=True)[0]
    out, offset = [], 0
    for g, row, dtype in zip(grads, rows, dtypes, strict=True):
        width = row.shape[1]
        out.append(mine[offset : offset + width].reshape(_leaf_rows(g.shape, n), *g.shape[1:]).astype(dtype))
        offset += width
    return out


def _gatherer(shapes: tuple, dtypes: tuple, axes: Axes, reduce_dtype: str):
    """shards -> whole leaves, whose backward reduce-scatters the gradients (in reduce_dtype)."""

    @jax.custom_vjp
    def gather(shards):
        return tuple(_gather(list(shards), list(shapes), axes))

    def fwd(shards):
        return gather(shards), None

    def bwd(_, grads):
        rows = _scatter(list(grads), axes, reduce_dtype, list(dtypes))
        if axes.replica and not axes.checked:  # no typed cast to sum the shard across the replicas: sum it here
            rows = [jax.lax.psum(r, axes.replica) for r in rows]
        return (tuple(rows),)

    gather.defvjp(fwd, bwd)

    def gathered(shards, sinks=None):
        # The rows enter typed as differing between every device: under hsdp they are the same in every group, and
        # autodiff sums their cotangent across the groups as it leaves this cast, on the reduce-scattered shard
        # (1/K of the gradient), which is hsdp's all-reduce across groups. (Cast after the gather instead, it
        # would sum the whole gradient there, K times the bytes.)
        if sinks is None:
            return gather(tuple(_per_device(x, axes) for x in shards))
        # accumulate_unsharded: the rows are not differentiated; each whole leaf gets a zero "sink" added, whose
        # gradient is the leaf's whole, unreduced gradient on this device (reduce-scattered once per step).
        whole = _gather([jax.lax.stop_gradient(x) for x in shards], list(shapes), axes)
        return tuple(w + s for w, s in zip(whole, sinks, strict=True))

    return gathered


_BLOCK = re.compile(r"^(.+?)\.(\d+)\.")


@dataclass(frozen=True)
class Units:
    """What is gathered together. `blocks` {(container path, index): leaf indices}: each module of the model's
    repeated blocks (an nnx.List of modules), gathered for its forward and, resharding, again for its backward.
    `modules` {attribute: leaf indices}: each other module the model holds (embeddings, final norm, output head),
    gathered when first used in a forward and kept to the end of it (a tied embedding is used twice). `outer`: the
    parameters the model holds itself (GPT's learned positions), gathered before the forward starts. `base`: the
    frozen leaves held in rows (base_rows: {path: whole shape}), gathered with their block or module, which is
    wrapped for them alone where it holds no parameter (LoRA's embeddings and norms); never scattered."""

    axes: Axes
    blocks: dict
    modules: dict
    outer: tuple
    base: dict = None

    @staticmethod
    def of_names(names: list[str], mesh: jax.sharding.Mesh | None = None, model=None, checked: bool = True,
                 base: dict | None = None) -> Units:  # fmt: skip
        blocks: dict = {}
        modules: dict = {}
        outer = []
        for k, name in enumerate(names):
            head = name.split(".")[0]
            if m := _BLOCK.match(name):
                blocks.setdefault((m.group(1), int(m.group(2))), []).append(k)
            elif "." in name and (model is None or isinstance(getattr(model, head, None), nnx.Module)):
                modules.setdefault(head, []).append(k)
            else:
                outer.append(k)
        return Units(Axes.of(mesh, checked) if mesh is not None else None, {key: tuple(v) for key, v in blocks.items()},
                     {key: tuple(v) for key, v in modules.items()}, tuple(outer), base or {})  # fmt: skip

    def base_units(self) -> tuple[list, list]:
        """(block keys, module names) that hold frozen leaves in rows but no parameter: wrapped for the base alone."""
        units = list(dict.fromkeys(_unit(path) for path in self.base))
        return ([u for u in units if isinstance(u, tuple) and u not in self.blocks],
                [u for u in units if isinstance(u, str) and u not in self.modules])  # fmt: skip

    def all(self) -> list[tuple]:
        return [*self.blocks.values(), *self.modules.values(), *([self.outer] if self.outer else [])]

    def unit_bytes(self, params) -> list[int]:
        leaves = jax.tree.leaves(params)
        return [tree_bytes([leaves[k] for k in unit]) for unit in self.all()]

    def scatter(self, whole: list, dtypes: list, reduce_dtype: str) -> list:
        """Whole gradients on this device (flat, in the parameters' order) -> this device's rows of their sum over
        the devices: one reduce-scatter per unit (hsdp: inside the group, then the shard summed across groups)."""
        out = [None] * len(whole)
        for ks in self.all():
            rows = _scatter([whole[k] for k in ks], self.axes, reduce_dtype, [dtypes[k] for k in ks])
            for k, x in zip(ks, rows, strict=True):
                out[k] = jax.lax.psum(x, self.axes.replica) if self.axes.replica else x
        return out

    def model_of(self, graphdef, shapes: tuple, reduce_dtype: str, reshard: bool):
        """(this device's rows, rest) -> (the model, whose units gather their parameters when used, and a function
        that puts the model's own modules back)."""

        def build(params, rest, sinks=None):
            """sinks: zeros shaped as each whole leaf (flat, in the parameters' order), whose gradients are then
            the whole gradients (accumulate_unsharded); None: the gradients are the rows' (reduce-scattered)."""

            def gatherer(leaves, ks):
                if not ks:  # a unit of the frozen base alone
                    return lambda shards: ()
                gather = _gatherer(tuple(shapes[k] for k in ks), tuple(leaves[k].dtype for k in ks), self.axes,
                                   reduce_dtype)  # fmt: skip
                return gather if sinks is None else lambda shards: gather(shards, tuple(sinks[k] for k in ks))

            leaves, tree = jax.tree.flatten(params)
            whole = list(leaves)
            if self.outer:
                for k, x in zip(self.outer, gatherer(leaves, self.outer)(tuple(leaves[k] for k in self.outer)),
                                strict=True):  # fmt: skip
                    whole[k] = x
            model = nnx.merge(graphdef, jax.tree.unflatten(tree, whole), rest, copy=True)
            swapped, chain = [], _Chain()
            base_blocks, base_modules = self.base_units()
            for (path, i), ks in [*self.blocks.items(), *((key, ()) for key in base_blocks)]:
                container = _find(model, path)
                if not isinstance(block := container[i], nnx.Module):
                    raise ValueError(f"strategy='fsdp' gathers {path}.{i} as a block, but it is not a module")
                base = _within(self.base, (*path.split("."), str(i)))
                container[i] = _Gathered(block, gatherer(leaves, ks), reshard, None, chain, base, self.axes)
                swapped.append((container.__setitem__, i, block))
            for name, ks in [*self.modules.items(), *((name, ()) for name in base_modules)]:
                module = getattr(model, name)
                base = _within(self.base, (name,))
                setattr(model, name, _Gathered(module, gatherer(leaves, ks), False, _Once(), None, base, self.axes))
                swapped.append((lambda key, value: setattr(model, key, value), name, module))

            def restore():
                for put, key, original in swapped:
                    put(key, original)

            return model, restore

        return build


def _find(model, path: str):
    obj = model
    for part in path.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


class _Once:
    """A module's gathered parameters, kept for the rest of one forward (None until first used)."""

    value = None


class _Chain:
    """The blocks of one forward in the order they run: each block's gather waits for the block before it to start
    (its input), so one block is gathered ahead and no more (PyTorch FSDP's limit_all_gathers). Unordered, XLA:CPU
    starts every block's gather at the top of the step: the whole model gathered at once."""

    before = None  # the input of the block that ran last

    def tie(self, shards: list, arrays: dict) -> list:
        """shards, ordered after the last block's input; the next block's gather after the first of `arrays` (this
        block's input)."""
        before = self.before
        self.before = next(iter(arrays.values()), before)
        return shards if before is None else _after(shards, before)


def _after(shards: list, before: jax.Array) -> list:
    """shards, available once `before` is (an optimization barrier; its gradient passes through unchanged)."""
    return jax.lax.optimization_barrier((shards, jax.lax.stop_gradient(before)))[0]


class _Gathered(nnx.Module):
    """A module whose parameters are this device's rows: calling it (or any of its methods: a tied embedding's
    `attend`) gathers them whole and runs it. A block lets go of them after its forward (reshard: gathered again
    for backward); a module with `once` gathers them at its first use and keeps them for the rest of the forward."""

    def __init__(self, module: nnx.Module, gather, reshard: bool, once: _Once | None, chain: _Chain | None = None,
                 base: dict | None = None, axes: Axes | None = None):  # fmt: skip
        self.module, self.gather, self.reshard, self.once, self.chain = module, gather, reshard, once, chain
        self.base, self.axes = base or {}, axes  # its frozen leaves held in rows: gathered with its parameters
        self.policy = remat.RESHARD if reshard else None  # what backward keeps (None: all, nothing recomputed)

    def recompute(self, policy):
        """Run under jax.checkpoint with `policy` (model.remat, remat.recomputing); returns the one it replaces."""
        before, self.policy = self.policy, policy
        return before

    def __call__(self, *args, **kwargs):
        return self.run("__call__", args, kwargs)

    def __getattr__(self, name: str):
        if name.startswith("_") or name in ("module", "gather", "reshard", "once", "chain", "policy", "base", "axes"):
            raise AttributeError(name)
        if not callable(getattr(type(self.module), name, None)):
            raise AttributeError(f"strategy='fsdp' gathers {type(self.module).__name__}'s parameters when it is "
                                 f"called; its attribute {name!r} is read directly (make it a method)")  # fmt: skip
        return lambda *args, **kwargs: self.run(name, args, kwargs)

    def run(self, method: str, args, kwargs):
        graphdef, shards, rest = nnx.split(self.module, nnx.Param, ...)
        arrays = {i: a for i, a in enumerate(args) if isinstance(a, jax.Array)}
        leaves, tree = jax.tree.flatten(shards)

        def whole(leaves):
            if self.once is None:
                return self.gather(tuple(leaves))
            if self.once.value is None:
                self.once.value = self.gather(tuple(leaves))
            return self.once.value

        def run(leaves, rest, arrays):
            module = nnx.merge(graphdef, jax.tree.unflatten(tree, list(whole(leaves))),
                               _whole_base(rest, self.base, self.axes))  # fmt: skip
            out = getattr(module, method)(*[arrays.get(i, a) for i, a in enumerate(args)], **kwargs)
            new = nnx.split(module, nnx.Param, ...)[2]
            return out, adapters.split_frozen(new)[1] if self.base else new  # the base's rows stay as they were

        if self.chain is not None:
            if self.base:  # its base's rows too: untied, XLA:CPU gathers every block's base at the top of the step
                leaves, base = self.chain.tie((leaves, adapters.frozen(rest)), arrays)
                rest = adapters.with_frozen(rest, base)
            else:
                leaves = self.chain.tie(leaves, arrays)
        if self.policy is not None:  # resharding, or model.remat: gathered again in backward, and recomputed
            run = jax.checkpoint(run, policy=self.policy)
        out, rest = run(leaves, rest, arrays)
        nnx.update(self.module, rest)
        return out


def _abstract(graphdef, param_shapes, rest):
    """The model with shapes for values: which of its attributes are modules (nothing is computed)."""
    return nnx.eval_shape(lambda: nnx.merge(graphdef, param_shapes, rest))


def _specs(params, mesh: jax.sharding.Mesh):
    return jax.tree.map(lambda x: P(shard_axis(mesh)) if x.ndim else P(), params)


def _check_state(state: TrainState, mesh: jax.sharding.Mesh, name: str) -> None:
    n = shard_count(mesh)
    if state.shapes is None or any(
        x.ndim and x.shape[0] != Rows(n).shape(jax.ShapeDtypeStruct(s, x.dtype))[0]
        for x, s in zip(jax.tree.leaves(state.params), state.shapes, strict=True)
    ):
        raise ValueError(
            f"the parameters are not laid out for {name} on {n} devices: build the state with "
            f"init_state(model, optimizer, mesh, strategy='{name}')"
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
):
    """The fsdp step: each device's rows of every parameter gathered block by block in forward (and again in
    backward with reshard_after_forward), the gradients reduce-scattered block by block as backward finishes them
    (with train.grad_accum > 1: after each micro-batch, into a 1/N running sum; accumulate_unsharded: summed whole
    over the micro-batches and reduce-scattered once, unit by unit, after the last), and the optimizer update
    applied to each device's rows. bucket_mb is unused: a block is the unit of every collective."""
    if len(mesh.axis_names) != 1:
        raise ValueError(
            f"strategy='fsdp' splits the state over every device of a 1-D mesh; this mesh has axes "
            f"{mesh.axis_names}: use strategy='hsdp' on it, or jdp.make_mesh() for fsdp"
        )
    return split_step(graphdef, loss_fn, optimizer, mesh, grad_accum, schedule, reduce_dtype, comm_hook,
                      reshard_after_forward, "fsdp", accumulate_unsharded)  # fmt: skip


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
):
    """make_train_step's (state, batch) -> (state, metrics), not jitted, its collectives and placements over the
    mesh's `data` axis only: DiLoCo runs it in every group at once (jax.vmap over the `group` axis)."""
    return split_step(graphdef, loss_fn, optimizer, mesh, grad_accum, schedule, reduce_dtype, comm_hook,
                      reshard_after_forward, "fsdp", accumulate_unsharded, jitted=False, check_vma=check_vma)  # fmt: skip


def split_step(
    graphdef, loss_fn, optimizer, mesh, grad_accum, schedule, reduce_dtype, comm_hook, reshard, name, unsharded=False,
    jitted=True, check_vma=True,
):  # fmt: skip
    """fsdp's step on a 1-D mesh, hsdp's on a (`replica`, `shard`) one: the same code, other axes (Axes); on
    DiLoCo's (`group`, `data`) mesh, one group's (not jitted: DiLoCo maps it over the groups)."""
    if comm_hook is not None:
        raise ValueError(f"a communication hook reduces ddp's buckets; strategy='{name}' has none to hook")
    n = mesh.devices.size // (mesh.shape[GROUP] if GROUP in mesh.axis_names else 1)
    lay = layout(mesh)
    axes = Axes.of(mesh, check_vma)

    def step(state: TrainState, batch: Batch):
        check_batch(batch, n, grad_accum)
        _check_state(state, mesh, name)
        expected = lay.shapes(optimizer, state.param_shapes())
        if [x.shape for x in jax.tree.leaves(state.opt_state)] != [x.shape for x in jax.tree.leaves(expected)]:
            raise ValueError(
                f"the optimizer state is not laid out for {name} on this mesh: build it with "
                f"init_state(model, optimizer, mesh, strategy='{name}') (or move it with relayout)"
            )
        abstract = _abstract(graphdef, state.param_shapes(), state.rest)
        units = Units.of_names(param_names(state.params), mesh, abstract, check_vma, base_rows(state.rest, lay.shards))
        build = units.model_of(graphdef, state.shapes, reduce_dtype, reshard)

        def forward(loss_fn, params, rest, micro, sinks=None):
            # Tied to this micro-batch, so that with train.grad_accum > 1 XLA cannot hoist the gathers out of the
            # accumulation loop (the rows do not change between micro-batches): hoisted, every block would be
            # gathered at once for the whole loop.
            if grad_accum > 1:
                params, _ = jax.lax.optimization_barrier((params, micro))
            model, restore = build(params, rest, sinks)
            loss, weight, extra = loss_fn(model, micro)
            restore()
            return loss, (weight, nnx.split(model, nnx.Param, ...)[2], extra)

        sums = local_sums(graphdef, loss_fn, grad_accum, forward=forward, axes=axes.batch)

        def unsharded_sums(params, rest, batch, step):
            """The micro-batches' gradients summed whole on this device (differentiating zeros added to each
            gathered leaf), then reduce-scattered once, unit by unit."""
            leaves, tree = jax.tree.flatten(params)
            sinks = [_per_device(jnp.zeros(s, x.dtype), axes) for x, s in zip(leaves, state.shapes, strict=True)]

            def sunk(loss_fn, sinks, rest, micro):
                return forward(loss_fn, params, rest, micro, sinks)

            whole, loss_sum, weight_sum, new_rest, extra = local_sums(
                graphdef, loss_fn, grad_accum, forward=sunk, axes=axes.batch
            )(sinks, rest, batch, step)
            rows = units.scatter(whole, [x.dtype for x in leaves], reduce_dtype)
            return jax.tree.unflatten(tree, rows), loss_sum, weight_sum, new_rest, extra

        def grads_of(params, rest, step, batch):
            summed = unsharded_sums if unsharded and grad_accum > 1 else sums
            grads_sum, loss_sum, weight_sum, new_rest, extra = summed(params, rest, batch, step)
            loss, weight, extra = reduced_sums(loss_sum, weight_sum, extra, axes.batch)
            # Each device holds the sum over devices of its rows' gradients (the gathers' backward); dividing by
            # the global token weight gives the gradient of the global token-weighted mean loss, as under ddp.
            scale = jnp.where(weight > 0, 1.0 / weight, 0.0)
            return jax.tree.map(lambda g: g * scale, grads_sum), loss, weight, new_rest, extra

        specs, rest_specs = _specs(state.params, mesh), lay.rest_specs(state.rest, mesh)
        sharded = jax.shard_map(
            grads_of, mesh=mesh, in_specs=(specs, rest_specs, P(), P(axes.batch)),
            out_specs=(specs, P(), P(), rest_specs, P()), check_vma=check_vma,
        )  # fmt: skip
        grads, loss, weight, rest, extra = sharded(state.params, state.rest, state.step, batch)
        params, opt_state, metrics = apply_update(
            optimizer, schedule, state.step, state.params, state.opt_state, grads, loss, weight, lay,
            state.param_shapes(), mesh, extra,
        )
        params = jax.lax.with_sharding_constraint(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
        opt_state = jax.lax.with_sharding_constraint(opt_state, lay.shardings(expected, mesh))
        rest = keep_if(metrics["skipped"] == 0, rest, state.rest)
        return TrainState(state.step + 1, params, opt_state, rest, None, state.shapes), metrics

    return RefusingDonated(jax.jit(step, donate_argnums=0)) if jitted else step


def make_eval_step(graphdef, loss_fn: LossFn, mesh: jax.sharding.Mesh, per_row: bool = False):
    """step.make_eval_step with the model built from each device's rows, gathered block by block."""
    from jdp.parallel.step import make_eval_step as generic

    def model_of(shapes, params, rest):
        own = [jax.ShapeDtypeStruct(s, x.dtype) for s, x in zip(shapes, jax.tree.leaves(params), strict=True)]
        abstract = _abstract(graphdef, jax.tree.unflatten(jax.tree.structure(params), own), rest)
        units = Units.of_names(param_names(params), mesh, abstract, base=base_rows(rest, shard_count(mesh)))
        build = units.model_of(graphdef, shapes, "float32", False)
        return lambda p, r: build(p, r)[0]

    return generic(graphdef, loss_fn, mesh, model_of=model_of, layout=layout(mesh), per_row=per_row)
