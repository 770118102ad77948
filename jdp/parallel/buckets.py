"""Gradient buckets, DDP's `bucket_cap_mb`: which gradients travel together, in the order backward finishes them.

Pure functions of shapes: nothing here runs on a device or communicates (step.py reduces the buckets).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["Bucket", "bucket_plan", "gradient_order", "plan_buckets"]


def gradient_order(loss_of: Callable, params, *args) -> list[int]:
    """Indices of `params`' leaves in the order backward finishes their gradients.

    A parameter's gradient is complete once backward has passed its *first* use in the forward pass, so the
    order is the reverse of first use, read off the traced forward program (for a transformer: the last
    layer first; a tied embedding, used first and last, comes last). Works for any model and loss.
    """
    leaves = jax.tree.leaves(params)
    closed = jax.make_jaxpr(loss_of)(params, *args)
    first: dict[int, tuple] = {}

    def walk(jaxpr, env: dict, where: tuple) -> None:
        for i, eqn in enumerate(jaxpr.eqns):
            for v in eqn.invars:
                try:
                    leaf = env.get(v)
                except TypeError:  # an unhashable literal
                    continue
                if leaf is not None:
                    first.setdefault(leaf, (*where, i))
            for sub in eqn.params.values():  # calls into nested programs (jit, custom_vjp, remat, ...)
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns") and len(inner.invars) == len(eqn.invars):
                    inner_env = {}
                    for outer_v, inner_v in zip(eqn.invars, inner.invars, strict=True):
                        try:
                            if outer_v in env:
                                inner_env[inner_v] = env[outer_v]
                        except TypeError:
                            continue
                    walk(inner, inner_env, (*where, i))

    walk(closed.jaxpr, {v: k for k, v in enumerate(closed.jaxpr.invars[: len(leaves)])}, ())
    # Unused parameters have a zero gradient at once: they go first.
    return sorted(range(len(leaves)), key=lambda k: first.get(k, (math.inf,)), reverse=True)


@dataclass(frozen=True)
class Bucket:
    leaves: tuple[int, ...]  # indices into jax.tree.leaves(params), in backward-completion order
    names: tuple[str, ...]
    elements: int
    nbytes: int  # as communicated, in the reduce dtype


def plan_buckets(params, order: list[int], bucket_mb: float, reduce_dtype: str = "float32") -> list[Bucket]:
    """Group the gradients, in `order`, into buckets of at most bucket_mb MiB (DDP's rule: a gradient
    larger than the cap gets a bucket of its own; bucket_mb=0 puts them all in one)."""
    flat = jax.tree_util.tree_leaves_with_path(params)
    item = jnp.dtype(reduce_dtype).itemsize
    cap = bucket_mb * 2**20 if bucket_mb > 0 else math.inf
    buckets, current = [], []

    def close():
        if current:
            n = sum(math.prod(flat[k][1].shape) for k in current)
            names = tuple(
                jax.tree_util.keystr(flat[k][0], simple=True, separator=".").removesuffix(".value") for k in current
            )
            buckets.append(Bucket(tuple(current), names, n, n * item))
            current.clear()

    size = 0
    for k in order:
        nbytes = math.prod(flat[k][1].shape) * item
        if current and size + nbytes > cap:
            close()
            size = 0
        current.append(k)
        size += nbytes
    close()
    return buckets


def _spec(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def bucket_plan(
    graphdef, loss_fn: Callable, params, rest, micro_batch, bucket_mb: float, reduce_dtype: str
) -> list[Bucket]:
    """The gradient buckets of a step: `micro_batch` is one device's micro-batch (arrays or shapes)."""

    def loss_of(params, rest, micro):
        return loss_fn(nnx.merge(graphdef, params, rest), micro)

    order = gradient_order(loss_of, _spec(params), _spec(rest), _spec(micro_batch))
    return plan_buckets(params, order, bucket_mb, reduce_dtype)
