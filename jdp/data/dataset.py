"""Data for any model: the global order of rows, a loader over any indexable source of rows, and one over a stream.

The order is the one the text pipeline uses (data.py's windows are rows too): global batch `step` is a pure
function of `(seed, step)`, the same for every number of processes, and each process reads only its rows of it.
A stream (`datasets.IterableDataset`) has no such order: each process reads its own shards in turn (`StreamLoader`,
stream.py's approach for text).
"""

from __future__ import annotations

import hashlib
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from jdp.errors import ConfigError

__all__ = ["GlobalOrder", "Loader", "Prefetcher", "Source", "StreamLoader", "Windows", "digest", "source_for"]

Batch = dict[str, np.ndarray]
_NUMERIC = "biufc"  # bool, int, uint, float, complex: what a device array can hold
_SAMPLE = 256  # rows checked at construction: enough to catch a bad column, cheap for any row size


def digest(*arrays: np.ndarray, names: tuple[str, ...] = ()) -> str:
    """A sha256 (16 hex digits) of arrays' dtypes, shapes and bytes (and `names`): what data held in memory is,
    for a checkpoint's fingerprint of its data (2 GB/s on a core with SHA instructions)."""
    h = hashlib.sha256(repr(names).encode())
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.reshape(-1).view(np.uint8))
    return h.hexdigest()[:16]


class GlobalOrder:
    """Which rows global batch `step` holds: entries [step*B, (step+1)*B) of the endless concatenation of one
    fresh permutation of the n rows per epoch.

    Every row appears exactly once per epoch. A batch that straddles an epoch boundary takes the end of one epoch
    and the start of the next (carried, not padded or dropped), so every process knows the number of steps up
    front and none waits for a batch another lacks. Nothing here depends on the number of processes.
    """

    def __init__(self, n: int, batch_size: int, seed: int, stream: int = 0):
        """`stream`: which of the seed's independent orders (0: the single source's; k+1: a mixture's source k)."""
        self.n, self.batch_size, self.seed, self.stream = n, batch_size, seed, stream
        self._perms: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()  # the prefetch thread and the loop may both ask

    def _perm(self, epoch: int) -> np.ndarray:
        with self._lock:
            if epoch not in self._perms:
                if len(self._perms) > 2:
                    self._perms.pop(min(self._perms))
                self._perms[epoch] = np.random.default_rng([self.seed, self.stream, epoch]).permutation(self.n)
            return self._perms[epoch]

    def indices(self, step: int) -> np.ndarray:
        """Row indices of global batch `step` (0-based)."""
        return self.at(step * self.batch_size + np.arange(self.batch_size))

    def at(self, pos: np.ndarray) -> np.ndarray:
        """Row indices at positions `pos` of the endless order."""
        epochs, within = np.divmod(np.asarray(pos, np.int64), self.n)
        out = np.empty(len(epochs), np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self._perm(int(e))[within[sel]]
        return out

    def epoch(self, step: int) -> float:
        return step * self.batch_size / self.n


class Source:
    """What the trainer asks of a run's data, for training and for evaluation (jdp/trainer.py, loop.py,
    callbacks.py), and nothing else: it never probes. jdp's loaders (Loader, StreamLoader, the text pipeline's
    lm.Text) subclass it; `source_for` gives a loader of a user's own the defaults below for what it lacks.

    Where a source keeps its place: `position()` is this process's own place in a stream (saved beside each
    checkpoint, one file per process, handed back to `load_position`); `state()` is what every process keeps alike
    besides the step (a mixture's schedule), saved in the checkpoint record and handed back to `restore`. A
    map-style order keeps neither: batch `step` is a function of `(seed, step)`."""

    def local_batch(self, step: int) -> Batch:
        """This process's rows of global batch `step`."""
        raise NotImplementedError

    def epoch(self, step: int) -> float:
        """The epochs done after `step` steps."""
        raise NotImplementedError

    def describe(self) -> str:
        """One line for the banner."""
        return type(self).__name__

    def eval_batches(self) -> Iterator[Batch]:
        """An evaluation set's batches, this process's rows, each with `valid` (the rows that count)."""
        raise NotImplementedError

    def eval_sets(self) -> list[tuple[str, Iterator[Batch]]]:
        """The evaluation sets, each with its label (a mixture's sources); one unlabelled set by default."""
        return [("", self.eval_batches())]

    def position(self) -> dict | None:
        """This process's place in a stream after the last batch read, or None (a map-style order)."""
        return None

    def load_position(self, position: dict) -> None:
        """Go back to a place position() gave."""

    def state(self) -> dict | None:
        """What checkpoint records keep of the data besides the step (the same on every process), or None."""
        return None

    def restore(self, saved: dict, step: int) -> str | None:
        """Take back what state() gave at `step`; a line saying what changed (reweighted sources), or None."""
        return None

    def stats(self, step: int) -> dict:
        """Numbers for the step's metrics record (a mixture's tokens and epochs per source)."""
        return {}

    def summary(self, step: int) -> dict:
        """The run's account for summary.json (a mixture's per source), or {}."""
        return {}

    def describe_sources(self) -> list[str]:
        """Banner lines, one per source of a mixture."""
        return []

    def fingerprint(self) -> dict[str, dict] | None:
        """What the training data is, per source ("" alone, a mixture's labels): sizes and digests, saved in each
        checkpoint record and compared on resume, where a change is refused (data.accept_changes). None: not
        known (a loader of a user's own, an indexable jdp cannot digest): not checked."""
        return None


class _OwnLoader(Source):
    """A user's own loader (it has local_batch or eval_batches), with Source's defaults for the methods it lacks."""

    def __init__(self, loader: Any):
        self._loader = loader
        for name in _SOURCE_METHODS:
            if hasattr(loader, name):
                setattr(self, name, getattr(loader, name))  # its own method, not the default

    def __getattr__(self, name: str):  # anything else it has (rows, batch_size, ...)
        return getattr(self._loader, name)


_SOURCE_METHODS = [name for name in vars(Source) if not name.startswith("_")]


def source_for(data: Any, rows: slice, batch_size: int, seed: int, collate=None, train: bool = True) -> Source | None:
    """What the trainer reads `data` through, for this process's `rows` of global batches of `batch_size`: a
    loader as it is (it must read those rows), what a function makes of the rows, or a Loader of a dataset."""
    if data is None:
        return None
    if isinstance(data, Source) or hasattr(data, "local_batch") or hasattr(data, "eval_batches"):
        made = (getattr(data, "rows", rows), getattr(data, "batch_size", batch_size))
        if made != (rows, batch_size):
            raise ConfigError(
                f"the {'training' if train else 'evaluation'} loader reads rows {made[0].start}:{made[0].stop} of "
                f"global batches of {made[1]}, but this process's share is rows {rows.start}:{rows.stop} of "
                f"train.batch_size={batch_size}: pass the dataset itself and the trainer makes the loader, "
                f"or build it with batch_size=train.batch_size and rows=jdp.process_rows(train.batch_size, mesh)"
            )
        return data if isinstance(data, Source) else _OwnLoader(data)
    if callable(data) and not hasattr(data, "__getitem__"):
        made = data(rows)
        return made if made is None or isinstance(made, Source) else _OwnLoader(made)
    return Loader(data, batch_size, seed=seed, collate=collate, rows=rows, train=train)


class Windows:
    """What the text pipeline asks of its training windows (data.Data and lm.Text, which never branch on their
    kind): one source's windows (data.Batches), a stream's (stream.StreamBatches), a mixture's (mixture.py), packed
    fine-tuning examples (sft.ExampleBatches), or a data format's own (formats.py). Every method but local_batch,
    epoch and banner has a default for a map-style order of one source."""

    def local_batch(self, step: int, rows: slice) -> Batch:
        """This process's `rows` of global batch `step` (a stream: its next batch, its rows its own already)."""
        raise NotImplementedError

    def epoch(self, step: int) -> float:
        raise NotImplementedError

    def banner(self, data: Any) -> str:
        """The banner's data line (`data`: the data.Data these windows are part of: tokenizer, validation tokens)."""
        raise NotImplementedError

    def eval_sets(self, data: Any) -> list[tuple[str, Iterator[Batch]]]:
        """The validation sets, each labelled ("" alone): data.val_tokens held out as windows, by default."""
        from jdp.data.tokens import eval_batches

        return [("", eval_batches(data.tokens.val, data.seq_len, data.batch_size, data.rows))]

    def position(self) -> dict | None:
        """A stream's place after its last batch (its state_dict); None for a map-style order."""
        return None

    def load_position(self, position: dict) -> None:
        """Go back to a place position() gave (a map-style order has none to go back to)."""

    def describe_sources(self, steps: int) -> list[str]:
        return []

    def stats(self, step: int) -> dict:
        return {}

    def summary(self, step: int) -> dict:
        return {}

    def state(self) -> dict | None:
        return None

    def restore(self, saved: dict, step: int) -> str:
        return ""

    def fingerprint(self, data: Any) -> dict[str, dict] | None:
        """Source.fingerprint: by default the token streams of one map-style source (data.tokens), whole."""
        t = data.tokens
        return {"": {"tokens": len(t.train), "val_tokens": len(t.val), "sha256": digest(t.train, t.val)}}


class Loader(Source):
    """Batches of any source of rows in jdp's global order: a Hugging Face `datasets.Dataset` (any numeric
    columns), a dict of equal-length numpy arrays, or any object with `len()` and `__getitem__(int) -> dict`.

    `local_batch(step)` reads only this process's `rows` of global batch `step` and stacks each column (or hands
    the rows to `collate`, PyTorch's convention). `train=False` is for an evaluation set, which may hold fewer
    rows than one global batch. Problems are found on a sample at construction, before anything compiles.
    A `datasets.IterableDataset` has no random access: `Loader(stream, ...)` returns a `StreamLoader`.
    """

    def __new__(cls, source: Any = None, *args, **kwargs):
        # The trainer (and a user) write Loader(data, ...) for any data; a stream needs another reader. A returned
        # object that is not a Loader skips Loader.__init__, so the StreamLoader is built once, here.
        if _is_stream(source):
            return StreamLoader(source, *args, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        source: Any,
        batch_size: int,
        *,
        seed: int = 0,
        collate: Callable[[list[dict]], Batch] | None = None,
        rows: slice | None = None,
        train: bool = True,
    ):
        self.source, self.collate, self._given = _adapt(source), collate, source
        self.n, self.batch_size, self.seed = len(self.source), batch_size, seed
        self.rows = rows if rows is not None else slice(0, batch_size)
        self.order = GlobalOrder(self.n, batch_size, seed)
        stop = self.rows.stop if self.rows.stop is not None else batch_size
        if batch_size < 1 or stop > batch_size or not len(range(batch_size)[self.rows]):
            raise ConfigError(
                f"rows={self.rows} is not a non-empty part of a global batch of {batch_size} rows; pass "
                f"jdp.process_rows(batch_size, mesh)"
            )
        if self.n == 0:
            raise ConfigError(f"the data source ({type(source).__name__}) holds no rows")
        if train and self.n < batch_size:
            raise ConfigError(
                f"the data source holds {self.n} rows, fewer than one global batch (batch_size={batch_size}); "
                f"use more data or a smaller batch"
            )
        sample = (self.order.indices(0) if train else np.arange(min(self.n, batch_size)))[:_SAMPLE]
        self.columns = {k: (v.shape[1:], v.dtype) for k, v in self._read(sample).items()}

    def _read(self, idx: np.ndarray) -> Batch:
        if self.collate is not None:
            batch = _check_collated(self.collate(self.source.rows(idx)), len(idx))
        else:
            batch = self.source.columns(idx)
        return _checked(batch)

    def local_batch(self, step: int) -> Batch:
        """This process's rows of global batch `step`, in global order."""
        return self._read(self.order.indices(step)[self.rows])

    def epoch(self, step: int) -> float:
        return self.order.epoch(step)

    def eval_batches(self) -> Iterator[Batch]:
        """This process's rows of each global batch of every row once, in order; the last batch is filled up by
        repeating rows, which carry `valid` = 0 (1 for the real rows) so that evaluation counts them out."""
        for start in range(0, self.n, self.batch_size):
            idx = start + np.arange(self.batch_size)
            valid = idx < self.n
            batch = self._read(np.where(valid, idx, idx % self.n)[self.rows])
            batch["valid"] = valid[self.rows].astype(np.float32)
            yield batch

    def fingerprint(self) -> dict[str, dict] | None:
        """A datasets.Dataset's own fingerprint (its content's hash in memory, its files' state on disk), a dict of
        arrays' digest; None for another indexable (not checked on resume)."""
        hf, given = sys.modules.get("datasets"), self._given
        if hf is not None and isinstance(given, hf.Dataset):
            return {"": {"rows": self.n, "datasets_fingerprint": given._fingerprint}}
        if isinstance(given, Mapping):
            arrays = [np.asarray(given[k]) for k in sorted(given)]
            if all(a.dtype.kind in _NUMERIC for a in arrays):
                return {"": {"rows": self.n, "sha256": digest(*arrays, names=tuple(sorted(given)))}}
        return None

    def describe(self) -> str:
        cols = ", ".join(f"{k} {tuple(s)} {d}" for k, (s, d) in self.columns.items())
        return f"{self.n:,} rows | {cols} | {self.n / self.batch_size:,.2f} batches of {self.batch_size} per epoch"


class StreamLoader(Source):
    """Batches of a Hugging Face `datasets.IterableDataset` (any columns) as it streams: `Loader(stream, ...)`.

    This process reads its own shards (`datasets.distributed.split_dataset_by_node`), in order: no shuffle buffer,
    since `datasets` cannot restore one's contents on resume. Its rank and the number of processes are its `rows`'
    place in the global batch (rows k*r:(k+1)*r of batch_size are process k of batch_size/r, as
    `jdp.process_rows` hands them out), so the trainer needs to say nothing more. Each `local_batch` takes the next
    r rows; when this process's shards run out it starts its next epoch over them (a batch is carried across,
    never padded), so no process waits for rows another lacks. `position()` is the exact place after the last
    batch (the dataset's own `state_dict()`), which the trainer saves beside each checkpoint and hands back to
    `load_position()` on resume. Unlike the map-style order, the batches depend on the number of processes, steps
    come in order, and epochs are per process; `seed` has no effect (the order is the stream's).

    `train=False` (an evaluation set): `eval_batches()` has every process read the whole stream and keep its rows of
    each global batch, so every row is evaluated once and every process sees as many batches.
    """

    def __init__(
        self,
        source: Any,
        batch_size: int,
        *,
        seed: int = 0,
        collate: Callable[[list[dict]], Batch] | None = None,
        rows: slice | None = None,
        train: bool = True,
    ):
        self.batch_size, self.seed, self.collate, self.train = batch_size, seed, collate, train
        self.rows = rows if rows is not None else slice(0, batch_size)
        self.rank, self.world, self.n_rows = _process_of(self.rows, batch_size)
        if _shuffle_buffered(source):
            raise ConfigError(
                "the stream is shuffled with a buffer (IterableDataset.shuffle), whose contents datasets cannot "
                "restore on resume; shuffle the rows before streaming them (write shuffled files, or "
                "Dataset.shuffle(seed=...) before to_iterable_dataset())"
            )
        # Rows come as one-row Arrow tables (the fastest way through datasets, and its state_dict stays exact); a
        # batch of them is read to numpy as the map-style path reads its rows
        from datasets.formatting import get_formatter

        self.base = source.with_format("arrow")
        self._formatter = get_formatter("numpy", features=source.features)
        self.n_shards = int(getattr(source, "num_shards", None) or source.n_shards)  # older datasets: n_shards
        self.epoch_count = self.next_step = self.n_read = self._in_epoch = 0
        self._node, self._it, self._loaded = self._split(0), None, None
        self._epochs = {0: 0}  # batches read -> this process's epoch after them; the metrics ask a few steps late
        self.columns = {k: (v.shape[1:], v.dtype) for k, v in self._sample().items()}

    def _split(self, epoch: int):
        from datasets.distributed import split_dataset_by_node

        node = split_dataset_by_node(self.base, rank=self.rank, world_size=self.world)
        node.set_epoch(epoch)  # datasets >= 4 also reorders the shards by epoch; a restored position names its own
        return node

    def _sample(self) -> Batch:
        """The first rows this process reads (of the whole stream for evaluation), checked before any compute."""
        source, want = (self._split(0), self.n_rows) if self.train else (self.base, self.batch_size)
        rows = []
        for row in source:
            rows.append(row)
            if len(rows) >= min(want, _SAMPLE):
                break
        if not rows and self.train:
            shards = f"{self.n_shards} shard{'s' * (self.n_shards != 1)}"
            raise ConfigError(
                f"process {self.rank} of {self.world} got no rows from the stream ({shards}); give the dataset at "
                f"least as many shards as processes (more files, or to_iterable_dataset(num_shards=N))"
            )
        if not rows:
            raise ConfigError("the evaluation stream holds no rows")
        return self._collate(rows, np.arange(len(rows)))

    def _numpy(self, rows: list) -> dict[str, Any]:
        """One-row tables as datasets' numpy format would give them (numbers and even lists straight from Arrow)."""
        import pyarrow as pa

        table = pa.concat_tables(rows, promote_options="default")  # a column's type may be unknown in a few rows
        out = {
            k: _arrow_numpy(table.column(k)) if _plain(table.schema.field(k).type, pa) else None
            for k in table.column_names
        }
        if slow := [k for k, v in out.items() if v is None]:
            out.update(self._formatter.format_batch(table.select(slow)))
        return out

    def _collate(self, rows: list, idx: np.ndarray) -> Batch:
        cols = self._numpy(rows)
        if self.collate is not None:
            return _checked(_check_collated(self.collate(_as_rows(cols, len(rows))), len(rows)))
        try:
            return _checked(_stacked(cols, idx))
        except ConfigError as e:
            if " row " not in str(e):  # only a shape or dtype that differs names rows
                raise
            raise ConfigError(
                f"{e} (rows counted in the order process {self.rank} of {self.world} reads the stream)"
            ) from None

    def _next_row(self):
        while True:
            if self._it is None:
                self._it = iter(self._node)
            try:
                row = next(self._it)
            except StopIteration:
                if self._in_epoch == 0:
                    raise ConfigError(
                        f"process {self.rank} of {self.world} got no rows from the stream in its epoch "
                        f"{self.epoch_count}; give the dataset at least as many non-empty shards as processes"
                    ) from None
                # A fresh split for the next epoch: a restored dataset would otherwise restart mid-epoch again.
                self.epoch_count += 1
                self._node, self._it, self._in_epoch = self._split(self.epoch_count), None, 0
                continue
            self._in_epoch += 1
            self.n_read += 1
            return row

    def local_batch(self, step: int) -> Batch:
        """This process's next `rows` rows of the stream, as batch `step` (steps come in order: 0, 1, ...)."""
        if step != self.next_step:
            raise ConfigError(
                f"a stream is read in order: batch {step} was asked for, but the next one is {self.next_step}; to "
                f"resume elsewhere, hand a saved position() to load_position()"
            )
        first = self.n_read
        rows = [self._next_row() for _ in range(self.n_rows)]
        batch = self._collate(rows, np.arange(first, first + len(rows)))
        self.next_step, self._loaded = step + 1, None
        self._epochs[step + 1] = self.epoch_count
        self._epochs.pop(step - 63, None)
        return batch

    def epoch(self, step: int) -> float:
        """The epochs this process had finished after `step` batches (whole ones: a stream's length is unknown)."""
        return float(self._epochs.get(step, self.epoch_count))

    def position(self) -> dict:
        """Where this process stands after its last batch: JSON, exact, for load_position()."""
        if self._loaded is not None:  # datasets reports a loaded state only once iteration starts
            return self._loaded
        return {
            "dataset": self._node.state_dict(),
            "epoch": self.epoch_count,
            "in_epoch": self._in_epoch,
            "read": self.n_read,
            "step": self.next_step,
            "rank": self.rank,
            "world": self.world,
            "shards": self.n_shards,
        }

    def load_position(self, position: dict) -> None:
        """Continue exactly after the batch `position` was taken at (on the same process of as many)."""
        keys = ("dataset", "epoch", "in_epoch", "read", "step", "rank", "world", "shards")
        if not isinstance(position, Mapping) or any(k not in position for k in keys):
            raise ConfigError(f"{position!r:.200} is not a stream position saved by jdp's StreamLoader")
        if (position["rank"], position["world"]) != (self.rank, self.world):
            why = (
                f"which rows a process streams depends on the number of processes; resume on {position['world']}"
                if position["world"] != self.world
                else "each process resumes its own shards; keep each process's share of the batch (the mesh order)"
            )
            raise ConfigError(
                f"a stream position saved by process {position['rank']} of {position['world']} cannot be restored "
                f"on process {self.rank} of {self.world}: {why}, or start over (train.resume=false)"
            )
        if position["shards"] != self.n_shards:
            raise ConfigError(
                f"the stream position was saved for a dataset of {position['shards']} shards, this one has "
                f"{self.n_shards}: resume with the same data, or start over (train.resume=false)"
            )
        self._node = self._split(position["epoch"])
        self._node.load_state_dict(position["dataset"])
        self.epoch_count, self._in_epoch, self.n_read = position["epoch"], position["in_epoch"], position["read"]
        self.next_step, self._it, self._loaded = position["step"], None, dict(position)
        self._epochs = {self.next_step: self.epoch_count}

    def eval_batches(self) -> Iterator[Batch]:
        """This process's rows of each global batch of the whole stream, in order, as the map-style Loader's: the
        last batch is filled up by repeating rows from the start, which carry `valid` = 0 (1 for the real rows)."""
        head, batch, n = [], [], 0
        for row in self.base:
            if len(head) < self.batch_size:  # what the padding repeats (row p % n for position p >= n)
                head.append(row)
            batch.append(row)
            n += 1
            if len(batch) == self.batch_size:
                yield self._eval_batch(batch, n - self.batch_size, np.ones(self.batch_size, bool))
                batch = []
        if batch:
            real = len(batch)
            batch += [head[p % n] for p in range(n, n - real + self.batch_size)]
            yield self._eval_batch(batch, n - real, np.arange(self.batch_size) < real)

    def _eval_batch(self, rows: list, first: int, valid: np.ndarray) -> Batch:
        idx = (first + np.arange(self.batch_size))[self.rows]
        out = self._collate(rows[self.rows], idx)
        out["valid"] = valid[self.rows].astype(np.float32)
        return out

    def describe(self) -> str:
        cols = ", ".join(f"{k} {tuple(s)} {d}" for k, (s, d) in self.columns.items())
        if not self.train:
            return f"streaming evaluation set (no length; every process reads all of it) | {cols}"
        if self.n_shards % self.world == 0:
            how = f"{self.n_shards // self.world} of {self.n_shards} shards"
        else:  # datasets then has every process read every shard, keeping every world-th row
            how = f"every {self.world}th row of all {self.n_shards} shards"
        return (
            f"streaming (no length), process {self.rank} of {self.world} reads {how}, in order, epochs its own | "
            f"{cols} | {self.n_rows} of each batch of {self.batch_size} rows"
        )


def _process_of(rows: slice, batch_size: int) -> tuple[int, int, int]:
    """(rank, processes, rows per process) of a process whose share of each global batch is `rows`."""
    start, stop = rows.start or 0, rows.stop if rows.stop is not None else batch_size
    if batch_size < 1 or not 0 <= start < stop <= batch_size or rows.step not in (None, 1):
        raise ConfigError(
            f"rows={rows} is not a non-empty part of a global batch of {batch_size} rows; pass "
            f"jdp.process_rows(batch_size, mesh)"
        )
    size = stop - start
    if batch_size % size or start % size:
        raise ConfigError(
            f"rows {start}:{stop} of a global batch of {batch_size} are not one of equal parts: a stream is split "
            f"between processes by their share of the batch, so every process needs as many rows (as many devices)"
        )
    return start // size, batch_size // size, size


def _shuffle_buffered(ds) -> bool:
    """Whether `ds` was shuffled through a buffer (datasets has no public flag: its iterables are walked)."""
    todo = [getattr(ds, "_ex_iterable", None)]
    while todo:
        it = todo.pop()
        if it is None:
            continue
        if type(it).__name__ == "BufferShuffledExamplesIterable":
            return True
        todo += [getattr(it, "ex_iterable", None), *getattr(it, "ex_iterables", [])]
    return False


# ---------------------------------------------------------------------------------------------- sources


def _is_stream(source: Any) -> bool:
    hf = sys.modules.get("datasets")  # an HF object can only exist if its module is loaded
    return hf is not None and isinstance(source, hf.IterableDataset)


def _adapt(source: Any):
    hf = sys.modules.get("datasets")
    if hf is not None and isinstance(source, hf.DatasetDict | hf.IterableDatasetDict):
        kind = type(source).__name__
        raise ConfigError(
            f"the data source is {'an' if kind[0] in 'AEIOU' else 'a'} {kind} with splits {list(source)}; pass one "
            f"split, e.g. ds['train']"
        )
    if hf is not None and isinstance(source, hf.Dataset):
        return _HFRows(source)
    if isinstance(source, Mapping):
        return _ArrayRows(source)
    if hasattr(source, "__len__") and hasattr(source, "__getitem__"):
        return _IndexedRows(source)
    raise ConfigError(
        f"a data source of type {type(source).__name__} has no len() and __getitem__(int); pass a datasets.Dataset, "
        f"a dict of numpy arrays, an indexable of dicts or a datasets.IterableDataset (a stream)"
    )


class _HFRows:
    """A Hugging Face Dataset, read with one batched __getitem__ per batch.

    Numbers and equal-length (nested) lists of numbers go from Arrow to numpy directly: datasets' numpy format
    builds nested lists row by row in Python (see docs/data.md for the measured difference). Anything else
    (Array3D and other extension types, images to decode, ragged lists, strings, nulls) is read in datasets'
    numpy format.
    """

    def __init__(self, ds):
        import pyarrow as pa

        fast = [k for k, t in zip(ds.data.schema.names, ds.data.schema.types, strict=True) if _plain(t, pa)]
        self.names, self.n = list(ds.column_names), len(ds)
        self.arrow = ds.select_columns(fast).with_format("arrow") if fast else None
        self.numpy = ds.with_format("numpy")
        self._formats: dict[tuple[str, ...], Any] = {}

    def __len__(self) -> int:
        return self.n

    def _read(self, idx: np.ndarray) -> dict[str, Any]:
        keys = idx.tolist()
        out = dict.fromkeys(self.names)
        if self.arrow is not None:
            table = self.arrow[keys]
            out.update({k: _arrow_numpy(table.column(k)) for k in table.column_names})
        slow = tuple(k for k, v in out.items() if v is None)  # typed so, or ragged/null in this batch
        if slow:
            if slow not in self._formats:
                self._formats[slow] = self.numpy.select_columns(list(slow)).with_format("numpy")
            out.update(self._formats[slow][keys])
        return out

    def columns(self, idx: np.ndarray) -> Batch:
        return _stacked(self._read(idx), idx)

    def rows(self, idx: np.ndarray) -> list[dict]:
        return _as_rows(self._read(idx), len(idx))


def _stacked(cols: dict[str, Any], idx: np.ndarray) -> Batch:
    """Columns in datasets' numpy format as arrays; a ragged one comes back as per-row arrays: stacked, the first
    bad pair is named."""
    return {
        k: v if isinstance(v, np.ndarray) and v.dtype.kind in _NUMERIC else _stack(k, list(v), idx)
        for k, v in cols.items()
    }


def _as_rows(cols: dict[str, Any], n: int) -> list[dict]:
    return [{k: v[i] for k, v in cols.items()} for i in range(n)]


def _plain(kind, pa) -> bool:
    """Numbers, or (nested) lists of numbers: what _arrow_numpy reads without datasets' formatting."""
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        return _plain(kind.value_type, pa)
    return pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)


def _arrow_numpy(column) -> np.ndarray | None:
    """An Arrow column of numbers or of equal-length (nested) lists of numbers as one array; None when this
    batch of it is ragged or holds nulls."""
    import pyarrow as pa

    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    kind = arr.type
    if arr.null_count:
        return None
    if pa.types.is_fixed_size_list(kind):
        size = kind.list_size
    elif pa.types.is_list(kind) or pa.types.is_large_list(kind):
        lengths = np.diff(arr.offsets.to_numpy())
        if len(lengths) == 0 or (lengths != lengths[0]).any():
            return None
        size = int(lengths[0])
    else:
        return arr.to_numpy(zero_copy_only=False)
    inner = _arrow_numpy(arr.flatten())
    return None if inner is None else inner.reshape(len(arr), size, *inner.shape[1:])


class _ArrayRows:
    """A dict of equal-length arrays: rows are fancy-indexed, no copy of the whole."""

    def __init__(self, arrays: Mapping):
        self.arrays = {k: np.asarray(v) for k, v in arrays.items()}
        lengths = {k: len(v) if v.ndim else None for k, v in self.arrays.items()}
        if len(set(lengths.values())) > 1 or None in lengths.values():
            raise ConfigError(
                f"the data's arrays differ in length (or are scalars): {lengths}; give every column one entry per row"
            )
        for k, v in self.arrays.items():
            _require_numeric(k, v.dtype)
        _checked(self.arrays)  # whole columns in memory: a value the devices would wrap is found before compiling

    def __len__(self) -> int:
        return len(next(iter(self.arrays.values()), ()))

    def columns(self, idx: np.ndarray) -> Batch:
        return {k: v[idx] for k, v in self.arrays.items()}

    def rows(self, idx: np.ndarray) -> list[dict]:
        return [{k: v[i] for k, v in self.arrays.items()} for i in idx]


class _IndexedRows:
    """A user's indexable (a PyTorch map-style Dataset, a list of dicts): one __getitem__ per row."""

    def __init__(self, source):
        self.source = source

    def __len__(self) -> int:
        return len(self.source)

    def rows(self, idx: np.ndarray) -> list[dict]:
        out = [self.source[int(i)] for i in idx]
        for i, row in zip(idx, out, strict=True):
            if not isinstance(row, Mapping):
                raise ConfigError(
                    f"row {i} of the data is a {type(row).__name__}, not a dict of columns; return a dict from "
                    f"__getitem__ (e.g. {{'image': x, 'label': y}}) or pass collate= to turn rows into arrays"
                )
        return out

    def columns(self, idx: np.ndarray) -> Batch:
        return _stack_rows(self.rows(idx), idx)


# ---------------------------------------------------------------------------------------------- checks


def _checked(batch: Batch) -> Batch:
    """What every batch a loader hands out is checked for: no column under jdp's reserved name, and no 64-bit
    integer that the devices would wrap (JAX keeps integers in 32 bits unless jax_enable_x64 is on)."""
    if "valid" in batch:
        raise ConfigError(
            "the data has a column named 'valid', which jdp reserves for marking evaluation padding; rename it"
        )
    for name, x in batch.items():
        if x.dtype in (np.int64, np.uint64) and x.size:
            narrow = np.iinfo(np.int32 if x.dtype == np.int64 else np.uint32)
            if (x.min() < narrow.min or x.max() > narrow.max) and not _x64():
                bad = x.flat[int(np.argmax((x < narrow.min) | (x > narrow.max)))]
                raise ConfigError(
                    f"column {name!r} holds {bad} ({x.dtype}), beyond {narrow.dtype}: JAX keeps integers in 32 bits "
                    f"unless jax_enable_x64 is on, so it would wrap to {bad.astype(narrow.dtype)} on the devices. "
                    f"Map the values into {narrow.dtype}'s range (e.g. label ids 0..K-1), or call "
                    f"jax.config.update('jax_enable_x64', True) before anything runs"
                )
    return batch


def _x64() -> bool:
    import jax

    return bool(jax.config.read("jax_enable_x64"))


def _require_numeric(name: str, dtype: np.dtype, collated: bool = False) -> None:
    if dtype.kind in _NUMERIC:
        return
    if collated:
        raise ConfigError(f"collate returned {name!r} as {dtype} values, not numbers; return numeric arrays only")
    raise ConfigError(
        f"column {name!r} holds {dtype} values, not numbers; drop it (ds.remove_columns) or pass collate= to "
        f"turn rows into numeric arrays (tokenize text there, for example)"
    )


def _stack_rows(rows: list[Mapping], idx: np.ndarray) -> Batch:
    """Rows (dicts) as one array per column; `idx` numbers them in errors."""
    keys = list(rows[0])
    for i, row in zip(idx, rows, strict=True):
        if list(row) != keys:
            raise ConfigError(
                f"row {i} of the data has columns {list(row)}, row {idx[0]} has {keys}; give every row the same columns"
            )
    return {k: _stack(k, [np.asarray(r[k]) for r in rows], idx) for k in keys}


def _stack(name: str, values: list[np.ndarray], idx: np.ndarray) -> np.ndarray:
    """One column's per-row values as one array; the first row that differs from the first is named."""
    values = [np.asarray(v) for v in values]
    first = values[0]
    _require_numeric(name, first.dtype)
    for i, v in zip(idx, values, strict=True):
        if v.shape != first.shape or v.dtype != first.dtype:
            raise ConfigError(
                f"column {name!r}: row {i} is {v.shape} {v.dtype} but row {idx[0]} is {first.shape} {first.dtype}; "
                f"every row of a column needs one shape and dtype (pad or cut in collate=)"
            )
    return np.stack(values)


def _check_collated(batch: Any, n_rows: int) -> Batch:
    if not isinstance(batch, Mapping):
        raise ConfigError(f"collate returned a {type(batch).__name__}; it must return a dict of numpy arrays")
    out = {}
    for k, v in batch.items():
        v = np.asarray(v)
        _require_numeric(k, v.dtype, collated=True)
        if v.ndim == 0 or len(v) != n_rows:
            raise ConfigError(
                f"collate returned {k!r} with shape {v.shape} for {n_rows} rows; every array needs one leading "
                f"entry per row"
            )
        out[k] = v
    return out


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
