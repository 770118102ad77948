"""The data-parallel API that library users and the trainer call: state placed for a strategy, the train step it
runs, a state moved between strategies, the layout a checkpoint was saved in."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jdp.parallel import strategies, sync
from jdp.parallel.comm_hooks import CommHook
from jdp.parallel.mesh import Batch, make_mesh, per_group, replicated
from jdp.parallel.remat import Remat, recomputing
from jdp.parallel.step import (
    LossFn,
    OptLayout,
    TrainState,
    init_comm,
    make_eval_step,
)


def mesh_for(parallel_cfg) -> jax.sharding.Mesh:
    """The mesh the config's strategy runs on: every device on `data`, or (hsdp) groups of parallel.shard_size, or
    the groups parallel.sync trains apart (DiLoCo's `group` axis)."""
    if (ways := sync.get(getattr(parallel_cfg, "sync", "step")).steps()) is not None:
        return ways.mesh(parallel_cfg)
    k = parallel_cfg.shard_size if strategies.get(parallel_cfg.strategy).groups else 0
    if k and (k < 1 or jax.device_count() % k):
        return make_mesh()  # the config check names the shard_size that does not divide the devices
    return make_mesh(shard_size=k)


def opt_layout(strategy: str, mesh: jax.sharding.Mesh) -> OptLayout:
    """How `strategy` lays out the optimizer state on `mesh` (what checkpoints record)."""
    return strategies.get(strategy).steps().layout(mesh)


def layout_of(saved: dict) -> OptLayout:
    """The layout a checkpoint was written in, from what its record keeps of it (checkpoint.saved_layout): the one
    of the strategies' layouts (each strategy module's LAYOUT) that reads it."""
    kinds = {strategies.get(name).steps().LAYOUT for name in strategies.names()}
    (kind,) = [k for k in kinds if k.reads(saved)]
    return kind(int(saved.get("shards", 0)))


def init_state(
    model: nnx.Module,
    optimizer: optax.GradientTransformation,
    mesh: jax.sharding.Mesh,
    strategy: str = "ddp",
    comm_hook: CommHook | None = None,
):
    """Split the model once; place the parameters and the model's other variables, replicated, on every device of
    the mesh, the optimizer state as `strategy` keeps it (ddp: replicated; zero1: split over the devices; dp: on
    the master), and the communication hook's initial state (pass the hook given to make_train_step)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    steps = strategies.get(strategy).steps()
    layout = steps.layout(mesh)
    layout.check(optimizer, params)
    own = tuple(tuple(x.shape) for x in jax.tree.leaves(params)) if layout.splits_parameters else None
    params, rest = layout.place(params, mesh), layout.place_rest(rest, mesh)
    return graphdef, _with_optimizer(params, rest, optimizer, mesh, strategy, comm_hook, own)


def init_state_from(
    make_model: Callable[[], nnx.Module],
    optimizer: optax.GradientTransformation,
    mesh: jax.sharding.Mesh,
    strategy: str = "ddp",
    comm_hook: CommHook | None = None,
):
    """init_state for the model `make_model()` (no arguments) makes. Under a strategy that splits the parameters
    (fsdp, hsdp) the model is made inside one jax.jit whose outputs are each device's rows, so its parameters are
    never whole on any device (an 8B model would not fit one); under the others, init_state(make_model(), ...)."""
    steps = strategies.get(strategy).steps()
    layout = steps.layout(mesh)
    if not layout.splits_parameters:
        return init_state(make_model(), optimizer, mesh, strategy, comm_hook)
    graphdef, params, rest = nnx.split(nnx.eval_shape(make_model), nnx.Param, ...)
    layout.check(optimizer, params)
    own = tuple(tuple(x.shape) for x in jax.tree.leaves(params))
    split = layout.shardings(jax.eval_shape(layout.view, params), mesh)

    def made():
        _, p, r = nnx.split(make_model(), nnx.Param, ...)
        return layout.view(p), r

    params, rest = jax.jit(made, out_shardings=(split, layout.rest_shardings(rest, mesh)))()
    return graphdef, _with_optimizer(params, rest, optimizer, mesh, strategy, comm_hook, own)


def _with_optimizer(params, rest, optimizer, mesh, strategy: str, comm_hook, own) -> TrainState:
    """The train state of placed parameters and variables: the optimizer state as `strategy` keeps it, step 0."""
    steps = strategies.get(strategy).steps()
    layout = steps.layout(mesh)
    shapes = layout.shapes(optimizer, params)
    init = lambda p: optimizer.init(layout.view(p))  # noqa: E731
    opt_state = jax.jit(init, out_shardings=steps.opt_shardings(shapes, mesh))(params)
    step = jax.device_put(np.zeros((), np.int32), replicated(mesh))
    return TrainState(step, params, opt_state, rest, init_comm(comm_hook, params, mesh), own)


class Assembled(NamedTuple):
    graphdef: nnx.GraphDef
    state: TrainState
    train_step: Callable  # jitted (state, global batch) -> (state, metrics); donates the state
    eval_step: Callable  # jitted (state, global batch) -> (loss sum, weight sum), the model in evaluation mode


def assemble(model: nnx.Module, loss_fn: LossFn, optimizer: optax.GradientTransformation, mesh: jax.sharding.Mesh,
             par, grad_accum: int = 1, schedule: optax.Schedule | None = None, comm_hook: CommHook | None = None,
             factory: Callable[[], nnx.Module] | None = None, remat: Remat | None = None) -> Assembled:  # fmt: skip
    """The one way the trainer and jdp's commands assemble a run's state and steps, as a config's `parallel`
    section (`par`) asks: the model's state laid out for par.strategy, the jitted train step, and an eval step that
    runs the model in evaluation mode (`model.eval()`: dropout off, BatchNorm's running statistics). With `factory`
    (what makes the model; `model` is then its shapes) the state is made by init_state_from. `remat`: which blocks
    the train step recomputes in backward (model.remat; remat.py)."""
    remat = remat or Remat()
    remat.check(model)  # before anything is placed: a model with no blocks to recompute is refused
    model.eval()
    eval_graphdef = nnx.graphdef(model)
    model.train()
    if factory is not None:
        graphdef, state = init_state_from(factory, optimizer, mesh, par.strategy, comm_hook)
    else:
        graphdef, state = init_state(model, optimizer, mesh, par.strategy, comm_hook)
    train_loss = recomputing(loss_fn, remat)
    eval_step = make_strategy_eval_step(eval_graphdef, loss_fn, mesh, par.strategy)
    if (ways := sync.get(getattr(par, "sync", "step")).steps()) is not None:  # groups that agree every H steps
        state, train_step = ways.assemble(graphdef, state, train_loss, optimizer, mesh, par, grad_accum, schedule)
        return Assembled(graphdef, state, train_step, eval_step)
    train_step = configured_train_step(graphdef, train_loss, optimizer, mesh, par, grad_accum, schedule, comm_hook)
    return Assembled(graphdef, state, train_step, eval_step)


def configured_train_step(graphdef, loss_fn: LossFn, optimizer: optax.GradientTransformation, mesh: jax.sharding.Mesh,
                          par, grad_accum: int = 1, schedule: optax.Schedule | None = None,
                          comm_hook: CommHook | None = None):  # fmt: skip
    """make_train_step as a config's `parallel` section asks for it (its strategy's own options included)."""
    return make_train_step(
        graphdef, loss_fn, optimizer, mesh, grad_accum, schedule, strategy=par.strategy, bucket_mb=par.bucket_mb,
        reduce_dtype=par.reduce_dtype, comm_hook=comm_hook, **strategies.get(par.strategy).options_of(par),
    )  # fmt: skip


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
    **options,
) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]]:
    """The data-parallel step: (state, global batch) -> (new state, metrics), state donated (passing a donated
    state again raises ConfigError; so do rows that do not split into devices x grad_accum and a loss_fn that does
    not return (loss_sum, weight_sum), while the step is traced).

    strategy="ddp" (jdp's design): every device computes its gradients, they are averaged by all-reduces
    of about bucket_mb MiB, and every replica applies the identical update; comm_hook replaces the mean of each
    bucket (comm_hooks.py; build the state with init_state(..., comm_hook=the same hook)). strategy="zero1" splits
    the optimizer state over the devices; strategy="dp" is PyTorch DataParallel's master pattern, kept as the
    baseline to measure against (strategies/; build the state with init_state(..., strategy=the same)).
    strategy="fsdp" splits the parameters, gradients and optimizer state too; its one option is
    reshard_after_forward (default True).

    Under every strategy the model's other variables (state.rest) are updated by the forward passes and kept
    replicated: floating-point ones (BatchNorm's running statistics) averaged over the devices; nnx rng streams
    (nnx.Dropout) drawn per step and device; RowDropout (nn.py) per step and global row (step.local_sums).
    """
    s = strategies.get(strategy)
    if comm_hook is not None and not s.comm_hooks:
        raise ValueError(f"a communication hook reduces ddp's buckets; strategy={strategy!r} has none to hook")
    if unknown := sorted(set(options) - set(s.options)):
        raise ValueError(
            f"strategy={strategy!r} takes no option {', '.join(unknown)} (it takes: {s.options or 'none'})"
        )
    return s.steps().make_train_step(
        graphdef, loss_fn, optimizer, mesh, grad_accum, schedule,
        bucket_mb=bucket_mb, reduce_dtype=reduce_dtype, comm_hook=comm_hook, **options,
    )  # fmt: skip


def make_strategy_eval_step(graphdef, loss_fn: LossFn, mesh: jax.sharding.Mesh, strategy: str = "ddp",
                            per_row: bool = False):  # fmt: skip
    """The eval step for a state laid out by `strategy` (fsdp's gathers its split parameters block by block);
    per_row: one value per row of the batch (step.make_eval_step)."""
    steps = strategies.get(strategy).steps()
    make = getattr(steps, "make_eval_step", make_eval_step)
    return make(graphdef, loss_fn, mesh, per_row=True) if per_row else make(graphdef, loss_fn, mesh)


def relayout(state: TrainState, optimizer, mesh: jax.sharding.Mesh, strategy: str) -> TrainState:
    """`state` with its optimizer state (in any layout) moved to the one `strategy` keeps on `mesh`: how a
    checkpoint of one strategy or device count continues under another. Values are unchanged, only placed anew."""
    steps = strategies.get(strategy).steps()
    dst = steps.layout(mesh)
    own = state.param_shapes()
    canonical, target = OptLayout().shapes(optimizer, own), dst.shapes(optimizer, own)

    def move(x, c, t):
        return jnp.pad(x.ravel()[: c.size], (0, t.size - c.size)).reshape(t.shape)

    moved = lambda o: jax.tree.map(move, o, canonical, target)  # noqa: E731
    shardings = steps.opt_shardings(target, mesh)
    if state.inner is not None:  # DiLoCo: each group's optimizer state is the strategy's (a leading axis of groups)
        groups = jax.jit(jax.vmap(moved), out_shardings=jax.tree.map(per_group, shardings))
        return dataclasses.replace(state, inner={**state.inner, "opt_state": groups(state.inner["opt_state"])})
    opt_state = jax.jit(moved, out_shardings=shardings)(state.opt_state)
    return dataclasses.replace(state, opt_state=opt_state)


def restore_target(state: TrainState, optimizer, mesh: jax.sharding.Mesh, strategy: str, saved: OptLayout):
    """What to restore a checkpoint written in layout `saved` into: `state` itself (shapes and shardings) when that
    is today's layout or both keep the optimizer state shaped as the parameters (ddp and fsdp: the checkpoint's
    padding is cut or zeros added, each device reading its own rows), else the saved shapes with the optimizer
    state replicated, for relayout to place."""
    today = opt_layout(strategy, mesh)
    if saved.reads_into(today):
        return state
    g = state.groups()
    opt = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape if g is None else (g, *x.shape), x.dtype, sharding=replicated(mesh)),
        saved.shapes(optimizer, state.param_shapes()),
    )
    like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    if g is not None:  # DiLoCo: the groups' optimizer state is the strategy's
        return dataclasses.replace(like, inner={**like.inner, "opt_state": opt})
    return dataclasses.replace(like, opt_state=opt)
