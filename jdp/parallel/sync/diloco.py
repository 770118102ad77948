"""DiLoCo (Douillard et al. 2023): groups of devices that train apart and agree every H steps.

The devices are split into G groups (`parallel.groups`; by default one per host), contiguous blocks of the
`data` order, so a group reads exactly the rows its devices read without groups: a "step" is still one global
batch, each group training on its own exclusive part of it. Inside a group the step is the strategy's (ddp's
bucketed all-reduces, or zero1's reduce-scatters and all-gathers, over the group's fast links); between groups
nothing travels per step. Every `parallel.outer_every` = H steps each
group's pseudo-gradient, the round's parameters minus its own, is averaged over the groups (quantised as
`parallel.outer_dtype` says) and an outer SGD with Nesterov momentum (`parallel.outer_lr`,
`parallel.outer_momentum`; PyTorch's and the paper's) moves the round's parameters by it. Every group restarts from
those, bit-identical; each keeps its own inner optimizer state (AdamW's moments are never reset, as in the paper).

The state is a TrainState whose `params`, `opt_state` and `rest` are the round's (the model every group agreed on:
what evaluation, checkpoints' model and params_sha256 see) and the outer optimizer's state, and whose `inner` holds
each group's parameters, optimizer state and variables with a leading axis of the groups, split over the mesh's
`group` axis. Programs: the inner step (every step, collectives over `data` only) and each fragment's outer step
(every H steps at the fragment's offset, the only one that crosses groups; one fragment, at the round's end, for
plain DiLoCo), and for Streaming DiLoCo (Douillard et al. 2025; `parallel.sync=streaming`) each fragment's mix, the
outer step landing `parallel.outer_delay` steps after its sync. The outer all-gather moves each device's 1/n slice
of the pseudo-gradient (n: the devices of a group), so a group sends one model's payload across the slow link per
round, not n.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jdp import adapters
from jdp.errors import ConfigError
from jdp.parallel import strategies
from jdp.parallel.costs import BLOCK, payload_bytes
from jdp.parallel.guards import RefusingDonated, checking_rows
from jdp.parallel.mesh import AXIS, GROUP, REPLICA, SHARD, per_group, shard_axis
from jdp.parallel.step import TrainState, leaf_digest, param_names

__all__ = ["GROUP", "assemble", "host_groups", "make_mesh", "make_train_step", "mesh", "outer_optimizer"]

def make_mesh(groups: int, devices: list | None = None, shard_size: int = 0) -> jax.sharding.Mesh:
    """A 2-D mesh (`group`, `data`) of the devices in their usual order: `groups` contiguous blocks (a host's);
    with shard_size=K (hsdp inside each group) a 3-D one (`group`, `replica`, `shard`): each group's devices in
    blocks of K, as jdp.make_mesh(shard_size=K) lays out all of them."""
    devices = jax.devices() if devices is None else list(devices)
    if groups < 1 or len(devices) % groups:
        raise ValueError(f"parallel.groups={groups} must split the {len(devices)} devices into equal groups")
    per_group = len(devices) // groups
    if shard_size and per_group % shard_size == 0:
        blocks = np.asarray(devices).reshape(groups, per_group // shard_size, shard_size)
        return jax.sharding.Mesh(blocks, (GROUP, REPLICA, SHARD))
    return jax.sharding.Mesh(np.asarray(devices).reshape(groups, per_group), (GROUP, AXIS))


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
    shard_size = par.shard_size if strategies.get(par.strategy).groups else 0  # hsdp's groups inside each
    return make_mesh(groups if jax.device_count() % groups == 0 else 1, shard_size=shard_size)


@dataclass(frozen=True)
class Outer:
    """The outer optimizer: SGD with Nesterov momentum, as torch.optim.SGD(nesterov=True) and the paper: buf = m buf
    + g; p -= lr (g + m buf); momentum 0: p -= lr g (lr 1: the groups' average). Its state is the momentum buffers,
    float32, shaped as the parameters, so that a fragment updates its own leaves only (streaming)."""

    lr: float
    momentum: float

    def init(self, params):
        return jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)

    def step(self, theta, grad, buf):
        """One leaf, float32: (new parameter, new buffer)."""
        buf = self.momentum * buf + grad
        return theta - self.lr * (grad + self.momentum * buf), buf


def outer_optimizer(lr: float, momentum: float) -> Outer:
    return Outer(float(lr), float(momentum))


def init(state: TrainState, mesh: jax.sharding.Mesh, outer: Outer) -> TrainState:
    """A strategy's fresh state (replicated over the mesh) as DiLoCo's: every group's copy of it, the round's
    parameters and the outer optimizer's state."""
    g = mesh.shape[GROUP]
    inner = {"params": state.params, "opt_state": state.opt_state, "rest": state.rest}
    inner = jax.jit(lambda t: jax.tree.map(lambda x: jnp.broadcast_to(x, (g, *x.shape)), t),
                    out_shardings=jax.tree.map(lambda x: per_group(x.sharding), inner))(inner)  # fmt: skip
    opt_state = jax.jit(outer.init, out_shardings=jax.tree.map(lambda x: x.sharding, state.params))(state.params)
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


# -- the two programs ---------------------------------------------------------------------------------------------


def make_inner_step(graphdef, loss_fn, optimizer, mesh, grad_accum: int, schedule, par, shapes=None):
    """(inner, step, global batch) -> (inner, step + 1, per-group metrics): the strategy's step (its module's
    make_step: ddp's or zero1's, collectives over `data`, inside a group, only) in every group at once, by jax.vmap
    over the groups with the `group` axis as the mapped one (each group's state and rows on its own devices). Metrics
    have a leading axis of the groups. `shapes`: the parameters' own shapes where they are padded (TrainState.shapes:
    fsdp's rows)."""
    s = strategies.get(par.strategy)
    group_step = s.steps().make_step(graphdef, loss_fn, optimizer, mesh, grad_accum, schedule,
                                     bucket_mb=par.bucket_mb, reduce_dtype=par.reduce_dtype, check_vma=False,
                                     **s.options_of(par))  # fmt: skip
    g = mesh.shape[GROUP]

    def one_group(inner, step, batch):
        state = TrainState(step, inner["params"], inner["opt_state"], inner["rest"], None, shapes)
        new, metrics = group_step(state, batch)
        return {"params": new.params, "opt_state": new.opt_state, "rest": new.rest}, metrics

    every = jax.vmap(one_group, in_axes=(0, None, 0), spmd_axis_name=GROUP)
    per_group = NamedSharding(mesh, P(GROUP))

    def step(inner, step, batch):
        rows = jax.tree.map(lambda x: x.reshape(g, x.shape[0] // g, *x.shape[1:]), batch)  # group g's own block
        new, metrics = every(inner, step, rows)
        return new, step + 1, jax.lax.with_sharding_constraint(metrics, per_group)

    return jax.jit(checking_rows(step, mesh.devices.size, grad_accum), donate_argnums=(0, 1))


def fragments(names: list[str], n: int, every: int) -> list[tuple[tuple[int, ...], int]]:
    """Streaming DiLoCo's fragments: (leaf indices, offset) each. Block b's leaves (the first number in a leaf's
    name: blocks.3.attn..., layers.3...) are fragment b mod n, strided as the paper's; the leaves of no block
    (embeddings, the final norm, an untied head) fragment 0. Fragment f syncs at the steps s with s mod H = its offset,
    (f + 1) H / n mod H: evenly spread over the round, the last at its end (n = 1: every H steps, plain DiLoCo)."""
    blocks = [re.search(r"(?:^|\.)(\d+)(?:\.|$)", name) for name in names]
    owner = [int(b.group(1)) % n if b else 0 for b in blocks]
    out = [(tuple(k for k, f in enumerate(owner) if f == i), (i + 1) * (every // n) % every) for i in range(n)]
    if empty := [i for i, (leaves, _) in enumerate(out) if not leaves]:
        raise ConfigError(
            f"parallel.fragments={n}: fragments {empty} hold no parameters (the model's blocks are numbered "
            f"{sorted({int(b.group(1)) for b in blocks if b})}); use at most as many fragments as blocks"
        )
    return out


def make_outer_step(mesh, outer: Outer, dtype: str, leaves: tuple[int, ...], write: bool, rest_too: bool,
                    rows: str | None = None, rest_specs=None):  # fmt: skip
    """(groups' params, groups' rest, round params, outer state) -> (the groups' params, their rest, the round params,
    outer state, rest, metrics, digests) for the parameter leaves `leaves` (a fragment; every leaf for plain DiLoCo).
    `digests`: every device's digest of its new round values of the fragment, in the mesh's order, for Step to compare
    (they must be the same bits everywhere: the replica check right after each sync). Each
    device encodes its 1/n slice of its group's pseudo-gradient, all-gathers it over `group` (the one collective
    across groups), decodes and averages the G slices in a fixed order (so every device computes the same bits),
    and the slices are all-gathered over `data` (inside a group). write: the groups restart from the new round's
    values now (else later, `make_mix`); rest_too: the groups' other variables averaged too. rows: the axis the
    parameters, the round's and its momentum are split over in rows (fsdp's layout: `data`; hsdp's: `shard`): each
    device's own rows, or its 1/R slice of them across hsdp's R replicas, are its part of the pseudo-gradient, and
    its new rows stay (no gather inside the group). rest_specs: the layout's (fsdp's frozen base in rows; None: whole)."""
    g = mesh.shape[GROUP]
    inside = tuple(a for a in mesh.axis_names if a != GROUP)  # a group's devices
    apart = tuple(a for a in inside if a != rows)  # the axes a device's values are sliced over (each sends 1/n)
    n = math.prod(mesh.shape[a] for a in apart)
    split = P(rows) if rows else P()

    def one(inner_params, inner_rest, theta, buf):
        flat_x, tree = jax.tree.flatten(inner_params)
        flat_t, flat_b = jax.tree.leaves(theta), jax.tree.leaves(buf)
        mine_t = [flat_t[k] for k in leaves]
        delta = jnp.concatenate(
            [(flat_t[k].astype(jnp.float32) - flat_x[k][0].astype(jnp.float32)).ravel() for k in leaves]
        )
        size = delta.size
        if apart:  # its 1/n slice of what it holds (the whole, or hsdp's rows)
            chunk = -(-size // (n * BLOCK)) * BLOCK
            delta = jnp.pad(delta, (0, chunk * n - size))
            index = jax.lax.axis_index(apart[0] if len(apart) == 1 else apart)
            mine = jax.lax.dynamic_slice(delta, (index * chunk,), (chunk,))
        else:  # fsdp: this device's rows are its part
            mine = jnp.pad(delta, (0, -size % BLOCK))
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
        spread, err, norm2 = jax.lax.psum(jnp.stack([spread, err, norm2]), inside)
        err, norm2 = jax.lax.psum(jnp.stack([err, norm2]), GROUP)
        full = jax.lax.all_gather(mean, apart, tiled=True)[:size] if apart else mean[:size]
        offsets = np.cumsum([0] + [t.size for t in mine_t])
        avg = [full[a:b].reshape(t.shape) for a, b, t in zip(offsets[:-1], offsets[1:], mine_t, strict=True)]
        new_x, new_t, new_b = list(flat_x), list(flat_t), list(flat_b)
        for k, t, gr in zip(leaves, mine_t, avg, strict=True):
            p, new_b[k] = outer.step(t.astype(jnp.float32), gr, flat_b[k])
            new_t[k] = p.astype(t.dtype)
            if write:
                new_x[k] = new_t[k][None]
        mine_digest = jnp.zeros((), jnp.uint32)
        for k in leaves:
            mine_digest = mine_digest * jnp.uint32(31) + leaf_digest(new_t[k])
        digests = jax.lax.all_gather(mine_digest, (GROUP, *inside), tiled=False)  # a few bytes, once a sync
        unflat = lambda v: jax.tree.unflatten(tree, v)  # noqa: E731
        # The groups' other variables averaged (BatchNorm's statistics); a frozen base (adapters.py) is not sent
        rest = jax.tree.map(lambda r: jax.lax.pmean(r[0], GROUP) if jnp.issubdtype(r.dtype, jnp.inexact) else r[0],
                            adapters.split_frozen(inner_rest)[1])  # fmt: skip
        rest_g = adapters.with_frozen(inner_rest, jax.tree.map(lambda v: v[None], rest)) if rest_too else inner_rest
        rest = adapters.with_frozen(jax.tree.map(lambda r: r[0], inner_rest), rest)
        norm2_avg = sum(jnp.sum(jnp.square(a)) for a in avg)
        metrics = {
            "outer_grad_norm": jnp.sqrt(jax.lax.psum(norm2_avg, rows) if rows else norm2_avg),
            "outer_divergence": jnp.sqrt(spread / g),  # RMS over the groups of |pseudo-gradient - their mean|
            "outer_quant_error": jnp.sqrt(err / jnp.maximum(norm2, 1e-30)),  # |decoded - sent| / |sent|
        }
        return unflat(new_x), rest_g, unflat(new_t), unflat(new_b), rest, metrics, digests

    # check_vma=False: the results are the same on every device (each computes them from the same gathered bytes in
    # the same order), which shard_map cannot see through the all-gathers.
    mine, rest = P(GROUP, *split), P() if rest_specs is None else rest_specs
    rest_g = jax.tree.map(lambda s: P(GROUP, *s), rest)
    sharded = jax.shard_map(one, mesh=mesh, in_specs=(mine, rest_g, split, split),
                            out_specs=(mine, rest_g, split, split, rest, P(), P()), check_vma=False)  # fmt: skip
    return jax.jit(sharded, donate_argnums=(0, 1, 2, 3))


def make_mix(mesh, leaves: tuple[int, ...], alpha: float, rows: str | None = None):
    """(groups' params, round params) -> the groups' params with the leaves `leaves` set to alpha x theirs + (1 -
    alpha) x the round's (streaming DiLoCo's delayed outer step landing; alpha 0: the round's exactly)."""

    def one(inner_params, theta):
        flat_x, tree = jax.tree.flatten(inner_params)
        flat_t = jax.tree.leaves(theta)
        for k in leaves:
            t = flat_t[k][None]
            mixed = alpha * flat_x[k].astype(jnp.float32) + (1 - alpha) * t.astype(jnp.float32)
            flat_x[k] = t if alpha == 0 else mixed.astype(t.dtype)
        return jax.tree.unflatten(tree, flat_x)

    split = P(rows) if rows else P()
    sharded = jax.shard_map(one, mesh=mesh, in_specs=(P(GROUP, *split), split), out_specs=P(GROUP, *split),
                            check_vma=False)  # fmt: skip
    return jax.jit(sharded, donate_argnums=(0,))


class Step:
    """DiLoCo's train step: the inner step, then each fragment's outer step at its offset of every H steps (one
    fragment, at the end of each round: plain DiLoCo), and with a delay of D steps, D steps later the mix of the
    fragment's new round values into the groups. Its metrics are this process's groups' (the loss their tokens'
    mean), so no number crosses groups between syncs; a sync's step adds the outer metrics and
    `outer_bytes_per_step` (what each group receives across the slow link per step, averaged over the round)."""

    def __init__(self, inner, mesh, par, names: list[str], sizes: list[int], rows: str | None = None,
                 rest_specs=None):  # fmt: skip
        self.inner, self.mesh, self.every = inner, mesh, par.outer_every
        self.delay = getattr(par, "outer_delay", 0)
        n = getattr(par, "fragments", 1)
        self.fragments = fragments(names, n, self.every)
        outer = outer_optimizer(par.outer_lr, par.outer_momentum)
        last = max(range(n), key=lambda f: self.fragments[f][1] == 0)  # the one at the end of the round
        self.rows = rows  # the axis the parameters are split over in rows (fsdp or hsdp inside the groups)
        self.outer = [make_outer_step(mesh, outer, par.outer_dtype, leaves, not self.delay, f == last, rows, rest_specs)
                      for f, (leaves, _) in enumerate(self.fragments)]  # fmt: skip
        self.mix = [make_mix(mesh, leaves, getattr(par, "outer_mix", 0.0), rows) for leaves, _ in self.fragments]
        g = mesh.shape[GROUP]
        payload = sum(payload_bytes(sum(sizes[k] for k in leaves), par.outer_dtype) for leaves, _ in self.fragments)
        self.bytes_per_step = payload * (g - 1) / self.every
        self.streaming = n > 1 or self.delay > 0
        self.at: int | None = None  # the host's count of the state's step (read once, then followed)
        self.last = None  # the step array this object returned last
        self.unchecked: list[tuple[int, jax.Array]] = []  # (sync step, every device's digest): compared a step later

    def __call__(self, state: TrainState, batch) -> tuple[TrainState, dict]:
        if state.inner is None:
            raise ValueError("this state has no groups' state: build it with parallel.assemble(..., par.sync=diloco)")
        if state.step is not self.last:
            self.at = int(jax.device_get(state.step))
        inner, step, per_group = self.inner(state.inner, state.step, batch)
        self.check_syncs()  # the last step's syncs, now that the next step is queued behind them
        self.at, self.last = self.at + 1, step
        state = dataclasses.replace(state, step=step, inner=inner)
        metrics = _local(per_group)
        for f, (_, offset) in enumerate(self.fragments):
            if self.delay and self.at > self.delay and (self.at - self.delay) % self.every == offset:
                mixed = self.mix[f](state.inner["params"], state.params)
                state = dataclasses.replace(state, inner={**state.inner, "params": mixed})
        for f, (_, offset) in enumerate(self.fragments):
            if self.at % self.every != offset:
                continue
            inner = state.inner
            params, rest_g, theta, opt_state, rest, outer, digests = self.outer[f](
                inner["params"], inner["rest"], state.params, state.opt_state
            )
            self.unchecked.append((self.at, digests))
            inner = {**inner, "params": params, "rest": rest_g}
            state = dataclasses.replace(state, params=theta, opt_state=opt_state, rest=rest, inner=inner)
            metrics.update(outer, outer_bytes_per_step=jnp.float32(self.bytes_per_step))
            if self.streaming:
                metrics["outer_fragment"] = jnp.float32(f)
        return state, metrics


    def check_syncs(self) -> None:
        """Every device's new round values of each fragment synced since the last call must be the same bits
        (computed apart on every device from the same gathered bytes): else stop, naming the devices that differ."""
        for at, digests in self.unchecked:
            every = np.asarray(digests.addressable_data(0)).reshape(self.mesh.shape[GROUP], -1)
            # Each device of a group holds the whole round (its digest is device 0's), or its own rows of it (the
            # same device of every group holds the same rows: group 0's is the one to equal).
            differs = every != (every[:1] if self.rows else every[0, 0])
            if bad := np.flatnonzero(differs.ravel()).tolist():
                devices = list(self.mesh.devices.flat)
                named = ", ".join(f"{devices[i]} (process {devices[i].process_index})" for i in bad)
                raise RuntimeError(
                    f"the groups disagree after the sync at step {at}: the round's parameters on {named} differ from "
                    f"{'group 0' if self.rows else 'device 0'}'s (a device computed the outer step from other values: corrupted memory, or a "
                    f"nondeterministic kernel)"
                )
        self.unchecked = []


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


def make_train_step(graphdef, loss_fn, optimizer, mesh, grad_accum: int, schedule, par, state: TrainState) -> Any:
    """DiLoCo's train step for the strategy's state `state` (its parameters' names place them in fragments)."""
    inner = make_inner_step(graphdef, loss_fn, optimizer, mesh, grad_accum, schedule, par, state.shapes)
    sizes = [math.prod(x.shape) for x in jax.tree.leaves(state.param_shapes())]
    rest_specs = strategies.get(par.strategy).steps().layout(mesh).rest_specs(state.rest, mesh)  # fsdp's base in rows
    step = Step(inner, mesh, par, param_names(state.params), sizes, rows=shard_axis(mesh) if state.shapes is not None else None,
                rest_specs=rest_specs)  # fmt: skip
    return RefusingDonated(step)


def assemble(graphdef, state: TrainState, loss_fn, optimizer, mesh, par, grad_accum: int, schedule):
    """(state, train step) of DiLoCo from a ddp state made on the (`group`, `data`) mesh (parallelize.assemble)."""
    step = make_train_step(graphdef, loss_fn, optimizer, mesh, grad_accum, schedule, par, state)
    return init(state, mesh, outer_optimizer(par.outer_lr, par.outer_momentum)), step


# -- checkpoints of every-step sync, continued under DiLoCo, and the reverse ---------------------------------------


def restore_like(state: TrainState, optimizer, mesh, saved_groups: int | None):
    """What to read a checkpoint of the other kind into, for today's `state`: an every-step checkpoint's optimizer
    state is the strategy's (whole copies); a DiLoCo one holds the outer momentum buffers (shaped as the parameters,
    whatever the outer step's settings) and `saved_groups` groups' states (read whole onto every device, then
    averaged: `converted`)."""
    everywhere = NamedSharding(mesh, P())
    shaped = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=everywhere), tree)  # noqa: E731
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    params = state.param_shapes()
    if saved_groups is None:  # an every-step checkpoint, for DiLoCo
        return dataclasses.replace(like, opt_state=shaped(jax.eval_shape(optimizer.init, params)), inner=None)
    outer = Outer(0.0, 0.0)  # only its state's shapes
    g = saved_groups
    stacked = lambda tree: jax.tree.map(  # noqa: E731
        lambda x: jax.ShapeDtypeStruct((g, *x.shape), x.dtype, sharding=everywhere), tree
    )
    inner = {"params": stacked(params), "opt_state": stacked(jax.eval_shape(optimizer.init, params)),
             "rest": stacked(shaped(state.rest))}  # fmt: skip
    return dataclasses.replace(like, params=shaped(params), opt_state=shaped(jax.eval_shape(outer.init, params)),
                               inner=inner)  # fmt: skip


def converted(state: TrainState, mesh, diloco_today: bool, par) -> tuple[TrainState, str]:
    """A restored checkpoint of another kind as today's state, and what was done, in words. From every-step sync to
    DiLoCo: every group starts from the checkpoint's parameters and optimizer state, the outer momentum from zero.
    From DiLoCo: the round's parameters (the last sync's), the optimizer state the groups' average (AdamW's moments;
    counts are the same in every group); to ddp the outer momentum is dropped, to DiLoCo with another number of
    groups (a host lost or added: elastic membership) it is kept and every group starts from the round."""
    outer = outer_optimizer(par.outer_lr, par.outer_momentum) if diloco_today else None
    if state.inner is None:
        fresh = init(state, mesh, outer)
        return fresh, "every group starts from the checkpoint's parameters and optimizer state; outer momentum zero"
    everywhere = NamedSharding(mesh, P())
    mean = lambda x: jnp.mean(x, axis=0).astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.inexact) else x[0]  # noqa: E731
    opt_state = jax.jit(lambda t: jax.tree.map(mean, t), out_shardings=everywhere)(state.inner["opt_state"])
    g = state.groups()
    averaged = f"the optimizer state averaged over the checkpoint's {g} groups"
    if not diloco_today:
        state = dataclasses.replace(state, opt_state=opt_state, inner=None)
        return state, f"the round's parameters, {averaged} (DiLoCo's outer momentum is dropped)"
    momentum = state.opt_state
    fresh = init(dataclasses.replace(state, opt_state=opt_state, inner=None), mesh, outer)
    return dataclasses.replace(fresh, opt_state=momentum), (
        f"{mesh.shape[GROUP]} groups now: every group starts from the round's parameters and {averaged}; the outer "
        f"momentum goes on"
    )
