"""Communication hooks, DDP's `register_comm_hook`: what turns one bucket's local gradients into their average.

A hook runs inside the per-device train step, once per gradient bucket (buckets.py), on every device:

    hook.reduce(bucket, grads, states, step) -> (averaged grads, new states)

`grads` are this device's gradient sums for the bucket's parameters (in the bucket's order, their own shapes and
dtypes); the hook returns what every replica must use as their mean over the `bucket.axis` devices. jdp scales
the result to the global mean loss's gradient afterwards, as for the built-in mean. Whatever the hook returns
must be identical on every device (computed from collective results only), or the replicas drift apart; the
replica digest (train.check_replicas_every) catches a hook that breaks this.

`states` holds each parameter's hook state, made by `hook.init(index, name, shape)` (None: no state). States live
in the train state (`TrainState.comm`), one copy per device (a hook may keep per-device values, as PowerSGD's
error feedback does), are updated only on steps whose update is applied (the non-finite guard skips them too),
and are checkpointed with the run. Keying them by parameter, not by bucket, keeps them valid when
parallel.bucket_mb changes on resume.

Built in: `Mean` (float32 or bfloat16 on the wire: parallel.reduce_dtype) and `PowerSGD` (parallel.compression).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["CommHook", "GradBucket", "Mean", "PowerSGD", "varying"]


def varying(tree, axis: str):
    """`tree` marked as differing between the devices of `axis` (the per-device step's type for such values; a
    collective's result is the same everywhere, and a value kept per device must be cast back). jax >= 0.10
    names it pcast(to="varying"); older releases called it pvary."""
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(tree, axis, to="varying")
    return jax.lax.pvary(tree, axis)


@dataclass(frozen=True)
class GradBucket:
    """What a hook knows about the bucket it reduces (PyTorch's GradBucket)."""

    index: int  # 0 = the first bucket backward finishes
    leaves: tuple[int, ...]  # indices into jax.tree.leaves(params)
    names: tuple[str, ...]  # the parameters' names, e.g. "blocks.0.attn.qkv.kernel"
    axis: str  # the mesh axis to average over: use it in jax.lax.pmean / psum
    devices: int  # how many devices share the axis

    def flatten(self, grads: list[jax.Array], dtype=None) -> jax.Array:
        """The bucket as one flat buffer (one collective instead of one per tensor), optionally cast."""
        return jnp.concatenate([(g if dtype is None else g.astype(dtype)).ravel() for g in grads])

    def unflatten(self, flat: jax.Array, like: list[jax.Array]) -> list[jax.Array]:
        """Split a flat buffer back into tensors shaped (and typed) as `like`."""
        out, offset = [], 0
        for g in like:
            out.append(flat[offset : offset + g.size].reshape(g.shape).astype(g.dtype))
            offset += g.size
        return out


class CommHook:
    """The interface; subclass it. The default state is none; `describe` names the hook in the checkpoint record
    (a resumed run keeps the saved states only when its hook describes itself the same way)."""

    def init(self, index: int, name: str, shape: tuple[int, ...]) -> Any:
        """Per-parameter state (a pytree of arrays, identical on every device at start), or None."""
        return None

    def reduce(self, bucket: GradBucket, grads: list[jax.Array], states: list[Any], step: jax.Array):
        raise NotImplementedError

    def describe(self) -> dict:
        return {"hook": type(self).__name__}

    def wire_elements(self, named_shapes: list[tuple[str, tuple[int, ...]]]) -> int:
        """Elements this hook sends per step for gradients of these (name, shape)s (for reports; the mean: all)."""
        return sum(math.prod(s) for _, s in named_shapes)


@dataclass(frozen=True)
class Mean(CommHook):
    """DDP's default: one all-reduce (pmean) of the whole bucket as a flat buffer, in `dtype` on the wire
    (bfloat16 halves the bytes: DDP's bf16_compress_hook)."""

    dtype: str = "float32"

    def reduce(self, bucket, grads, states, step):
        return bucket.unflatten(jax.lax.pmean(bucket.flatten(grads, self.dtype), bucket.axis), grads), states

    def describe(self) -> dict:
        return {"hook": "mean", "dtype": self.dtype}


@dataclass(frozen=True)
class PowerSGD(CommHook):
    """PowerSGD (Vogels, Karimireddy and Jaggi, 2019), as PyTorch's powerSGD_hook: each gradient matrix M (m x n;
    a tensor of more dimensions is seen as shape[0] x the rest) travels as two rank-`rank` factors,
    r(m + n) numbers instead of mn:

        M = grad + error              (error feedback: what earlier steps' compression left out)
        P = mean_devices(M Q)         (all-reduce 1)
        P = orthonormal basis of P    (QR)
        Q = mean_devices(M^T P)       (all-reduce 2)
        average = P Q^T;  error = M - P Q^T;  Q is kept for the next step (warm start)

    Every device ends with the same P and Q, so the same average. Tensors that compression would not shrink by
    `min_ratio` (biases, LayerNorm scales, small matrices) go uncompressed, together in one plain all-reduce per
    bucket. The first `start_step` steps all-reduce everything plainly (the paper's and PyTorch's warm-up); Q starts
    as the same seeded Gaussian on every device by construction (the key depends only on `seed` and the
    parameter's index), and errors start at zero.
    """

    rank: int = 4
    start_step: int = 100
    error_feedback: bool = True
    min_ratio: float = 2.0
    seed: int = 0
    dtype: str = "float32"  # of the uncompressed all-reduce (parallel.reduce_dtype); the factors are float32
    uncompressed: tuple[str, ...] = ()  # parameters whose name contains one of these always travel whole

    @staticmethod
    def matrix(shape: tuple[int, ...]) -> tuple[int, int]:
        return (shape[0], math.prod(shape[1:])) if len(shape) >= 2 else (1, math.prod(shape))

    def compresses(self, name: str, shape: tuple[int, ...]) -> bool:
        m, n = self.matrix(shape)
        if any(part in name for part in self.uncompressed):
            return False
        return len(shape) >= 2 and m * n >= self.min_ratio * self.rank * (m + n)

    def init(self, index, name, shape):
        if not self.compresses(name, shape):
            return None
        m, n = self.matrix(shape)
        q = jax.random.normal(jax.random.fold_in(jax.random.key(self.seed), index), (n, self.rank), jnp.float32)
        state = {"q": q}
        if self.error_feedback:
            state["error"] = jnp.zeros((m, n), jnp.float32)
        return state

    def reduce(self, bucket, grads, states, step):
        plain = [i for i, s in enumerate(states) if s is None]
        packed = [i for i, s in enumerate(states) if s is not None]
        out = list(grads)
        if plain:
            averaged = Mean(self.dtype).reduce(bucket, [grads[i] for i in plain], [], step)[0]
            for i, g in zip(plain, averaged, strict=True):
                out[i] = g
        if not packed:
            return out, states

        def compressed(_):
            return self._compress(bucket, [grads[i] for i in packed], [states[i] for i in packed])

        def warm_up(_):
            dense = Mean("float32").reduce(bucket, [grads[i] for i in packed], [], step)[0]
            return dense, [states[i] for i in packed]

        if self.start_step <= 0:
            averaged, new = compressed(None)
        else:
            averaged, new = jax.lax.cond(step >= self.start_step, compressed, warm_up, None)
        new_states = list(states)
        for j, i in enumerate(packed):
            out[i], new_states[i] = averaged[j], new[j]
        return out, new_states

    def _compress(self, bucket, grads, states):
        shapes = [self.matrix(g.shape) for g in grads]
        ms = [g.reshape(s).astype(jnp.float32) for g, s in zip(grads, shapes, strict=True)]
        if self.error_feedback:
            ms = [m + s["error"] for m, s in zip(ms, states, strict=True)]
        # Both factors of every matrix in the bucket travel together: two all-reduces per bucket.
        ps = [m @ s["q"] for m, s in zip(ms, states, strict=True)]
        ps = bucket.unflatten(jax.lax.pmean(bucket.flatten(ps), bucket.axis), ps)
        ps = [jnp.linalg.qr(p)[0] for p in ps]
        qs = [m.T @ p for m, p in zip(ms, ps, strict=True)]
        qs = bucket.unflatten(jax.lax.pmean(bucket.flatten(qs), bucket.axis), qs)
        approx = [p @ q.T for p, q in zip(ps, qs, strict=True)]
        new = []
        for m, q, a in zip(ms, qs, approx, strict=True):
            state = {"q": varying(q, bucket.axis)}  # kept per device, like every hook state
            if self.error_feedback:
                state["error"] = m - a
            new.append(state)
        return [a.reshape(g.shape).astype(g.dtype) for a, g in zip(approx, grads, strict=True)], new

    def wire_elements(self, named_shapes):
        return sum(
            self.rank * sum(self.matrix(s)) if self.compresses(name, s) else math.prod(s)
            for name, s in named_shapes
        )  # fmt: skip

    def describe(self) -> dict:
        return {"hook": "powersgd", "rank": self.rank, "error_feedback": self.error_feedback,
                "min_ratio": self.min_ratio, "seed": self.seed, "uncompressed": list(self.uncompressed)}  # fmt: skip
