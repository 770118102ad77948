"""A third model family, defined outside jdp/ (tests/test_families.py registers it): GPT-J's parallel block, one
RMSNorm feeding attention and a GeGLU MLP side by side, x + attn(norm(x)) + mlp(norm(x)); learned positions, a tied
output. Nothing under jdp/ names it: jdp asks it, through jdp.models.register(this module).

Dimension glossary: B batch, L sequence length, N = B * L tokens, D model width, H heads, K head width, F MLP width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jdp.attention import attention
from jdp.models.common import mask_padded_vocab

NAME, TITLE = "parallel", "Parallel"
KEYS = ("mlp_ratio",)  # GPT's key too: a key may belong to several families


def problems(m) -> list[str]:
    """A refusal of its own, so the tests can see the family is asked."""
    if m.mlp_ratio < 2:
        return [f"model.mlp_ratio={m.mlp_ratio}: Parallel's GeGLU needs model.mlp_ratio >= 2"]
    return []


def build(m, rngs: nnx.Rngs) -> ParallelLM:
    return ParallelLM(m, rngs)


def ff_width(m) -> int:
    return m.mlp_ratio * m.d_model // 2  # GeGLU: two input matrices, the parameters of a GELU MLP of mlp_ratio


def block_matmul_params(m) -> int:
    """q, k, v and the output projection (4 D^2), GeGLU's gate, up and down (3 D F)."""
    return 4 * m.d_model * m.d_model + 3 * m.d_model * ff_width(m)


def block_activation_bytes(m, tokens: int, itemsize: int) -> int:
    """The residual stream and the norm output (2 ND), q, k, v and the attention output (4 ND), GeGLU's gate, up,
    GELU(gate) and its tanh and their product (5 NF); one float32 1/rms."""
    N, D, F = tokens, m.d_model, ff_width(m)
    return (6 * N * D + 5 * N * F) * itemsize + N * 4


def _linear(m, d_in: int, d_out: int, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(d_in, d_out, use_bias=False, dtype=m.dtype, param_dtype=m.param_dtype,
                      kernel_init=nnx.initializers.normal(0.02), rngs=rngs)  # fmt: skip


class Block(nnx.Module):
    def __init__(self, m, rngs: nnx.Rngs):
        D, F = m.d_model, ff_width(m)
        self.H, self.kind = m.n_heads, m.attention
        self.norm = nnx.RMSNorm(D, epsilon=m.norm_eps, dtype=m.dtype, param_dtype=m.param_dtype, rngs=rngs)
        self.qkv = _linear(m, D, 3 * D, rngs)
        self.out = _linear(m, D, D, rngs)
        self.gate, self.up, self.down = _linear(m, D, F, rngs), _linear(m, D, F, rngs), _linear(m, F, D, rngs)

    def mlp(self, h_NxD: jax.Array) -> jax.Array:
        return self.down(jax.nn.gelu(self.gate(h_NxD)) * self.up(h_NxD))

    def __call__(self, x_NxD, B: int, L: int, segments_BxL=None) -> jax.Array:
        h_NxD = self.norm(x_NxD)
        q, k, v = self.decode_qkv(x_NxD, jnp.zeros((B, L), jnp.int32))
        y_NxD = attention(q, k, v, self.kind, segments_BxL).reshape(B * L, -1)
        return x_NxD + self.out(y_NxD) + self.mlp(h_NxD)

    def decode_qkv(self, x_NxD, positions_BxL, tables=None):
        B, L = positions_BxL.shape
        D = x_NxD.shape[-1]
        qkv_BxLx3xHxK = self.qkv(self.norm(x_NxD)).reshape(B, L, 3, self.H, D // self.H)
        return tuple(qkv_BxLx3xHxK[:, :, i] for i in range(3))

    def decode_finish(self, x_NxD, y_NxD):
        return x_NxD + self.out(y_NxD) + self.mlp(self.norm(x_NxD))


class ParallelLM(nnx.Module):
    def __init__(self, m, rngs: nnx.Rngs):
        self.cfg = m
        self.embed = nnx.Embed(m.vocab_size, m.d_model, dtype=m.dtype, param_dtype=m.param_dtype,
                               embedding_init=nnx.initializers.normal(0.02), rngs=rngs)  # fmt: skip
        self.pos_embed = nnx.Param(nnx.initializers.normal(0.01)(rngs.params(), (m.max_seq_len, m.d_model)))
        self.blocks = nnx.List([Block(m, rngs) for _ in range(m.n_layers)])
        self.norm = nnx.RMSNorm(m.d_model, epsilon=m.norm_eps, dtype=m.dtype, param_dtype=m.param_dtype, rngs=rngs)

    def __call__(self, tokens_BxL, segments_BxL=None, positions_BxL=None):
        B, L = tokens_BxL.shape
        positions_BxL = jnp.broadcast_to(jnp.arange(L), (B, L)) if positions_BxL is None else positions_BxL
        x_NxD = self.decode_embed(tokens_BxL, positions_BxL)
        for block in self.blocks:
            x_NxD = block(x_NxD, B, L, segments_BxL)
        return self.logits(x_NxD).reshape(B, L, -1)

    def logits(self, x_NxD):
        return mask_padded_vocab(self.embed.attend(self.norm(x_NxD)).astype(jnp.float32), self.cfg)

    def decode_tables(self):
        return None

    def decode_embed(self, tokens_BxL, positions_BxL):
        x_BxLxD = self.embed(tokens_BxL) + self.pos_embed[...][positions_BxL].astype(self.cfg.dtype)
        return x_BxLxD.reshape(-1, x_BxLxD.shape[-1])
