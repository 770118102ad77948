"""Documents: where the text comes from (the embedded stdlib corpus, local files, a saved dataset or the hub),
as a `datasets.Dataset` (map-style) or an `IterableDataset` (streaming), with clear errors for bad sources."""

from __future__ import annotations

import glob
import hashlib
import os
import sys
import sysconfig
from pathlib import Path

from filelock import FileLock

from jdp.config import ConfigError, DataConfig

BUILDERS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def cache_root(cfg: DataConfig) -> Path:
    return Path(cfg.cache_dir or os.environ.get("JDP_CACHE") or Path.home() / ".cache" / "jdp")


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
    if is_saved_dataset(path):
        ds = load_saved(cfg, path)
    elif (files := data_files(cfg, source)) is not None:
        builder = BUILDERS[Path(files[0]).suffix.lower()]
        try:
            ds = datasets.load_dataset(builder, data_files=files, split="train", **_decoding(cfg, builder))
        except Exception as e:  # datasets fails on empty files with StopIteration, ValueError, ...
            if undecodable := decoding_error(cfg, files, e):
                raise undecodable from e
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


def open_stream(cfg: DataConfig):
    """The whole corpus as an IterableDataset, in file order: local files, a saved dataset or the hub."""
    import datasets

    source = resolve_source(cfg)
    path = Path(source).expanduser()
    if is_saved_dataset(path):
        ds = load_saved(cfg, path)
        ds = ds.to_iterable_dataset(num_shards=max(1, min(len(ds), 64)))
    elif (files := data_files(cfg, source)) is not None:
        builder = BUILDERS[Path(files[0]).suffix.lower()]
        ds = datasets.load_dataset(builder, data_files=files, split="train", streaming=True, **_decoding(cfg, builder))
    else:
        ds = datasets.load_dataset(source, cfg.name or None, split=cfg.split, streaming=True)
    if ds.column_names is not None and cfg.text_column not in ds.column_names:
        raise ConfigError(
            f"data.source={cfg.source}: no column {cfg.text_column!r}; its columns are {ds.column_names} "
            f"(set data.text_column)"
        )
    return ds


def _decoding(cfg: DataConfig, builder: str) -> dict:
    """How datasets' text, json and csv builders decode files (parquet stores its own encoding)."""
    return {} if builder == "parquet" else {"encoding": "utf-8", "encoding_errors": cfg.encoding_errors}


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
