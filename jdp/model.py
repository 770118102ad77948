"""A GPT-style decoder-only transformer in Flax NNX; it never mentions devices or meshes.

Dimension glossary: B batch, L sequence length, D model width, H heads, K head width (D / H),
F MLP width, V vocabulary, P positions (max_seq_len).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jdp.config import ModelConfig


def _linear(cfg: ModelConfig, d_in: int, d_out: int, std: float, rngs: nnx.Rngs) -> nnx.Linear:
    # No biases in the projections (as in PaLM, LLaMA, nanoGPT's bias=False). The key bias in particular
    # has an exactly-zero gradient (softmax ignores a constant shift), which Adam turns rounding noise into
    # full-size updates of.
    return nnx.Linear(
        d_in,
        d_out,
        use_bias=False,
        dtype=cfg.dtype,
        param_dtype=cfg.param_dtype,
        kernel_init=nnx.initializers.normal(std),
        rngs=rngs,
    )


def _norm(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(cfg.d_model, epsilon=1e-5, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)


class CausalSelfAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.n_heads = cfg.n_heads
        # None lets jax pick cuDNN's fused kernel on GPUs where it applies and XLA elsewhere.
        self.implementation = None if cfg.attention == "auto" else cfg.attention
        residual_std = 0.02 / math.sqrt(2 * cfg.n_layers)  # GPT-2: scale the residual projections
        self.qkv = _linear(cfg, cfg.d_model, 3 * cfg.d_model, 0.02, rngs)
        self.out = _linear(cfg, cfg.d_model, cfg.d_model, residual_std, rngs)

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        B, L, D = x_BxLxD.shape
        qkv_BxLx3D = self.qkv(x_BxLxD)
        q_BxLxHxK, k_BxLxHxK, v_BxLxHxK = (
            t.reshape(B, L, self.n_heads, D // self.n_heads) for t in jnp.split(qkv_BxLx3D, 3, axis=-1)
        )
        y_BxLxHxK = jax.nn.dot_product_attention(
            q_BxLxHxK, k_BxLxHxK, v_BxLxHxK, is_causal=True, implementation=self.implementation
        )
        return self.out(y_BxLxHxK.reshape(B, L, D))


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d_ff = cfg.mlp_ratio * cfg.d_model
        self.up = _linear(cfg, cfg.d_model, d_ff, 0.02, rngs)
        self.down = _linear(cfg, d_ff, cfg.d_model, 0.02 / math.sqrt(2 * cfg.n_layers), rngs)

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        return self.down(jax.nn.gelu(self.up(x_BxLxD)))


class Block(nnx.Module):
    """Pre-norm: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.norm1 = _norm(cfg, rngs)
        self.attn = CausalSelfAttention(cfg, rngs)
        self.norm2 = _norm(cfg, rngs)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        x_BxLxD = x_BxLxD + self.attn(self.norm1(x_BxLxD))
        return x_BxLxD + self.mlp(self.norm2(x_BxLxD))


class GPT(nnx.Module):
    """Token embedding + learned positions, pre-norm blocks, final norm, output tied to the embedding."""

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
        self.pos_embed = nnx.Param(
            nnx.initializers.normal(0.01)(rngs.params(), (cfg.max_seq_len, cfg.d_model), cfg.param_dtype)
        )
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layers)])
        self.norm = _norm(cfg, rngs)

    def __call__(self, tokens_BxL: jax.Array) -> jax.Array:
        """Logits (float32) for the next token at every position."""
        L = tokens_BxL.shape[1]
        x_BxLxD = self.embed(tokens_BxL) + self.pos_embed[:L].astype(self.cfg.dtype)
        for block in self.blocks:
            x_BxLxD = block(x_BxLxD)
        logits_BxLxV = self.embed.attend(self.norm(x_BxLxD))
        return logits_BxLxV.astype(jnp.float32)


def lm_loss(model: nnx.Module, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """Next-token cross-entropy as (sum over weighted tokens, sum of weights).

    Returning sums, not a mean, is what lets the data-parallel step form the exact global
    token-weighted mean however unevenly padding falls across devices.
    """
    logits_BxLxV = model(batch["inputs"])
    nll_BxL = optax.softmax_cross_entropy_with_integer_labels(logits_BxLxV, batch["targets"])
    weights_BxL = batch["weights"].astype(jnp.float32)
    return jnp.sum(nll_BxL * weights_BxL), jnp.sum(weights_BxL)


def count_params(model: nnx.Module) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
