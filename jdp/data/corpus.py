"""Documents: where the text comes from (the embedded stdlib corpus, local files, a saved dataset or the hub) and
which split validates, as `datasets.Dataset`s (map-style) or `IterableDataset`s (streaming), with clear errors
for bad sources."""

from __future__ import annotations

import glob
import hashlib
import os
import sys
import sysconfig
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from filelock import FileLock

from jdp.config import ConfigError, DataConfig
from jdp.data import formats

__all__ = [
    "BUILDERS",
    "TEXT_UNITS",
    "UNIT_NAMES",
    "VAL_SPLITS",
    "Corpus",
    "build_stdlib_corpus",
    "cache_root",
    "choose_val_split",
    "data_files",
    "decoding_error",
    "file_identity",
    "files_fingerprint",
    "files_by_split",
    "first_undecodable",
    "is_saved_dataset",
    "load_documents",
    "load_saved",
    "looks_local",
    "open_corpus",
    "open_stream",
    "resolve_source",
    "stdlib_files",
]

BUILDERS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
# data.text_unit: where datasets' text builder cuts .txt files into documents (its `sample_by`), and the banner's words
TEXT_UNITS = {"file": "document", "line": "line", "paragraph": "paragraph"}
UNIT_NAMES = {"file": "one per .txt file", "line": "one per line of text", "paragraph": "one per paragraph of text"}
VAL_SPLITS = ("validation", "test")  # the splits data.val_split=auto validates on, in this order


def cache_root(cfg: DataConfig) -> Path:
    return Path(cfg.cache_dir or os.environ.get("JDP_CACHE") or Path.home() / ".cache" / "jdp").expanduser()


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


def is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists())


def looks_local(source: str) -> bool:
    """Whether `source` names local files rather than a hub dataset (`name` or `owner/name`): it exists, has a
    data file's suffix, starts like a path, has more than one `/`, or lives in a local directory that exists."""
    path = Path(source).expanduser()
    if path.exists() or path.suffix.lower() in BUILDERS or source.startswith((".", "/", "~")) or source.count("/") > 1:
        return True
    return "/" in source and path.parent.is_dir()


def data_files(cfg: DataConfig, source: str) -> list[str] | None:
    """The local data files `source` names (a file, a glob or a directory); None for a hub dataset name."""
    path = Path(source).expanduser()
    if not (glob.has_magic(source) or looks_local(source)):
        return None
    if not glob.has_magic(source) and not path.exists():
        parent = next((p for p in path.parents if p.is_dir()), Path("."))
        raise ConfigError(
            f"data.source={cfg.source}: no data files found: no such file or directory ({path.absolute()}; the "
            f"nearest directory that "
            f"exists is {parent.absolute()}). Fix the path; a Hugging Face hub dataset is named `name` or "
            f"`owner/name`"
        )
    if glob.has_magic(source):
        files = sorted(glob.glob(str(path)))
    elif path.is_dir():
        files = sorted(str(p) for p in path.rglob("*") if p.suffix.lower() in BUILDERS)
    else:
        files = [str(path)] if path.is_file() else []
    if not files:
        raise ConfigError(
            f"data.source={cfg.source}: no data files found. Give a file, a glob, a directory of "
            f"{'/'.join(sorted(BUILDERS))} files, a save_to_disk directory, or a hub dataset name"
        )
    kinds = {Path(f).suffix.lower() for f in files}
    if not kinds <= set(BUILDERS) or len({BUILDERS[k] for k in kinds}) != 1:
        raise ConfigError(
            f"data.source={cfg.source}: files must share one known format ({', '.join(sorted(BUILDERS))}); "
            f"found {', '.join(sorted(kinds))}"
        )
    return files


def resolve_source(cfg: DataConfig) -> str:
    """data.source, with "stdlib" replaced by the path of the embedded corpus (built on first use)."""
    return str(build_stdlib_corpus(cache_root(cfg))) if cfg.source == "stdlib" else cfg.source


def load_saved(cfg: DataConfig, path: Path):
    """A `save_to_disk` directory: a Dataset, or a DatasetDict of splits."""
    import datasets

    try:
        return datasets.load_from_disk(str(path))
    except Exception as e:  # datasets cannot load a saved dataset with no rows (IndexError)
        raise ConfigError(
            f"data.source={cfg.source}: could not load this save_to_disk directory: "
            f"{type(e).__name__}: {e} (is the dataset empty?)"
        ) from e


@dataclass
class Corpus:
    """The documents to train on and, when the source has a split for it, the documents that validate."""

    train: Any  # a datasets.Dataset, or an IterableDataset when streaming
    val: Any | None  # the validation split; None: validation documents are held out of `train`
    val_split: str  # the validation split's name ("" when held out)
    unit: str  # what one document is, for the banner ("" unless the documents come from .txt files)
    # What the documents are without reading them (streaming's fingerprint, files_fingerprint): the local files or
    # a saved dataset's, else the hub dataset's name
    identity: dict = field(default_factory=dict)


def open_corpus(cfg: DataConfig, streaming: bool = False) -> Corpus:
    """The training documents of cfg.source and its validation split (data.val_split), checked; errors say what
    is missing and how to fix it."""
    source = resolve_source(cfg)
    splits, named, unit, identity = _open_splits(cfg, source, streaming)
    train_split = cfg.split if named else next(iter(splits))
    if train_split not in splits:
        raise ConfigError(f"data.source={cfg.source}: no split {cfg.split!r}; it has {sorted(splits)} (set data.split)")
    val_split = choose_val_split(cfg, splits, train_split, named)
    corpus = Corpus(splits[train_split], splits[val_split] if val_split else None, val_split, unit, identity)
    _check_documents(cfg, corpus.train, "")
    if corpus.val is not None:
        _check_documents(cfg, corpus.val, f" (data.val_split={val_split})")
    return corpus


def load_documents(cfg: DataConfig):
    """The training documents of cfg.source as a `datasets.Dataset`."""
    return open_corpus(cfg).train


def open_stream(cfg: DataConfig):
    """The training documents of cfg.source as an IterableDataset, in file order."""
    return open_corpus(cfg, streaming=True).train


def choose_val_split(cfg: DataConfig, splits: dict, train_split: str, named: bool) -> str:
    """The split data.val_split names ("auto": the first of VAL_SPLITS the source has); "" for a hold-out."""
    want = cfg.val_split
    if want == "holdout":
        return ""
    if want == "auto":
        trained = train_split.split("[")[0]  # a slice of a split (train[:90%]) is that split
        others = (n for n in VAL_SPLITS if n in splits and n != trained and _has_rows(splits[n]))
        return next(others, "") if named else ""
    if not want:
        raise ConfigError("data.val_split is empty; use auto, holdout or the name of one of the dataset's splits")
    if not named:
        raise ConfigError(
            f"data.val_split={want}: data.source={cfg.source} has no named splits (one set of documents), so "
            f"validation documents are held out of it: use data.val_split=auto or holdout, or a source with "
            f"splits (a saved DatasetDict, a hub dataset, a directory of train.* and validation.* files)"
        )
    if want == train_split.split("[")[0]:
        raise ConfigError(
            f"data.val_split={want} is also data.split: validating on the training documents measures nothing; "
            f"choose another of {sorted(splits)}, or data.val_split=holdout"
        )
    if want not in splits:
        raise ConfigError(
            f"data.val_split={want}: data.source={cfg.source} has no such split; it has {sorted(splits)} (or use "
            f"data.val_split=auto or holdout)"
        )
    return want


def _has_rows(ds) -> bool:
    """False for a map-style dataset without rows (a stream's length is unknown: True)."""
    import datasets

    return not isinstance(ds, datasets.Dataset) or len(ds) > 0


def _open_splits(cfg: DataConfig, source: str, streaming: bool) -> tuple[dict, bool, str, dict]:
    """The source's splits by name, whether those names mean anything (a source of one set of documents has
    just "train"), what one document is, and what the documents are without reading them (files_fingerprint)."""
    import datasets

    path = Path(source).expanduser()
    if is_saved_dataset(path):
        ds = load_saved(cfg, path)
        named = isinstance(ds, datasets.DatasetDict)
        splits = dict(ds) if named else {"train": ds}
        # Its arrow files, not the directory: datasets' `map` adds cache files beside them.
        arrows = [f["filename"] for d in splits.values() for f in d.cache_files]
        splits = _with_identity(splits, file_identity(arrows))
        if streaming:
            splits = {n: d.to_iterable_dataset(num_shards=max(1, min(len(d), 64))) for n, d in splits.items()}
        return splits, named, "", files_fingerprint(arrows) if streaming else {}
    if (files := data_files(cfg, source)) is not None:
        by_split = files_by_split(source, files)
        builder = BUILDERS[Path(files[0]).suffix.lower()]
        unit = f"{UNIT_NAMES[cfg.text_unit]}, data.text_unit={cfg.text_unit}" if builder == "text" else ""
        identity = file_identity(Path(f) for f in files)
        # datasets keys its parse of local files by path and mtime only, so a file rewritten under `touch -r`
        # would come back from its cache as it was: each identity of the files gets a cache of its own.
        parsed = {} if streaming else {"cache_dir": str(Path(datasets.config.HF_DATASETS_CACHE) / "jdp" / identity)}
        try:
            with _quiet(datasets):  # "Downloading data", "Generating train split": a parse of local files
                splits = datasets.load_dataset(
                    builder, data_files=by_split, streaming=streaming, **parsed, **_reading(cfg, builder)
                )
        except Exception as e:  # datasets fails on empty files with StopIteration, ValueError, ...
            if undecodable := decoding_error(cfg, files, e):
                raise undecodable from e
            if malformed := next((m for f in files if (m := first_malformed(f)) is not None), None):
                raise ConfigError(f"data.source={cfg.source}: {malformed}; fix that line or leave it out") from e
            raise ConfigError(
                f"data.source={cfg.source}: could not read {len(files)} {builder} file(s): "
                f"{type(e).__name__}: {e or 'no data'} (is it empty or malformed?)"
            ) from e
        streamed = files_fingerprint(files) if streaming else {}
        return _with_identity(dict(splits), identity), len(by_split) > 1, unit, streamed
    splits = dict(_from_hub(cfg, source, streaming))
    if cfg.split not in splits and "[" in cfg.split and not streaming:  # a slice such as train[:10%]
        splits[cfg.split] = _from_hub(cfg, source, streaming, split=cfg.split)
    return splits, True, "", {"hub": source, "name": cfg.name, "split": cfg.split}


_ENDS = 1 << 16  # bytes read at each end of a file by files_fingerprint


def files_fingerprint(files) -> dict:
    """What a stream's files are, without reading them through (checked on resume, trainer.py): their number,
    total size, and a digest of each one's path below their common directory, size, and first and last 64 KiB.
    A copy elsewhere or a `touch` keeps it; adding, removing, renaming, growing or cutting a file, or rewriting an
    end of one, changes it (a same-size edit in the middle of a large file does not: that would need a full read)."""
    paths = sorted(Path(f).absolute() for f in files)
    root = Path(os.path.commonpath(paths)) if paths else Path()
    root = root.parent if len(paths) == 1 else root
    h, total = hashlib.sha256(), 0
    for p in paths:
        size = p.stat().st_size
        total += size
        h.update(f"{p.relative_to(root)}\0{size}\0".encode())
        with open(p, "rb") as f:
            h.update(f.read(_ENDS))
            if size > _ENDS:
                f.seek(max(_ENDS, size - _ENDS))
                h.update(f.read(_ENDS))
    return {"files": len(paths), "bytes": total, "files_sha256": h.hexdigest()[:16]}


@contextmanager
def _quiet(datasets) -> Iterator[None]:
    """datasets' progress bars off while it parses local files (jdp's own, `tokenizing`, stay on)."""
    was_on = not datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_on:
            datasets.enable_progress_bars()


def file_identity(paths) -> str:
    """A digest of each file's path, inode, ctime, size and mtime: it changes when any file's content may have
    (a rewrite moves the ctime, which no user tool can set back), and costs no read of the data."""
    stats = []
    for p in sorted(Path(p).absolute() for p in paths):
        st = p.stat()
        stats.append(f"{p}:{st.st_ino}:{st.st_ctime_ns}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(stats).encode()).hexdigest()[:16]


def _with_identity(splits: dict, identity: str) -> dict:
    """The splits, each map-style one's datasets fingerprint folded with the identity of the files it was read
    from: the token cache and datasets' own `map` cache are keyed by fingerprint, which follows only a saved
    dataset's state.json or a file's path and mtime."""
    for d in splits.values():
        if hasattr(d, "_fingerprint"):
            d._fingerprint = hashlib.sha256(f"{d._fingerprint}:{identity}".encode()).hexdigest()[:16]
    return splits


def _from_hub(cfg: DataConfig, source: str, streaming: bool, **kwargs):
    """Every split of a Hugging Face hub dataset (or the one `split` asks for); a failure becomes one clear error."""
    import datasets

    try:
        return datasets.load_dataset(source, cfg.name or None, streaming=streaming, **kwargs)
    except Exception as e:  # ConnectionError, DatasetNotFoundError, HTTP errors, a bad configuration name, ...
        named = f"hub dataset {source!r}" + (f" (configuration {cfg.name!r})" if cfg.name else "")
        offline = "; offline mode is on now" if datasets.config.HF_HUB_OFFLINE else ""
        raise ConfigError(
            f"data.source={cfg.source}: no local file or directory of that name, and the Hugging Face {named} "
            f"could not be loaded: {type(e).__name__}: {e}. For local data, fix the path (a local path exists, or "
            f"starts with ./ or /); for a hub dataset, check the name (`name` or `owner/name`) and the network. "
            f"Without a network set HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1: only datasets already in the Hugging "
            f"Face cache load, and nothing waits on retries{offline}"
        ) from e


def files_by_split(source: str, files: list[str]) -> dict[str, list[str]]:
    """A directory's data files by split, as `datasets` names them (train.jsonl, validation/, test-0.txt, ...)
    when those names place every file in exactly one split; otherwise all of them are the one split "train"."""
    path = Path(source).expanduser()
    if path.is_dir() and not glob.has_magic(source):
        from datasets.data_files import DataFilesDict, get_data_patterns

        base = os.path.abspath(path)
        ours = {os.path.abspath(f): f for f in files}
        found = DataFilesDict.from_patterns(get_data_patterns(base), base_path=base)
        by_split = {str(n): sorted(ours[f] for f in found[n] if f in ours) for n in found}
        placed = [f for fs in by_split.values() for f in fs]
        if len(by_split) > 1 and len(placed) == len(set(placed)) == len(files):
            return by_split
    return {"train": files}


def _check_documents(cfg: DataConfig, ds, where: str) -> None:
    """The text column exists and holds text, and a map-style dataset has rows."""
    import datasets

    needs = formats.get(cfg.format).columns(cfg)
    if ds.column_names is not None and (missing := [c for c in needs if c not in ds.column_names]):
        hint = "set data.text_column"
        if cfg.format == "text" and "messages" in ds.column_names:
            hint += ", or data.format=chat for conversations"
        elif cfg.format == "text" and {"prompt", "completion"} <= set(ds.column_names):
            hint += ", or data.format=prompt for prompt/completion pairs"
        elif cfg.format != "text":
            hint = f"data.format={cfg.format} reads column(s) {', '.join(needs)}"
        raise ConfigError(
            f"data.source={cfg.source}{where}: no column {missing[0]!r}; its columns are {ds.column_names} ({hint})"
        )
    if not isinstance(ds, datasets.Dataset) or cfg.format != "text":
        if isinstance(ds, datasets.Dataset) and len(ds) == 0:
            raise ConfigError(f"data.source={cfg.source}{where}: the dataset is empty")
        return
    feature = ds.features[cfg.text_column]
    if getattr(feature, "dtype", None) not in ("string", "large_string"):
        raise ConfigError(f"data.source={cfg.source}{where}: column {cfg.text_column!r} holds {feature}, not text")
    if len(ds) == 0:
        raise ConfigError(f"data.source={cfg.source}{where}: the dataset is empty")


def _reading(cfg: DataConfig, builder: str) -> dict:
    """How datasets' text, json and csv builders decode files (parquet stores its own encoding), and where the
    text builder cuts documents (data.text_unit)."""
    if builder == "parquet":
        return {}
    unit = {"sample_by": TEXT_UNITS[cfg.text_unit]} if builder == "text" else {}
    return {"encoding": "utf-8", "encoding_errors": cfg.encoding_errors, **unit}


def decoding_error(cfg: DataConfig, files: list[str] | None, error: BaseException) -> ConfigError | None:
    """A clear error for a file that is not valid UTF-8, naming the file, the offset and the byte, when `error`
    (or what caused it) is a decoding error; None for any other error."""
    cause = error
    while cause is not None and not isinstance(cause, UnicodeDecodeError):
        cause = cause.__cause__ or cause.__context__
    if cause is None:
        return None
    where = next((found for f in files or [] if (found := first_undecodable(f)) is not None), None)
    at = (
        f"{where[0]} is not valid UTF-8: byte 0x{where[1]:02x} at offset {where[2]:,} (line {where[3]:,})"
        if where
        else f"a file is not valid UTF-8 ({cause})"
    )
    return ConfigError(
        f"data.source={cfg.source}: {at}. Convert it to UTF-8 (e.g. `iconv -f latin1 -t utf-8`), or read the "
        f"files leniently with data.encoding_errors=replace (each undecodable byte becomes U+FFFD) or "
        f"data.encoding_errors=ignore (dropped)"
    )


def first_undecodable(path: str) -> tuple[str, int, int, int] | None:
    """(path, byte, offset, line) of the first byte of `path` that is not valid UTF-8, or None."""
    import codecs

    decoder, offset, lines = codecs.getincrementaldecoder("utf-8")(), 0, 1
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            pending = decoder.getstate()[0]
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as e:
                data = pending + chunk
                return path, data[e.start], offset - len(pending) + e.start, lines + data[: e.start].count(b"\n")
            offset += len(chunk)
            lines += chunk.count(b"\n")
    return None


def first_malformed(path: str) -> str | None:
    """Where a JSON Lines, JSON or CSV file stops parsing (`PATH line N: ...`), or None: what datasets' error (an
    Arrow message) does not say. Read only after datasets failed on the files."""
    import csv
    import json

    suffix = Path(path).suffix.lower()
    try:
        if suffix == ".csv":
            with open(path, newline="", encoding="utf-8", errors="replace") as f:
                rows = csv.reader(f)
                header = next(rows, None)
                for row in rows:
                    if row and header is not None and len(row) != len(header):
                        return (f"{path} line {rows.line_num}: {len(row)} fields where the header has {len(header)} "
                                f"({', '.join(header)[:80]})")  # fmt: skip
            return None
        if suffix not in (".json", ".jsonl"):
            return None
        text = Path(path).read_text(encoding="utf-8", errors="replace")
        if suffix == ".json" and not text.lstrip().startswith("{"):
            try:
                json.loads(text)  # one JSON document (a list of records)
                return None
            except ValueError as e:
                return f"{path} line {e.lineno}, column {e.colno}: not valid JSON ({e.msg})"
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                return f"{path} line {n}, column {e.colno}: not valid JSON ({e.msg}): {line.strip()[:60]!r}"
            if not isinstance(record, dict):
                return f"{path} line {n}: {line.strip()[:60]!r} is not a JSON object (one record per line)"
    except OSError:
        return None
    return None
