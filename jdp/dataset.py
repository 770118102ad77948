"""Data for any model: the global order of rows, and a loader over any indexable source of rows.

The order is the one the text pipeline uses (data.py's windows are rows too): global batch `step` is a pure
function of `(seed, step)`, the same for every number of processes, and each process reads only its rows of it.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from jdp.config import ConfigError

__all__ = ["GlobalOrder", "Loader"]

Batch = dict[str, np.ndarray]
_NUMERIC = "biufc"  # bool, int, uint, float, complex: what a device array can hold
_SAMPLE = 256  # rows checked at construction: enough to catch a bad column, cheap for any row size


class GlobalOrder:
    """Which rows global batch `step` holds: entries [step*B, (step+1)*B) of the endless concatenation of one
    fresh permutation of the n rows per epoch.

    Every row appears exactly once per epoch. A batch that straddles an epoch boundary takes the end of one epoch
    and the start of the next (carried, not padded or dropped), so every process knows the number of steps up
    front and none waits for a batch another lacks. Nothing here depends on the number of processes.
    """

    def __init__(self, n: int, batch_size: int, seed: int):
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self._perms: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()  # the prefetch thread and the loop may both ask

    def _perm(self, epoch: int) -> np.ndarray:
        with self._lock:
            if epoch not in self._perms:
                if len(self._perms) > 2:
                    self._perms.pop(min(self._perms))
                self._perms[epoch] = np.random.default_rng([self.seed, 0, epoch]).permutation(self.n)
            return self._perms[epoch]

    def indices(self, step: int) -> np.ndarray:
        """Row indices of global batch `step` (0-based)."""
        pos = step * self.batch_size + np.arange(self.batch_size)
        epochs, within = np.divmod(pos, self.n)
        out = np.empty(self.batch_size, np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self._perm(int(e))[within[sel]]
        return out

    def epoch(self, step: int) -> float:
        return step * self.batch_size / self.n


class Loader:
    """Batches of any source of rows in jdp's global order: a Hugging Face `datasets.Dataset` (any numeric
    columns), a dict of equal-length numpy arrays, or any object with `len()` and `__getitem__(int) -> dict`.

    `local_batch(step)` reads only this process's `rows` of global batch `step` and stacks each column (or hands
    the rows to `collate`, PyTorch's convention). `train=False` is for an evaluation set, which may hold fewer
    rows than one global batch. Problems are found on a sample at construction, before anything compiles.
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
        self.source, self.collate = _adapt(source), collate
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
        if "valid" in batch:
            raise ConfigError(
                "the data has a column named 'valid', which jdp reserves for marking evaluation padding; rename it"
            )
        return batch

    def local_batch(self, step: int) -> Batch:
        """This process's rows of global batch `step`, in global order."""
        return self._read(self.order.indices(step)[self.rows])

    def epoch(self, step: int) -> float:
        return self.order.epoch(step)

    def position(self) -> None:
        """Map-style data has no position of its own: the step is the position, so resuming needs nothing."""
        return None

    def eval_batches(self) -> Iterator[Batch]:
        """This process's rows of each global batch of every row once, in order; the last batch is filled up by
        repeating rows, which carry `valid` = 0 (1 for the real rows) so that evaluation counts them out."""
        for start in range(0, self.n, self.batch_size):
            idx = start + np.arange(self.batch_size)
            valid = idx < self.n
            batch = self._read(np.where(valid, idx, idx % self.n)[self.rows])
            batch["valid"] = valid[self.rows].astype(np.float32)
            yield batch

    def describe(self) -> str:
        cols = ", ".join(f"{k} {tuple(s)} {d}" for k, (s, d) in self.columns.items())
        return f"{self.n:,} rows | {cols} | {self.n / self.batch_size:,.2f} batches of {self.batch_size} per epoch"


# ---------------------------------------------------------------------------------------------- sources


def _adapt(source: Any):
    hf = sys.modules.get("datasets")  # an HF object can only exist if its module is loaded
    if hf is not None and isinstance(source, hf.IterableDataset | hf.IterableDatasetDict):
        raise ConfigError(
            "streaming datasets go through jdp train's text pipeline; for other data use a map-style Dataset "
            "(load_dataset(..., streaming=False))"
        )
    if hf is not None and isinstance(source, hf.DatasetDict):
        raise ConfigError(
            f"the data source is a DatasetDict with splits {list(source)}; pass one split, e.g. ds['train']"
        )
    if hf is not None and isinstance(source, hf.Dataset):
        return _HFRows(source)
    if isinstance(source, Mapping):
        return _ArrayRows(source)
    if hasattr(source, "__len__") and hasattr(source, "__getitem__"):
        return _IndexedRows(source)
    raise ConfigError(
        f"a data source of type {type(source).__name__} has no len() and __getitem__(int); pass a datasets.Dataset, "
        f"a dict of numpy arrays or an indexable of dicts (streams: jdp train's text pipeline)"
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
        # a ragged column comes back as an object array of per-row arrays: stack it to name the first bad pair
        return {k: v if v.dtype.kind in _NUMERIC else _stack(k, list(v), idx) for k, v in self._read(idx).items()}

    def rows(self, idx: np.ndarray) -> list[dict]:
        cols = self._read(idx)
        return [{k: v[i] for k, v in cols.items()} for i in range(len(idx))]


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
        rows = self.rows(idx)
        keys = list(rows[0])
        for i, row in zip(idx, rows, strict=True):
            if list(row) != keys:
                raise ConfigError(
                    f"row {i} of the data has columns {list(row)}, row {idx[0]} has {keys}; give every row the same columns"
                )
        return {k: _stack(k, [np.asarray(r[k]) for r in rows], idx) for k in keys}


# ---------------------------------------------------------------------------------------------- checks


def _require_numeric(name: str, dtype: np.dtype, collated: bool = False) -> None:
    if dtype.kind in _NUMERIC:
        return
    if collated:
        raise ConfigError(f"collate returned {name!r} as {dtype} values, not numbers; return numeric arrays only")
    raise ConfigError(
        f"column {name!r} holds {dtype} values, not numbers; drop it (ds.remove_columns) or pass collate= to "
        f"turn rows into numeric arrays (tokenize text there, for example)"
    )


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
