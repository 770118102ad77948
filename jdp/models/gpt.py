"""jdp's GPT family: a GPT-2-style decoder-only transformer in Flax NNX (learned positions, LayerNorm, GELU MLP,
multi-head attention, biases by model.bias), and what jdp asks of the family (jdp/models/__init__.py's Family). It
never mentions devices or meshes.

Dimension glossary: B batch, L sequence length, N = B * L tokens, D model width, H heads, K head width (D / H),
F MLP width, V vocabulary, P positions (max_seq_len).
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
from flax import nnx

from jdp.attention import attention
from jdp.models.common import mask_padded_vocab, pad_id_of, token_embedding
from jdp.models.config import ModelConfig
from jdp.models.hf_names import Architecture

__all__ = ["GPT", "MLP", "Block", "CausalSelfAttention"]

NAME, TITLE = "gpt", "GPT"
KEYS = ("mlp_ratio", "bias")  # its own model.* keys, besides the shared ones


def problems(m: ModelConfig) -> list[str]:
    """Nothing beyond the shared checks and the other families' keys (jdp/models/__init__.py)."""
    return []


def build(m: ModelConfig, rngs: nnx.Rngs) -> GPT:
    return GPT(m, rngs)


def ff_width(m: ModelConfig) -> int:
    """F = mlp_ratio x d_model."""
    return m.mlp_ratio * m.d_model


def block_matmul_params(m: ModelConfig) -> int:
    """q, k, v and the output projection (4 D^2), the MLP's up and down (2 D F)."""
    D = m.d_model
    return 2 * D * m.n_heads * m.head_width + 2 * D * m.kv_heads * m.head_width + 2 * D * ff_width(m)


def block_activation_bytes(m: ModelConfig, tokens: int, itemsize: int) -> int:
    """In the compute dtype: the residual stream into both norms (2 ND), both norm outputs (2 ND), q, k and v
    (3 ND), the attention output (ND), and the MLP's up-projection, its tanh (GELU's backward uses it) and the GELU
    output (3 r ND); in float32, the mean and 1/std of both norms (jdp/plan.py's activation_bytes)."""
    N, D = tokens, m.d_model
    norm_stats = 2 * 2 * N * 4
    return (8 + 3 * m.mlp_ratio) * N * D * itemsize + norm_stats


def block_projection_bytes(m: ModelConfig, tokens: int, itemsize: int) -> int:
    """Under model.remat=dots: the block's input (ND) and its projections' outputs, q, k and v (3 ND), the
    attention's output projection (ND), the MLP's up (r ND) and down (ND) projections."""
    return (6 + m.mlp_ratio) * tokens * m.d_model * itemsize


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

    def decode_qkv(self, x_NxD: jax.Array, positions_BxL: jax.Array, tables=None) -> tuple[jax.Array, ...]:
        """q, k and v (each BxLxHxK) from the block's own norm and projection."""
        B, L = positions_BxL.shape
        H = self.attn.n_heads
        qkv_BxLx3xHxK = self.attn.qkv(self.norm1(x_NxD)).reshape(B, L, 3, H, x_NxD.shape[-1] // H)
        return tuple(qkv_BxLx3xHxK[:, :, i] for i in range(3))

    def decode_finish(self, x_NxD: jax.Array, y_NxHK: jax.Array) -> jax.Array:
        """The block after attention: the output projection and residual, then the norm, MLP and residual."""
        x_NxD = x_NxD + self.attn.out(y_NxHK)
        return x_NxD + self.mlp(self.norm2(x_NxD))


class GPT(nnx.Module):
    """Token embedding + learned positions, pre-norm blocks, final norm, output tied to the embedding."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = token_embedding(cfg, rngs)
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
        return self.logits(x_NxD).reshape(B, L, -1)

    def logits(self, x_NxD: jax.Array) -> jax.Array:
        """The final norm and the output projection (tied to the embedding), in float32."""
        return mask_padded_vocab(self.embed.attend(self.norm(x_NxD)).astype(jnp.float32), self.cfg)

    # ---- the KV-cache decoder's pieces (jdp/decode.py's Decodable) ----

    def decode_tables(self) -> None:
        """Nothing to compute once per sampling call: the positions are learned."""
        return None

    def decode_embed(self, tokens_BxL: jax.Array, positions_BxL: jax.Array) -> jax.Array:
        """The tokens' embeddings plus their positions' (each row its own), N x D."""
        x_BxLxD = self.embed(tokens_BxL) + self.pos_embed[...][positions_BxL].astype(self.cfg.dtype)
        return x_BxLxD.reshape(-1, x_BxLxD.shape[-1])


# ---- Hugging Face: GPT-2 is this family with biases (model.bias=true) -----------------------------------------------------------------------------------------------------

_GELU_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")  # jax.nn.gelu(approximate=True), one formula


def _gpt2_fields(hf: dict) -> tuple[dict, list[str]]:
    d = hf.get("n_embd", 768)
    problems = []
    if hf.get("activation_function", "gelu_new") not in _GELU_TANH:
        problems.append(f"activation_function {hf['activation_function']!r} (jdp's MLP uses tanh GELU, gelu_new)")
    if (n_inner := hf.get("n_inner")) is not None and n_inner % d:
        problems.append(f"n_inner {n_inner} is not a multiple of n_embd {d}")
    if not hf.get("scale_attn_weights", True) or hf.get("scale_attn_by_inverse_layer_idx", False):
        problems.append("attention scaled other than by 1/sqrt(head width)")
    if not hf.get("tie_word_embeddings", True):
        problems.append("tie_word_embeddings false (jdp's output layer is the embedding)")
    fields = {
        "vocab_size": hf.get("vocab_size", 50257),
        "max_seq_len": hf.get("n_positions", 1024),
        "d_model": d,
        "n_layers": hf.get("n_layer", 12),
        "n_heads": hf.get("n_head", 12),
        "mlp_ratio": (hf.get("n_inner") or 4 * d) // d,
        "bias": True,
        "arch": "gpt",
        "norm_eps": hf.get("layer_norm_epsilon", 1e-5),
        "pad_id": pad_id_of(hf, hf.get("vocab_size", 50257)),
    }
    return fields, problems


def _gpt2_config(m: ModelConfig) -> dict:
    return {
        "n_positions": m.max_seq_len,
        "n_embd": m.d_model,
        "n_layer": m.n_layers,
        "n_head": m.n_heads,
        "n_inner": m.mlp_ratio * m.d_model,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": m.norm_eps,
        "resid_pdrop": 0.0,  # jdp trains without dropout
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "tie_word_embeddings": True,
    }


GPT2 = Architecture(
    model_type="gpt2",
    class_name="GPT2LMHeadModel",
    family="gpt",
    prefix="transformer.",
    top={
        "wte.weight": ("embed", "embedding"),
        "wpe.weight": ("pos_embed",),
        "ln_f.weight": ("norm", "scale"),
        "ln_f.bias": ("norm", "bias"),
    },
    block={
        "ln_1.weight": ("norm1", "scale"),
        "ln_1.bias": ("norm1", "bias"),
        "attn.c_attn.weight": ("attn", "qkv", "kernel"),
        "attn.c_attn.bias": ("attn", "qkv", "bias"),
        "attn.c_proj.weight": ("attn", "out", "kernel"),
        "attn.c_proj.bias": ("attn", "out", "bias"),
        "ln_2.weight": ("norm2", "scale"),
        "ln_2.bias": ("norm2", "bias"),
        "mlp.c_fc.weight": ("mlp", "up", "kernel"),
        "mlp.c_fc.bias": ("mlp", "up", "bias"),
        "mlp.c_proj.weight": ("mlp", "down", "kernel"),
        "mlp.c_proj.bias": ("mlp", "down", "bias"),
    },
    blocks="h",
    buffers=re.compile(r"h\.\d+\.attn\.(bias|masked_bias)$"),
    embedding="wte.weight",
    tied_output="lm_head.weight",
    transposed=frozenset(),  # Conv1D stores [in, out], as Flax does
    bias_key="bias",
    fields=_gpt2_fields,
    hf_config=_gpt2_config,
)
HF_ARCHITECTURES = (GPT2,)  # what jdp/hf.py imports into this family and exports it as
