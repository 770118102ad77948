"""What a library user can get wrong with jdp's steps, refused in jdp's words before anything runs: a batch whose
rows do not split over devices x grad_accum, a loss that does not return (loss_sum, weight_sum), a state an earlier
step consumed (JAX's own errors name reshapes, tracers and tiling factors; jaxlib 0.10 crashed on the last). Each
check costs nothing per step: it runs while the step is traced, or is O(1)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax

from jdp.errors import ConfigError

__all__ = ["Batch", "LossFn", "RefusingDonated", "check_batch", "check_rows", "checked_loss", "checking_rows"]

Batch = dict[str, Any]
LossFn = Callable[..., tuple[Any, Any]]  # (model, batch) -> (loss_sum, weight_sum)


def check_rows(path: tuple, rows: int | None, n_devices: int, grad_accum: int, where: str) -> None:
    """Refuse a batch leaf (rows: its global rows; None: a scalar) that does not split into n_devices x
    grad_accum equal micro-batches."""
    name = f"batch{jax.tree_util.keystr(path)}"
    if rows is None:
        raise ConfigError(f"{where}: {name} is a scalar; every leaf of a batch holds rows along its first axis")
    per_step = n_devices * grad_accum
    if rows % per_step == 0:
        return
    lo = max(per_step, rows // per_step * per_step)
    over = f"devices ({n_devices}) x grad_accum ({grad_accum}) = {per_step}" if grad_accum > 1 else "the mesh's"
    other = f", or a grad_accum that divides its {rows // n_devices} rows per device" if rows % n_devices == 0 else ""
    raise ConfigError(
        f"{where}: a global batch of {rows} rows ({name}) does not split evenly over {over}"
        f"{'' if grad_accum > 1 else f' {n_devices} devices'}; use a multiple of {per_step} rows, "
        f"e.g. {lo} or {lo + per_step}{other}"
    )


def check_batch(batch: Batch, n_devices: int, grad_accum: int, where: str = "train step") -> None:
    """check_rows for every leaf of a global batch (arrays, tracers or shapes)."""
    for path, x in jax.tree_util.tree_leaves_with_path(batch):
        check_rows(path, x.shape[0] if x.shape else None, n_devices, grad_accum, where)


def checking_rows(fn: Callable, n_devices: int, grad_accum: int, where: str = "train step") -> Callable:
    """fn(..., global batch), refusing while it is traced a batch that check_batch refuses (named like fn: the
    compilation cache and `jdp allreduce` know the step by its name)."""

    @functools.wraps(fn)
    def checked(*args):
        check_batch(args[-1], n_devices, grad_accum, where)
        return fn(*args)

    return checked


def _shape_of(x) -> str:
    """float32[16] for an array or tracer, the type's name for anything else."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"{x.dtype}[{','.join(map(str, x.shape))}]"
    return type(x).__name__


def checked_loss(loss_fn: LossFn) -> LossFn:
    """loss_fn as (loss sum, weight sum, metric sums), refusing (while the step traces it) an output that is not the
    contract's two scalars, or two scalars and a dict of scalar sums (metrics reported as their mean per unit of
    weight over every device: `rewards/chosen`, ...); a loss of two gives an empty dict."""

    @functools.wraps(loss_fn)
    def loss(model, batch):
        out = loss_fn(model, batch)
        scalar = lambda x: isinstance(x, int | float) or getattr(x, "shape", None) == ()  # noqa: E731
        pair = isinstance(out, tuple | list) and len(out) in (2, 3)
        if pair and all(scalar(x) for x in out[:2]):
            if len(out) == 2:
                return out[0], out[1], {}
            if isinstance(out[2], dict) and all(isinstance(k, str) and scalar(v) for k, v in out[2].items()):
                return out[0], out[1], dict(out[2])
            raise ConfigError(
                f"loss_fn's third value must be a dict of scalar sums over its rows ({{'rewards/chosen': ...}}), "
                f"reported as their mean per unit of weight; {getattr(loss_fn, '__name__', 'loss_fn')} returned "
                f"{type(out[2]).__name__}"
                + (f" ({', '.join(f'{k}: {_shape_of(v)}' for k, v in out[2].items())})" if isinstance(out[2], dict) else "")
            )  # fmt: skip
        if pair:
            what = "a pair" if len(out) == 2 else "a triple starting"
            got = f"{what} ({_shape_of(out[0])}, {_shape_of(out[1])}), not two scalars"
        elif isinstance(out, tuple | list):
            got = f"a {type(out).__name__} of {len(out)}: ({', '.join(_shape_of(x) for x in out)})"
        else:
            got = f"one value, {_shape_of(out)}" + (" (a mean?)" if getattr(out, "shape", None) == () else "")
        raise ConfigError(
            f"loss_fn must return (loss_sum, weight_sum), two scalars: the sum of the per-example (or per-token) "
            f"losses over the rows it is given and their number (or total weight), from which jdp forms the exact "
            f"mean over every device; {getattr(loss_fn, '__name__', 'loss_fn')} returned {got}. Return sums, e.g. "
            f"`return losses.sum(), jnp.float32(losses.shape[0])`"
        )

    return loss


def _is_deleted(x) -> bool:
    return bool(getattr(x, "is_deleted", lambda: False)())


def _donated_state_error(state) -> ConfigError:
    """The error for a state the step already consumed, naming its deleted arrays."""
    gone = [jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_leaves_with_path(state) if _is_deleted(x)]
    return ConfigError(
        f"this state's arrays were consumed by an earlier train step ({len(gone)} deleted: {', '.join(gone[:3])}"
        f"{', ...' if len(gone) > 3 else ''}): the step donates the state it is given, so that the new state can "
        f"reuse its memory. Pass on the state the step returned, `state, metrics = step(state, batch)`, and copy a "
        f"state you want to keep before stepping it: `old = jax.tree.map(jnp.copy, state)`"
    )


class RefusingDonated:
    """A train or eval step that refuses a state an earlier step consumed, before dispatch: jaxlib 0.10 crashed
    (segfault) on one. Checking the step counter is enough and O(1): a step donates every array of the state
    it is given, and every state the step returns has a new counter. Only a state assembled from parts of
    different states slips past it: jax 0.12 then raises, re-worded here (jaxlib 0.10 still crashes)."""

    def __init__(self, fn: Callable):
        self.fn = fn

    def __call__(self, state, batch: Batch):
        if _is_deleted(getattr(state, "step", None)):
            raise _donated_state_error(state)
        try:
            return self.fn(state, batch)
        except RuntimeError as e:
            # Only JAX's refusal of a deleted array becomes ours: a run that failed (out of memory) may have
            # deleted its donated inputs too, and keeps its own error.
            if "deleted" not in str(e) or not any(_is_deleted(x) for x in jax.tree.leaves(state)):
                raise
            raise _donated_state_error(state) from e

    def __getattr__(self, name: str):  # lower, trace, eval_shape: the jitted step's
        if "fn" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.fn, name)
