"""A GPT-style decoder-only transformer in Flax NNX, and `make_model`, the config's model (GPT or Llama, llama.py); it
never mentions devices or meshes.

Dimension glossary: B batch, L sequence length, N = B * L tokens, D model width, H heads, K head width (D / H),
F MLP width, V vocabulary, P positions (max_seq_len).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jdp.attention import attention
from jdp.config import ConfigError, ModelConfig, model_problems
from jdp.llama import Llama

__all__ = ["GPT", "MLP", "Block", "CausalSelfAttention", "count_params", "lm_loss", "make_model"]


def _linear(cfg: ModelConfig, d_in: int, d_out: int, std: float, rngs: nnx.Rngs) -> nnx.Linear:
    # By default no biases in the projections (as in PaLM, LLaMA, nanoGPT's bias=False). The key bias in
    # particular has an exactly-zero gradient (softmax ignores a constant shift), which Adam turns rounding noise
    # into full-size updates of. model.bias=true adds them (GPT-2 has them; they start at zero).
    return nnx.Linear(
        d_in,
        d_out,
        use_bias=cfg.bias,
        dtype=cfg.dtype,
        param_dtype=cfg.param_dtype,
        kernel_init=nnx.initializers.normal(std),
        rngs=rngs,
    )


def _norm(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(cfg.d_model, epsilon=cfg.norm_eps, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)


class CausalSelfAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.n_heads = cfg.n_heads
        self.attention = cfg.attention
        residual_std = 0.02 / math.sqrt(2 * cfg.n_layers)  # GPT-2: scale the residual projections
        self.qkv = _linear(cfg, cfg.d_model, 3 * cfg.d_model, 0.02, rngs)
        self.out = _linear(cfg, cfg.d_model, cfg.d_model, residual_std, rngs)

    def __call__(self, x_NxD: jax.Array, B: int, L: int, segments_BxL: jax.Array | None = None) -> jax.Array:
        D = x_NxD.shape[-1]
        H, K = self.n_heads, D // self.n_heads
        qkv_Nx3D = self.qkv(x_NxD)
        q, k, v = qkv_Nx3D.reshape(B, L, 3, H, K).transpose(2, 0, 1, 3, 4)  # each BxLxHxK
        return self.out(attention(q, k, v, self.attention, segments_BxL).reshape(B * L, D))


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d_ff = cfg.mlp_ratio * cfg.d_model
        self.up = _linear(cfg, cfg.d_model, d_ff, 0.02, rngs)
        self.down = _linear(cfg, d_ff, cfg.d_model, 0.02 / math.sqrt(2 * cfg.n_layers), rngs)

    def __call__(self, x_NxD: jax.Array) -> jax.Array:
        return self.down(jax.nn.gelu(self.up(x_NxD)))


class Block(nnx.Module):
    """Pre-norm: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.norm1 = _norm(cfg, rngs)
        self.attn = CausalSelfAttention(cfg, rngs)
        self.norm2 = _norm(cfg, rngs)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x_NxD: jax.Array, B: int, L: int, segments_BxL: jax.Array | None = None) -> jax.Array:
        x_NxD = x_NxD + self.attn(self.norm1(x_NxD), B, L, segments_BxL)
        return x_NxD + self.mlp(self.norm2(x_NxD))


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

    def __call__(
        self, tokens_BxL: jax.Array, segments_BxL: jax.Array | None = None, positions_BxL: jax.Array | None = None
    ) -> jax.Array:
        """Logits (float32) for the next token at every position. With `segments_BxL` and `positions_BxL`
        (data.document_attention=within) attention stays within each document and positions restart at each."""
        B, L = tokens_BxL.shape
        positions = self.pos_embed[:L] if positions_BxL is None else self.pos_embed[...][positions_BxL]
        x_BxLxD = self.embed(tokens_BxL) + positions.astype(self.cfg.dtype)
        # Between attentions the tokens are one flat axis, so every projection is a plain 2-D matrix multiply
        # (XLA on CPU runs the 3-D weight-gradient contractions at half the speed).
        x_NxD = x_BxLxD.reshape(B * L, -1)
        for block in self.blocks:
            x_NxD = block(x_NxD, B, L, segments_BxL)
        logits_NxV = self.embed.attend(self.norm(x_NxD)).astype(jnp.float32)
        V, valid = self.cfg.vocab_size, self.cfg.vocab_valid
        if 0 < valid < V:  # the rows padded onto an imported vocabulary never get probability
            logits_NxV = jnp.where(jnp.arange(V) < valid, logits_NxV, -1e30)
        return logits_NxV.reshape(B, L, -1)


def make_model(m: ModelConfig, rngs: nnx.Rngs) -> GPT | Llama:
    """The model `m` describes: jdp's GPT (model.arch=gpt) or the Llama family (llama); refused in the config's
    words when its keys do not fit together (as validate refuses them for `jdp train`)."""
    families = {"gpt": GPT, "llama": Llama}
    if m.arch not in families:
        raise ConfigError(f"model.arch={m.arch!r} must be one of {', '.join(families)}")
    if problems := model_problems(m):
        raise ConfigError("invalid model config:\n  " + "\n  ".join(problems))
    return families[m.arch](m, rngs)


def lm_loss(model: nnx.Module, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """Next-token cross-entropy as (sum over weighted tokens, sum of weights).

    Returning sums, not a mean, is what lets the data-parallel step form the exact global
    token-weighted mean however unevenly padding falls across devices.
    """
    if "segments" in batch:  # data.document_attention=within: each document of a packed window on its own
        logits_BxLxV = model(batch["inputs"], batch["segments"], batch["positions"])
    else:
        logits_BxLxV = model(batch["inputs"])
    nll_BxL = optax.softmax_cross_entropy_with_integer_labels(logits_BxLxV, batch["targets"])
    weights_BxL = batch["weights"].astype(jnp.float32)
    return jnp.sum(nll_BxL * weights_BxL), jnp.sum(weights_BxL)


def count_params(model: nnx.Module) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
