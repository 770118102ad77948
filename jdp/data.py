"""Data: documents (Hugging Face datasets) -> tokens -> packed windows -> the global batch of (seed, step)."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import queue
import sys
import sysconfig
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from filelock import FileLock

from jdp.config import ConfigError, DataConfig

FORMAT_VERSION = 1
_BUILDERS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
_EOD_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|eos|>", "[SEP]", "<|end_of_text|>")


def cache_root(cfg: DataConfig) -> Path:
    return Path(cfg.cache_dir or os.environ.get("JDP_CACHE") or Path.home() / ".cache" / "jdp")


# ---------------------------------------------------------------------------------------------- documents


def stdlib_files() -> list[Path]:
    """The Python standard library's own .py sources, without its test suites and installed packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts))


def build_stdlib_corpus(cache: Path) -> Path:
    """The embedded default corpus: the standard library's sources as a local HF dataset, built once."""
    files = stdlib_files()
    tag = hashlib.sha256("\n".join(f"{p}:{p.stat().st_size}" for p in files).encode()).hexdigest()[:12]
    path = cache / f"stdlib-py{sys.version_info.major}.{sys.version_info.minor}-{tag}"
    cache.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        if not (path / "dataset_info.json").exists():
            _save_stdlib(files, path)
    return path


def _save_stdlib(files: list[Path], path: Path) -> None:
    import datasets

    root = Path(sysconfig.get_paths()["stdlib"])
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in files]
    ds = datasets.Dataset.from_dict({"text": texts, "path": [str(p.relative_to(root)) for p in files]})
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    ds.save_to_disk(str(tmp))
    tmp.rename(path)  # atomic: a reader never sees a partial corpus


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists())


def data_files(cfg: DataConfig, source: str) -> list[str] | None:
    """The local data files `source` names (a file, a glob or a directory); None for a hub dataset name."""
    path = Path(source).expanduser()
    looks_local = path.exists() or Path(source).suffix.lower() in _BUILDERS or source.startswith((".", "/", "~"))
    if not (glob.has_magic(source) or looks_local):
        return None
    if glob.has_magic(source):
        files = sorted(glob.glob(str(path)))
    elif path.is_dir():
        files = sorted(str(p) for p in path.rglob("*") if p.suffix.lower() in _BUILDERS)
    else:
        files = [str(path)] if path.is_file() else []
    if not files:
        raise ConfigError(
            f"data.source={cfg.source}: no data files found. Give a file, a glob, a directory of "
            f"{'/'.join(sorted(_BUILDERS))} files, a save_to_disk directory, or a hub dataset name"
        )
    kinds = {Path(f).suffix.lower() for f in files}
    if not kinds <= set(_BUILDERS) or len({_BUILDERS[k] for k in kinds}) != 1:
        raise ConfigError(
            f"data.source={cfg.source}: files must share one known format ({', '.join(sorted(_BUILDERS))}); "
            f"found {', '.join(sorted(kinds))}"
        )
    return files


def resolve_source(cfg: DataConfig) -> str:
    """data.source, with "stdlib" replaced by the path of the embedded corpus (built on first use)."""
    return str(build_stdlib_corpus(cache_root(cfg))) if cfg.source == "stdlib" else cfg.source


def load_saved(cfg: DataConfig, path: Path):
    """The data.split of a `save_to_disk` directory (a Dataset, or a DatasetDict holding that split)."""
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # datasets cannot load a saved dataset with no rows (IndexError)
        raise ConfigError(
            f"data.source={cfg.source}: could not load this save_to_disk directory: "
            f"{type(e).__name__}: {e} (is the dataset empty?)"
        ) from e
    if isinstance(ds, datasets.DatasetDict):
        if cfg.split not in ds:
            raise ConfigError(f"data.source={cfg.source}: no split {cfg.split!r}; it has {sorted(ds)} (set data.split)")
        ds = ds[cfg.split]
    return ds


def load_documents(cfg: DataConfig):
    """A `datasets.Dataset` of documents from cfg.source; errors say what is missing and how to fix it."""
    import datasets

    source = resolve_source(cfg)
    path = Path(source).expanduser()
    if _is_saved_dataset(path):
        ds = load_saved(cfg, path)
    elif (files := data_files(cfg, source)) is not None:
        builder = _BUILDERS[Path(files[0]).suffix.lower()]
        try:
            ds = datasets.load_dataset(builder, data_files=files, split="train")
        except Exception as e:  # datasets fails on empty files with StopIteration, ValueError, ...
            raise ConfigError(
                f"data.source={cfg.source}: could not read {len(files)} {builder} file(s): "
                f"{type(e).__name__}: {e or 'no data'} (is it empty or malformed?)"
            ) from e
    else:  # a Hugging Face hub dataset
        ds = datasets.load_dataset(source, cfg.name or None, split=cfg.split)
    if cfg.text_column not in ds.column_names:
        raise ConfigError(
            f"data.source={cfg.source}: no column {cfg.text_column!r}; its columns are {ds.column_names} "
            f"(set data.text_column)"
        )
    feature = ds.features[cfg.text_column]
    if getattr(feature, "dtype", None) not in ("string", "large_string"):
        raise ConfigError(f"data.source={cfg.source}: column {cfg.text_column!r} holds {feature}, not text")
    if len(ds) == 0:
        raise ConfigError(f"data.source={cfg.source}: the dataset is empty")
    return ds


# ---------------------------------------------------------------------------------------------- tokenizers


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, with 256 as the end-of-document token."""

    name = "byte"
    vocab_size = 257
    eod_id = 256

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), np.uint8).astype(np.uint16) for t in texts]

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """Any Hugging Face tokenizer from a local path: a tokenizer.json (the `tokenizers` format) or a directory."""

    def __init__(self, path: str):
        p = Path(path).expanduser()
        file = p / "tokenizer.json" if p.is_dir() else p
        if file.is_file():
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(str(file))
            vocab = self._tok.get_vocab(with_added_tokens=True)
            self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
            self._encode = lambda texts: [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]
            self.decode = lambda ids: self._tok.decode([int(i) for i in ids])
        elif p.is_dir():
            try:
                from transformers import AutoTokenizer
            except ImportError as e:
                raise ConfigError(
                    f"data.tokenizer={path}: has no tokenizer.json; `pip install transformers` to read it"
                ) from e
            self._tok = AutoTokenizer.from_pretrained(str(p))
            vocab = self._tok.get_vocab()
            self.vocab_size = len(self._tok)
            self._encode = lambda texts: self._tok(texts, add_special_tokens=False)["input_ids"]
            self.decode = lambda ids: self._tok.decode([int(i) for i in ids])
        else:
            raise ConfigError(
                f"data.tokenizer={path}: no such file or directory (use 'byte' or a local tokenizer path)"
            )
        eod = next((vocab[n] for n in _EOD_NAMES if n in vocab), None)
        if eod is None:
            raise ConfigError(f"data.tokenizer={path}: no end-of-document token (looked for {', '.join(_EOD_NAMES)})")
        self.eod_id = eod
        if file.is_file():
            spec = self._tok.to_str()  # the whole tokenizer: normalizer, pre-tokenizer, model, added tokens
        else:
            backend = getattr(self._tok, "backend_tokenizer", None)
            spec = backend.to_str() if backend is not None else json.dumps(sorted(vocab.items()))
        self.name = f"hf:{file if file.is_file() else p}:{hashlib.sha256(spec.encode()).hexdigest()[:12]}"

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        dtype = np.uint16 if self.vocab_size <= 1 << 16 else np.uint32
        return [np.asarray(ids, dtype) for ids in self._encode(texts)]


def load_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    return ByteTokenizer() if spec == "byte" else HFTokenizer(spec)


# ---------------------------------------------------------------------------------------------- tokens


@dataclass
class Tokens:
    """The corpus as two flat token streams (documents joined by end-of-document tokens)."""

    train: np.ndarray
    val: np.ndarray
    n_docs: int
    n_empty: int  # documents with no text: skipped, and counted here


def tokenize(ds, tokenizer, cfg: DataConfig, seed: int) -> Tokens:
    """Tokenize with `datasets.map`, hold out whole documents for validation, and cache the streams."""
    key = json.dumps([FORMAT_VERSION, ds._fingerprint, tokenizer.name, cfg.text_column, cfg.val_tokens, seed])
    cache = cache_root(cfg) / f"tokens-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    cache.parent.mkdir(parents=True, exist_ok=True)
    # One process per host tokenizes; the others wait for it and then read its cache.
    with FileLock(str(cache) + ".lock"):
        if not (cache / "meta.json").exists():
            _tokenize_into(cache, key, ds, tokenizer, cfg, seed)
    meta = json.loads((cache / "meta.json").read_text())
    # Memory-mapped: processes on one host share the page cache instead of each holding a copy.
    train, val = (np.load(cache / f"{name}.npy", mmap_mode="r") for name in ("train", "val"))
    return Tokens(train, val, meta["n_docs"], meta["n_empty"])


def _tokenize_into(cache: Path, key: str, ds, tokenizer, cfg: DataConfig, seed: int) -> None:

    column = cfg.text_column
    num_proc = cfg.num_proc or min(os.cpu_count() or 1, max(1, len(ds) // 2000))
    ids = ds.map(
        lambda b: {"ids": tokenizer.encode_batch([t or "" for t in b[column]])},
        batched=True,
        remove_columns=ds.column_names,
        num_proc=num_proc if num_proc > 1 else None,
        desc="tokenizing",
    )
    col = ids.data.column("ids").combine_chunks()
    values = col.flatten().to_numpy(zero_copy_only=False)
    offsets = col.offsets.to_numpy()
    lengths = np.diff(offsets)
    nonempty = lengths > 0
    n_empty = int((~nonempty).sum())
    if not nonempty.any():
        raise ConfigError(f"data.source={cfg.source}: every document in column {column!r} is empty")
    # One end-of-document token after every document.
    stream = np.insert(values, offsets[1:][nonempty], tokenizer.eod_id).astype(values.dtype)
    doc_of_token = np.repeat(np.arange(len(lengths))[nonempty], lengths[nonempty] + 1)

    is_val = np.zeros(len(lengths), bool)
    if cfg.val_tokens > 0:
        order = np.random.default_rng([seed, 1]).permutation(np.flatnonzero(nonempty))
        taken = np.cumsum(lengths[order] + 1)
        n_val = int(np.searchsorted(taken, cfg.val_tokens) + 1)
        if n_val >= len(order):
            raise ConfigError(
                f"data.source={cfg.source}: holding out data.val_tokens={cfg.val_tokens} for validation would "
                f"leave no training documents; lower data.val_tokens (0 switches evaluation off)"
            )
        is_val[order[:n_val]] = True
    token_is_val = is_val[doc_of_token]
    tokens = Tokens(stream[~token_is_val], stream[token_is_val], int(nonempty.sum()), n_empty)

    tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    np.save(tmp / "train.npy", tokens.train)
    np.save(tmp / "val.npy", tokens.val)
    (tmp / "meta.json").write_text(json.dumps({"n_docs": tokens.n_docs, "n_empty": n_empty, "key": key}))
    tmp.rename(cache)  # atomic: a reader never sees a partial cache


# ---------------------------------------------------------------------------------------------- batches


def n_windows(stream: np.ndarray, seq_len: int) -> int:
    """Non-overlapping windows of seq_len inputs (+1 shifted target) that the stream holds."""
    return max(0, (len(stream) - 1) // seq_len)


def windows(stream: np.ndarray, idx: np.ndarray, seq_len: int) -> dict[str, np.ndarray]:
    """Batch of windows `idx` (-1: a zero-weight padding row): inputs, next-token targets, weights."""
    valid = idx >= 0
    starts = np.where(valid, idx, 0)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    w = stream[starts].astype(np.int32)
    weights = np.repeat(valid[:, None], seq_len, axis=1).astype(np.float32)
    return {"inputs": w[:, :-1], "targets": w[:, 1:], "weights": weights}


class Batches:
    """The training batches: global batch `step` is a pure function of (seed, step).

    Window order is the endless concatenation of one fresh permutation per epoch; global batch s is
    entries [s*B, (s+1)*B) of it. Every window appears exactly once per epoch, and a batch that
    straddles an epoch boundary takes the end of one epoch and the start of the next: nothing is dropped
    or repeated, and no process ever waits for a batch another process lacks.
    """

    def __init__(self, stream: np.ndarray, seq_len: int, batch_size: int, seed: int):
        self.stream, self.seq_len, self.batch_size, self.seed = stream, seq_len, batch_size, seed
        self.n = n_windows(stream, seq_len)
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) > 2:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = np.random.default_rng([self.seed, 0, epoch]).permutation(self.n)
        return self._perms[epoch]

    def indices(self, step: int) -> np.ndarray:
        """Window indices of global batch `step` (0-based)."""
        pos = step * self.batch_size + np.arange(self.batch_size)
        epochs, within = np.divmod(pos, self.n)
        out = np.empty(self.batch_size, np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self._perm(int(e))[within[sel]]
        return out

    def epoch(self, step: int) -> float:
        return step * self.batch_size / self.n

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

    def local_batch(self, step: int) -> dict[str, np.ndarray]:
        """This process's rows of global batch `step` (streams: the next batch; steps come in order)."""
        if isinstance(self.train, Batches):
            return self.train.batch(step, self.rows)
        return self.train.next_batch()

    def position(self) -> dict | None:
        """Where a streaming loader stands (its state_dict); None for map-style data, whose position is the step."""
        return None if isinstance(self.train, Batches) else self.train.state_dict()

    def describe(self) -> str:
        t, tok = self.tokens, f"tokenizer {self.tokenizer.name} (vocab {self.tokenizer.vocab_size})"
        if not isinstance(self.train, Batches):
            return f"streaming, each process its own shards | val {len(t.val):,} tokens | {tok}"
        return (
            f"{t.n_docs:,} documents ({t.n_empty} empty, skipped) | train {len(t.train):,} tokens = "
            f"{self.train.n:,} windows | val {len(t.val):,} tokens | {tok}"
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
    if cfg.streaming:
        from jdp import stream

        ds = stream.open_stream(cfg)
        val, exclude = stream.hold_out(ds, tokenizer, cfg)
        tokens = Tokens(np.zeros(0, val.dtype), val, 0, 0)
        train = stream.StreamBatches(ds, tokenizer, cfg, rows.stop - rows.start, rank, world, exclude)
    else:
        tokens = tokenize(load_documents(cfg), tokenizer, cfg, seed)
        train = Batches(tokens.train, cfg.seq_len, batch_size, seed)
        if train.n < batch_size:
            raise ConfigError(
                f"data.source={cfg.source}: {train.n} training windows of data.seq_len={cfg.seq_len} tokens, fewer "
                f"than one global batch (train.batch_size={batch_size}); use more data, a shorter seq_len or a "
                f"smaller batch"
            )
    if cfg.val_tokens > 0 and n_windows(tokens.val, cfg.seq_len) == 0:
        raise ConfigError(
            f"data.val_tokens={cfg.val_tokens} holds out fewer than data.seq_len+1 tokens; raise it (or 0 for no evaluation)"
        )
    return Data(tokenizer, tokens, train, rows)


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
                raise RuntimeError("the data loader thread failed") from item
            self._next = step + 1
        self.wait_s += time.perf_counter() - start
        return step, item

    def close(self) -> None:
        self._stop.set()
        if self._depth > 0:
            self._thread.join(timeout=5)
