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


def data_files(cfg: DataConfig, source: str) -> list[str] | None:
    """The local data files `source` names (a file, a glob or a directory); None for a hub dataset name."""
    path = Path(source).expanduser()
    looks_local = path.exists() or Path(source).suffix.lower() in BUILDERS or source.startswith((".", "/", "~"))
    if not (glob.has_magic(source) or looks_local):
        return None
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


def open_stream(cfg: DataConfig):
    """The whole corpus as an IterableDataset, in file order: local files, a saved dataset or the hub."""
    import datasets

    source = resolve_source(cfg)
    path = Path(source).expanduser()
    if is_saved_dataset(path):
        ds = load_saved(cfg, path)
        ds = ds.to_iterable_dataset(num_shards=max(1, min(len(ds), 64)))
    elif (files := data_files(cfg, source)) is not None:
        ds = datasets.load_dataset(
            BUILDERS[Path(files[0]).suffix.lower()], data_files=files, split="train", streaming=True
        )
    else:
        ds = datasets.load_dataset(source, cfg.name or None, split=cfg.split, streaming=True)
    if ds.column_names is not None and cfg.text_column not in ds.column_names:
        raise ConfigError(
            f"data.source={cfg.source}: no column {cfg.text_column!r}; its columns are {ds.column_names} "
            f"(set data.text_column)"
        )
    return ds
