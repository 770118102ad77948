"""Fine-tuning data (data.format=chat or prompt): examples whose loss falls only on the answer, packed whole into
windows.

chat: a `messages` column (a list of {role, content}, tool calls and tool results as the template renders them; a
`tools` column, if any, is passed to the template) rendered with the tokenizer's own chat template, without
`transformers`; which tokens are answers is chat.py's (transformers' assistant mask where the template marks them,
the same rule where it does not), found by character offsets in the tokenization of the whole conversation, so the
tokens are exactly the whole text's.
prompt: `prompt` and `completion` columns; the completion and an end-of-document token are the answer.

Each example is [end-of-document] + its tokens (the end-of-document token starts it, as data.document_attention=within
reads it), with a weight per token: 1 on the answer, 0 elsewhere. Examples are packed in order, whole, into windows
of data.seq_len + 1 tokens, the rest of a window padded with weight 0; one longer than a window is truncated or
dropped (data.overlong) and counted, never cut silently.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from filelock import FileLock

from jdp.config import ConfigError, DataConfig
from jdp.data import formats
from jdp.data.chat import ChatTemplate, chat_example, role_counts, roles_note
from jdp.data.corpus import cache_root
from jdp.data.dataset import GlobalOrder, Windows, digest
from jdp.data.stream import Shards, decoded
from jdp.data.tokens import Tokens
from jdp.log import logger

__all__ = ["ChatTemplate", "ExampleBatches", "Examples", "chat_example", "load_examples", "load_windows", "pack"]

log = logger("jdp.sft")

FORMAT_VERSION = 3  # 2: answers as transformers marks them (chat.py); 3: content parts read as text


def prompt_example(prompt: str, completion: str, tokenizer) -> tuple[np.ndarray, np.ndarray]:
    p, c = (np.asarray(x, np.int64) for x in tokenizer.encode_batch([prompt or "", completion or ""]))
    ids = np.concatenate([p, c, [tokenizer.eod_id]])
    return ids, np.concatenate([np.zeros(len(p), np.uint8), np.ones(len(c) + 1, np.uint8)])


@dataclass
class Examples:
    """Packed windows of examples: tokens and weights (n x seq_len+1), and what packing did."""

    tokens: np.ndarray
    weights: np.ndarray
    n_examples: int
    truncated: int
    dropped: int
    answer_tokens: int

    def batch(self, idx: np.ndarray) -> dict[str, np.ndarray]:
        """Windows `idx` (-1: a zero-weight padding row) as inputs, next-token targets and the targets' weights."""
        valid = idx >= 0
        rows = np.where(valid, idx, 0)
        t = self.tokens[rows].astype(np.int32)
        w = self.weights[rows, 1:].astype(np.float32) * valid[:, None]
        return {"inputs": t[:, :-1], "targets": t[:, 1:], "weights": w}

    def eval_batches(self, batch_size: int, rows: slice):
        """Every window once, in order, this process's rows; the last batch padded with zero-weight rows."""
        n = len(self.tokens)
        for start in range(0, n, batch_size):
            idx = np.arange(start, start + batch_size)
            yield self.batch(np.where(idx < n, idx, -1)[rows])

    def describe(self) -> str:
        cut = f"{self.truncated} truncated, {self.dropped} dropped (longer than a window, data.overlong)"
        return f"{self.n_examples:,} examples in {len(self.tokens):,} windows ({cut}), {self.answer_tokens:,} answer tokens"


def pack(examples: list[tuple[np.ndarray, np.ndarray]], seq_len: int, eod_id: int, overlong: str) -> Examples:
    """Whole examples, in order, each after an end-of-document token, into windows of seq_len + 1 tokens."""
    size = seq_len + 1
    tokens, weights, row_t, row_w = [], [], [], []
    truncated = dropped = kept = 0

    def close():
        pad = size - sum(len(x) for x in row_t)
        tokens.append(np.concatenate([*row_t, np.full(pad, eod_id, np.int64)]))
        weights.append(np.concatenate([*row_w, np.zeros(pad, np.uint8)]))
        row_t.clear()
        row_w.clear()

    for ids, w in examples:
        ids, w = np.concatenate([[eod_id], ids]), np.concatenate([[0], w]).astype(np.uint8)
        if len(ids) > size:
            if overlong == "drop":
                dropped += 1
                continue
            ids, w, truncated = ids[:size], w[:size], truncated + 1
        if sum(len(x) for x in row_t) + len(ids) > size:
            close()
        row_t.append(ids)
        row_w.append(w)
        kept += 1
    if row_t:
        close()
    dtype = np.uint16 if eod_id < 1 << 16 and all(t.max() < 1 << 16 for t in tokens) else np.uint32
    t = np.stack(tokens).astype(dtype) if tokens else np.zeros((0, size), dtype)
    w = np.stack(weights) if weights else np.zeros((0, size), np.uint8)
    return Examples(t, w, kept, truncated, dropped, int(w[:, 1:].sum()))


def row_example(row: dict, tokenizer, cfg: DataConfig, template: ChatTemplate | None,
                at: str) -> tuple[np.ndarray, np.ndarray, bool]:  # fmt: skip
    """One row of fine-tuning data as (token ids, answer weights, whether it has an answer); `at` names the row in
    errors."""
    if cfg.format == "chat":
        if not isinstance(messages := row["messages"], list):
            raise ConfigError(f"{at}: messages is {messages!r:.80}, not a list of {{role, content}} mappings")
        ids, w = chat_example(messages, template, tokenizer, at, row.get("tools"))
        return ids, w, any(isinstance(m, dict) and m.get("role") == "assistant" for m in messages)
    for key in ("prompt", "completion"):
        if not isinstance(row[key], str) and not (key == "prompt" and row[key] is None):  # no prompt: ""
            raise ConfigError(
                f"{at}: {key} is {row[key]!r:.80}, not text"
                + (" (an example without an answer would train only the end-of-document token: give it one "
                   "or drop the example)" if key == "completion" and row[key] is None else "")
            )  # fmt: skip
    ids, w = prompt_example(row["prompt"], row["completion"], tokenizer)
    return ids, w, bool(row["completion"].strip())


def _unanswered(cfg: DataConfig) -> tuple[str, str, str]:
    """What examples without an answer are, what one of them lacks, and what it trains."""
    if cfg.format == "chat":
        return "conversations have no assistant turn", "has no assistant turn", "nothing"
    return "examples have an empty completion", "has an empty completion", "only the end-of-document token"


def _examples(ds, tokenizer, cfg: DataConfig, template: ChatTemplate | None, where: str) -> list:
    out, empty, roles = [], [], Counter()
    for i, row in enumerate(ds):
        ids, w, answered = row_example(row, tokenizer, cfg, template, f"data.source={cfg.source}{where}, example {i}")
        out.append((ids, w))
        if not answered:
            empty.append(i)
            roles += role_counts(row["messages"]) if cfg.format == "chat" else Counter()
    seen = f" ({roles_note(roles)})" if roles else ""
    if empty and len(empty) == len(out):
        chat = cfg.format == "chat"
        what = "no conversation has an assistant turn (role 'assistant')" if chat else "every completion is empty"
        raise ConfigError(f"data.source={cfg.source}{where}: {what}, so there is no answer to learn{seen}")
    if empty:
        what, _, trains = _unanswered(cfg)
        log.warning(f"data.source={cfg.source}{where}: {len(empty)} of {len(out)} {what} (examples "
                    f"{', '.join(map(str, empty[:5]))}{', ...' if len(empty) > 5 else ''}): each trains "
                    f"{trains}{seen}")  # fmt: skip
    return out


def load_examples(corpus, tokenizer, cfg: DataConfig, seed: int) -> tuple[Examples, Examples]:
    """Training and validation windows (validation: whole examples held out, chosen by the seed, until
    data.val_tokens; or the validation split), cached like the token streams."""
    template = ChatTemplate.load(cfg) if cfg.format == "chat" else None
    val_print = corpus.val._fingerprint if corpus.val is not None else None
    key = json.dumps([FORMAT_VERSION, corpus.train._fingerprint, val_print, tokenizer.name, cfg.format,
                      template.digest if template else None, cfg.seq_len, cfg.overlong, cfg.val_tokens, seed])  # fmt: skip
    cache = cache_root(cfg) / f"examples-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    cache.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache) + ".lock"):
        if not (cache / "meta.json").exists():
            _build(cache, corpus, tokenizer, cfg, seed, template)
    meta = json.loads((cache / "meta.json").read_text())
    parts = []
    for name in ("train", "val"):
        t, w = (np.load(cache / f"{name}_{k}.npy", mmap_mode="r") for k in ("tokens", "weights"))
        parts.append(Examples(t, w, **meta[name]))
    return parts[0], parts[1]


def _build(cache: Path, corpus, tokenizer, cfg: DataConfig, seed: int, template) -> None:
    train = _examples(corpus.train, tokenizer, cfg, template, "")
    if corpus.val is not None:
        val = _examples(corpus.val, tokenizer, cfg, template, " (validation split)")
    else:  # whole examples held out, in a seeded order, until data.val_tokens
        order = np.random.default_rng([seed, 1]).permutation(len(train))
        held, n = set(), 0
        for i in order:
            if n >= cfg.val_tokens:
                break
            held.add(int(i))
            n += len(train[i][0]) + 1
        if len(held) >= len(train):
            raise ConfigError(
                f"data.source={cfg.source}: holding out data.val_tokens={cfg.val_tokens:,} would leave no training "
                f"examples ({len(train)} in all); lower data.val_tokens or set it to 0"
            )
        val = [train[i] for i in sorted(held)]
        train = [e for i, e in enumerate(train) if i not in held]
    packed = {name: pack(examples, cfg.seq_len, tokenizer.eod_id, cfg.overlong)
              for name, examples in (("train", train), ("val", val))}  # fmt: skip
    tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        meta = {}
        for name, ex in packed.items():
            np.save(tmp / f"{name}_tokens.npy", ex.tokens)
            np.save(tmp / f"{name}_weights.npy", ex.weights)
            meta[name] = {k: getattr(ex, k) for k in ("n_examples", "truncated", "dropped", "answer_tokens")}
        (tmp / "meta.json").write_text(json.dumps(meta))
        tmp.rename(cache)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class ExampleBatches(Windows):
    """The training batches of packed examples: global batch `step` is a pure function of (seed, step), every
    window once per epoch (dataset.GlobalOrder), as for text; `eval_batches` every validation window once."""

    def __init__(self, train: Examples, val: Examples, batch_size: int, seed: int):
        self.examples, self.val, self.batch_size = train, val, batch_size
        self.n = len(train.tokens)
        self.order = GlobalOrder(self.n, batch_size, seed)

    def batch(self, step: int, rows: slice = slice(None)) -> dict[str, np.ndarray]:
        return self.examples.batch(self.order.indices(step)[rows])

    def local_batch(self, step: int, rows: slice) -> dict[str, np.ndarray]:
        return self.batch(step, rows)

    def epoch(self, step: int) -> float:
        return self.order.epoch(step)

    def eval_sets(self, data) -> list:
        return [("", self.val.eval_batches(self.batch_size, data.rows))]

    def describe(self) -> str:
        return f"train {self.examples.describe()} | val {self.val.describe()}"

    def fingerprint(self, data) -> dict[str, dict]:
        return {"": examples_fingerprint(self.examples, self.val)}

    def banner(self, data) -> str:
        return f"{self.describe()} | {data.describe_tokenizer()}"


def examples_fingerprint(train: Examples, val: Examples) -> dict:
    """The packed windows and their answer weights, training and validation, whole."""
    return {"windows": len(train.tokens), "val_windows": len(val.tokens),
            "sha256": digest(train.tokens, train.weights, val.tokens, val.weights)}  # fmt: skip


@dataclass
class ExampleSource:
    """Fine-tuning data as one source of a mixture (data.sources with data.format=chat or prompt): what
    mixture.MixtureBatches asks of a source (mixture.Source's methods), over its packed windows."""

    label: str
    train: Examples
    val: Examples
    seq_len: int

    n_empty = 0

    @property
    def n_docs(self) -> int:
        return self.train.n_examples

    def n_windows(self, seq_len: int) -> int:
        return len(self.train.tokens)

    def rows(self, idx: np.ndarray, seq_len: int) -> dict[str, np.ndarray]:
        return self.train.batch(idx)

    def eval_batches(self, seq_len: int, batch_size: int, rows: slice):
        return self.val.eval_batches(batch_size, rows) if len(self.val.tokens) else None

    @property
    def n_tokens(self) -> int:
        return len(self.train.tokens) * self.seq_len

    @property
    def n_val_tokens(self) -> int:
        return len(self.val.tokens) * self.seq_len

    def describe(self, n_windows: int) -> str:
        return self.train.describe()

    def fingerprint(self) -> dict:
        return examples_fingerprint(self.train, self.val)


def examples_source(corpus, tokenizer, sub: DataConfig, seed: int, label: str) -> ExampleSource:
    """data.format=chat or prompt as a data.sources entry: its examples packed (and cached) as data.source's."""
    train, val = load_examples(corpus, tokenizer, sub, seed)
    _check_examples(train, val, sub)
    return ExampleSource(label, train, val, sub.seq_len)


def _check_examples(train_ex: Examples, val_ex: Examples, cfg: DataConfig) -> None:
    if not len(train_ex.tokens):
        fix = f": {_longer(cfg, 'training')}" if train_ex.dropped else ""
        raise ConfigError(f"data.source={cfg.source}: no training window ({train_ex.describe()}){fix}")
    if train_ex.answer_tokens == 0:
        raise ConfigError(
            f"data.source={cfg.source}: no training example keeps a token of its answer ({train_ex.describe()}): "
            f"they are longer than data.seq_len={cfg.seq_len} and their answers come last; raise data.seq_len "
            f"(and model.max_seq_len)"
        )
    if train_ex.truncated or train_ex.dropped:
        log.warning(f"data.overlong={cfg.overlong}: {train_ex.describe()}")
    _check_val(val_ex, cfg)


def _longer(cfg: DataConfig, which: str) -> str:
    """What to do when data.overlong=drop dropped every `which` example."""
    return (f"every {which} example is longer than a window (data.seq_len+1={cfg.seq_len + 1} tokens) and "
            f"data.overlong=drop dropped it; raise data.seq_len (and model.max_seq_len), or set "
            f"data.overlong=truncate to keep each example's first data.seq_len+1 tokens")  # fmt: skip


def _check_val(val_ex: Examples, cfg: DataConfig) -> None:
    if cfg.val_tokens > 0 and not len(val_ex.tokens):
        if val_ex.dropped:
            raise ConfigError(f"data.source={cfg.source}: no validation window ({val_ex.describe()}): "
                              f"{_longer(cfg, 'validation')}")  # fmt: skip
        raise ConfigError(f"data.source={cfg.source}: no validation examples; raise data.val_tokens or set it to 0")


def load_windows(corpus, tokenizer, cfg: DataConfig, batch_size: int, seed: int, rows: slice, rank: int, world: int):
    """data.format=chat or prompt: examples packed whole into windows, the loss on their answers; their validation
    examples are theirs (the returned validation tokens are empty). Streamed (data.streaming=true): packed as read."""
    if cfg.streaming:
        train = stream_examples(corpus, tokenizer, cfg, rows.stop - rows.start, rank, world)
        return train, Tokens(np.zeros(0, np.uint16), np.zeros(0, np.uint16), 0, 0)
    train_ex, val_ex = load_examples(corpus, tokenizer, cfg, seed)
    _check_examples(train_ex, val_ex, cfg)
    if len(train_ex.tokens) < batch_size:
        raise ConfigError(
            f"data.source={cfg.source}: {train_ex.describe()}, fewer windows than one global batch "
            f"(train.batch_size={batch_size}); use more data, a longer data.seq_len or a smaller batch"
        )
    empty = Tokens(np.zeros(0, np.uint16), np.zeros(0, np.uint16), train_ex.n_examples, 0)
    return ExampleBatches(train_ex, val_ex, batch_size, seed), empty


# Streamed fine-tuning data (data.streaming=true): validation is the head of the stream (or its split), as for text;
# each process packs its own shards' examples as it reads them, by pack's rule; the open window travels in the
# position, so a resume is exact.


def _row_digest(row: dict, cfg: DataConfig) -> bytes:
    """What identifies an example: the columns it is made of."""
    columns = ("messages", "tools") if cfg.format == "chat" else ("prompt", "completion")
    text = json.dumps([row.get(c) for c in columns], sort_keys=True, default=str, ensure_ascii=False)
    return hashlib.sha1(text.encode("utf-8")).digest()


def hold_out_examples(ds, tokenizer, cfg: DataConfig, template) -> tuple[Examples, set[bytes]]:
    """The first examples of `ds`, up to data.val_tokens tokens, packed as validation windows, and their digests
    (training skips examples with the same columns when `ds` is the training stream itself)."""
    held, digests, total = [], set(), 0
    if cfg.val_tokens > 0:
        for i, row in enumerate(decoded(ds, cfg)):
            ids, w, _ = row_example(row, tokenizer, cfg, template, f"data.source={cfg.source}, streamed example {i}")
            held.append((ids, w))
            digests.add(_row_digest(row, cfg))
            total += len(ids) + 1
            if total >= cfg.val_tokens:
                break
        if not held:
            raise ConfigError(f"data.source={cfg.source}: the stream has no examples to hold out for validation")
    return pack(held, cfg.seq_len, tokenizer.eod_id, cfg.overlong), digests


class StreamExamples(Shards):
    """This process's rows of each global batch from its own shards of a stream of fine-tuning examples (Shards):
    each example rendered as for map-style data, packed whole into windows of seq_len + 1 tokens as it is read
    (pack's rule: a window is closed, padded with weight 0, when the next example does not fit). A long example is
    truncated or dropped (data.overlong) and an example without an answer trained as it is: each said as it happens
    on its process (the 1st, 10th, 100th, ... of each kind) and counted in the position. The open window travels in
    the position, so a resume continues it exactly."""

    SAID_AT = (1, 10, 100, 1000, 10000, 100000)

    def __init__(self, ds, tokenizer, cfg: DataConfig, rows: int, rank: int, world: int, exclude: set[bytes],
                 identity: dict, template, val: Examples):  # fmt: skip
        super().__init__(ds, cfg, rows, rank, world, exclude, identity)
        self.tokenizer, self.template, self.val = tokenizer, template, val
        self.size = cfg.seq_len + 1
        self.open_tokens: list[int] = []
        self.open_weights: list[int] = []
        self.counts = {"read": 0, "examples": 0, "truncated": 0, "dropped": 0, "unanswered": 0}

    def _count(self, kind: str, what: str) -> None:
        self.counts[kind] += 1
        if (n := self.counts[kind]) in self.SAID_AT:
            log.warning(f"data.source={self.cfg.source}, streamed: process {self.rank}'s {what}; {n:,} {kind} so far "
                        f"on this process (said at the 1st, 10th, 100th, ... of them)")  # fmt: skip

    def _next_example(self) -> tuple[np.ndarray, np.ndarray]:
        """The next example of this process's shards as [end-of-document] + its tokens, and their weights."""
        while True:
            row = self._next_row()
            n = self.counts["read"]
            self.counts["read"] += 1
            if self.exclude and _row_digest(row, self.cfg) in self.exclude:
                self._skip("held out")
                continue
            at = f"data.source={self.cfg.source}, process {self.rank}'s streamed example {n}"
            ids, w, answered = row_example(row, self.tokenizer, self.cfg, self.template, at)
            ids = np.concatenate([[self.tokenizer.eod_id], ids]).astype(np.int64)
            w = np.concatenate([[0], w]).astype(np.uint8)
            if not answered:
                _, lacks, trains = _unanswered(self.cfg)
                self._count("unanswered", f"example {n} {lacks}: it trains {trains}")
            if len(ids) > self.size:
                longer = f"example {n} is longer than a window ({len(ids)} tokens, data.seq_len+1={self.size})"
                if self.cfg.overlong == "drop":
                    self._count("dropped", f"{longer}: dropped (data.overlong=drop)")
                    self._skip("dropped")
                    continue
                self._count("truncated", f"{longer}: truncated (data.overlong=truncate)")
                ids, w = ids[: self.size], w[: self.size]
            self._docs_this_epoch += 1
            self.counts["examples"] += 1
            return ids, w

    def next_windows(self, rows: int) -> dict[str, np.ndarray]:
        tokens, weights = [], []
        while len(tokens) < rows:
            ids, w = self._next_example()
            if len(self.open_tokens) + len(ids) > self.size:
                pad = self.size - len(self.open_tokens)
                tokens.append(self.open_tokens + [self.tokenizer.eod_id] * pad)
                weights.append(self.open_weights + [0] * pad)
                self.open_tokens, self.open_weights = [], []
            self.open_tokens += ids.tolist()
            self.open_weights += w.tolist()
        t = np.asarray(tokens, np.int32)
        return {"inputs": t[:, :-1], "targets": t[:, 1:], "weights": np.asarray(weights, np.float32)[:, 1:]}

    def packed_state(self) -> dict:
        return {"open_tokens": self.open_tokens, "open_weights": self.open_weights, "counts": dict(self.counts)}

    def load_packed_state(self, state: dict) -> None:
        self.open_tokens, self.open_weights = list(state["open_tokens"]), list(state["open_weights"])
        self.counts = dict(state["counts"])

    def eval_sets(self, data) -> list:
        return [("", self.val.eval_batches(data.batch_size, data.rows))] if len(self.val.tokens) else []

    def fingerprint(self, data) -> dict[str, dict]:
        return {"": self.fingerprint_with(self.val)}

    def fingerprint_with(self, val: Examples) -> dict:
        """The stream's files (or hub name) and the validation windows held out of its head, whole."""
        return {**self.identity, "val_windows": len(val.tokens), "val_sha256": digest(val.tokens, val.weights)}

    def banner(self, data) -> str:
        return (f"streaming {self.cfg.format} examples, each process its own shards, packed as read | val "
                f"{self.val.describe()} | {data.describe_tokenizer()}")  # fmt: skip


def stream_examples(corpus, tokenizer, cfg: DataConfig, rows: int, rank: int, world: int) -> StreamExamples:
    """data.format=chat or prompt, streamed: validation held out of the stream's head (or its split)."""
    template = ChatTemplate.load(cfg) if cfg.format == "chat" else None
    val, held = hold_out_examples(corpus.train if corpus.val is None else corpus.val, tokenizer, cfg, template)
    _check_val(val, cfg)
    exclude = held if corpus.val is None else set()  # a validation split shares no examples with training
    return StreamExamples(corpus.train, tokenizer, cfg, rows, rank, world, exclude, corpus.identity, template, val)


def examples_stream_source(corpus, tokenizer, sub: DataConfig, rows: int, rank: int, world: int, label: str):
    """data.format=chat or prompt as a streamed data.sources entry: its stream, and the source that holds its
    validation windows (mixture.StreamMixture asks the first for windows, the second for validation)."""
    st = stream_examples(corpus, tokenizer, sub, rows, rank, world)
    empty = Examples(np.zeros((0, sub.seq_len + 1), np.uint16), np.zeros((0, sub.seq_len + 1), np.uint8), 0, 0, 0, 0)
    return st, ExampleSource(label, empty, st.val, sub.seq_len)


formats.attach("chat", load_windows, mix=examples_source, stream=examples_stream_source)
formats.attach("prompt", load_windows, mix=examples_source, stream=examples_stream_source)
