"""Causal attention for every model: the per-platform choice, and the blocked einsum path it takes on CPUs.

Dimension glossary: B batch, L sequence length, H query heads, G key/value heads (G divides H; G = H is multi-head,
G = 1 multi-query attention), R = H / G query heads per key/value head, K head width, Q queries per block, E keys.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jdp.log import logger

__all__ = ["attention", "attention_scores", "causal_attention", "query_blocks"]

F32 = jnp.float32


def query_blocks(L: int) -> int:
    """How many query blocks the written-out causal attention splits L into (blocks of 64 to L/8 queries)."""
    size = max(64, L // 8)
    return L // size if L % size == 0 else 1


def attention_scores(L: int) -> int:
    """Query-key scores per sequence and head that causal_attention computes: L^2 (n + 1) / 2n with n blocks."""
    n = query_blocks(L)
    return (L // n) ** 2 * n * (n + 1) // 2


def causal_attention(
    q_BxHxLxK: jax.Array, k_BxGxLxK: jax.Array, v_BxGxLxK: jax.Array, segments_BxL: jax.Array | None = None
) -> jax.Array:
    """softmax(q k^T / sqrt(K) + causal mask) v, written out in heads-major layout, one query block at a time.

    Query block i attends only keys up to the block's end, so the fully masked part of q k^T is never computed:
    with 2 blocks (L = 128) a quarter of the attention work goes, with 8 (L >= 512) 44%. On CPUs XLA runs this
    faster than jax.nn.dot_product_attention's generic path (fewer transposes, an additive mask;
    docs/performance.md); on GPUs the fused cuDNN kernel wins, so "auto" picks per platform.

    With fewer key/value heads than query heads (G < H), each key/value head serves its R = H / G query heads in
    one grouped einsum: the keys and values are never copied R times.

    With `segments_BxL` (data.document_attention=within: which document of the packed window each token is in) a
    query also sees only keys of its own document.
    """
    B, H, L, K = q_BxHxLxK.shape
    G = k_BxGxLxK.shape[1]
    n = query_blocks(L)
    Q = L // n
    q = q_BxHxLxK * (K**-0.5)
    if G == H:  # multi-head: the subscripts jdp's GPT was measured with
        scores_spec, values_spec = "bhqk,bhek->bhqe", "bhqe,bhek->bhqk"
    else:
        q = q.reshape(B, G, H // G, L, K)  # query head h uses key/value head h // R, as Hugging Face's repeat_kv
        scores_spec, values_spec = "bgrqk,bgek->bgrqe", "bgrqe,bgek->bgrqk"
    outputs = []
    for i in range(n):
        end = (i + 1) * Q  # this block's queries see keys [0, end)
        # Scores and weighted sums accumulate in float32 whatever the compute dtype (as the fused kernels do): a bf16
        # accumulation over the keys, or over a key/value head's R query heads in backward, lost 2.6% (gpu_check).
        scores = jnp.einsum(scores_spec, q[..., i * Q : end, :], k_BxGxLxK[:, :, :end], preferred_element_type=F32)
        visible_QxE = jnp.arange(i * Q, end)[:, None] >= jnp.arange(end)[None, :]
        if segments_BxL is None:
            mask = jnp.where(visible_QxE, 0.0, -1e9).astype(scores.dtype)
        else:  # and only its own document's: one mask per sequence, broadcast over the heads
            same_BxQxE = segments_BxL[:, i * Q : end, None] == segments_BxL[:, None, :end]
            mask = jnp.where(visible_QxE & same_BxQxE, 0.0, -1e9).astype(scores.dtype)
            mask = mask.reshape(B, *(1,) * (scores.ndim - 3), end - i * Q, end)
        probs = jax.nn.softmax(scores + mask, axis=-1)
        y = jnp.einsum(values_spec, probs.astype(v_BxGxLxK.dtype), v_BxGxLxK[:, :, :end], preferred_element_type=F32)
        outputs.append(y.astype(v_BxGxLxK.dtype))
    y = outputs[0] if n == 1 else jnp.concatenate(outputs, axis=-2)
    return y.reshape(B, H, L, K)


def attention(
    q_BxLxHxK: jax.Array,
    k_BxLxGxK: jax.Array,
    v_BxLxGxK: jax.Array,
    kind: str = "auto",
    segments_BxL: jax.Array | None = None,
) -> jax.Array:
    """Causal attention, y_BxLxHxK, by model.attention's `kind`: "auto" is cuDNN's fused kernel on GPUs for 16-bit
    compute (XLA's jax.nn.dot_product_attention for float32, which cuDNN does not take, or where cuDNN refuses the
    shapes, with a warning naming why) and the written-out `causal_attention` elsewhere; "einsum" always the latter;
    "xla" or "cudnn" jax.nn.dot_product_attention with that implementation (it takes G < H natively).
    `segments_BxL`: attention within documents only (the fused kernels take it as a mask)."""
    if kind == "auto":
        if jax.default_backend() != "gpu":
            kind = "einsum"
        elif q_BxLxHxK.dtype in (jnp.bfloat16, jnp.float16):
            try:  # jax checks the dtypes, layout and head width for cuDNN while tracing
                return _fused(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, "cudnn", segments_BxL)
            except (ValueError, NotImplementedError, RuntimeError, TypeError) as e:
                _warn_once(f"cuDNN's fused attention refused {q_BxLxHxK.shape} ({type(e).__name__}: "
                           f"{str(e).splitlines()[0][:200]}); using XLA's attention instead")  # fmt: skip
                kind = "xla"
        else:
            kind = "xla"  # jax's own default (None) is XLA too, as of jax 0.10-0.12: it does not pick cuDNN
    if kind == "einsum":
        heads_major = [x.transpose(0, 2, 1, 3) for x in (q_BxLxHxK, k_BxLxGxK, v_BxLxGxK)]
        return causal_attention(*heads_major, segments_BxL).transpose(0, 2, 1, 3)
    return _fused(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, kind, segments_BxL)


def _fused(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, implementation: str, segments_BxL) -> jax.Array:
    mask = None if segments_BxL is None else (segments_BxL[:, None, :, None] == segments_BxL[:, None, None, :])
    return jax.nn.dot_product_attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, mask=mask, is_causal=True,
                                        implementation=implementation)  # fmt: skip


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger(__name__).warning(message)
