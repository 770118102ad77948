"""Muon (momentum orthogonalised by Newton-Schulz) for the hidden weight matrices, AdamW for the rest, exact under
every layout of the optimizer state.

Newton-Schulz needs each matrix whole, but zero1, fsdp and hsdp hand the optimizer their views of the parameters
(zero1: every leaf flat and padded, fsdp: rows padded), split over the devices. So Muon keeps its momentum in the
view (elementwise, split as AdamW's moments are), and for the orthogonalisation asks the layout the strategy's step
names (`laid_out`, set around the update by `parallel.step.apply_update`) for each matrix whole on every device
(`layout.gathered`: one all-gather), orthogonalises it with optax's own Newton-Schulz, and hands it back to be laid
out again (`layout.scattered`: each device keeps its part). Under ddp (no layout named) the leaves are the
matrices. The arithmetic is optax.contrib.muon's (tests/test_muon.py compares them)."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

__all__ = ["MuonState", "is_matrix", "laid_out", "muon", "scale_by_muon"]

# How a strategy's update sees the parameters: (its layout, {parameter path: the parameter's own shape}); None
# (ddp, dp, a user's own loop): the leaves are the parameters as they are.
_LAYOUT: contextvars.ContextVar = contextvars.ContextVar("jdp_muon_layout", default=None)


@contextlib.contextmanager
def laid_out(layout: Any, shapes: Any, mesh: jax.sharding.Mesh):
    """While the optimizer updates `layout`'s views of parameters shaped `shapes` (a tree like the parameters),
    split over `mesh`: Muon asks `layout.gathered(leaf, shape, mesh)` for each matrix whole on every device and
    `layout.scattered(update, leaf, mesh)` to lay its update out again (each device keeping its own part)."""
    own = {jax.tree_util.keystr(p): tuple(s.shape) for p, s in jax.tree_util.tree_leaves_with_path(shapes)}
    token = _LAYOUT.set((layout, own, mesh))
    try:
        yield
    finally:
        _LAYOUT.reset(token)


def is_matrix(path, leaf, adamw_only: tuple[str, ...]) -> bool:
    """Whether Muon updates this parameter: a matrix (2 axes) whose path names none of `adamw_only` (embeddings,
    norms and the output head by default; every other parameter, biases included, gets AdamW)."""
    names = jax.tree_util.keystr(path).lower()
    return leaf.ndim == 2 and not any(part in names for part in adamw_only)


class MuonState(NamedTuple):
    count: jax.Array  # updates so far (int32)
    mu: Any  # the momentum, as the layout views the parameters


def _orthogonalised(x, shape: tuple[int, int], coeffs: jax.Array, steps: int, eps: float, scale: str):
    """One matrix (as the layout views it) -> its update: whole (one all-gather under a split layout), optax's
    Newton-Schulz on it where it lies, scaled by its shape, laid out again (each device keeping its own part)."""
    from optax.contrib import _muon  # optax's Newton-Schulz (not exported by name)

    seen = _LAYOUT.get()
    whole = x if seen is None else seen[0].gathered(x, shape, seen[2])
    o = _muon.orthogonalize_via_newton_schulz(whole, coeffs[0] if coeffs.shape[0] == 1 else coeffs, ns_steps=steps,
                                              eps=eps)  # fmt: skip
    fan_in, fan_out = shape
    if scale == "width":  # Keller Jordan's: sqrt(max(1, out / in)), optax's default
        o = jnp.sqrt(jnp.maximum(1, fan_out / fan_in)) * o
    else:  # "rms": Moonshot's, the update's RMS that of AdamW's (0.2), so AdamW's rate and decay carry over
        o = jnp.sqrt(jnp.maximum(fan_in, fan_out)) * 0.2 * o
    return o if seen is None else seen[0].scattered(o, x, seen[2])


def _by_shape(tree, fn):
    """fn(leaf, its parameter's shape) for every leaf, the leaves of one shape in a loop (lax.map over them
    stacked), so that one matrix at a time is whole with its Newton-Schulz temporaries. Applied to each leaf
    apart, XLA runs them all at once and holds every matrix's temporaries (5x the matrices' bytes, measured on
    XLA:CPU; an optimization barrier between them did not stop it once the parameters' update follows)."""
    seen = _LAYOUT.get()
    paths, tree_def = jax.tree_util.tree_flatten_with_path(tree)
    shapes = []
    for path, x in paths:
        shapes.append(x.shape if seen is None else seen[1].get(jax.tree_util.keystr(path)))
        if shapes[-1] is None:
            raise ValueError(f"Muon: the strategy's layout names no parameter {jax.tree_util.keystr(path)}")
    groups: dict = {}
    for k, ((_, x), shape) in enumerate(zip(paths, shapes, strict=True)):
        groups.setdefault((x.shape, x.dtype, shape), []).append(k)
    out = [None] * len(paths)
    for (_, _, shape), ks in groups.items():
        if len(ks) == 1:
            out[ks[0]] = fn(paths[ks[0]][1], shape)
            continue
        done = jax.lax.map(lambda x, shape=shape: fn(x, shape), jnp.stack([paths[k][1] for k in ks]))
        for i, k in enumerate(ks):
            out[k] = done[i]
    return jax.tree.unflatten(tree_def, out)


def scale_by_muon(
    coeffs=((3.4445, -4.775, 2.0315),), steps: int = 5, beta: float = 0.95, eps: float = 1e-8,
    nesterov: bool = True, scale: str = "width",
) -> optax.GradientTransformation:  # fmt: skip
    """optax.contrib.scale_by_muon's momentum (its moment, bias correction and Nesterov form) kept elementwise,
    then each matrix orthogonalised whole and scaled by its shape (`scale`: "width" or "rms")."""
    ns = jnp.asarray(coeffs, jnp.float32)

    def init(params):
        return MuonState(jnp.zeros([], jnp.int32), optax.tree.zeros_like(params))

    def update(updates, state, params=None):
        del params
        mu = optax.tree.update_moment(updates, state.mu, beta, 1)
        count = optax.safe_increment(state.count)
        if nesterov:
            mu_hat = jax.tree.map(
                lambda m, g: beta * m + (1 - beta) * g,
                optax.tree.bias_correction(mu, beta, optax.safe_increment(count)),
                optax.tree.bias_correction(updates, beta, count),
            )
        else:
            mu_hat = optax.tree.bias_correction(mu, beta, count)
        return _by_shape(mu_hat, lambda x, shape: _orthogonalised(x, shape, ns, steps, eps, scale)), MuonState(count, mu)

    return optax.GradientTransformation(init, update)


def muon(
    learning_rate, adamw_rate, *, beta: float, nesterov: bool, steps: int, coeffs, scale: str, weight_decay: float,
    adamw_only: tuple[str, ...], decay_mask, b1: float, b2: float, eps: float,
) -> optax.GradientTransformation:  # fmt: skip
    """Muon for the matrices `is_matrix` picks (decoupled weight decay times the rate, as optax's), AdamW for the
    rest (its decay where `decay_mask` says)."""

    def labels(params):
        return jax.tree_util.tree_map_with_path(
            lambda p, x: "muon" if is_matrix(p, x, adamw_only) else "adamw", params
        )

    matrices = optax.chain(
        scale_by_muon(coeffs, steps, beta, eps, nesterov, scale),
        optax.add_decayed_weights(weight_decay),
        optax.scale_by_learning_rate(learning_rate),
    )
    rest = optax.adamw(adamw_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=decay_mask)
    return optax.partition({"muon": matrices, "adamw": rest}, labels)
