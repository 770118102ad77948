"""Streaming data: each process reads its own shards of a `datasets.IterableDataset` and packs windows on the fly."""

from __future__ import annotations

import hashlib
from collections import Counter

import numpy as np

from jdp.config import ConfigError, DataConfig
from jdp.data.corpus import data_files, decoding_error, resolve_source
from jdp.data.dataset import Windows, digest
from jdp.data.tokens import windows

__all__ = ["Shards", "StreamBatches", "decoded", "hold_out"]


def _digest(text: str) -> bytes:
    return hashlib.sha1(text.encode("utf-8")).digest()


def decoded(ds, cfg: DataConfig):
    """Iterate `ds`; a file that is not valid UTF-8 becomes corpus.decoding_error's clear message."""
    try:
        yield from ds
    except UnicodeDecodeError as e:
        raise decoding_error(cfg, data_files(cfg, resolve_source(cfg)), e) from e


def hold_out(ds, tokenizer, cfg: DataConfig) -> tuple[np.ndarray, set[bytes]]:
    """The first documents of `ds`, up to data.val_tokens tokens, as the validation stream, and their digests.

    `ds` is the validation split, or else the unsplit training stream: every process reads the same head of it,
    and training then skips documents with the same text (by digest), so validation and training never share
    a document.
    """
    parts, digests, total = [], set(), 0
    if cfg.val_tokens <= 0:
        return np.zeros(0, np.uint16), digests
    for example in decoded(ds, cfg):
        text = example[cfg.text_column] or ""
        if not text:
            continue
        ids = tokenizer.encode_batch([text])[0]
        parts += [ids, np.asarray([tokenizer.eod_id], ids.dtype)]
        digests.add(_digest(text))
        total += len(ids) + 1
        if total >= cfg.val_tokens:
            break
    if not parts:
        raise ConfigError(f"data.source={cfg.source}: the stream has no non-empty documents in {cfg.text_column!r}")
    return np.concatenate(parts), digests


class Shards(Windows):
    """This process's shards of a `datasets.IterableDataset`, read in order, epoch after epoch, with an exact position.

    Shards are split between processes with `datasets.distributed.split_dataset_by_node`; rows are read in order
    (no shuffle buffer: its contents cannot be restored exactly on resume). When this process's shards run out it
    starts its next epoch over them, so no process ever waits for data that another one lacks. What a row becomes
    (a document's tokens, a fine-tuning example) and how rows are packed into windows is the subclass's
    (StreamBatches here, sft.StreamExamples); `state_dict()` is the dataset's own state, the epoch and the
    subclass's `packed_state()`, the rows read but not yet given out.
    """

    def __init__(self, ds, cfg: DataConfig, rows: int, rank: int, world: int, exclude: set[bytes],
                 identity: dict | None = None):  # fmt: skip
        """`identity`: what the stream's documents are without reading them (corpus.Corpus.identity); `exclude`:
        digests of the documents validation holds out (hold_out), which training skips."""
        self.base, self.cfg, self.rows = ds, cfg, rows
        self.identity = identity or {}
        self.rank, self.world, self.exclude = rank, world, exclude
        self.epoch_count = 0
        self.n_excluded = 0
        self._node = self._split()
        self._it = None
        self._docs_this_epoch = 0
        self._read_this_epoch = 0
        self._skipped = Counter()  # this epoch's rows not trained on, by why (_skip)

    def _skip(self, why: str) -> None:
        """A row read and not trained on: "held out" (it repeats a validation example), "empty", "dropped"."""
        self._skipped[why] += 1
        self.n_excluded += why == "held out"

    def _split(self):
        from datasets.distributed import split_dataset_by_node

        return split_dataset_by_node(self.base, rank=self.rank, world_size=self.world)

    def _next_row(self) -> dict:
        """The next row of this process's shards (its next epoch begun when they run out); the subclass counts the
        rows it keeps in `_docs_this_epoch`."""
        while True:
            if self._it is None:
                self._it = iter(self._node)
            try:
                row = next(self._it)
                self._read_this_epoch += 1
                return row
            except UnicodeDecodeError as e:
                raise decoding_error(self.cfg, data_files(self.cfg, resolve_source(self.cfg)), e) from e
            except StopIteration:
                if self._docs_this_epoch == 0:
                    raise self._nothing_to_train() from None
                # A fresh split for the next epoch: a restored dataset would otherwise restart mid-epoch again.
                self.epoch_count += 1
                self._node, self._it = self._split(), None
                self._node.set_epoch(self.epoch_count)
                self._docs_this_epoch = self._read_this_epoch = 0
                self._skipped = Counter()

    def _nothing_to_train(self) -> ConfigError:
        """Why a whole epoch of this process's shards gave nothing to train on, and what to change."""
        head = f"data.source={self.cfg.source}: process {self.rank} of {self.world}"
        if self._read_this_epoch == 0:
            return ConfigError(f"{head} got no training documents from the stream; give the dataset at least as "
                               f"many files (shards) as processes")  # fmt: skip
        n, cfg = self._skipped, self.cfg
        why = {
            "held out": f"{n['held out']:,} repeat an example validation holds out of the stream's head (up to "
            f"data.val_tokens={cfg.val_tokens:,} tokens; training skips a row equal to a held-out one)",
            "empty": f"{n['empty']:,} are empty",
            "dropped": f"{n['dropped']:,} are longer than a window (data.seq_len+1={cfg.seq_len + 1}) and "
            f"data.overlong=drop dropped them",
        }
        fix = {
            "held out": "lower data.val_tokens (the stream's head is validation, and these rows repeat it), give a "
            "validation split (data.val_split), or set data.val_tokens=0",
            "empty": "give the dataset more non-empty documents, in at least as many files (shards) as processes",
            "dropped": "raise data.seq_len (and model.max_seq_len) or set data.overlong=truncate",
        }
        return ConfigError(
            f"{head} got no training documents from the stream: of the {self._read_this_epoch:,} rows of its shards "
            f"in epoch {self.epoch_count}, {', '.join(why[k] for k in why if n[k])}"
            + "".join(f"; {fix[k]}" for k in fix if n[k])
        )

    def next_batch(self) -> dict[str, np.ndarray]:
        """The next `rows` windows of this process's stream."""
        return self.next_windows(self.rows)

    def local_batch(self, step: int, rows: slice) -> dict[str, np.ndarray]:
        return self.next_batch()  # steps come in order; this process's rows are its own shards'

    def next_windows(self, rows: int) -> dict[str, np.ndarray]:
        """The next `rows` windows of this process's stream (a mixture takes as many as the schedule gives it)."""
        raise NotImplementedError

    def position(self) -> dict:
        return self.state_dict()

    def load_position(self, position: dict) -> None:
        self.load_state_dict(position)

    def epoch(self, step: int) -> float:
        return float(self.epoch_count)  # this process's epochs of its shards

    def packed_state(self) -> dict:
        """What was read but not yet given out (JSON)."""
        raise NotImplementedError

    def load_packed_state(self, state: dict) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {
            "dataset": self._node.state_dict(),
            **self.packed_state(),
            "epoch": self.epoch_count,
            "rank": self.rank,
            "world": self.world,
        }

    def load_state_dict(self, state: dict) -> None:
        if (state["rank"], state["world"]) != (self.rank, self.world):
            raise ConfigError(
                f"a streaming data position saved by process {state['rank']} of {state['world']} cannot be "
                f"restored on process {self.rank} of {self.world}: streaming shards depend on the world size"
            )
        self.epoch_count = state["epoch"]
        self._node = self._split()
        self._node.set_epoch(self.epoch_count)
        self._node.load_state_dict(state["dataset"])
        self._it = None
        self._docs_this_epoch = 1  # restored mid-epoch: this process's shards are known not to be empty
        self.load_packed_state(state)


class StreamBatches(Shards):
    """This process's rows of each global batch, packed from its own shards of the stream (Shards): each document
    followed by an end-of-document token, cut into windows of seq_len+1 tokens; the tokens packed but not yet used
    travel in the position."""

    def __init__(self, ds, tokenizer, cfg: DataConfig, rows: int, rank: int, world: int, exclude: set[bytes],
                 identity: dict | None = None):  # fmt: skip
        super().__init__(ds, cfg, rows, rank, world, exclude, identity)
        self.tokenizer = tokenizer
        self.n_empty = 0
        self.buffer = np.zeros(0, np.uint32)

    def _next_document(self) -> np.ndarray:
        while True:
            example = self._next_row()
            text = example[self.cfg.text_column]
            if not isinstance(text, str) or not text:
                if text is not None and not isinstance(text, str):
                    raise ConfigError(f"data.source={self.cfg.source}: column {self.cfg.text_column!r} is not text")
                self.n_empty += 1
                self._skip("empty")
                continue
            if self.exclude and _digest(text) in self.exclude:
                self._skip("held out")
                continue
            ids = self.tokenizer.encode_batch([text])[0]
            self._docs_this_epoch += 1
            return np.concatenate([ids, [self.tokenizer.eod_id]]).astype(np.uint32)

    def fingerprint(self, data) -> dict[str, dict]:
        return {"": self.fingerprint_with(data.tokens.val)}

    def fingerprint_with(self, val) -> dict:
        """The stream's files (or hub name) and the validation tokens held out of its head, whole."""
        return {**self.identity, "val_tokens": len(val), "val_sha256": digest(val)}

    def banner(self, data) -> str:
        unit = f" (documents: {data.unit})" if data.unit else ""
        return f"streaming, each process its own shards{unit} | {data.describe_val()} | {data.describe_tokenizer()}"

    def next_windows(self, rows: int) -> dict[str, np.ndarray]:
        """The next `rows` windows of this process's stream (a mixture takes as many as the schedule gives it)."""
        L = self.cfg.seq_len
        need = rows * L + 1
        parts = [self.buffer]
        have = len(self.buffer)
        while have < need:
            doc = self._next_document()
            parts.append(doc)
            have += len(doc)
        stream = np.concatenate(parts)
        # Consecutive windows share one token (a window's last target is the next one's first input),
        # exactly as in the map-style path.
        self.buffer = stream[rows * L :]
        return windows(stream, np.arange(rows), L)

    def packed_state(self) -> dict:
        return {"buffer": self.buffer.tolist()}

    def load_packed_state(self, state: dict) -> None:
        self.buffer = np.asarray(state["buffer"], np.uint32)
