"""Tokens: tokenizers, the cached token streams of a corpus, and the windows cut from a stream."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from filelock import FileLock

from jdp.config import ConfigError, DataConfig
from jdp.data.corpus import BUILDERS, cache_root, data_files, resolve_source
from jdp.log import logger

__all__ = [
    "eval_batches",
    "FORMAT_VERSION",
    "ByteTokenizer",
    "HFTokenizer",
    "Tokens",
    "documents",
    "load_tokenizer",
    "n_windows",
    "tokenize",
    "windows",
]

log = logger("jdp.tokens")

FORMAT_VERSION = 1
_EOD_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|eos|>", "[SEP]", "<|end_of_text|>")


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, with 256 as the end-of-document token."""

    name = "byte"
    vocab_size = 257
    eod_id = 256

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), np.uint8).astype(np.uint16) for t in texts]

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


# What transformers reads a tokenizer from when there is no tokenizer.json (sentencepiece, BPE and WordPiece files)
_SLOW_TOKENIZER_FILES = ("tokenizer.model", "spiece.model", "vocab.json", "vocab.txt", "sentencepiece.bpe.model")


class HFTokenizer:
    """Any Hugging Face tokenizer from a local path: a tokenizer.json (the `tokenizers` format) or a directory."""

    def __init__(self, path: str):
        p = Path(path).expanduser()
        file = p / "tokenizer.json" if p.is_dir() else p
        if file.is_file():
            from tokenizers import Tokenizer

            try:
                self._tok = Tokenizer.from_file(str(file))
            except Exception as e:  # tokenizers raises a bare Exception with the JSON parser's message
                raise ConfigError(
                    f"data.tokenizer={path}: {file} is not a Hugging Face tokenizer ({e}); give a tokenizer.json "
                    f"saved by `tokenizers` or `transformers` (or its directory), or data.tokenizer=byte for a model "
                    f"trained from scratch (not with train.init_from: an imported model reads its own ids)"
                ) from e
            vocab = self._tok.get_vocab(with_added_tokens=True)
            self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
            self._encode = lambda texts: [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]
            self.decode = lambda ids: self._tok.decode([int(i) for i in ids])
        elif p.is_dir():
            if not any((p / f).is_file() for f in _SLOW_TOKENIZER_FILES):
                found = ", ".join(sorted(q.name for q in p.iterdir())[:8]) or "nothing"
                raise ConfigError(
                    f"data.tokenizer={path}: this directory holds no tokenizer (no tokenizer.json, and none of "
                    f"{', '.join(_SLOW_TOKENIZER_FILES)}; found: {found}); give the directory a tokenizer was saved to "
                    f"(save_pretrained, `hf download`), its tokenizer.json, or data.tokenizer=byte for a model trained "
                    f"from scratch (not with train.init_from: an imported model reads its own ids)"
                )
            try:
                from transformers import AutoTokenizer
            except ImportError as e:
                raise ConfigError(
                    f"data.tokenizer={path}: has no tokenizer.json; `pip install transformers` to read it"
                ) from e
            try:
                self._tok = AutoTokenizer.from_pretrained(str(p), trust_remote_code=False)  # never its code
            except Exception as e:
                raise ConfigError(
                    f"data.tokenizer={path}: transformers could not load a tokenizer from it ({e})"
                ) from e
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


@dataclass
class Tokens:
    """The corpus as two flat token streams (documents joined by end-of-document tokens)."""

    train: np.ndarray
    val: np.ndarray
    n_docs: int
    n_empty: int  # documents with no text: skipped, and counted here


def tokenize(ds, tokenizer, cfg: DataConfig, seed: int, val_ds=None) -> Tokens:
    """Tokenize with `datasets.map`, take validation documents (whole ones, held out of `ds`, or from `val_ds`, the
    validation split, when there is one), and cache the streams."""
    # A local source's fingerprints hold its files' identity (corpus.file_identity): a rewritten file misses.
    val_print = val_ds._fingerprint if val_ds is not None else None
    key = [FORMAT_VERSION, ds._fingerprint, val_print, tokenizer.name, cfg.text_column, cfg.val_tokens, seed]
    # text_unit too: the datasets fingerprint of .txt files follows it today, but the cache must not rely on that.
    key = json.dumps([*key, cfg.text_unit])
    cache = cache_root(cfg) / f"tokens-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    cache.parent.mkdir(parents=True, exist_ok=True)
    # One process per host tokenizes; the others wait for it and then read its cache.
    with FileLock(str(cache) + ".lock"):
        if (cache / "meta.json").exists() and _read_cache(cache) is None:  # damaged after it was written
            log.warning(f"the token cache {cache} is damaged; tokenizing again")
            shutil.rmtree(cache)
        if not (cache / "meta.json").exists():
            _tokenize_into(cache, key, ds, val_ds, tokenizer, cfg, seed)
    return _read_cache(cache)


def _read_cache(cache: Path) -> Tokens | None:
    """The cached streams, memory-mapped (processes on one host share the page cache instead of each holding a
    copy); None when the cache does not read back (a file cut off or altered)."""
    try:
        meta = json.loads((cache / "meta.json").read_text())
        train, val = (np.load(cache / f"{name}.npy", mmap_mode="r") for name in ("train", "val"))
        return Tokens(train, val, int(meta["n_docs"]), int(meta["n_empty"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass
class _Documents:
    """A dataset's documents as one token stream, each non-empty one followed by an end-of-document token."""

    stream: np.ndarray
    doc_of_token: np.ndarray  # the document each token of `stream` belongs to
    lengths: np.ndarray  # tokens per document, without its end-of-document token
    nonempty: np.ndarray  # which documents have tokens (the others are skipped)

    def take(self, is_taken: np.ndarray) -> np.ndarray:
        """The stream of the documents `is_taken` marks, in order."""
        return self.stream[is_taken[self.doc_of_token]]

    def choose(self, n_tokens: int, seed: int) -> np.ndarray:
        """Whole non-empty documents, in a seeded order, until they hold at least n_tokens tokens (or all of them)."""
        chosen = np.zeros(len(self.lengths), bool)
        if n_tokens > 0:
            order = np.random.default_rng([seed, 1]).permutation(np.flatnonzero(self.nonempty))
            taken = np.cumsum(self.lengths[order] + 1)
            chosen[order[: int(np.searchsorted(taken, n_tokens) + 1)]] = True
        return chosen


def _documents(ds, tokenizer, cfg: DataConfig, where: str) -> _Documents:
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
    if not nonempty.any():
        raise ConfigError(f"data.source={cfg.source}{where}: every document in column {column!r} is empty")
    # One end-of-document token after every document.
    stream = np.insert(values, offsets[1:][nonempty], tokenizer.eod_id).astype(values.dtype)
    doc_of_token = np.repeat(np.arange(len(lengths))[nonempty], lengths[nonempty] + 1)
    return _Documents(stream, doc_of_token, lengths, nonempty)


def _holds_everything(docs: _Documents, n_docs: int, cfg: DataConfig, seed: int) -> ConfigError:
    """data.val_tokens would hold out every document: the fix that works (a value that leaves training documents,
    or, for one document, cutting it into several: no data.val_tokens can split a document)."""
    head = (f"data.source={cfg.source}: holding out data.val_tokens={cfg.val_tokens:,} for validation would leave "
            f"no training documents: it holds {len(docs.stream):,} tokens in {n_docs:,} document{'s' * (n_docs > 1)}")  # fmt: skip
    if n_docs == 1:
        cut = (f"cut it into documents with data.text_unit=line or data.text_unit=paragraph (data.text_unit="
               f"{cfg.text_unit} makes each .txt file one document), " if _text_files(cfg) else "")  # fmt: skip
        return ConfigError(
            f"{head}, and validation holds out whole documents, so no data.val_tokens leaves one to train on: "
            f"{cut}give a validation file or split (data.val_split), or set data.val_tokens=0 to switch evaluation off"
        )
    # choose() takes documents in this order until it holds data.val_tokens: any value up to all but the last's
    order = np.random.default_rng([seed, 1]).permutation(np.flatnonzero(docs.nonempty))
    fits = int(np.sum(docs.lengths[order[:-1]] + 1))
    return ConfigError(
        f"{head}. Lower data.val_tokens to at most {fits}, e.g. data.val_tokens={min(fits, len(docs.stream) // 10)}, "
        f"or set it to 0 to switch evaluation off"
    )


def _text_files(cfg: DataConfig) -> bool:
    """Whether the source is .txt files (data.text_unit says what a document of them is)."""
    try:
        files = data_files(cfg, resolve_source(cfg)) or []
    except ConfigError:
        return False
    return any(BUILDERS.get(Path(f).suffix.lower()) == "text" for f in files)


def _tokenize_into(cache: Path, key: str, ds, val_ds, tokenizer, cfg: DataConfig, seed: int) -> None:
    docs = _documents(ds, tokenizer, cfg, "")
    n_docs, n_empty = int(docs.nonempty.sum()), int((~docs.nonempty).sum())
    if val_ds is None:  # hold whole documents out of the training split
        is_val = docs.choose(cfg.val_tokens, seed)
        if is_val.sum() >= n_docs:
            raise _holds_everything(docs, n_docs, cfg, seed)
        tokens = Tokens(docs.take(~is_val), docs.take(is_val), n_docs, n_empty)
    else:  # the validation split, bounded by data.val_tokens like a hold-out; nothing is held out of training
        val = np.zeros(0, docs.stream.dtype)
        if cfg.val_tokens > 0:
            val_docs = _documents(val_ds, tokenizer, cfg, " (its validation split)")
            val = val_docs.take(val_docs.choose(cfg.val_tokens, seed))
        tokens = Tokens(docs.stream, val, n_docs, n_empty)

    tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        np.save(tmp / "train.npy", tokens.train)
        np.save(tmp / "val.npy", tokens.val)
        (tmp / "meta.json").write_text(json.dumps({"n_docs": tokens.n_docs, "n_empty": n_empty, "key": key}))
        tmp.rename(cache)  # atomic: a reader never sees a partial cache
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        need, free = tokens.train.nbytes + tokens.val.nbytes, shutil.disk_usage(cache.parent).free
        why = e.strerror or ("the disk is full" if free < need else str(e))  # numpy's short write has no errno
        raise ConfigError(
            f"the token cache {cache} could not be written: {why} ({need:,} bytes needed, {free:,} free there); "
            f"free some space, or point data.cache_dir (or $JDP_CACHE) at a larger disk"
        ) from None


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


def eval_batches(stream: np.ndarray, seq_len: int, batch_size: int, rows: slice = slice(None)):
    """Every validation window once, in order; the last batch is padded with zero-weight rows."""
    n = n_windows(stream, seq_len)
    for start in range(0, n, batch_size):
        idx = np.arange(start, start + batch_size)
        yield windows(stream, np.where(idx < n, idx, -1)[rows], seq_len)


def documents(batch: dict[str, np.ndarray], eod_id: int) -> dict[str, np.ndarray]:
    """The batch with `segments` and `positions` (data.document_attention=within): each end-of-document token
    starts the next document (it is that document's first input, as a beginning-of-sequence token would be), the
    tokens of one document share a segment id, and positions count from 0 at each document's start. A window's
    first tokens continue a document cut by the window's start; they count from 0 too."""
    inputs = batch["inputs"]
    starts = inputs == eod_id
    segments = np.cumsum(starts, axis=1, dtype=np.int32)
    at = np.broadcast_to(np.arange(inputs.shape[1], dtype=np.int32), inputs.shape)
    first = np.maximum.accumulate(np.where(starts, at, 0), axis=1)
    return {**batch, "segments": segments, "positions": (at - first).astype(np.int32)}
