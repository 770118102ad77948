"""The Llama decoder family (Llama 2/3, Qwen2, Mistral without a sliding window, SmolLM) in Flax NNX, and what jdp
asks of the family (jdp/models/__init__.py's Family).

Rotary positions, RMSNorm, a SwiGLU MLP and grouped-query attention, computed as Hugging Face transformers'
LlamaForCausalLM computes them, so its weights import by name and a plain transpose (jdp/hf.py). It never mentions
devices or meshes.

Dimension glossary: B batch, L sequence length, N = B * L tokens, D model width, H query heads, G key/value heads,
K head width, F MLP width, V vocabulary.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jdp.attention import attention
from jdp.models.common import mask_padded_vocab, pad_id_of, token_embedding
from jdp.models.config import ModelConfig
from jdp.models.hf_names import Architecture

__all__ = ["MLP", "Attention", "Block", "Llama", "RMSNorm", "rope", "rope_frequencies", "rope_tables"]

NAME, TITLE = "llama", "Llama"
# its own model.* keys, besides the shared ones
KEYS = ("n_kv_heads", "d_ff", "head_dim", "rope_theta", "rope_scaling", "rope_factor", "rope_low_freq_factor",
        "rope_high_freq_factor", "rope_original_max_len", "qkv_bias", "tie_embeddings")  # fmt: skip
NAMED_REFUSALS = ("bias", "mlp_ratio")  # GPT's keys, refused below in Llama's words
_LLAMA3_ONLY = ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_len")


def problems(m: ModelConfig) -> list[str]:
    """Llama's keys that do not fit together, or GPT's set for a Llama (each with Llama's way to say it)."""
    problems, default = [], ModelConfig()
    if m.bias:
        problems.append(
            "model.bias=true with model.arch=llama: Llama has no biases on o_proj or the MLP; for biases on q, k and v "
            "(Qwen2) set model.qkv_bias=true instead"
        )
    if m.mlp_ratio != default.mlp_ratio:
        problems.append(
            f"model.mlp_ratio={m.mlp_ratio} is GPT's MLP width; Llama's is model.d_ff (leave mlp_ratio out)"
        )
    if m.n_kv_heads and m.n_heads % m.n_kv_heads:
        problems.append(
            f"model.n_kv_heads={m.n_kv_heads} does not divide model.n_heads={m.n_heads}; use a divisor (1: multi-query, "
            f"{m.n_heads}: multi-head)"
        )
    if m.head_width % 2:
        where = f"model.head_dim={m.head_dim}" if m.head_dim else f"model.d_model / model.n_heads = {m.head_width}"
        problems.append(f"{where} is odd; RoPE rotates pairs of dimensions: make each head's width even")
    if m.rope_scaling not in ("", "llama3"):
        problems.append(
            f'model.rope_scaling={m.rope_scaling!r}: jdp computes llama3 (Llama 3.1\'s) scaling or none (""); '
            f"a model with another scaling cannot be trained or imported exactly"
        )
    elif not m.rope_scaling:
        changed = [f"model.{k}={getattr(m, k)}" for k in _LLAMA3_ONLY if getattr(m, k) != getattr(default, k)]
        if changed:
            problems.append(
                f"{', '.join(changed)} without model.rope_scaling=llama3 would be unused; set both or neither"
            )
    elif m.rope_high_freq_factor <= m.rope_low_freq_factor:
        problems.append(
            f"model.rope_high_freq_factor={m.rope_high_freq_factor} must be more than model.rope_low_freq_factor="
            f"{m.rope_low_freq_factor} (llama3 scaling blends the wavelengths between them)"
        )
    return problems


def build(m: ModelConfig, rngs: nnx.Rngs) -> Llama:
    return Llama(m, rngs)


def ff_width(m: ModelConfig) -> int:
    """F = model.d_ff, or 8/3 d_model rounded up to a multiple of 64 (Llama's rule)."""
    return m.d_ff or -(-8 * m.d_model // (3 * 64)) * 64


def block_matmul_params(m: ModelConfig) -> int:
    """The query and output projections (2 D H K), the key and value projections (2 D G K: G key/value heads of
    width K), SwiGLU's gate, up and down (3 D F)."""
    D = m.d_model
    return 2 * D * m.n_heads * m.head_width + 2 * D * m.kv_heads * m.head_width + 3 * D * ff_width(m)


def block_activation_bytes(m: ModelConfig, tokens: int, itemsize: int) -> int:
    """In the compute dtype: the residual stream and the norm outputs (4 ND), q (NHK), k and v (2 NGK), q and k
    after RoPE (NHK + NGK), the attention output (NHK), SwiGLU's gate, up and silu(gate) * up (3 NF: silu is
    recomputed); in float32, one 1/rms per norm."""
    N, D, H, G, K, F = tokens, m.d_model, m.n_heads, m.kv_heads, m.head_width, ff_width(m)
    return (4 * N * D + 3 * N * H * K + 3 * N * G * K + 3 * N * F) * itemsize + 2 * N * 4


def block_projection_bytes(m: ModelConfig, tokens: int, itemsize: int) -> int:
    """Under model.remat=dots: the block's input (ND) and its projections' outputs, q (NHK), k and v (2 NGK), the
    output projection (ND), SwiGLU's gate and up (2 NF) and down (ND) projections."""
    N, D, H, G, K, F = tokens, m.d_model, m.n_heads, m.kv_heads, m.head_width, ff_width(m)
    return (3 * N * D + N * H * K + 2 * N * G * K + 2 * N * F) * itemsize


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
    Face's q_proj and k_proj import without a permutation). The halves are swapped by a flip, the sign folded into
    sin: the same numbers as rotate_half's slices and concatenation, whose gradient XLA made a pad of each half
    and a sum (with _swiglu's recomputation, 3% off a llama-tiny step on a CPU: docs/performance.md)."""
    *lead, K = x_BxLxHxK.shape
    swapped = jnp.flip(x_BxLxHxK.reshape(*lead, 2, K // 2), -2).reshape(x_BxLxHxK.shape)
    signed = jnp.concatenate([-sin_LxK[..., : K // 2], sin_LxK[..., K // 2 :]], axis=-1)
    return x_BxLxHxK * cos_LxK[..., None, :] + swapped * signed[..., None, :]  # LxK, or BxLxK per sequence


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


@jax.checkpoint
def _swiglu(gate_NxF: jax.Array, up_NxF: jax.Array) -> jax.Array:
    """silu(gate) * up, its sigmoid recomputed in the backward pass from gate and up (kept anyway, the projections'
    outputs), as torch.compile's partitioner does: the forward is one elementwise pass, not three (XLA keeps each
    intermediate the backward reads, each a pass over NxF). The same numbers either way."""
    return jax.nn.silu(gate_NxF) * up_NxF


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        D, F = cfg.d_model, ff_width(cfg)
        self.gate = _linear(cfg, D, F, 0.02, rngs)
        self.up = _linear(cfg, D, F, 0.02, rngs)
        self.down = _linear(cfg, F, D, 0.02 / math.sqrt(2 * cfg.n_layers), rngs)

    def __call__(self, x_NxD: jax.Array) -> jax.Array:
        return self.down(_swiglu(self.gate(x_NxD), self.up(x_NxD)))


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

    def decode_qkv(self, x_NxD: jax.Array, positions_BxL: jax.Array, rope_PxK) -> tuple[jax.Array, ...]:
        """q (BxLxHxK), k and v (BxLxGxK) from the block's own norm and projections, q and k rotated by the rows of
        rope_PxK = (cos, sin) at each token's position."""
        B, L = positions_BxL.shape
        H, G, K, attn = self.attn.H, self.attn.G, self.attn.K, self.attn
        h_NxD = self.attn_norm(x_NxD)
        # Each token its own row's position: rope() broadcasts one table row per token over a batch of one.
        cos_NxK, sin_NxK = (table_PxK[positions_BxL.reshape(-1)] for table_PxK in rope_PxK)
        q_BxLxHxK = rope(attn.q(h_NxD).reshape(1, B * L, H, K), cos_NxK, sin_NxK).reshape(B, L, H, K)
        k_BxLxGxK = rope(attn.k(h_NxD).reshape(1, B * L, G, K), cos_NxK, sin_NxK).reshape(B, L, G, K)
        return q_BxLxHxK, k_BxLxGxK, attn.v(h_NxD).reshape(B, L, G, K)

    def decode_finish(self, x_NxD: jax.Array, y_NxHK: jax.Array) -> jax.Array:
        """The block after attention: the output projection and residual, then the norm, MLP and residual."""
        x_NxD = x_NxD + self.attn.o(y_NxHK)
        return x_NxD + self.mlp(self.mlp_norm(x_NxD))


class Llama(nnx.Module):
    """Token embedding, pre-norm blocks, final RMSNorm, output tied to the embedding or a separate lm_head.

    The parameter tree is an interface (jdp/hf.py maps Hugging Face's names onto it): embed, blocks[i].{attn_norm,
    attn.{q,k,v,o}, mlp_norm, mlp.{gate,up,down}}, norm, and lm_head only when model.tie_embeddings is false.
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = token_embedding(cfg, rngs)
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
        return self.logits(x_NxD).reshape(B, L, -1)

    def logits(self, x_NxD: jax.Array) -> jax.Array:
        """The final norm and the output projection (the embedding's, or lm_head), in float32."""
        x_NxD = self.norm(x_NxD)
        logits = self.embed.attend(x_NxD) if self.cfg.tie_embeddings else self.lm_head(x_NxD)
        return mask_padded_vocab(logits.astype(jnp.float32), self.cfg)

    # ---- the KV-cache decoder's pieces (jdp/decode.py's Decodable) ----

    def decode_tables(self) -> tuple[jax.Array, jax.Array]:
        """cos and sin of every position (PxK), computed once per sampling call, not per token."""
        return rope_tables(self.cfg, self.cfg.max_seq_len, self.cfg.dtype)

    def decode_embed(self, tokens_BxL: jax.Array, positions_BxL: jax.Array) -> jax.Array:
        """The tokens' embeddings, N x D (the positions rotate q and k instead)."""
        x_BxLxD = self.embed(tokens_BxL)
        return x_BxLxD.reshape(-1, x_BxLxD.shape[-1])


# ---- Hugging Face: Llama, Qwen2 and Mistral read into this family ------------------------------------------------------------------------------------------

# config.json's defaults where a key is missing: the transformers classes' (LlamaConfig, Qwen2Config, MistralConfig)
_LLAMA_DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
                   "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False}  # fmt: skip
_DEFAULTS = {
    "llama": _LLAMA_DEFAULTS,
    "qwen2": {**_LLAMA_DEFAULTS, "vocab_size": 151936, "intermediate_size": 22016, "max_position_embeddings": 32768},
    "mistral": {**_LLAMA_DEFAULTS, "intermediate_size": 14336, "num_key_value_heads": 8,
                "max_position_embeddings": 131072, "sliding_window": 4096},
}  # fmt: skip
# llama3 RoPE scaling's keys in config.json -> jdp's
_LLAMA3_KEYS = {"factor": "rope_factor", "low_freq_factor": "rope_low_freq_factor",
                "high_freq_factor": "rope_high_freq_factor", "original_max_position_embeddings": "rope_original_max_len"}  # fmt: skip


def _rope_fields(hf: dict, default_theta: float) -> tuple[dict, list[str]]:
    """RoPE's fields from transformers v4's `rope_theta` + `rope_scaling` or v5's `rope_parameters` (or both, agreeing)."""
    legacy, params, theta = hf.get("rope_scaling"), hf.get("rope_parameters"), hf.get("rope_theta")
    problems = []
    for key, value in (("rope_scaling", legacy), ("rope_parameters", params)):
        if value is not None and not isinstance(value, dict):
            return {}, [f"{key} {value!r} (expected a mapping, e.g. {{'rope_type': 'llama3', ...}})"]
    if params and params.get("rope_theta") is not None:
        if theta is not None and theta != params["rope_theta"]:
            problems.append(f"rope_theta {theta} and rope_parameters.rope_theta {params['rope_theta']} disagree")
        theta = params["rope_theta"]
    fields = {"rope_theta": float(default_theta if theta is None else theta), "rope_scaling": ""}
    kinds = {}
    for key, value in (("rope_scaling", legacy), ("rope_parameters", params)):
        if value:
            kinds[key] = value.get("rope_type", value.get("type", "default"))
    if len(set(kinds.values())) > 1:
        problems.append(f"rope_scaling type {kinds['rope_scaling']!r} and rope_parameters type "
                        f"{kinds['rope_parameters']!r} disagree")  # fmt: skip
        return fields, problems
    key, kind = next(iter(kinds.items()), ("rope_scaling", "default"))
    scaling = legacy or params
    if kind == "llama3":
        fields["rope_scaling"] = "llama3"
        for theirs, ours in _LLAMA3_KEYS.items():
            if scaling.get(theirs) is None:
                problems.append(f"{key}.{theirs} missing (llama3 RoPE scaling needs it)")
            else:
                fields[ours] = type(getattr(ModelConfig(), ours))(scaling[theirs])
    elif kind != "default":
        problems.append(f"{key} type {kind!r} (jdp computes plain RoPE and llama3 scaling; not linear, dynamic, "
                        f"yarn, longrope or others)")  # fmt: skip
    if (partial := (scaling or {}).get("partial_rotary_factor", 1.0)) != 1.0:
        problems.append(f"{key}.partial_rotary_factor {partial} (jdp rotates every dimension of a head)")
    return fields, problems


def _sliding_window_problems(hf: dict, model_type: str, positions: int) -> list[str]:
    """Sliding-window attention is refused: jdp attends to every earlier position (a window at least as long as
    the model's positions is no window)."""
    problems = []
    if model_type == "qwen2" and hf.get("use_sliding_window"):
        problems.append("use_sliding_window true (sliding-window attention; jdp attends to every earlier position)")
    if model_type == "mistral":
        window = hf.get("sliding_window", _DEFAULTS["mistral"]["sliding_window"])
        if window is not None and window < positions:
            problems.append(
                f"sliding_window {window} (shorter than max_position_embeddings {positions}: sliding-window "
                f"attention, which jdp does not compute; Mistral v0.2 and later have none)"
            )
    if any(kind != "full_attention" for kind in hf.get("layer_types") or []):
        problems.append(f"layer_types {sorted(set(hf['layer_types']))} (jdp computes full_attention only)")
    return problems


def _llama_fields(hf: dict) -> tuple[dict, list[str]]:
    model_type = hf["model_type"]
    defaults = _DEFAULTS[model_type]
    get = lambda key: hf[key] if hf.get(key) is not None else defaults.get(key)  # noqa: E731  (null: the default)
    D, H = get("hidden_size"), get("num_attention_heads")
    G, K = get("num_key_value_heads") or H, get("head_dim") or (D // H if H else 0)
    problems = []
    if (act := get("hidden_act")) not in ("silu", "swish"):
        problems.append(f"hidden_act {act!r} (jdp's SwiGLU MLP uses silu)")
    if model_type != "qwen2" and hf.get("attention_bias"):
        problems.append("attention_bias true (biases on q, k, v and o_proj; jdp has q/k/v biases only, as Qwen2)")
    if hf.get("mlp_bias"):
        problems.append("mlp_bias true (jdp's MLP has no biases)")
    if hf.get("quantization_config"):
        problems.append("quantization_config (a quantized checkpoint; jdp reads float weights: give the original)")
    if H and G and H % G:
        problems.append(f"num_key_value_heads {G} does not divide num_attention_heads {H}")
    positions = get("max_position_embeddings")
    problems += _sliding_window_problems(hf, model_type, positions)
    rope, rope_problems = _rope_fields(hf, defaults["rope_theta"])
    fields = {
        "arch": "llama",
        "vocab_size": get("vocab_size"),
        "max_seq_len": positions,
        "d_model": D,
        "n_layers": get("num_hidden_layers"),
        "n_heads": H,
        "n_kv_heads": 0 if G == H else G,  # 0: as many as the query heads
        "head_dim": 0 if H and K * H == D else K,  # 0: d_model / n_heads
        "d_ff": get("intermediate_size"),
        "norm_eps": float(get("rms_norm_eps")),
        "qkv_bias": model_type == "qwen2",  # Qwen2's q/k/v projections always have biases, its o_proj never
        "tie_embeddings": bool(get("tie_word_embeddings")),
        "pad_id": pad_id_of(hf, get("vocab_size")),
        "bias": False,
        **rope,
    }
    return fields, problems + rope_problems


def _llama_config(m: ModelConfig) -> dict:
    """The keys transformers v4 and v5 both read: RoPE as v4's rope_theta + rope_scaling and as v5's
    rope_parameters, the same values."""
    scaling = None
    if m.rope_scaling == "llama3":
        scaling = {"rope_type": "llama3", **{theirs: getattr(m, ours) for theirs, ours in _LLAMA3_KEYS.items()}}
    return {
        "hidden_size": m.d_model,
        "intermediate_size": ff_width(m),
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.kv_heads,
        "head_dim": m.head_width,
        "max_position_embeddings": m.max_seq_len,
        "rms_norm_eps": m.norm_eps,
        "hidden_act": "silu",
        "tie_word_embeddings": m.tie_embeddings,
        "rope_theta": m.rope_theta,
        "rope_scaling": scaling,
        "rope_parameters": {**(scaling or {"rope_type": "default"}), "rope_theta": m.rope_theta},
        "attention_dropout": 0.0,  # jdp trains without dropout
        "mlp_bias": False,
    }


def _llama(model_type: str, class_name: str, biases: bool, config: Callable[[ModelConfig], dict]) -> Architecture:
    attn = {f"self_attn.{x}_proj.weight": ("attn", x, "kernel") for x in "qkvo"}
    if biases:
        attn |= {f"self_attn.{x}_proj.bias": ("attn", x, "bias") for x in "qkv"}
    mlp = {f"mlp.{x}_proj.weight": ("mlp", x, "kernel") for x in ("gate", "up", "down")}
    block = {"input_layernorm.weight": ("attn_norm", "scale"), **attn,
             "post_attention_layernorm.weight": ("mlp_norm", "scale"), **mlp}  # fmt: skip
    return Architecture(
        model_type=model_type,
        class_name=class_name,
        family="llama",
        prefix="model.",
        top={
            "embed_tokens.weight": ("embed", "embedding"),
            "norm.weight": ("norm", "scale"),
            "lm_head.weight": ("lm_head", "kernel"),
        },
        block=block,
        blocks="layers",
        buffers=re.compile(r"layers\.\d+\.self_attn\.rotary_emb\.inv_freq$"),
        embedding="embed_tokens.weight",
        tied_output="lm_head.weight",
        transposed=frozenset([*(k for k in block if k.endswith("_proj.weight")), "lm_head.weight"]),  # nn.Linear
        bias_key="qkv_bias" if biases else "",
        fields=_llama_fields,
        hf_config=config,
    )


LLAMA = _llama("llama", "LlamaForCausalLM", False, lambda m: {**_llama_config(m), "attention_bias": False})
# Qwen2: no layer has a window (max_window_layers: the layers from this one on would, with use_sliding_window)
QWEN2 = _llama("qwen2", "Qwen2ForCausalLM", True,
               lambda m: {**_llama_config(m), "use_sliding_window": False, "sliding_window": None,
                          "max_window_layers": m.n_layers, "layer_types": ["full_attention"] * m.n_layers})  # fmt: skip
MISTRAL = _llama("mistral", "MistralForCausalLM", False, lambda m: {**_llama_config(m), "sliding_window": None})
HF_ARCHITECTURES = (LLAMA, QWEN2, MISTRAL)  # what jdp/hf.py imports into this family; the first exports
