"""What every family's model shares: the token embedding, the next-token loss, the parameter count, the padded
vocabulary's mask."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jdp.models.config import ModelConfig

__all__ = ["TokenEmbedding", "count_params", "lm_loss", "mask_padded_vocab", "pad_id_of", "token_embedding"]


class TokenEmbedding(nnx.Embed):
    """nnx.Embed whose lookups of `pad_id` pass no gradient to that row (transformers' padding_idx: a fine-tune of
    an imported model leaves the padding token's row as the lookup found it; a tied output layer still trains it,
    as there). The values it computes are nnx.Embed's."""

    def __init__(self, *args, pad_id: int = -1, **kwargs):
        super().__init__(*args, **kwargs)
        self.pad_id = pad_id

    def __call__(self, inputs: jax.Array) -> jax.Array:
        out = super().__call__(inputs)
        if self.pad_id < 0:
            return out
        return jnp.where((inputs == self.pad_id)[..., None], jax.lax.stop_gradient(out), out)


def token_embedding(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Embed:
    """The token embedding every family starts with (normal(0.02), as GPT-2's and Llama's initializers)."""
    return TokenEmbedding(
        cfg.vocab_size,
        cfg.d_model,
        dtype=cfg.dtype,
        param_dtype=cfg.param_dtype,
        embedding_init=nnx.initializers.normal(0.02),
        rngs=rngs,
        pad_id=cfg.pad_id,
    )


def pad_id_of(hf: dict, vocab_size: int) -> int:
    """config.json's pad_token_id as model.pad_id (-1 when it has none, or one outside the vocabulary)."""
    pad = hf.get("pad_token_id")
    return pad if isinstance(pad, int) and not isinstance(pad, bool) and 0 <= pad < vocab_size else -1


def mask_padded_vocab(logits_NxV: jax.Array, cfg: ModelConfig) -> jax.Array:
    """The rows padded onto an imported vocabulary (model.vocab_valid on) never get probability."""
    V, valid = cfg.vocab_size, cfg.vocab_valid
    if 0 < valid < V:
        return jnp.where(jnp.arange(V) < valid, logits_NxV, -1e30)
    return logits_NxV


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
