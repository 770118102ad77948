"""The Llama decoder family (Llama 2/3, Qwen2, Mistral without a sliding window, SmolLM) in Flax NNX.

Rotary positions, RMSNorm, a SwiGLU MLP and grouped-query attention, computed as Hugging Face transformers'
LlamaForCausalLM computes them, so its weights import by name and a plain transpose (jdp/hf.py). It never mentions
devices or meshes.

Dimension glossary: B batch, L sequence length, N = B * L tokens, D model width, H query heads, G key/value heads,
K head width, F MLP width, V vocabulary.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jdp.attention import attention
from jdp.config import ModelConfig

__all__ = ["MLP", "Attention", "Block", "Llama", "RMSNorm", "rope", "rope_frequencies", "rope_tables"]


def _linear(cfg: ModelConfig, d_in: int, d_out: int, std: float, rngs: nnx.Rngs, bias: bool = False) -> nnx.Linear:
    return nnx.Linear(
        d_in,
        d_out,
        use_bias=bias,
        dtype=cfg.dtype,
        param_dtype=cfg.param_dtype,
        kernel_init=nnx.initializers.normal(std),
        rngs=rngs,
    )


class RMSNorm(nnx.Module):
    """x / sqrt(mean(x^2) + eps) in float32, back in x's dtype, times `scale` (Hugging Face's LlamaRMSNorm)."""

    def __init__(self, cfg: ModelConfig):
        self.eps, self.dtype = cfg.norm_eps, cfg.dtype
        self.scale = nnx.Param(jnp.ones((cfg.d_model,), cfg.param_dtype))

    def __call__(self, x_NxD: jax.Array) -> jax.Array:
        x32 = x_NxD.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scale[...].astype(self.dtype) * normed.astype(x_NxD.dtype)


def rope_frequencies(m: ModelConfig) -> np.ndarray:
    """Radians per position of each of the K/2 rotated pairs (float32): theta^(-2i/K), then, with
    rope_scaling=llama3, Llama 3.1's rescaling (transformers' _compute_llama3_parameters, term by term)."""
    K = m.head_width
    exponents = np.arange(0, K, 2, dtype=np.float32) / np.float32(K)  # in float32, as transformers computes them
    inv_freq = (1.0 / np.float32(m.rope_theta) ** exponents).astype(np.float32)
    if m.rope_scaling != "llama3":
        return inv_freq
    factor, low, high, old = m.rope_factor, m.rope_low_freq_factor, m.rope_high_freq_factor, m.rope_original_max_len
    wavelen = 2 * math.pi / inv_freq
    # Wavelengths longer than old / low turn `factor` times slower; shorter than old / high keep their speed.
    scaled = np.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)  # and in between, a blend of the two
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return np.where(medium, blended, scaled).astype(np.float32)


def rope_tables(m: ModelConfig, L: int, dtype, positions_BxL: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """cos and sin (LxK, in `dtype`) of position x frequency, each frequency twice (transformers' cat(freqs,
    freqs)); positions start at 0 in every window, or are `positions_BxL` (then the tables are BxLxK)."""
    at = jnp.arange(L) if positions_BxL is None else positions_BxL
    angles_LxK2 = at.astype(jnp.float32)[..., None] * jnp.asarray(rope_frequencies(m))
    angles_LxK = jnp.concatenate([angles_LxK2, angles_LxK2], axis=-1)
    return jnp.cos(angles_LxK).astype(dtype), jnp.sin(angles_LxK).astype(dtype)


def rope(x_BxLxHxK: jax.Array, cos_LxK: jax.Array, sin_LxK: jax.Array) -> jax.Array:
    """Rotate dimension i with dimension i + K/2 of every head (transformers' rotate_half convention, so Hugging
    Face's q_proj and k_proj import without a permutation)."""
    K = x_BxLxHxK.shape[-1]
    rotated = jnp.concatenate([-x_BxLxHxK[..., K // 2 :], x_BxLxHxK[..., : K // 2]], axis=-1)
    return x_BxLxHxK * cos_LxK[..., None, :] + rotated * sin_LxK[..., None, :]  # LxK, or BxLxK per sequence


class Attention(nnx.Module):
    """Grouped-query attention: H query heads share G key/value heads, rotary positions on q and k."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        D, self.H, self.G, self.K = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_width
        self.kind = cfg.attention
        residual_std = 0.02 / math.sqrt(2 * cfg.n_layers)  # as GPT's: scale the residual projections
        self.q = _linear(cfg, D, self.H * self.K, 0.02, rngs, cfg.qkv_bias)
        self.k = _linear(cfg, D, self.G * self.K, 0.02, rngs, cfg.qkv_bias)
        self.v = _linear(cfg, D, self.G * self.K, 0.02, rngs, cfg.qkv_bias)
        self.o = _linear(cfg, self.H * self.K, D, residual_std, rngs)

    def __call__(self, x_NxD: jax.Array, B: int, L: int, cos_LxK: jax.Array, sin_LxK: jax.Array,
                 segments_BxL: jax.Array | None = None) -> jax.Array:  # fmt: skip
        q_BxLxHxK = rope(self.q(x_NxD).reshape(B, L, self.H, self.K), cos_LxK, sin_LxK)
        k_BxLxGxK = rope(self.k(x_NxD).reshape(B, L, self.G, self.K), cos_LxK, sin_LxK)
        v_BxLxGxK = self.v(x_NxD).reshape(B, L, self.G, self.K)
        y_BxLxHxK = attention(q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, self.kind, segments_BxL)
        return self.o(y_BxLxHxK.reshape(B * L, self.H * self.K))


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        D, F = cfg.d_model, cfg.ff_width
        self.gate = _linear(cfg, D, F, 0.02, rngs)
        self.up = _linear(cfg, D, F, 0.02, rngs)
        self.down = _linear(cfg, F, D, 0.02 / math.sqrt(2 * cfg.n_layers), rngs)

    def __call__(self, x_NxD: jax.Array) -> jax.Array:
        return self.down(jax.nn.silu(self.gate(x_NxD)) * self.up(x_NxD))


class Block(nnx.Module):
    """Pre-norm: x + attn(attn_norm(x)), then x + mlp(mlp_norm(x))."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x_NxD: jax.Array, B: int, L: int, cos_LxK: jax.Array, sin_LxK: jax.Array,
                 segments_BxL: jax.Array | None = None) -> jax.Array:  # fmt: skip
        x_NxD = x_NxD + self.attn(self.attn_norm(x_NxD), B, L, cos_LxK, sin_LxK, segments_BxL)
        return x_NxD + self.mlp(self.mlp_norm(x_NxD))


class Llama(nnx.Module):
    """Token embedding, pre-norm blocks, final RMSNorm, output tied to the embedding or a separate lm_head.

    The parameter tree is an interface (jdp/hf.py maps Hugging Face's names onto it): embed, blocks[i].{attn_norm,
    attn.{q,k,v,o}, mlp_norm, mlp.{gate,up,down}}, norm, and lm_head only when model.tie_embeddings is false.
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(
            cfg.vocab_size,
            cfg.d_model,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            embedding_init=nnx.initializers.normal(0.02),
            rngs=rngs,
        )
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg)
        if not cfg.tie_embeddings:
            self.lm_head = _linear(cfg, cfg.d_model, cfg.vocab_size, 0.02, rngs)

    def __call__(
        self, tokens_BxL: jax.Array, segments_BxL: jax.Array | None = None, positions_BxL: jax.Array | None = None
    ) -> jax.Array:
        """Logits (float32) for the next token at every position; with `segments_BxL` and `positions_BxL`, attention
        within each document and rotary positions restarting at each (data.document_attention=within)."""
        B, L = tokens_BxL.shape
        cos_LxK, sin_LxK = rope_tables(self.cfg, L, self.cfg.dtype, positions_BxL)
        # As GPT's: the tokens are one flat axis between attentions, so every projection is a 2-D matmul.
        x_NxD = self.embed(tokens_BxL).reshape(B * L, -1)
        for block in self.blocks:
            x_NxD = block(x_NxD, B, L, cos_LxK, sin_LxK, segments_BxL)
        x_NxD = self.norm(x_NxD)
        logits = self.embed.attend(x_NxD) if self.cfg.tie_embeddings else self.lm_head(x_NxD)
        logits_NxV = logits.astype(jnp.float32)
        V, valid = self.cfg.vocab_size, self.cfg.vocab_valid
        if 0 < valid < V:  # the rows padded onto an imported vocabulary never get probability
            logits_NxV = jnp.where(jnp.arange(V) < valid, logits_NxV, -1e30)
        return logits_NxV.reshape(B, L, -1)
