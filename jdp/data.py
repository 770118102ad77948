"""Data: the global batch of (seed, step), this process's rows of it, and the background prefetcher.

Map-style data is tokenized once into cached streams (tokens.py) and cut into windows; streaming data packs
windows on the fly (stream.py). Either way every problem is reported before compilation.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from jdp import stream
from jdp.config import ConfigError, DataConfig
from jdp.corpus import open_corpus
from jdp.dataset import GlobalOrder
from jdp.log import logger
from jdp.mixture import MixtureBatches, Source, StreamMixture, integer_weights
from jdp.sft import ExampleBatches, load_examples
from jdp.tokens import ByteTokenizer, HFTokenizer, Tokens, load_tokenizer, n_windows, tokenize, windows

__all__ = ["Batches", "Data", "Prefetcher", "eval_batches", "load_data"]

log = logger("jdp.data")


class Batches:
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


def eval_batches(stream: np.ndarray, seq_len: int, batch_size: int, rows: slice = slice(None)):
    """Every validation window once, in order; the last batch is padded with zero-weight rows."""
    n = n_windows(stream, seq_len)
    for start in range(0, n, batch_size):
        idx = np.arange(start, start + batch_size)
        yield windows(stream, np.where(idx < n, idx, -1)[rows], seq_len)


@dataclass
class Data:
    tokenizer: ByteTokenizer | HFTokenizer
    tokens: Tokens  # for streaming: the validation stream only
    train: Batches  # or stream.StreamBatches
    rows: slice  # this process's rows of every global batch
    unit: str = ""  # what one document is ("one per .txt file, data.text_unit=file"); "" for other sources
    val_split: str = ""  # the split that validates; "" when documents are held out of the training split

    def local_batch(self, step: int) -> dict[str, np.ndarray]:
        """This process's rows of global batch `step` (streams: the next batch; steps come in order)."""
        if isinstance(self.train, Batches | MixtureBatches | ExampleBatches):
            return self.train.batch(step, self.rows)
        if isinstance(self.train, StreamMixture):  # this process's rows are its own already
            return self.train.batch(step)
        return self.train.next_batch()

    def position(self) -> dict | None:
        """Where a streaming loader stands (its state_dict); None for map-style data, whose position is the step."""
        return None if isinstance(self.train, Batches | MixtureBatches | ExampleBatches) else self.train.state_dict()

    def describe(self) -> str:
        if isinstance(self.train, ExampleBatches):
            return f"{self.train.describe()} | tokenizer {self.tokenizer.name} (vocab {self.tokenizer.vocab_size})"
        if isinstance(self.train, StreamMixture):
            tok = f"tokenizer {self.tokenizer.name} (vocab {self.tokenizer.vocab_size})"
            return (
                f"streaming mixture of {len(self.train.sources)} sources, each process its own shards of each | {tok}"
            )
        if isinstance(self.train, MixtureBatches):
            m, tok = self.train, f"tokenizer {self.tokenizer.name} (vocab {self.tokenizer.vocab_size})"
            val = (
                f"val {sum(len(s.val) for s in m.sources):,} tokens"
                if any(len(s.val) for s in m.sources)
                else "no validation"
            )
            return f"mixture of {len(m.sources)} sources, {m.n:,} windows in all | {val} | {tok}"
        t, tok = self.tokens, f"tokenizer {self.tokenizer.name} (vocab {self.tokenizer.vocab_size})"
        if not len(t.val):
            val = "no validation"
        else:
            held = f"from split {self.val_split!r}" if self.val_split else "held out of the training documents"
            val = f"val {len(t.val):,} tokens {held}"
        if not isinstance(self.train, Batches):
            unit = f" (documents: {self.unit})" if self.unit else ""
            return f"streaming, each process its own shards{unit} | {val} | {tok}"
        unit = f"{self.unit}; " if self.unit else ""
        return (
            f"{t.n_docs:,} documents ({unit}{t.n_empty} empty, skipped) | train {len(t.train):,} tokens = "
            f"{self.train.n:,} windows | {val} | {tok}"
        )


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
        return Data(tokenizer, Tokens(np.zeros(0, np.uint16), np.zeros(0, np.uint16), 0, 0), mixture, rows)
    corpus = open_corpus(cfg, streaming=cfg.streaming)
    if cfg.format != "text":  # fine-tuning examples, packed whole into windows (sft.py)
        train_ex, val_ex = load_examples(corpus, tokenizer, cfg, seed)
        if len(train_ex.tokens) < batch_size:
            raise ConfigError(
                f"data.source={cfg.source}: {train_ex.describe()}, fewer windows than one global batch "
                f"(train.batch_size={batch_size}); use more data, a longer data.seq_len or a smaller batch"
            )
        if train_ex.answer_tokens == 0:
            raise ConfigError(
                f"data.source={cfg.source}: no training example keeps a token of its answer ({train_ex.describe()}): "
                f"they are longer than data.seq_len={cfg.seq_len} and their answers come last; raise data.seq_len "
                f"(and model.max_seq_len)"
            )
        if train_ex.truncated or train_ex.dropped:
            log.warning(f"data.overlong={cfg.overlong}: {train_ex.describe()}")
        if cfg.val_tokens > 0 and not len(val_ex.tokens):
            raise ConfigError(f"data.source={cfg.source}: no validation examples; raise data.val_tokens or set it to 0")
        empty = Tokens(np.zeros(0, np.uint16), np.zeros(0, np.uint16), train_ex.n_examples, 0)
        return Data(
            tokenizer, empty, ExampleBatches(train_ex, val_ex, batch_size, seed), rows, corpus.unit, corpus.val_split
        )
    if cfg.streaming:
        val, held_out = stream.hold_out(corpus.train if corpus.val is None else corpus.val, tokenizer, cfg)
        exclude = held_out if corpus.val is None else set()  # a validation split shares no documents with training
        tokens = Tokens(np.zeros(0, val.dtype), val, 0, 0)
        train = stream.StreamBatches(corpus.train, tokenizer, cfg, rows.stop - rows.start, rank, world, exclude)
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
    return Data(tokenizer, tokens, train, rows, corpus.unit, corpus.val_split)


def load_mixture(
    cfg: DataConfig, tokenizer, batch_size: int, seed: int, rows: slice, rank: int = 0, world: int = 1
) -> MixtureBatches | StreamMixture:
    """data.sources: each source opened, checked and tokenized (or streamed) as data.source would be (its own keys
    over the mixture's), then the schedule of rows (mixture.py)."""
    from jdp.config import SOURCE_KEYS, source_labels

    sources, streams = [], []
    weights = integer_weights([float(e.get("weight", 1.0)) for e in cfg.sources])
    for entry, label in zip(cfg.sources, source_labels(cfg.sources), strict=True):
        own = {k: v for k, v in entry.items() if k in SOURCE_KEYS and k not in ("weight", "label")}
        sub = dataclasses.replace(cfg, sources=(), **own)
        corpus = open_corpus(sub, streaming=cfg.streaming)
        if cfg.streaming:  # validation: the head of the stream (or its split), skipped by training, as for one
            val, held = stream.hold_out(corpus.train if corpus.val is None else corpus.val, tokenizer, sub)
            exclude = held if corpus.val is None else set()
            if sub.val_tokens > 0 and n_windows(val, cfg.seq_len) == 0:
                raise ConfigError(
                    f"data.sources: source {label!r} ({sub.source}) holds out {len(val)} validation tokens, fewer "
                    f"than data.seq_len+1={cfg.seq_len + 1}; raise its val_tokens, or set val_tokens: 0 for it"
                )
            streams.append(stream.StreamBatches(corpus.train, tokenizer, sub, rows.stop - rows.start, rank, world,
                                                exclude))  # fmt: skip
            sources.append(Source(label, np.zeros(0, np.uint16), 0, 0, val))
            continue
        tokens = tokenize(corpus.train, tokenizer, sub, seed, corpus.val)
        if n_windows(tokens.train, cfg.seq_len) == 0:
            raise ConfigError(
                f"data.sources: source {label!r} ({sub.source}) holds {len(tokens.train)} training tokens, not one "
                f"window of data.seq_len+1={cfg.seq_len + 1}; give it more data or leave it out"
            )
        if sub.val_tokens > 0 and n_windows(tokens.val, cfg.seq_len) == 0:
            raise ConfigError(
                f"data.sources: source {label!r} ({sub.source}) holds out {len(tokens.val)} validation tokens, fewer "
                f"than data.seq_len+1={cfg.seq_len + 1}; raise its val_tokens, or set val_tokens: 0 for that source"
            )
        sources.append(Source(label, tokens.train, tokens.n_docs, tokens.n_empty, tokens.val))
    if cfg.streaming:
        return StreamMixture(streams, sources, weights, cfg.seq_len, batch_size, rows)
    mixture = MixtureBatches(sources, weights, cfg.seq_len, batch_size, seed)
    if mixture.n < batch_size:
        raise ConfigError(
            f"data.sources: {mixture.n} training windows in all, fewer than one global batch "
            f"(train.batch_size={batch_size}); use more data, a shorter seq_len or a smaller batch"
        )
    return mixture


class Prefetcher:
    """Makes `produce(step)` for steps start..stop-1 on a background thread, at most `depth` batches ahead.

    `wait_s` adds up how long the training loop waited for data: time the devices may have sat idle.
    depth=0 produces each batch in the loop itself (no thread), for debugging.
    """

    def __init__(self, produce: Callable[[int], object], start: int, stop: int, depth: int = 2):
        self.wait_s = 0.0
        self._produce, self._next, self._stop_at, self._depth = produce, start, stop, depth
        self._stop = threading.Event()
        if depth > 0:
            self._queue: queue.Queue = queue.Queue(maxsize=depth)
            self._thread = threading.Thread(target=self._run, daemon=True, name="jdp-prefetch")
            self._thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            for step in range(self._next, self._stop_at):
                if not self._put((step, self._produce(step))):
                    return
        except BaseException as e:  # handed to the training loop, which re-raises it
            self._put((None, e))

    def __iter__(self) -> Iterator:
        return self

    def __next__(self):
        start = time.perf_counter()
        if self._depth == 0:
            if self._next >= self._stop_at:
                raise StopIteration
            step, item = self._next, self._produce(self._next)
            self._next += 1
        else:
            if self._next >= self._stop_at:
                raise StopIteration
            step, item = self._queue.get()
            if step is None:
                if isinstance(item, ConfigError):  # bad input found while reading (a streamed file, say)
                    raise item
                raise RuntimeError("the data loader thread failed") from item
            self._next = step + 1
        self.wait_s += time.perf_counter() - start
        return step, item

    def close(self) -> None:
        self._stop.set()
        if self._depth > 0:
            self._thread.join(timeout=5)
