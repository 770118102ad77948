"""Sampling for any model family whose model is `Decodable` (jdp's GPT and Llama are): with a KV cache (prefill
the prompts once, then one token per step), and the windowed forward that re-reads the whole context for every
token (the reference, and the path past max_seq_len).

Dimension glossary: B batch (prompts), T prompt columns (the longest prompt; shorter ones are padded on the left),
C cache length, L tokens fed in one call (a prefill chunk, or 1 per step), N = B * L, Y layers, H query heads,
G key/value heads, R = H / G, K head width, D model width, V vocabulary, P positions (model.max_seq_len).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jdp.errors import ConfigError

__all__ = ["Decodable", "KVCache", "cache_length", "check_prompts", "check_sampling", "pick", "sample"]

_MIN_CACHE = 64  # cache lengths are powers of two from here (capped at P): few compiled programs, little waste
_PREFILL_CHUNK = 64  # prompt columns read per prefill step: a short prompt costs one chunk, not the whole cache


class KVCache(NamedTuple):
    """Every layer's keys and values, YxBxGxCxK each; column c of row b holds that row's token at position
    c - (row b's left padding)."""

    k: jax.Array
    v: jax.Array

    def write(self, layer: int, k_BxLxGxK: jax.Array, v_BxLxGxK: jax.Array, column: jax.Array) -> KVCache:
        """Columns [column, column + L) of `layer` (the same columns in every row: the prompts are left-padded)."""
        at = (layer, 0, 0, column, 0)
        k = jax.lax.dynamic_update_slice(self.k, k_BxLxGxK.transpose(0, 2, 1, 3)[None].astype(self.k.dtype), at)
        v = jax.lax.dynamic_update_slice(self.v, v_BxLxGxK.transpose(0, 2, 1, 3)[None].astype(self.v.dtype), at)
        return KVCache(k, v)


def check_sampling(max_new_tokens: int, temperature: float, top_k: int) -> None:
    if max_new_tokens < 0 or not temperature >= 0 or top_k < 0:
        raise ConfigError(
            f"need max_new_tokens >= 0, temperature >= 0 (0: greedy) and top_k >= 0 (0: no limit); got "
            f"{max_new_tokens}, {temperature}, {top_k}"
        )


def check_prompts(prompts: Sequence[Sequence[int]], max_seq_len: int) -> None:
    """Refuse an empty batch, an empty prompt or one longer than the model's context, naming which."""
    if not prompts:
        raise ConfigError("no prompts to continue")
    for i, ids in enumerate(prompts):
        which = "the prompt" if len(prompts) == 1 else f"prompt {i + 1} of {len(prompts)}"
        if not len(ids):
            raise ConfigError(f"{which} is empty (it encodes to no tokens)")
        if len(ids) > max_seq_len:
            raise ConfigError(
                f"{which} is {len(ids)} tokens, longer than the model's context (model.max_seq_len={max_seq_len}); "
                "shorten it"
            )


def cache_length(prompt_columns: int, max_new_tokens: int, max_seq_len: int) -> int:
    """Columns the cache needs for the prompts and the tokens fed back (all but the last drawn), rounded up to a
    power of two (at least 64), and never more than max_seq_len: one compiled program serves many lengths."""
    needed = prompt_columns + max(max_new_tokens, 1) - 1
    return min(max(_MIN_CACHE, 1 << (needed - 1).bit_length()), max_seq_len)


def pick(logits_BxV: jax.Array, key: jax.Array, index, temperature, top_k: int, n_vocab: int) -> jax.Array:
    """Token `index` of every row: argmax at temperature 0, else sampled from the top_k (0: all) with the key
    fold_in(key, index), the same for every row, so a row draws as it would alone."""
    logits_BxV = jnp.where(jnp.arange(logits_BxV.shape[-1]) < n_vocab, logits_BxV, -jnp.inf)  # padding ids never
    if top_k:
        kth_Bx1 = jax.lax.top_k(logits_BxV, top_k)[0][:, -1:]
        logits_BxV = jnp.where(logits_BxV < kth_Bx1, -jnp.inf, logits_BxV)
    # Token i's key depends on (seed, i) only, so a longer generation starts with the shorter one's text.
    row_key = jax.random.fold_in(key, index)
    sampled_B = jax.vmap(lambda l_V: jax.random.categorical(row_key, l_V / jnp.maximum(temperature, 1e-6)))(logits_BxV)
    return jnp.where(temperature > 0, sampled_B, jnp.argmax(logits_BxV, axis=-1)).astype(jnp.int32)


# ---- the model's own layers, with attention over the cache ----------------------------------------------------


@runtime_checkable
class Decodable(Protocol):
    """What the KV-cache decoder asks of a model (each family's model class gives it; jdp/models/): `cfg` (its
    ModelConfig: n_layers, kv_heads, head_width, max_seq_len, vocab_size, dtype), `blocks` (each with
    `decode_qkv(x_NxD, positions_BxL, tables)` -> q BxLxHxK, k and v BxLxGxK, and `decode_finish(x_NxD, y_NxHK)`
    -> the block's output), and the three below."""

    cfg: Any
    blocks: Any

    def decode_tables(self) -> Any:
        """What every block's decode_qkv needs of the positions, computed once per call (Llama's rotary tables)."""

    def decode_embed(self, tokens_BxL: jax.Array, positions_BxL: jax.Array) -> jax.Array:
        """The tokens at their positions (each row its own), as the model's first layer makes them: NxD."""

    def logits(self, x_NxD: jax.Array) -> jax.Array:
        """The final norm and output projection, float32, as the model's __call__ ends."""


def _attend(q_BxLxHxK: jax.Array, k_BxGxCxK: jax.Array, v_BxGxCxK: jax.Array, visible_BxLxC: jax.Array) -> jax.Array:
    """softmax(q k^T / sqrt(K) + mask) v over the cache's columns, in jdp/attention.py's precisions (scores, softmax
    and weighted sums in float32, the output in the compute dtype); each key/value head serves its R query heads
    (Hugging Face's repeat_kv)."""
    B, L, H, K = q_BxLxHxK.shape
    G = k_BxGxCxK.shape[1]
    q_BxGxRxLxK = (q_BxLxHxK * (K**-0.5)).transpose(0, 2, 1, 3).reshape(B, G, H // G, L, K)
    scores = jnp.einsum("bgrlk,bgck->bgrlc", q_BxGxRxLxK, k_BxGxCxK, preferred_element_type=jnp.float32)
    mask = jnp.where(visible_BxLxC, 0.0, -1e9).astype(scores.dtype)[:, None, None]
    probs = jax.nn.softmax(scores + mask, axis=-1)
    y = jnp.einsum("bgrlc,bgck->bgrlk", probs.astype(v_BxGxCxK.dtype), v_BxGxCxK, preferred_element_type=jnp.float32)
    return y.astype(v_BxGxCxK.dtype).reshape(B, H, L, K).transpose(0, 2, 1, 3)


def _forward(model: Decodable, tables, tokens_BxL, column, read_column, pad_B, cache: KVCache):
    """Feed tokens at cache columns [column, column + L): write their keys and values, attend each to its row's
    columns from its first real token up to itself, and return the logits at `read_column` (BxV) and the cache."""
    B, L = tokens_BxL.shape
    columns_L = column + jnp.arange(L)
    positions_BxL = jnp.clip(columns_L[None, :] - pad_B[:, None], 0, model.cfg.max_seq_len - 1)  # pads: 0, unread
    keys_1x1xC = jnp.arange(cache.k.shape[3])[None, None, :]
    visible_BxLxC = (keys_1x1xC <= columns_L[None, :, None]) & (keys_1x1xC >= pad_B[:, None, None])
    x_NxD = model.decode_embed(tokens_BxL, positions_BxL)
    for layer, block in enumerate(model.blocks):
        q_BxLxHxK, k_BxLxGxK, v_BxLxGxK = block.decode_qkv(x_NxD, positions_BxL, tables)
        cache = cache.write(layer, k_BxLxGxK, v_BxLxGxK, column)
        y_BxLxHxK = _attend(q_BxLxHxK, cache.k[layer], cache.v[layer], visible_BxLxC)
        x_NxD = block.decode_finish(x_NxD, y_BxLxHxK.reshape(B * L, -1))
    x_BxD = jax.lax.dynamic_index_in_dim(x_NxD.reshape(B, L, -1), read_column - column, axis=1, keepdims=False)
    return model.logits(x_BxD), cache


def _prefill(model: Decodable, tables, tokens_BxC, pad_B, T, cache: KVCache):
    """Read the prompts (columns [0, T)) into the cache in chunks of Q columns, in a loop whose length is traced:
    the last chunk starts at C - Q at the latest (recomputing columns already read gives the same keys and values),
    and the columns it reads past T - 1 are overwritten before any query sees them. The logits at column T - 1."""
    B, C = tokens_BxC.shape
    Q = min(_PREFILL_CHUNK, C)

    def chunk(j, carry):
        start = jnp.minimum(j * Q, C - Q)
        tokens_BxQ = jax.lax.dynamic_slice_in_dim(tokens_BxC, start, Q, axis=1)
        return _forward(model, tables, tokens_BxQ, start, jnp.clip(T - 1, start, start + Q - 1), pad_B, carry[1])

    logits_BxV = jnp.zeros((B, model.cfg.vocab_size), jnp.float32)
    return jax.lax.fori_loop(0, (T + Q - 1) // Q, chunk, (logits_BxV, cache))


# One compiled program per (batch, cache length): the prompt columns, the number of tokens, the seed, the
# temperature and the end-of-document id are all traced values.
@functools.partial(jax.jit, static_argnames=("graphdef", "top_k", "n_vocab"))
def _decode(graphdef, state, tokens_BxC, pad_B, T, n, key, temperature, eod, *, top_k: int, n_vocab: int):
    """Tokens 0..n-1 of every row (out_BxC[:, :n]): the prefill reads the prompts (they end at column T - 1), then
    step i feeds token i - 1 at column T + i - 1; the loop stops early once every row has drawn `eod`."""
    model = nnx.merge(graphdef, state)
    cfg = model.cfg
    B, C = tokens_BxC.shape
    zeros = jnp.zeros((cfg.n_layers, B, cfg.kv_heads, C, cfg.head_width), cfg.dtype)
    tables = model.decode_tables()  # once, not per step
    logits_BxV, cache = _prefill(model, tables, tokens_BxC, pad_B, T, KVCache(zeros, zeros))
    first_B = pick(logits_BxV, key, 0, temperature, top_k, n_vocab)
    out_BxC = jnp.zeros((B, C), jnp.int32).at[:, 0].set(first_B)

    def more(carry) -> jax.Array:
        i, _, _, done_B = carry
        return (i < n) & ~jnp.all(done_B)

    def step(carry):
        i, out_BxC, cache, done_B = carry
        column = T + i - 1
        fed_Bx1 = jax.lax.dynamic_slice_in_dim(out_BxC, i - 1, 1, axis=1)
        logits_BxV, cache = _forward(model, tables, fed_Bx1, column, column, pad_B, cache)
        token_B = pick(logits_BxV, key, i, temperature, top_k, n_vocab)
        out_BxC = jax.lax.dynamic_update_slice_in_dim(out_BxC, token_B[:, None], i, axis=1)
        return i + 1, out_BxC, cache, done_B | (token_B == eod)

    _, out_BxC, _, _ = jax.lax.while_loop(more, step, (jnp.int32(1), out_BxC, cache, first_B == eod))
    return out_BxC


# The reference: every token runs the whole forward on a fixed-size window and reads the logits at its row's last
# position; one compiled program serves every position and prompt length.
@functools.partial(jax.jit, static_argnames=("graphdef", "top_k", "n_vocab"))
def _window_step(graphdef, state, window_BxP, pos_B, key, index, temperature, *, top_k: int, n_vocab: int):
    """The token after window[b, pos_B[b]] for each row b (positions after it are never seen: causal attention)."""
    logits_BxPxV = nnx.merge(graphdef, state)(window_BxP)
    return pick(logits_BxPxV[jnp.arange(window_BxP.shape[0]), pos_B], key, index, temperature, top_k, n_vocab)


@dataclasses.dataclass(frozen=True)
class _Draw:
    """What every sampling call of one `sample` shares: the model split for jit, and the sampling settings."""

    graphdef: nnx.GraphDef
    state: nnx.State
    key: jax.Array
    temperature: float
    top_k: int
    n_vocab: int
    eod: int | None
    P: int
    rows: Any = None  # a sharding that splits the prompts' rows over devices (the model whole on each); None: one


def _sample_cached(d: _Draw, prompts: Sequence[Sequence[int]], max_new_tokens: int):
    """(tokens drawn with the cache, each row's tokens up to its eod, which rows drew eod): as many tokens as fit
    in the context of the longest prompt."""
    T = max(len(ids) for ids in prompts)
    n = min(max_new_tokens, d.P - T + 1)  # the last token fed back sits at position T + n - 2 <= P - 1
    tokens_BxC = np.zeros((len(prompts), cache_length(T, max_new_tokens, d.P)), np.int32)
    for row, ids in enumerate(prompts):
        tokens_BxC[row, T - len(ids) : T] = ids
    pad_B = np.asarray([T - len(ids) for ids in prompts], np.int32)
    if d.rows is not None:  # each device decodes its rows (the same program, split by the batch's sharding)
        tokens_BxC, pad_B = jax.device_put(tokens_BxC, d.rows), jax.device_put(pad_B, d.rows)
    eod = -1 if d.eod is None else d.eod
    out_BxC = _decode(
        d.graphdef, d.state, tokens_BxC, pad_B, T, n, d.key, d.temperature, eod, top_k=d.top_k, n_vocab=d.n_vocab
    )
    new, done = [], []
    for row in np.asarray(out_BxC)[:, :n].tolist():
        stop = row.index(eod) if eod in row else n
        new.append(row[:stop])
        done.append(stop < n)
    return n, new, done


def _sample_windowed(d: _Draw, prompts, new: list[list[int]], done: list[bool], start: int, max_new_tokens: int):
    """Tokens start..max_new_tokens-1 of the rows not done, appended to `new`, each from the row's last P tokens."""
    window_BxP = np.zeros((len(prompts), d.P), np.int32)
    pos_B = np.zeros(len(prompts), np.int32)
    for i in range(start, max_new_tokens):
        if all(done):
            break
        for row, ids in enumerate(prompts):
            context = (list(ids) + new[row])[-d.P :]  # once the context is full, the window slides
            window_BxP[row, : len(context)] = context
            pos_B[row] = len(context) - 1
        tokens_B = _window_step(
            d.graphdef, d.state, window_BxP, pos_B, d.key, i, d.temperature, top_k=d.top_k, n_vocab=d.n_vocab
        )
        for row, token in enumerate(np.asarray(tokens_B).tolist()):
            if not done[row]:
                done[row] = token == d.eod
                if not done[row]:
                    new[row].append(token)


def sample(
    model: Decodable,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int = 40,
    seed: int = 0,
    *,
    n_vocab: int = 0,
    eod: int | None = None,
    cache: bool = True,
    rows=None,
) -> list[list[int]]:
    """Each prompt's continuation (token ids), stopped before `eod` if drawn; ids from n_vocab on (0: the model's
    vocabulary) are never drawn. A prompt continues as it would alone, whatever it is batched with.

    cache=True prefills the prompts (left-padded to the longest) and draws one token per step from a KV cache while
    the longest row fits in model.max_seq_len; past that the model sees each row's last max_seq_len tokens, and every
    token re-reads that window (the cached keys were computed from earlier windows). cache=False is that windowed
    forward from the first token: the reference, equal greedy tokens. `rows`: a sharding of the batch's leading axis
    over several devices, each decoding its rows with the model whole on it (the prompts a multiple of them).
    """
    check_sampling(max_new_tokens, temperature, top_k)
    if not isinstance(model, Decodable):
        raise ConfigError(
            f"sampling needs a model with the KV-cache decoder's pieces (jdp.decode.Decodable: decode_tables, "
            f"decode_embed, logits, and decode_qkv and decode_finish on each block); a {type(model).__name__} has not"
        )
    P, V = model.cfg.max_seq_len, model.cfg.vocab_size
    check_prompts(prompts, P)
    n_vocab = min(n_vocab or V, V)
    graphdef, state = nnx.split(model)
    d = _Draw(graphdef, state, jax.random.key(seed), float(temperature), min(top_k, n_vocab), n_vocab, eod, P, rows)
    new, done, start = [[] for _ in prompts], [False] * len(prompts), 0
    if cache and max_new_tokens:
        start, new, done = _sample_cached(d, prompts, max_new_tokens)
    _sample_windowed(d, prompts, new, done, start, max_new_tokens)
    return new
