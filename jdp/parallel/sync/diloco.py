"""DiLoCo (Douillard et al. 2023): groups of devices that train apart and agree every H steps.

The devices are split into G groups (`parallel.groups`; by default one per host), contiguous blocks of the
`data` order, so a group reads exactly the rows its devices read without groups: a "step" is still one global
batch, each group training on its own exclusive part of it. Inside a group the step is ddp's (bucketed all-reduces
over the group's fast links); between groups nothing travels per step. Every `parallel.outer_every` = H steps each
group's pseudo-gradient, the round's parameters minus its own, is averaged over the groups (quantised as
`parallel.outer_dtype` says) and an outer SGD with Nesterov momentum (`parallel.outer_lr`,
`parallel.outer_momentum`; PyTorch's and the paper's) moves the round's parameters by it. Every group restarts from
those, bit-identical; each keeps its own inner optimizer state (AdamW's moments are never reset, as in the paper).

The state is a TrainState whose `params`, `opt_state` and `rest` are the round's (the model every group agreed on:
what evaluation, checkpoints' model and params_sha256 see) and the outer optimizer's state, and whose `inner` holds
each group's parameters, optimizer state and variables with a leading axis of the groups, split over the mesh's
`group` axis. Two programs: the inner step (every step, collectives over `data` only) and the outer step (every H
steps, the only one that crosses groups). The outer all-gather moves each device's 1/n slice of the pseudo-gradient
(n: the devices of a group), so a group sends one model's payload across the slow link per sync, not n.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jdp.parallel.guards import RefusingDonated, check_batch
from jdp.parallel.mesh import AXIS
from jdp.parallel.step import TrainState, global_grads, update

__all__ = ["GROUP", "assemble", "host_groups", "make_mesh", "make_train_step", "mesh", "outer_optimizer"]

GROUP = "group"
BLOCK = 256  # elements that share one scale in the 8- and 4-bit encodings (per-block absmax)


def make_mesh(groups: int, devices: list | None = None) -> jax.sharding.Mesh:
    """A 2-D mesh (`group`, `data`) of the devices in their usual order: `groups` contiguous blocks (a host's)."""
    devices = jax.devices() if devices is None else list(devices)
    if groups < 1 or len(devices) % groups:
        raise ValueError(f"parallel.groups={groups} must split the {len(devices)} devices into equal groups")
    return jax.sharding.Mesh(np.asarray(devices).reshape(groups, len(devices) // groups), (GROUP, AXIS))


def host_groups() -> int:
    """How many hosts the job's processes run on (as each published its host: jdp.job.coordination.publish_host);
    1 for one process. Each host's processes must be contiguous (processes are numbered host by host)."""
    from jdp.job.coordination import process_hosts

    names = process_hosts()
    if not names:
        return 1
    order = list(dict.fromkeys(names))
    if [order.index(n) for n in names] != sorted(order.index(n) for n in names):
        raise ValueError(
            f"parallel.groups=0 makes one group per host, but the hosts' processes are not contiguous ({names}): "
            f"number the processes host by host, or set parallel.groups"
        )
    return len(order)


def mesh(par) -> jax.sharding.Mesh:
    """The mesh of `par.groups` groups (0: one per host). Groups that do not split the devices give one group:
    the config check (sync.Sync.problems) names them before anything runs."""
    groups = par.groups or host_groups()
    return make_mesh(groups if jax.device_count() % groups == 0 else 1)


def outer_optimizer(lr: float, momentum: float) -> optax.GradientTransformation:
    """SGD with Nesterov momentum, as torch.optim.SGD(nesterov=True) and the paper: buf = m buf + g; p -= lr (g +
    m buf). momentum 0: plain SGD (lr 1: the groups' average)."""
    return optax.sgd(lr, momentum=momentum or None, nesterov=bool(momentum))


def init(state: TrainState, mesh: jax.sharding.Mesh, outer: optax.GradientTransformation) -> TrainState:
    """A strategy's fresh state (replicated over the mesh) as DiLoCo's: every group's copy of it, the round's
    parameters and the outer optimizer's state."""
    g = mesh.shape[GROUP]
    per_group = NamedSharding(mesh, P(GROUP))
    everywhere = NamedSharding(mesh, P())
    inner = {"params": state.params, "opt_state": state.opt_state, "rest": state.rest}
    inner = jax.jit(lambda t: jax.tree.map(lambda x: jnp.broadcast_to(x, (g, *x.shape)), t),
                    out_shardings=per_group)(inner)  # fmt: skip
    opt_state = jax.jit(outer.init, out_shardings=everywhere)(state.params)
    return dataclasses.replace(state, opt_state=opt_state, inner=inner)


# -- the pseudo-gradients' encodings -------------------------------------------------------------------------------


def _encode(x, dtype: str):
    """A flat float32 slice (a multiple of BLOCK long) as it travels: (payload arrays...)."""
    if dtype == "float32":
        return (x,)
    if dtype == "bfloat16":
        return (x.astype(jnp.bfloat16),)
    levels = 127 if dtype == "int8" else 7
    blocks = x.reshape(-1, BLOCK)
    scale = jnp.max(jnp.abs(blocks), axis=1) / levels
    q = jnp.round(blocks / jnp.where(scale > 0, scale, 1.0)[:, None])
    q = jnp.clip(q, -levels, levels).astype(jnp.int8)
    if dtype == "int4":  # two 4-bit values (offset by 8: 1..15) in each byte
        u = (q + 8).astype(jnp.uint8)
        q = u[:, 0::2] | (u[:, 1::2] << 4)
    return (q, scale)


def _decode(payload, dtype: str):
    if dtype in ("float32", "bfloat16"):
        return payload[0].astype(jnp.float32)
    q, scale = payload
    if dtype == "int4":
        lo, hi = (q & 0xF).astype(jnp.int8) - 8, (q >> 4).astype(jnp.int8) - 8
        q = jnp.stack([lo, hi], axis=-1).reshape(q.shape[0], BLOCK)
    return (q.astype(jnp.float32) * scale[:, None]).reshape(-1)


def payload_bytes(n_elements: int, dtype: str) -> int:
    """The bytes one pseudo-gradient of `n_elements` numbers travels as."""
    blocks = math.ceil(n_elements / BLOCK)
    per = {"float32": 4 * BLOCK, "bfloat16": 2 * BLOCK, "int8": BLOCK + 4, "int4": BLOCK // 2 + 4}[dtype]
    return blocks * per


# -- the two programs ---------------------------------------------------------------------------------------------


def make_inner_step(graphdef, loss_fn, optimizer, mesh, grad_accum: int, schedule, bucket_mb: float,
                    reduce_dtype: str):  # fmt: skip
    """(inner, step, global batch) -> (inner, step + 1, per-group metrics): ddp's step in every group at once, its
    collectives over `data` (inside a group) only. Metrics have a leading axis of the groups."""
    grads_of = global_grads(graphdef, loss_fn, mesh.shape[AXIS], grad_accum, bucket_mb, reduce_dtype)

    def one_group(inner, step, batch):
        mine = jax.tree.map(lambda x: x[0], inner)
        state = TrainState(step, mine["params"], mine["opt_state"], mine["rest"])
        grads, loss, weight, rest = grads_of(state.params, state.rest, batch, step)
        new, metrics = update(optimizer, schedule, state, grads, loss, weight, rest)
        out = {"params": new.params, "opt_state": new.opt_state, "rest": new.rest}
        return jax.tree.map(lambda x: x[None], out), jax.tree.map(lambda x: x[None], metrics)

    sharded = jax.shard_map(one_group, mesh=mesh, in_specs=(P(GROUP), P(), P((GROUP, AXIS))),
                            out_specs=(P(GROUP), P(GROUP)))  # fmt: skip

    def step(inner, step, batch):
        new, metrics = sharded(inner, step, batch)
        return new, step + 1, metrics

    return jax.jit(step, donate_argnums=(0, 1))


def make_outer_step(mesh, outer: optax.GradientTransformation, dtype: str):
    """(groups' params, groups' rest, round params, outer state) -> (the groups' new params, their rest, the new
    round params, outer state, rest, metrics). Each device encodes its 1/n slice of its group's pseudo-gradient,
    all-gathers it over `group` (the one collective across groups), decodes and averages the G slices in a fixed
    order (so every device computes the same bits), and the slices are all-gathered over `data` (inside a group)."""
    g, n = mesh.shape[GROUP], mesh.shape[AXIS]

    def one(inner_params, inner_rest, theta, outer_state):
        x = jax.tree.map(lambda v: v[0], inner_params)
        leaves, tree = jax.tree.flatten(theta)
        delta = jnp.concatenate(
            [
                (t.astype(jnp.float32) - v.astype(jnp.float32)).ravel()
                for t, v in zip(leaves, jax.tree.leaves(x), strict=True)
            ]
        )
        size = delta.size
        chunk = -(-size // (n * BLOCK)) * BLOCK
        delta = jnp.pad(delta, (0, chunk * n - size))
        mine = jax.lax.dynamic_slice(delta, (jax.lax.axis_index(AXIS) * chunk,), (chunk,))
        sent = _encode(mine, dtype)
        gathered = jax.lax.all_gather(sent, GROUP)  # every group's slice: the only bytes across groups
        each = [_decode([p[i] for p in gathered], dtype) for i in range(g)]
        mean = each[0]
        for e in each[1:]:
            mean = mean + e
        mean = mean / g
        own = _decode(sent, dtype)
        spread = sum(jnp.sum(jnp.square(e - mean)) for e in each)
        err, norm2 = jnp.sum(jnp.square(own - mine)), jnp.sum(jnp.square(mine))
        spread, err, norm2 = jax.lax.psum(jnp.stack([spread, err, norm2]), AXIS)
        err, norm2 = jax.lax.psum(jnp.stack([err, norm2]), GROUP)
        full = jax.lax.all_gather(mean, AXIS, tiled=True)[:size]
        offsets = np.cumsum([0] + [leaf.size for leaf in leaves])
        avg = jax.tree.unflatten(tree, [full[a:b].reshape(leaf.shape) for a, b, leaf in
                                        zip(offsets[:-1], offsets[1:], leaves, strict=True)])  # fmt: skip
        theta32 = jax.tree.map(lambda t: t.astype(jnp.float32), theta)
        updates, outer_state = outer.update(avg, outer_state, theta32)
        new = jax.tree.map(lambda t, u, o: (t + u).astype(o.dtype), theta32, updates, theta)
        rest = jax.tree.map(lambda r: jax.lax.pmean(r[0], GROUP) if jnp.issubdtype(r.dtype, jnp.inexact) else r[0],
                            inner_rest)  # fmt: skip
        metrics = {
            "outer_grad_norm": optax.tree.norm(avg),
            "outer_divergence": jnp.sqrt(spread / g),  # RMS over the groups of |pseudo-gradient - their mean|
            "outer_quant_error": jnp.sqrt(err / jnp.maximum(norm2, 1e-30)),  # |decoded - sent| / |sent|
        }
        stack = lambda t: jax.tree.map(lambda v: v[None], t)  # noqa: E731
        return stack(new), stack(rest), new, outer_state, rest, metrics

    # check_vma=False: the results are the same on every device (each computes them from the same gathered bytes in
    # the same order), which shard_map cannot see through the all-gathers.
    sharded = jax.shard_map(one, mesh=mesh, in_specs=(P(GROUP), P(GROUP), P(), P()),
                            out_specs=(P(GROUP), P(GROUP), P(), P(), P(), P()), check_vma=False)  # fmt: skip
    return jax.jit(sharded, donate_argnums=(0, 1, 2, 3))


class Step:
    """DiLoCo's train step: the inner step, and after every H-th step the outer step. Its metrics are this
    process's groups' (the loss their tokens' mean), so no number crosses groups between syncs; a sync's step
    adds the outer metrics and `outer_bytes_per_step` (what each group receives across the slow link per step)."""

    def __init__(self, inner, outer, every: int, mesh, n_params: int, dtype: str, grad_accum: int):
        self.inner, self.outer, self.every, self.mesh, self.grad_accum = inner, outer, every, mesh, grad_accum
        g = mesh.shape[GROUP]
        self.bytes_per_step = payload_bytes(n_params, dtype) * (g - 1) / every
        self.at: int | None = None  # the host's count of the state's step (read once, then followed)
        self.last = None  # the step array this object returned last

    def __call__(self, state: TrainState, batch) -> tuple[TrainState, dict]:
        if state.inner is None:
            raise ValueError("this state has no groups' state: build it with parallel.assemble(..., par.sync=diloco)")
        check_batch(batch, self.mesh.devices.size, self.grad_accum, "train step")
        if state.step is not self.last:
            self.at = int(jax.device_get(state.step))
        inner, step, per_group = self.inner(state.inner, state.step, batch)
        self.at, self.last = self.at + 1, step
        state = dataclasses.replace(state, step=step, inner=inner)
        metrics = _local(per_group)
        if self.at % self.every == 0:
            params, rest_g, theta, opt_state, rest, outer = self.outer(inner["params"], inner["rest"], state.params,
                                                                       state.opt_state)  # fmt: skip
            inner = {**inner, "params": params, "rest": rest_g}
            state = dataclasses.replace(state, params=theta, opt_state=opt_state, rest=rest, inner=inner)
            metrics.update(outer, outer_bytes_per_step=jnp.float32(self.bytes_per_step))
        return state, metrics


def _local(per_group: dict) -> dict:
    """The metrics of this process's groups (arrays of one entry per group, split over `group`) as scalars on one
    of its devices: the loss is their tokens' mean, tokens and skips their sums, other numbers their mean. Nothing
    is fetched: the loop reads them after dispatching the next step."""
    shards = {k: {s.index[0].start: s.data for s in v.addressable_shards} for k, v in per_group.items()}
    groups = sorted(shards["loss"])
    device = next(iter(shards["loss"][groups[0]].devices()))
    get = lambda k: [jax.device_put(shards[k][i], device)[0] for i in groups]  # noqa: E731
    out = {}
    tokens = get("tokens")
    for k in shards:
        values = get(k)
        if k == "loss":
            out[k] = sum(v * w for v, w in zip(values, tokens, strict=True)) / jnp.maximum(sum(tokens), 1e-30)
        elif k in ("tokens", "skipped"):
            out[k] = sum(values)
        else:
            out[k] = sum(values) / len(values)
    return out


def make_train_step(graphdef, loss_fn, optimizer, mesh, grad_accum: int, schedule, par, n_params: int) -> Any:
    inner = make_inner_step(graphdef, loss_fn, optimizer, mesh, grad_accum, schedule, par.bucket_mb,
                            par.reduce_dtype)  # fmt: skip
    outer = make_outer_step(mesh, outer_optimizer(par.outer_lr, par.outer_momentum), par.outer_dtype)
    return RefusingDonated(Step(inner, outer, par.outer_every, mesh, n_params, par.outer_dtype, grad_accum))


def assemble(graphdef, state: TrainState, loss_fn, optimizer, mesh, par, grad_accum: int, schedule):
    """(state, train step) of DiLoCo from a ddp state made on the (`group`, `data`) mesh (parallelize.assemble)."""
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(state.params))
    state = init(state, mesh, outer_optimizer(par.outer_lr, par.outer_momentum))
    return state, make_train_step(graphdef, loss_fn, optimizer, mesh, grad_accum, schedule, par, n_params)


# -- checkpoints of every-step sync, continued under DiLoCo, and the reverse ---------------------------------------


def groups_of(state: TrainState) -> int | None:
    """How many groups' states `state` holds (None: not DiLoCo's)."""
    return None if state.inner is None else int(jax.tree.leaves(state.inner)[0].shape[0])


def restore_like(state: TrainState, optimizer, mesh, saved_groups: int | None, saved_parallel: dict):
    """What to read a checkpoint of the other kind into, for today's `state`: an every-step checkpoint's optimizer
    state is the strategy's (whole copies); a DiLoCo one holds the outer optimizer's state and `saved_groups` groups'
    states (read whole onto every device, then averaged: `converted`)."""
    everywhere = NamedSharding(mesh, P())
    shaped = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=everywhere), tree)  # noqa: E731
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    params = state.param_shapes()
    if saved_groups is None:  # an every-step checkpoint, for DiLoCo
        return dataclasses.replace(like, opt_state=shaped(jax.eval_shape(optimizer.init, params)), inner=None)
    outer = outer_optimizer(saved_parallel.get("outer_lr", 0.7), saved_parallel.get("outer_momentum", 0.9))
    g = saved_groups
    stacked = lambda tree: jax.tree.map(  # noqa: E731
        lambda x: jax.ShapeDtypeStruct((g, *x.shape), x.dtype, sharding=everywhere), tree
    )
    inner = {"params": stacked(params), "opt_state": stacked(jax.eval_shape(optimizer.init, params)),
             "rest": stacked(shaped(state.rest))}  # fmt: skip
    return dataclasses.replace(like, params=shaped(params), opt_state=shaped(jax.eval_shape(outer.init, params)),
                               inner=inner)  # fmt: skip


def converted(state: TrainState, mesh, diloco_today: bool, par) -> tuple[TrainState, str]:
    """A restored checkpoint of the other kind as today's state, and what was done, in words. To DiLoCo: every group
    starts from the checkpoint's parameters and optimizer state, the outer momentum from zero. From DiLoCo: the
    round's parameters (the last sync's), the optimizer state the groups' average (AdamW's moments; counts are the
    same in every group), the outer momentum dropped."""
    if diloco_today:
        outer = outer_optimizer(par.outer_lr, par.outer_momentum)
        fresh = init(dataclasses.replace(state, inner=None), mesh, outer)
        return fresh, "every group starts from the checkpoint's parameters and optimizer state; outer momentum zero"
    everywhere = NamedSharding(mesh, P())
    mean = lambda x: jnp.mean(x, axis=0).astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.inexact) else x[0]  # noqa: E731
    opt_state = jax.jit(lambda t: jax.tree.map(mean, t), out_shardings=everywhere)(state.inner["opt_state"])
    g = groups_of(state)
    return dataclasses.replace(state, opt_state=opt_state, inner=None), (
        f"the round's parameters, the optimizer state averaged over the checkpoint's {g} groups (DiLoCo's outer "
        f"momentum is dropped)"
    )
