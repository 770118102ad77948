"""Preference data (data.format=preference): pairs of a chosen and a rejected answer to one prompt, for the
preference objectives (train.objective=dpo|ipo|simpo|orpo, jdp/preference.py).

A row is `prompt` + `chosen` + `rejected` as plain text, or in TRL's conversational form: message lists, `prompt`
the turns before the answers and `chosen` / `rejected` the answers (or, without a `prompt` column, two whole
conversations, whose shared first turns are the prompt). Each answer is tokenized as TRL's DPOTrainer tokenizes it:
the whole text (prompt + answer, plain text with the end-of-document token after it; a conversation rendered with
the tokenizer's chat template, data.chat_template as for data.format=chat), its answer the tokens after the longest
prefix it shares with the prompt's own tokens (the prompt rendered with the generation prompt). A plain-text
sequence starts with the end-of-document token, as data.format=prompt's examples do (TRL starts it with the
tokenizer's BOS where the tokenizer adds one).

A pair is one row of the batch: tokens (2, data.seq_len + 1), the chosen sequence first, each padded alone (not
packed: a pair's two answers are compared, not concatenated), with a weight per target token, 1 on the answer. The
batch's leading axis is the pairs, so the step's split over devices and micro-batches can never separate a pair's
two answers. A pair longer than a window is truncated at its end (data.overlong=truncate, as TRL's keep_start) or
dropped; one whose chosen or rejected answer keeps no token is dropped; each counted, none silently.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import numpy as np
from filelock import FileLock

from jdp.config import ConfigError, DataConfig
from jdp.data import formats
from jdp.data.chat import ChatTemplate, conversation
from jdp.data.corpus import cache_root
from jdp.data.dataset import GlobalOrder, Windows, digest
from jdp.data.tokens import Tokens
from jdp.log import logger

__all__ = ["Pairs", "PairBatches", "load_pairs", "pair_rows", "pair_tokens"]

log = logger("jdp.preference")

FORMAT_VERSION = 1


def _common(a, b) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n


def _split_prompt(row: dict, at: str) -> tuple:
    """(prompt, chosen, rejected) of a row: three texts, or three message lists (the prompt the shared turns of two
    whole conversations when there is no `prompt` column)."""
    chosen, rejected, prompt = row["chosen"], row["rejected"], row.get("prompt")
    if isinstance(chosen, str) and isinstance(rejected, str):
        if not isinstance(prompt, str | None):
            raise ConfigError(f"{at}: prompt is {prompt!r:.80}; with chosen and rejected as text it must be text too")
        return prompt or "", chosen, rejected
    if not (isinstance(chosen, list) and isinstance(rejected, list)):
        raise ConfigError(f"{at}: chosen and rejected must both be text or both message lists, not "
                          f"{type(chosen).__name__} and {type(rejected).__name__}")  # fmt: skip
    if prompt is None:
        n = 0
        while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
            n += 1
        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
    if not isinstance(prompt, list):
        raise ConfigError(f"{at}: prompt is {prompt!r:.80}; with chosen and rejected as message lists it must be one")
    for name, answer in (("chosen", chosen), ("rejected", rejected)):
        if not answer or not all(isinstance(m, dict) and m.get("role") == "assistant" for m in answer):
            raise ConfigError(f"{at}: the {name} answer (after the prompt's {len(prompt)} shared turns) must be "
                              f"assistant turns; it is {answer!r:.120}")  # fmt: skip
    return prompt, chosen, rejected


def pair_tokens(row: dict, tokenizer, template: ChatTemplate | None, at: str) -> tuple[list, int]:
    """([chosen ids, rejected ids], the prompt's length in them): TRL's tokenization (the module's docstring)."""
    prompt, chosen, rejected = _split_prompt(row, at)
    if isinstance(prompt, str):
        p, c, r = tokenizer.encode_batch([prompt, prompt + chosen, prompt + rejected])
        eod = [tokenizer.eod_id]
        seqs, p = [np.concatenate([eod, c, eod]), np.concatenate([eod, r, eod])], np.concatenate([eod, p])
    else:
        if template is None:
            raise ConfigError(f"{at}: a conversational pair needs a chat template (data.tokenizer's, or "
                              f"data.chat_template)")  # fmt: skip
        tools = row.get("tools")
        render = lambda m, **k: template.render(conversation(m, at, template.takes_parts), at=at, tools=tools, **k)  # noqa: E731
        texts = [render(prompt, add_generation_prompt=True), render(prompt + chosen), render(prompt + rejected)]
        p, *seqs = tokenizer.encode_batch(texts)
    seqs = [np.asarray(s, np.int64) for s in seqs]
    return seqs, min(_common(p, s) for s in seqs)


def pair_rows(seqs: list, prompt_len: int, size: int, eod_id: int) -> tuple[np.ndarray, np.ndarray, bool]:
    """A pair as tokens and answer weights (2 x size each), padded with eod and weight 0, and whether it was cut."""
    tokens, weights = np.full((2, size), eod_id, np.int64), np.zeros((2, size), np.uint8)
    for i, s in enumerate(seqs):
        n = min(len(s), size)
        tokens[i, :n] = s[:n]
        weights[i, prompt_len:n] = 1
    return tokens, weights, max(len(s) for s in seqs) > size


@dataclass
class Pairs:
    """Pairs as tokens and weights (n x 2 x seq_len+1), and what fitting them to windows did."""

    tokens: np.ndarray
    weights: np.ndarray
    truncated: int
    dropped: int
    reference: np.ndarray | None = None  # each pair's reference log-probabilities (train.precompute_reference)

    def batch(self, idx: np.ndarray) -> dict[str, np.ndarray]:
        """Pairs `idx` (-1: a padding pair, weight 0) as inputs, next-token targets and the targets' weights (and
        the reference's log-probabilities, `ref_logps`, where they were computed before training)."""
        valid = idx >= 0
        t = self.tokens[np.where(valid, idx, 0)].astype(np.int32)
        w = self.weights[np.where(valid, idx, 0), :, 1:].astype(np.float32) * valid[:, None, None]
        out = {"inputs": t[..., :-1], "targets": t[..., 1:], "weights": w}
        if self.reference is not None:
            out["ref_logps"] = self.reference[np.where(valid, idx, 0)].astype(np.float32)
        return out

    def eval_batches(self, batch_size: int, rows: slice):
        """Every pair once, in order, this process's rows; the last batch padded with weight-0 pairs."""
        for start in range(0, len(self.tokens), batch_size):
            idx = np.arange(start, start + batch_size)
            yield self.batch(np.where(idx < len(self.tokens), idx, -1)[rows])

    def describe(self) -> str:
        return (f"{len(self.tokens):,} pairs ({self.truncated} truncated, {self.dropped} dropped), "
                f"{int(self.weights.sum()):,} answer tokens")  # fmt: skip


def _fit(rows: list, cfg: DataConfig, eod_id: int, at: str) -> Pairs:
    size, tokens, weights, truncated, dropped, answerless = cfg.seq_len + 1, [], [], 0, 0, []
    for i, (seqs, prompt_len) in enumerate(rows):
        t, w, cut = pair_rows(seqs, prompt_len, size, eod_id)
        if cut and cfg.overlong == "drop" or not w[:, 1:].sum(axis=1).all():
            if not (cut and cfg.overlong == "drop"):
                answerless.append(i)
            dropped += 1
            continue
        truncated += cut
        tokens.append(t)
        weights.append(w)
    if answerless:  # said once, with the first few
        shown = ", ".join(map(str, answerless[:5])) + (", ..." if len(answerless) > 5 else "")
        log.warning(f"{at}: {len(answerless)} pair(s) ({shown}) keep no token of an answer in data.seq_len+1={size} "
                    f"tokens (their prompts fill it): dropped; raise data.seq_len to keep them")  # fmt: skip
    dtype = np.uint16 if eod_id < 1 << 16 and all(t.max() < 1 << 16 for t in tokens) else np.uint32
    shape = (0, 2, size)
    return Pairs(np.stack(tokens).astype(dtype) if tokens else np.zeros(shape, dtype),
                 np.stack(weights) if weights else np.zeros(shape, np.uint8), truncated, dropped)  # fmt: skip


def _tokenized(ds, tokenizer, cfg: DataConfig, template, where: str) -> list:
    return [pair_tokens(row, tokenizer, template, f"data.source={cfg.source}{where}, pair {i}") for i, row in enumerate(ds)]


def _template(corpus, cfg: DataConfig) -> ChatTemplate | None:
    first = corpus.train[0] if len(corpus.train) else {}
    return ChatTemplate.load(cfg) if isinstance(first.get("chosen"), list) else None


def load_pairs_split(corpus, tokenizer, cfg: DataConfig, seed: int) -> tuple[Pairs, Pairs]:
    """Training and validation pairs (validation: the validation split, or whole pairs held out, chosen by the seed,
    until their tokens reach data.val_tokens), cached like the other formats."""
    template = _template(corpus, cfg)
    val_print = corpus.val._fingerprint if corpus.val is not None else None
    key = json.dumps([FORMAT_VERSION, corpus.train._fingerprint, val_print, tokenizer.name, template.digest if template
                      else None, cfg.seq_len, cfg.overlong, cfg.val_tokens, seed])  # fmt: skip
    cache = cache_root(cfg) / f"pairs-{hashlib.sha256(key.encode()).hexdigest()[:16]}.npz"
    cache.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache) + ".lock"):
        if not cache.exists():
            train = _tokenized(corpus.train, tokenizer, cfg, template, "")
            if corpus.val is not None:
                val = _tokenized(corpus.val, tokenizer, cfg, template, " (validation split)")
            else:
                order, held, n = np.random.default_rng([seed, 1]).permutation(len(train)), set(), 0
                for i in order:
                    if n >= cfg.val_tokens or len(held) + 1 >= len(train):
                        break
                    held.add(int(i))
                    n += sum(len(s) for s in train[i][0])
                val = [train[i] for i in sorted(held)]
                train = [e for i, e in enumerate(train) if i not in held]
            parts = {"train": _fit(train, cfg, tokenizer.eod_id, f"data.source={cfg.source}"),
                     "val": _fit(val, cfg, tokenizer.eod_id, f"data.source={cfg.source} (validation)")}  # fmt: skip
            tmp = cache.with_suffix(".tmp.npz")
            np.savez(tmp, **{f"{k}_{f}": getattr(p, f) if f in ("tokens", "weights") else np.asarray(getattr(p, f))
                             for k, p in parts.items() for f in ("tokens", "weights", "truncated", "dropped")})  # fmt: skip
            tmp.rename(cache)
    with np.load(cache) as z:
        return tuple(Pairs(z[f"{k}_tokens"], z[f"{k}_weights"], int(z[f"{k}_truncated"]), int(z[f"{k}_dropped"]))
                     for k in ("train", "val"))  # fmt: skip


class PairBatches(Windows):
    """Global batch `step` of pairs is a pure function of (seed, step), every pair once per epoch (GlobalOrder), as
    for every other format; `eval_batches` every validation pair once."""

    def __init__(self, train: Pairs, val: Pairs, batch_size: int, seed: int):
        self.pairs, self.val, self.batch_size = train, val, batch_size
        self.n = len(train.tokens)
        self.order = GlobalOrder(self.n, batch_size, seed)

    def local_batch(self, step: int, rows: slice) -> dict[str, np.ndarray]:
        return self.pairs.batch(self.order.indices(step)[rows])

    def epoch(self, step: int) -> float:
        return self.order.epoch(step)

    def eval_sets(self, data) -> list:
        return [("", self.val.eval_batches(self.batch_size, data.rows))] if len(self.val.tokens) else []

    def describe(self) -> str:
        return f"train {self.pairs.describe()} | val {self.val.describe()}"

    def fingerprint(self, data) -> dict[str, dict]:
        p, v = self.pairs, self.val
        return {"": {"pairs": len(p.tokens), "val_pairs": len(v.tokens),
                     "sha256": digest(p.tokens, p.weights, v.tokens, v.weights)}}  # fmt: skip

    def banner(self, data) -> str:
        return f"{self.describe()} | {data.describe_tokenizer()}"

    def every_pair(self, rows: slice) -> dict[str, tuple[int, object]]:
        """Each set's number of pairs and its batches, every pair once in order (this process's rows)."""
        return {name: (len(p.tokens), p.eval_batches(self.batch_size, rows)) for name, p in
                (("train", self.pairs), ("val", self.val))}  # fmt: skip

    def use_reference(self, logps: dict[str, np.ndarray]) -> None:
        """Give each set's pairs their reference log-probabilities (every_pair's order), to put in every batch."""
        for name, p in (("train", self.pairs), ("val", self.val)):
            if logps[name].shape != (len(p.tokens), 2):
                raise ConfigError(f"the reference log-probabilities are for {logps[name].shape[0]} {name} pairs, the "
                                  f"data has {len(p.tokens)}: the data changed since they were computed")  # fmt: skip
            p.reference = logps[name]


def load_pairs(corpus, tokenizer, cfg: DataConfig, batch_size: int, seed: int, rows: slice, rank: int, world: int):
    """data.format=preference: the pairs, each a row of the batch; its validation pairs are its own (the returned
    validation tokens are empty)."""
    train, val = load_pairs_split(corpus, tokenizer, cfg, seed)
    if train.truncated or train.dropped:
        log.warning(f"data.overlong={cfg.overlong}: {train.describe()}")
    if len(train.tokens) < batch_size:
        raise ConfigError(
            f"data.source={cfg.source}: {train.describe()}, fewer than one global batch (train.batch_size="
            f"{batch_size} pairs); use more pairs, a longer data.seq_len or a smaller batch"
        )
    if cfg.val_tokens > 0 and not len(val.tokens):
        raise ConfigError(f"data.source={cfg.source}: no validation pairs ({val.describe()}); raise data.val_tokens "
                          f"or set it to 0")  # fmt: skip
    return PairBatches(train, val, batch_size, seed), Tokens(np.zeros(0, np.uint16), np.zeros(0, np.uint16), len(train.tokens), 0)


formats.attach("preference", load_pairs)
