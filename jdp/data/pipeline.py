"""The text pipeline's data: the global batch of (seed, step) and this process's rows of it, for any data.format.

data.format picks how documents become training windows (formats.py): text is tokenized once into cached streams
(tokens.py) and cut into windows, or packed on the fly when streamed (stream.py); chat and prompt are packed
fine-tuning examples (sft.py); a mixture is mixture.py's. Each is a dataset.Windows, which Data asks and never
branches on. Every problem is reported before compilation.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jdp.config import ConfigError, DataConfig
from jdp.data import formats, preference, sft, stream  # noqa: F401  (they attach their formats' loaders on import)
from jdp.data.corpus import data_files, is_saved_dataset, open_corpus
from jdp.data.dataset import GlobalOrder, Prefetcher, Windows
from jdp.data.mixture import MixtureBatches, Source, StreamMixture, integer_weights
from jdp.data.tokens import (
    ByteTokenizer,
    HFTokenizer,
    Tokens,
    eval_batches,
    load_tokenizer,
    n_windows,
    tokenize,
    windows,
)
from jdp.log import logger

__all__ = ["Batches", "Data", "Prefetcher", "eval_batches", "load_data", "load_text"]

log = logger("jdp.data")


class Batches(Windows):
    """The training batches: global batch `step` is a pure function of (seed, step).

    Windows are rows in jdp's global order (dataset.GlobalOrder): one fresh permutation per epoch, concatenated
    without end, batch s = entries [s*B, (s+1)*B). Every window appears exactly once per epoch, and a batch that
    straddles an epoch boundary takes the end of one epoch and the start of the next: nothing is dropped
    or repeated, and no process ever waits for a batch another process lacks.
    """

    def __init__(self, stream: np.ndarray, seq_len: int, batch_size: int, seed: int):
        self.stream, self.seq_len, self.batch_size, self.seed = stream, seq_len, batch_size, seed
        self.n = n_windows(stream, seq_len)
        self.order = GlobalOrder(self.n, batch_size, seed)

    def indices(self, step: int) -> np.ndarray:
        """Window indices of global batch `step` (0-based)."""
        return self.order.indices(step)

    def epoch(self, step: int) -> float:
        return self.order.epoch(step)

    def batch(self, step: int, rows: slice = slice(None)) -> dict[str, np.ndarray]:
        """This process's rows of global batch `step`."""
        return windows(self.stream, self.indices(step)[rows], self.seq_len)

    def local_batch(self, step: int, rows: slice) -> dict[str, np.ndarray]:
        return self.batch(step, rows)

    def banner(self, data: Data) -> str:
        t, unit = data.tokens, f"{data.unit}; " if data.unit else ""
        return (
            f"{t.n_docs:,} documents ({unit}{t.n_empty} empty, skipped) | train {len(t.train):,} tokens = "
            f"{self.n:,} windows | {data.describe_val()} | {data.describe_tokenizer()}"
        )


@dataclass
class Data:
    tokenizer: ByteTokenizer | HFTokenizer
    tokens: Tokens  # the validation stream (and, for map-style text, the training one)
    train: Windows  # the training windows, of whichever format (formats.py)
    rows: slice  # this process's rows of every global batch
    seq_len: int
    batch_size: int  # the global batch
    unit: str = ""  # what one document is ("one per .txt file, data.text_unit=file"); "" for other sources
    val_split: str = ""  # the split that validates; "" when documents are held out of the training split

    def local_batch(self, step: int) -> dict[str, np.ndarray]:
        """This process's rows of global batch `step` (streams: the next batch; steps come in order)."""
        return self.train.local_batch(step, self.rows)

    def position(self) -> dict | None:
        """Where a streaming loader stands (its state_dict); None for map-style data, whose position is the step."""
        return self.train.position()

    def eval_sets(self) -> list[tuple[str, object]]:
        return self.train.eval_sets(self)

    def describe(self) -> str:
        return self.train.banner(self)

    def describe_tokenizer(self) -> str:
        return f"tokenizer {self.tokenizer.name} (vocab {self.tokenizer.vocab_size})"

    def fingerprint(self) -> dict[str, dict] | None:
        return self.train.fingerprint(self)

    def describe_val(self) -> str:
        if not len(self.tokens.val):
            return "no validation"
        held = f"from split {self.val_split!r}" if self.val_split else "held out of the training documents"
        return f"val {len(self.tokens.val):,} tokens {held}"


def load_data(
    cfg: DataConfig,
    vocab_size: int,
    batch_size: int,
    seed: int,
    rows: slice | None = None,
    rank: int = 0,
    world: int = 1,
) -> Data:
    """Everything the loop needs from the data, with every problem reported before compilation."""
    rows = rows if rows is not None else slice(0, batch_size)
    tokenizer = load_tokenizer(cfg.tokenizer)
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(
            f"data.tokenizer={cfg.tokenizer} has {tokenizer.vocab_size} tokens but model.vocab_size={vocab_size}; "
            f"set model.vocab_size to at least {tokenizer.vocab_size} (a multiple of 64 is fastest)"
        )
    if cfg.sources:
        mixture = load_mixture(cfg, tokenizer, batch_size, seed, rows, rank, world)
        empty = Tokens(np.zeros(0, np.uint16), np.zeros(0, np.uint16), 0, 0)
        return Data(tokenizer, empty, mixture, rows, cfg.seq_len, batch_size)
    corpus = open_corpus(cfg, streaming=cfg.streaming)
    train, tokens = formats.get(cfg.format).load(corpus, tokenizer, cfg, batch_size, seed, rows, rank, world)
    return Data(tokenizer, tokens, train, rows, cfg.seq_len, batch_size, corpus.unit, corpus.val_split)


def load_text(corpus, tokenizer, cfg: DataConfig, batch_size: int, seed: int, rows: slice, rank: int, world: int):
    """data.format=text: documents tokenized into one stream and cut into windows (streamed: packed as read)."""
    if cfg.streaming:
        val, held_out = stream.hold_out(corpus.train if corpus.val is None else corpus.val, tokenizer, cfg)
        exclude = held_out if corpus.val is None else set()  # a validation split shares no documents with training
        tokens = Tokens(np.zeros(0, val.dtype), val, 0, 0)
        train = stream.StreamBatches(corpus.train, tokenizer, cfg, rows.stop - rows.start, rank, world, exclude,
                                     corpus.identity)  # fmt: skip
    else:
        tokens = tokenize(corpus.train, tokenizer, cfg, seed, corpus.val)
        train = Batches(tokens.train, cfg.seq_len, batch_size, seed)
        if train.n < batch_size:
            raise ConfigError(
                f"data.source={cfg.source}: {train.n} training windows of data.seq_len={cfg.seq_len} tokens, fewer "
                f"than one global batch (train.batch_size={batch_size}); use more data, a shorter seq_len or a "
                f"smaller batch"
            )
    if cfg.val_tokens > 0 and n_windows(tokens.val, cfg.seq_len) == 0:
        if corpus.val_split and len(tokens.val) < cfg.val_tokens:  # all of it, and still no window
            raise ConfigError(
                f"data.source={cfg.source}: its validation split {corpus.val_split!r} holds {len(tokens.val)} "
                f"tokens, fewer than data.seq_len+1={cfg.seq_len + 1}; use data.val_split=holdout, or a shorter "
                f"data.seq_len"
            )
        raise ConfigError(
            f"data.val_tokens={cfg.val_tokens} holds out fewer than data.seq_len+1 tokens; raise it (or 0 for no evaluation)"
        )
    return train, tokens


def text_source(corpus, tokenizer, sub: DataConfig, seed: int, label: str) -> Source:
    """data.format=text as a data.sources entry: its documents tokenized (and cached) as data.source's would be."""
    tokens = tokenize(corpus.train, tokenizer, sub, seed, corpus.val)
    if n_windows(tokens.train, sub.seq_len) == 0:
        raise ConfigError(
            f"data.sources: source {label!r} ({sub.source}) holds {len(tokens.train)} training tokens, not one "
            f"window of data.seq_len+1={sub.seq_len + 1}; give it more data or leave it out"
        )
    if sub.val_tokens > 0 and n_windows(tokens.val, sub.seq_len) == 0:
        raise ConfigError(
            f"data.sources: source {label!r} ({sub.source}) holds out {len(tokens.val)} validation tokens, fewer "
            f"than data.seq_len+1={sub.seq_len + 1}; raise its val_tokens, or set val_tokens: 0 for that source"
        )
    return Source(label, tokens.train, tokens.n_docs, tokens.n_empty, tokens.val)


def text_stream_source(corpus, tokenizer, sub: DataConfig, rows: int, rank: int, world: int, label: str):
    """data.format=text as a streamed data.sources entry: its stream (stream.StreamBatches), validation the head of
    the stream (or its split), skipped by training, as for one source."""
    val, held = stream.hold_out(corpus.train if corpus.val is None else corpus.val, tokenizer, sub)
    exclude = held if corpus.val is None else set()
    if sub.val_tokens > 0 and n_windows(val, sub.seq_len) == 0:
        raise ConfigError(
            f"data.sources: source {label!r} ({sub.source}) holds out {len(val)} validation tokens, fewer "
            f"than data.seq_len+1={sub.seq_len + 1}; raise its val_tokens, or set val_tokens: 0 for it"
        )
    st = stream.StreamBatches(corpus.train, tokenizer, sub, rows, rank, world, exclude, corpus.identity)
    return st, Source(label, np.zeros(0, np.uint16), 0, 0, val)


formats.attach("text", load_text, mix=text_source, stream=text_stream_source)


def load_mixture(
    cfg: DataConfig, tokenizer, batch_size: int, seed: int, rows: slice, rank: int = 0, world: int = 1
) -> MixtureBatches | StreamMixture:
    """data.sources: each source opened, checked and tokenized (or streamed) as data.source would be (its own keys
    over the mixture's), then the schedule of rows (mixture.py)."""
    from jdp.config import SOURCE_KEYS, source_labels

    sources, streams = [], []
    weights = integer_weights([float(e.get("weight", 1.0)) for e in cfg.sources])
    labels = source_labels(cfg.sources)
    subs = [dataclasses.replace(cfg, sources=(), **{k: v for k, v in entry.items()
                                                    if k in SOURCE_KEYS and k not in ("weight", "label")})
            for entry in cfg.sources]  # fmt: skip
    _check_disjoint(subs, labels)
    fmt = formats.get(cfg.format)
    if (fmt.stream if cfg.streaming else fmt.mix) is None:
        what = "streamed mixture loader (stream)" if cfg.streaming else "mixture loader (mix)"
        raise ConfigError(f"data.format={cfg.format} with data.sources: this format has no {what}")
    for sub, label in zip(subs, labels, strict=True):
        with _named_as_source(label, sub.source):
            corpus = open_corpus(sub, streaming=cfg.streaming)
        if cfg.streaming:  # the entry's stream, and its validation (the head of the stream or its split)
            with _named_as_source(label, sub.source):
                st, source = fmt.stream(corpus, tokenizer, sub, rows.stop - rows.start, rank, world, label)
            streams.append(st)
            sources.append(source)
            continue
        with _named_as_source(label, sub.source):
            sources.append(fmt.mix(corpus, tokenizer, sub, seed, label))
    if cfg.streaming:
        return StreamMixture(streams, sources, weights, cfg.seq_len, batch_size, rows)
    mixture = MixtureBatches(sources, weights, cfg.seq_len, batch_size, seed)
    if mixture.n < batch_size:
        raise ConfigError(
            f"data.sources: {mixture.n} training windows in all, fewer than one global batch "
            f"(train.batch_size={batch_size}); use more data, a shorter seq_len or a smaller batch"
        )
    return mixture


@contextmanager
def _named_as_source(label: str, source: str) -> Iterator[None]:
    """A source of data.sources reports its problems as one: `data.sources: source 'web' (PATH)` where data.source
    would say `data.source=PATH`, and its own keys (val_tokens, split, ...) as its, not the global data.* ones."""
    from jdp.config import SOURCE_KEYS

    try:
        yield
    except ConfigError as e:
        text = str(e).replace(f"data.source={source}", f"data.sources: source {label!r} ({source})")
        for key in SOURCE_KEYS:  # data.val_tokens=N -> its val_tokens: N (as its data.sources entry writes it)
            text = re.sub(rf"\bdata\.{key}=", f"its {key}: ", text)
            text = re.sub(rf"\bdata\.{key}\b", f"its {key}", text)
        raise ConfigError(text) from e


def _check_disjoint(subs: list[DataConfig], labels: list[str]) -> None:
    """Two sources of a mixture that read the same documents (the same path twice, a directory and a file in it,
    the same hub dataset and split) would train them twice per epoch, outside the weights: refused, naming both."""
    seen: dict[tuple, str] = {}
    for sub, label in zip(subs, labels, strict=True):
        saved = is_saved_dataset(Path(sub.source).expanduser())
        with _named_as_source(label, sub.source):
            files = data_files(sub, sub.source) if sub.source != "stdlib" and not saved else None
        source = str(Path(sub.source).expanduser().resolve()) if saved else sub.source
        how = (sub.name, sub.split, sub.text_column, sub.text_unit)  # read otherwise, they are other documents
        items = [(str(Path(f).resolve()), *how) for f in files] if files is not None else [(source, *how)]
        for item in items:
            if (other := seen.get(item)) is not None and other != label:
                raise ConfigError(
                    f"data.sources: sources {other!r} and {label!r} both read {item[0]}: each epoch would train its "
                    f"documents twice, outside the weights. List the data once (a larger weight gives it a larger "
                    f"share), or leave the file out of one of them"
                )
            seen[item] = label
