"""jdp.data (corpus, tokens, pipeline): documents from local files, tokenization and caching, windows, and the (seed, step) batches."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import sysconfig
from collections import Counter
from pathlib import Path

import datasets
import numpy as np
import pandas as pd
import pytest

import jdp.data.corpus as jd
from jdp.config import ConfigError, DataConfig
from jdp.data import Batches, eval_batches, load_data
from jdp.data.corpus import load_documents
from jdp.data.tokens import ByteTokenizer, HFTokenizer, load_tokenizer, n_windows, tokenize, windows

EOD = ByteTokenizer.eod_id

DOCS = [
    "first document",
    'second one, with a comma and "quotes"',
    "third: ünïcode ✓ and emoji 🐍",
    "fourth",
]


@pytest.fixture(autouse=True)
def _isolated_caches(tmp_path, monkeypatch):
    """No network and no writes outside tmp_path: the HF datasets cache and $JDP_CACHE point into it."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("JDP_CACHE", str(tmp_path / "jdp-env-cache"))


def _cfg(tmp_path: Path, source, **kw) -> DataConfig:
    return DataConfig(source=str(source), cache_dir=str(tmp_path / "cache"), **kw)


def _write_jsonl(path: Path, texts, **extra_columns) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, t in enumerate(texts):
        row = {"text": t}
        row.update({k: v[i] for k, v in extra_columns.items()})
        rows.append(json.dumps(row))
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return path


def _split_docs(stream: np.ndarray) -> list[str]:
    """A byte-token stream back into its documents; every document must end with the EOD id."""
    assert len(stream) == 0 or stream[-1] == EOD, "a stream must end with an end-of-document token"
    cuts = np.flatnonzero(stream == EOD)
    docs, start = [], 0
    for c in cuts:
        docs.append(bytes(stream[start:c].astype(np.uint8)).decode("utf-8"))
        start = c + 1
    return docs


# ---------------------------------------------------------------------------------------------- Batches

SEQ = 4


def _stream(n_win: int, seq_len: int = SEQ, extra: int = 0) -> np.ndarray:
    # Values above int16 range, so a narrowing conversion anywhere would show.
    return (40000 + np.arange(n_win * seq_len + 1 + extra)).astype(np.uint16)


def test_batch_is_pure_function_of_seed_and_step():
    stream = _stream(10)
    a = Batches(stream, SEQ, 3, seed=7)
    b = Batches(stream, SEQ, 3, seed=7)
    # b is queried in a different (scrambled) order: its internal cache must not change the answers.
    steps = [0, 1, 2, 3, 4, 9, 25, 13, 2, 0, 40, 7]
    expected = {s: a.indices(s).copy() for s in sorted(set(steps))}
    for s in steps:
        np.testing.assert_array_equal(b.indices(s), expected[s])
        ba, bb = a.batch(s), b.batch(s)
        for k in ("inputs", "targets", "weights"):
            np.testing.assert_array_equal(ba[k], bb[k])
    other = Batches(stream, SEQ, 3, seed=8)
    run = np.concatenate([a.indices(s) for s in range(10)])
    run_other = np.concatenate([other.indices(s) for s in range(10)])
    assert not np.array_equal(run, run_other)


def test_every_window_once_per_epoch_and_fresh_permutations():
    n, bs = 10, 3  # batch size does not divide the window count
    stream = _stream(n, extra=2)  # a partial trailing window is not a window
    b = Batches(stream, SEQ, bs, seed=1)
    assert b.n == n == n_windows(stream, SEQ)
    n_epochs = 6
    steps = -(-n_epochs * n // bs)
    seq = np.concatenate([b.indices(s) for s in range(steps)])
    assert len(seq) == steps * bs >= n_epochs * n
    blocks = [seq[e * n : (e + 1) * n] for e in range(n_epochs)]
    for e, block in enumerate(blocks):
        np.testing.assert_array_equal(np.sort(block), np.arange(n), err_msg=f"epoch {e}")
    assert len({tuple(bl) for bl in blocks}) > 1, "every epoch got the same permutation"
    assert not np.array_equal(blocks[0], blocks[1])
    assert b.epoch(0) == 0 and b.epoch(10) == pytest.approx(3.0)


def test_batch_straddling_epoch_boundary():
    n, bs = 10, 3
    stream = _stream(n)
    b = Batches(stream, SEQ, bs, seed=3)
    seq = np.concatenate([b.indices(s) for s in range(8)])
    epoch0, epoch1 = seq[:n], seq[n : 2 * n]
    # Step 3 covers positions 9, 10, 11: the last window of epoch 0 and the first two of epoch 1.
    straddle = Batches(stream, SEQ, bs, seed=3).indices(3)
    np.testing.assert_array_equal(straddle, [epoch0[9], epoch1[0], epoch1[1]])
    batch = b.batch(3)
    for row, w in enumerate(straddle):
        np.testing.assert_array_equal(batch["inputs"][row], stream[w * SEQ : w * SEQ + SEQ])
        np.testing.assert_array_equal(batch["targets"][row], stream[w * SEQ + 1 : w * SEQ + SEQ + 1])
    assert batch["weights"].shape == (bs, SEQ) and np.all(batch["weights"] == 1)


def test_batch_rows_are_exclusive_contiguous_shards():
    bs = 8
    stream = _stream(13)
    b = Batches(stream, SEQ, bs, seed=5)
    for step in (0, 1, 2, 3, 11):  # step 1 straddles an epoch (positions 8..15 of 13)
        full = b.batch(step)
        assert full["inputs"].shape == (bs, SEQ)
        part = b.batch(step, rows=slice(2, 5))
        for k in full:
            np.testing.assert_array_equal(part[k], full[k][2:5])
        for n_shards in (1, 2, 4):
            per = bs // n_shards
            shards = [b.batch(step, rows=slice(i * per, (i + 1) * per)) for i in range(n_shards)]
            assert all(s["inputs"].shape == (per, SEQ) for s in shards)
            for k in full:
                np.testing.assert_array_equal(np.concatenate([s[k] for s in shards]), full[k])
            idx_shards = [b.indices(step)[i * per : (i + 1) * per] for i in range(n_shards)]
            np.testing.assert_array_equal(np.concatenate(idx_shards), b.indices(step))


# ---------------------------------------------------------------------------------------------- windows


def test_windows_shift_targets_and_weight_padding():
    seq_len = 5
    rng = np.random.default_rng(0)
    stream = rng.integers(0, 65535, size=6 * seq_len + 1).astype(np.uint16)
    idx = np.array([2, -1, 0, 5, -1])
    out = windows(stream, idx, seq_len)
    assert out["inputs"].shape == out["targets"].shape == out["weights"].shape == (5, seq_len)
    assert out["inputs"].dtype == np.int32 and out["targets"].dtype == np.int32
    for row, w in enumerate(idx):
        if w < 0:
            np.testing.assert_array_equal(out["weights"][row], 0)
            continue
        start = w * seq_len
        np.testing.assert_array_equal(out["weights"][row], 1)
        np.testing.assert_array_equal(out["inputs"][row], stream[start : start + seq_len])
        for i in range(seq_len):
            assert out["targets"][row, i] == stream[start + i + 1]
    assert out["weights"].sum() == 3 * seq_len


def test_n_windows():
    assert n_windows(np.zeros(0, np.uint16), 4) == 0
    assert n_windows(np.zeros(4, np.uint16), 4) == 0  # 4 inputs need a 5th token as the last target
    assert n_windows(np.zeros(5, np.uint16), 4) == 1
    assert n_windows(np.zeros(12, np.uint16), 4) == 2


# ---------------------------------------------------------------------------------------------- eval_batches


def test_eval_batches_cover_every_window_once_in_order():
    seq_len, n, bs = 4, 7, 3
    stream = (1000 + np.arange(n * seq_len + 1 + 2)).astype(np.uint16)
    assert n_windows(stream, seq_len) == n
    batches = list(eval_batches(stream, seq_len, bs))
    assert len(batches) == 3
    assert all(b["inputs"].shape == (bs, seq_len) for b in batches)
    real_inputs = np.concatenate([b["inputs"][b["weights"][:, 0] == 1] for b in batches])
    real_targets = np.concatenate([b["targets"][b["weights"][:, 0] == 1] for b in batches])
    np.testing.assert_array_equal(real_inputs.reshape(-1), stream[: n * seq_len])
    np.testing.assert_array_equal(real_targets.reshape(-1), stream[1 : n * seq_len + 1])
    last = batches[-1]
    np.testing.assert_array_equal(last["weights"][:, 0], [1, 0, 0])
    np.testing.assert_array_equal(last["weights"][1:], 0)
    assert sum(b["weights"].sum() for b in batches) == n * seq_len
    # rows: each process gets its slice of every batch.
    for rows in (slice(0, 1), slice(1, 3), slice(0, 3)):
        parts = list(eval_batches(stream, seq_len, bs, rows=rows))
        assert len(parts) == len(batches)
        for p, full in zip(parts, batches, strict=True):
            for k in full:
                np.testing.assert_array_equal(p[k], full[k][rows])
    assert list(eval_batches(stream[:seq_len], seq_len, bs)) == []


# ---------------------------------------------------------------------------------------------- load_documents


STORIES = {
    "a.txt": "Once upon a time\nthere was a cat.\n\nThe cat sat.\n",
    "b.txt": "def main():\n    return 0\n",
    "c.txt": "",  # an empty file: one empty document, skipped and counted
}


def _stories(tmp_path: Path) -> Path:
    d = tmp_path / "stories"
    d.mkdir(parents=True)
    for name, text in STORIES.items():
        (d / name).write_text(text, encoding="utf-8")
    return d


def test_a_txt_file_is_one_document_by_default_with_its_newlines(tmp_path):
    ds = load_documents(_cfg(tmp_path, _stories(tmp_path)))
    assert ds["text"] == list(STORIES.values())  # whole files, in file order, newlines kept


@pytest.mark.parametrize(
    "unit, expected",
    [
        ("line", ["Once upon a time", "there was a cat.", "", "The cat sat.", "def main():", "    return 0"]),
        ("paragraph", ["Once upon a time\nthere was a cat.", "The cat sat.\n", "def main():\n    return 0\n"]),
    ],
)
def test_data_text_unit_cuts_txt_files_into_lines_or_paragraphs(tmp_path, unit, expected):
    ds = load_documents(_cfg(tmp_path, _stories(tmp_path), text_unit=unit))
    assert ds["text"] == expected


def test_data_text_unit_line_reads_one_document_per_line(tmp_path):
    f = tmp_path / "corpus.txt"
    f.write_text("\n".join(DOCS) + "\n", encoding="utf-8")
    ds = load_documents(_cfg(tmp_path, f, text_unit="line"))
    assert ds["text"] == DOCS


def test_the_token_cache_key_holds_the_text_unit(tmp_path):
    # The same dataset object under another data.text_unit must not find the first unit's tokens.
    UNITS = ("file", "line")
    src = _stories(tmp_path)
    ds = load_documents(_cfg(tmp_path, src))
    for unit in UNITS:
        tokenize(ds, ByteTokenizer(), _cfg(tmp_path, src, text_unit=unit, val_tokens=0), seed=0)
    assert len([p for p in (tmp_path / "cache").iterdir() if p.name.startswith("tokens-") and p.is_dir()]) == 2
    by_unit = {u: load_data(_cfg(tmp_path, src, text_unit=u, val_tokens=0, seq_len=8), 320, 2, 0) for u in UNITS}
    assert _split_docs(by_unit["file"].tokens.train) == [t for t in STORIES.values() if t]
    assert _split_docs(by_unit["line"].tokens.train) == [t for t in "".join(STORIES.values()).split("\n") if t]


def test_the_banner_counts_documents_and_says_what_one_is(tmp_path):
    data = load_data(_cfg(tmp_path, _stories(tmp_path), seq_len=8, val_tokens=0), 320, 2, 0)
    assert data.describe().startswith("2 documents (one per .txt file, data.text_unit=file; 1 empty, skipped) |")
    lines = load_data(_cfg(tmp_path, _stories(tmp_path / "l"), seq_len=8, val_tokens=0, text_unit="line"), 320, 2, 0)
    assert lines.describe().startswith("5 documents (one per line of text, data.text_unit=line; 1 empty, skipped)")
    jsonl = load_data(_cfg(tmp_path, _write_jsonl(tmp_path / "c.jsonl", DOCS * 4), seq_len=8, val_tokens=0), 320, 2, 0)
    assert jsonl.describe().startswith("16 documents (0 empty, skipped) |")  # a unit only for .txt files


def test_load_jsonl(tmp_path):
    f = _write_jsonl(tmp_path / "corpus.jsonl", DOCS, id=list(range(len(DOCS))))
    ds = load_documents(_cfg(tmp_path, f))
    assert ds["text"] == DOCS
    assert set(ds.column_names) == {"text", "id"}


def test_load_json_list_of_records(tmp_path):
    f = tmp_path / "corpus.json"
    f.write_text(json.dumps([{"text": t, "n": i} for i, t in enumerate(DOCS)]), encoding="utf-8")
    ds = load_documents(_cfg(tmp_path, f))
    assert ds["text"] == DOCS


def test_load_csv(tmp_path):
    f = tmp_path / "corpus.csv"
    pd.DataFrame({"id": range(len(DOCS)), "body": DOCS}).to_csv(f, index=False)
    ds = load_documents(_cfg(tmp_path, f, text_column="body"))
    assert ds["body"] == DOCS


def test_load_parquet(tmp_path):
    f = tmp_path / "corpus.parquet"
    pd.DataFrame({"text": DOCS, "score": [0.5] * len(DOCS)}).to_parquet(f)
    ds = load_documents(_cfg(tmp_path, f))
    assert ds["text"] == DOCS


def test_load_directory_of_jsonl(tmp_path):
    d = tmp_path / "shards"
    _write_jsonl(d / "a.jsonl", DOCS[:2])
    _write_jsonl(d / "b.jsonl", DOCS[2:3])
    _write_jsonl(d / "nested" / "c.jsonl", DOCS[3:])
    (d / "README.md").write_text("not data")  # other files in the directory are ignored
    ds = load_documents(_cfg(tmp_path, d))
    assert sorted(ds["text"]) == sorted(DOCS)


def test_load_glob(tmp_path):
    d = tmp_path / "parts"
    _write_jsonl(d / "part-0.jsonl", DOCS[:2])
    _write_jsonl(d / "part-1.jsonl", DOCS[2:])
    _write_jsonl(d / "other.jsonl", ["must not be loaded"])
    (d / "notes.txt").write_text("must not be loaded either")
    ds = load_documents(_cfg(tmp_path, d / "part-*.jsonl"))
    assert sorted(ds["text"]) == sorted(DOCS)


def test_load_save_to_disk_dataset(tmp_path):
    d = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": DOCS, "id": list(range(len(DOCS)))}).save_to_disk(str(d))
    ds = load_documents(_cfg(tmp_path, d))
    assert ds["text"] == DOCS


def test_load_save_to_disk_dataset_dict(tmp_path):
    d = tmp_path / "saved-dict"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": DOCS}),
            "validation": datasets.Dataset.from_dict({"text": ["held out"]}),
        }
    ).save_to_disk(str(d))
    assert load_documents(_cfg(tmp_path, d))["text"] == DOCS
    assert load_documents(_cfg(tmp_path, d, split="validation"))["text"] == ["held out"]
    with pytest.raises(ConfigError) as e:
        load_documents(_cfg(tmp_path, d, split="test"))
    msg = str(e.value)
    assert "'test'" in msg and "train" in msg and "validation" in msg and "data.split" in msg


def test_error_missing_file(tmp_path):
    missing = tmp_path / "does-not-exist.jsonl"
    with pytest.raises(ConfigError) as e:
        load_documents(_cfg(tmp_path, missing))
    msg = str(e.value)
    assert str(missing) in msg and "no data files" in msg
    with pytest.raises(ConfigError, match="no data files"):  # a glob that matches nothing
        load_documents(_cfg(tmp_path, tmp_path / "nowhere" / "*.jsonl"))


def test_error_directory_without_data_files(tmp_path):
    d = tmp_path / "empty-dir"
    d.mkdir()
    (d / "notes.md").write_text("hello")
    with pytest.raises(ConfigError) as e:
        load_documents(_cfg(tmp_path, d))
    msg = str(e.value)
    assert "no data files" in msg and ".jsonl" in msg and "save_to_disk" in msg


def test_error_mixed_formats(tmp_path):
    d = tmp_path / "mixed"
    d.mkdir()
    (d / "a.txt").write_text("some text\n")
    pd.DataFrame({"text": ["x"]}).to_csv(d / "b.csv", index=False)
    with pytest.raises(ConfigError) as e:
        load_documents(_cfg(tmp_path, d))
    msg = str(e.value)
    assert "one known format" in msg and ".csv" in msg and ".txt" in msg


def test_error_unknown_format_file(tmp_path):
    f = tmp_path / "corpus.md"
    f.write_text("# hello\n")
    with pytest.raises(ConfigError, match="known format"):
        load_documents(_cfg(tmp_path, f))


def test_error_missing_text_column(tmp_path):
    f = _write_jsonl(tmp_path / "c.jsonl", DOCS, title=["t"] * len(DOCS))
    with pytest.raises(ConfigError) as e:
        load_documents(_cfg(tmp_path, f, text_column="content"))
    msg = str(e.value)
    assert "'content'" in msg and "'text'" in msg and "'title'" in msg and "data.text_column" in msg


def test_error_non_text_column(tmp_path):
    f = _write_jsonl(tmp_path / "c.jsonl", DOCS, n=list(range(len(DOCS))))
    with pytest.raises(ConfigError) as e:
        load_documents(_cfg(tmp_path, f, text_column="n"))
    msg = str(e.value)
    assert "'n'" in msg and "not text" in msg and "int64" in msg


def test_error_empty_dataset(tmp_path, monkeypatch):
    # jdp's own check, on a dataset that loads fine but has no rows (here: a hub dataset, stubbed offline).
    features = datasets.Features({"text": datasets.Value("string")})
    empty = datasets.Dataset.from_dict({"text": []}, features=features)
    calls = []

    def hub(*args, **kwargs):
        calls.append((args, kwargs))
        return empty if "split" in kwargs else datasets.DatasetDict({"train": empty})

    monkeypatch.setattr(datasets, "load_dataset", hub)
    with pytest.raises(ConfigError) as e:
        load_documents(DataConfig(source="someone/corpus", name="en", split="train[:0]"))
    assert "someone/corpus" in str(e.value) and "empty" in str(e.value)
    # Every split first (to find a validation split), then the slice data.split asks for.
    assert calls == [
        (("someone/corpus", "en"), {"streaming": False}),
        (("someone/corpus", "en"), {"streaming": False, "split": "train[:0]"}),
    ]


def _empty_jsonl(tmp_path: Path) -> Path:
    f = tmp_path / "empty.jsonl"
    f.write_text("")
    return f


def _header_only_csv(tmp_path: Path) -> Path:
    f = tmp_path / "empty.csv"
    f.write_text("text\n")
    return f


def _empty_saved(tmp_path: Path) -> Path:
    d = tmp_path / "empty-saved"
    features = datasets.Features({"text": datasets.Value("string")})
    datasets.Dataset.from_dict({"text": []}, features=features).save_to_disk(str(d))
    return d


@pytest.mark.parametrize("make", [_empty_jsonl, _header_only_csv, _empty_saved], ids=["jsonl", "csv", "saved"])
def test_error_empty_local_data(tmp_path, make):
    # Local data with no rows must be a ConfigError saying so. (datasets itself fails on these with
    # StopIteration, ValueError('Instruction "train" corresponds to no data!') or IndexError.)
    source = make(tmp_path)
    with pytest.raises(ConfigError) as e:
        load_documents(_cfg(tmp_path, source))
    assert str(source) in str(e.value) and "empty" in str(e.value)


def test_stdlib_corpus(tmp_path, monkeypatch):
    files = jd.stdlib_files()
    names = {p.name for p in files}
    assert len(files) > 100 and "os.py" in names and "dataclasses.py" in names
    assert all(p.suffix == ".py" for p in files)
    root = Path(sysconfig.get_paths()["stdlib"])
    bad = {"site-packages", "dist-packages", "test", "tests", "__pycache__"}
    assert not any(bad.intersection(p.relative_to(root).parts) for p in files)
    # Build the corpus from a few of those files only, to keep this test quick.
    few = [p for p in files if p.parent == root and p.name in ("os.py", "abc.py", "this.py")]
    assert len(few) == 3
    monkeypatch.setattr(jd, "stdlib_files", lambda: few)
    cache = tmp_path / "cache"
    path = jd.build_stdlib_corpus(cache)
    assert path.parent == cache and (path / "dataset_info.json").exists()
    ds = datasets.load_from_disk(str(path))
    assert sorted(ds.column_names) == ["path", "text"]
    assert sorted(ds["text"]) == sorted(p.read_text(encoding="utf-8") for p in few)
    # Built once: a second call finds it and writes nothing.
    monkeypatch.setattr(datasets.Dataset, "save_to_disk", lambda *a, **k: pytest.fail("rebuilt the corpus"))
    assert jd.build_stdlib_corpus(cache) == path
    docs = load_documents(DataConfig(source="stdlib", cache_dir=str(cache)))
    assert sorted(docs["text"]) == sorted(ds["text"])


# ---------------------------------------------------------------------------------------------- tokenize / load_data


def _corpus(n: int = 40, seed: int = 0) -> list[str]:
    """Unique documents of varied length (some multi-byte), with a few empty ones mixed in."""
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "délta", "ε", "zeta", "ēta", "θ", "iota", "kappa", "🐍"]
    docs = []
    for i in range(n):
        k = int(rng.integers(3, 30))
        docs.append(f"doc{i}: " + " ".join(rng.choice(words, k)))
        if i % 9 == 4:
            docs.append("")
    return docs


def _saved(tmp_path: Path, texts: list[str], name: str = "docs") -> Path:
    d = tmp_path / name
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(d))
    return d


def test_tokenize_byte_streams_and_validation_split(tmp_path):
    texts = _corpus()
    nonempty = [t for t in texts if t]
    n_empty = len(texts) - len(nonempty)
    assert n_empty > 0
    val_tokens = 300
    cfg = _cfg(tmp_path, _saved(tmp_path, texts), val_tokens=val_tokens)
    tokens = tokenize(load_documents(cfg), ByteTokenizer(), cfg, seed=0)
    assert tokens.n_empty == n_empty
    assert tokens.n_docs == len(nonempty)
    assert int((tokens.train == EOD).sum() + (tokens.val == EOD).sum()) == len(nonempty)
    train_docs, val_docs = _split_docs(tokens.train), _split_docs(tokens.val)
    # Every non-empty document, as its exact bytes followed by EOD, is in exactly one of the streams.
    assert Counter(train_docs + val_docs) == Counter(nonempty)
    assert val_docs and train_docs
    assert not set(train_docs) & set(val_docs)
    # Whole documents are held out until at least val_tokens tokens, and no more documents than that needs.
    assert len(tokens.val) >= val_tokens
    longest = max(len(d.encode()) + 1 for d in val_docs)
    assert len(tokens.val) - longest < val_tokens
    assert len(tokens.train) + len(tokens.val) == sum(len(t.encode()) + 1 for t in nonempty)


def test_tokenize_without_validation(tmp_path):
    texts = _corpus(12)
    cfg = _cfg(tmp_path, _saved(tmp_path, texts), val_tokens=0)
    tokens = tokenize(load_documents(cfg), ByteTokenizer(), cfg, seed=0)
    assert len(tokens.val) == 0
    assert _split_docs(tokens.train) == [t for t in texts if t]  # in document order


def test_tokenize_all_empty_documents(tmp_path):
    cfg = _cfg(tmp_path, _saved(tmp_path, ["", "", ""]), val_tokens=0)
    with pytest.raises(ConfigError, match="empty"):
        tokenize(load_documents(cfg), ByteTokenizer(), cfg, seed=0)


def test_tokenize_is_cached(tmp_path, monkeypatch):
    texts = _corpus(30)
    src = _saved(tmp_path, texts)
    cfg = _cfg(tmp_path, src, val_tokens=200)
    cache = Path(cfg.cache_dir)
    first = tokenize(load_documents(cfg), ByteTokenizer(), cfg, seed=0)
    entries = sorted(p.name for p in cache.iterdir() if p.suffix != ".lock")
    assert len([e for e in entries if e.startswith("tokens-")]) == 1
    assert not [e for e in entries if ".tmp" in e]

    # The second call must not tokenize again.
    with monkeypatch.context() as m:
        m.setattr(ByteTokenizer, "encode_batch", lambda self, texts: pytest.fail("tokenized again"))
        second = tokenize(load_documents(cfg), ByteTokenizer(), cfg, seed=0)
    np.testing.assert_array_equal(second.train, first.train)
    np.testing.assert_array_equal(second.val, first.val)
    assert (second.n_docs, second.n_empty) == (first.n_docs, first.n_empty)
    assert sorted(p.name for p in cache.iterdir() if p.suffix != ".lock") == entries

    # val_tokens is part of the key: a new cache entry, and a different split.
    cfg2 = _cfg(tmp_path, src, val_tokens=400)
    third = tokenize(load_documents(cfg2), ByteTokenizer(), cfg2, seed=0)
    after = sorted(p.name for p in cache.iterdir() if p.suffix != ".lock")
    assert len(after) == len(entries) + 1
    assert len(third.val) > len(first.val)
    # So is the seed.
    tokenize(load_documents(cfg), ByteTokenizer(), cfg, seed=1)
    assert len([p for p in cache.iterdir() if p.suffix != ".lock"]) == len(entries) + 2


def test_tokenize_cache_follows_source_file_changes(tmp_path):
    f = _write_jsonl(tmp_path / "c.jsonl", ["one document", "another document"])
    cfg = _cfg(tmp_path, f, val_tokens=0)
    first = tokenize(load_documents(cfg), ByteTokenizer(), cfg, seed=0)
    assert _split_docs(first.train) == ["one document", "another document"]
    _write_jsonl(f, ["edited document", "another document", "a third"])
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # as an edit a second later would
    second = tokenize(load_documents(cfg), ByteTokenizer(), cfg, seed=0)
    assert _split_docs(second.train) == ["edited document", "another document", "a third"]


def test_a_streams_files_fingerprint_follows_content_not_times_or_place(tmp_path):
    """A streamed source is not read through at start: its fingerprint (in each checkpoint record, compared on
    resume) is its files' relative names, sizes and ends. The same bytes written again or copied elsewhere keep
    it; a file added, renamed, grown, or rewritten at an end changes it."""
    from jdp.data.corpus import files_fingerprint

    src = tmp_path / "a"
    src.mkdir()
    for i in range(3):
        (src / f"{i}.txt").write_bytes(bytes(range(256)) * (300 * (i + 1)))  # 76.8-230 KB: both ends read
    files = lambda d: sorted(d.glob("*.txt"))  # noqa: E731
    first = files_fingerprint(files(src))
    assert first["files"] == 3 and first["bytes"] == 256 * 300 * 6
    for p in files(src):
        p.write_bytes(p.read_bytes())
    copy = tmp_path / "b"
    copy.mkdir()
    for p in files(src):
        (copy / p.name).write_bytes(p.read_bytes())
    assert files_fingerprint(files(src)) == files_fingerprint(files(copy)) == first
    (copy / "1.txt").rename(copy / "9.txt")
    assert files_fingerprint(files(copy)) != first
    big = src / "2.txt"
    data = bytearray(big.read_bytes())
    data[-1] ^= 1  # the last byte
    big.write_bytes(bytes(data))
    assert files_fingerprint(files(src)) != first
    big.write_bytes(bytes(data[:-1]))
    assert files_fingerprint(files(src))["bytes"] == first["bytes"] - 1


def test_tokenize_with_worker_processes_matches_single_process(tmp_path):
    texts = _corpus(40)
    # Two copies of the data, so that the second run cannot reuse the first one's `datasets.map` cache.
    one = _cfg(tmp_path, _saved(tmp_path, texts, "docs-1"), val_tokens=200, num_proc=1)
    two = _cfg(tmp_path, _saved(tmp_path, texts, "docs-2"), val_tokens=200, num_proc=2)
    two = dataclasses.replace(two, cache_dir=str(tmp_path / "cache-2"))  # and no shared token cache
    a = tokenize(load_documents(one), ByteTokenizer(), one, seed=0)
    b = tokenize(load_documents(two), ByteTokenizer(), two, seed=0)
    np.testing.assert_array_equal(a.train, b.train)
    np.testing.assert_array_equal(a.val, b.val)
    assert (a.n_docs, a.n_empty) == (b.n_docs, b.n_empty)


def test_cache_dir_defaults_to_env(tmp_path, monkeypatch):
    env_cache = tmp_path / "from-env"
    monkeypatch.setenv("JDP_CACHE", str(env_cache))
    cfg = DataConfig(source=str(_saved(tmp_path, _corpus(10))), val_tokens=0)
    assert jd.cache_root(cfg) == env_cache
    tokenize(load_documents(cfg), ByteTokenizer(), cfg, seed=0)
    assert [p.name.startswith("tokens-") for p in env_cache.iterdir() if p.suffix != ".lock"] == [True]
    assert jd.cache_root(DataConfig(cache_dir=str(tmp_path / "x"))) == tmp_path / "x"


def test_load_data_byte(tmp_path):
    texts = _corpus(60)
    seq_len, bs = 16, 4
    cfg = _cfg(tmp_path, _saved(tmp_path, texts), seq_len=seq_len, val_tokens=200)
    data = load_data(cfg, vocab_size=320, batch_size=bs, seed=0)
    assert data.tokenizer.vocab_size == 257 and data.tokenizer.eod_id == EOD
    assert data.train.n == n_windows(data.tokens.train, seq_len) >= bs
    assert data.tokens.n_empty == texts.count("")
    batch = data.train.batch(0)
    assert batch["inputs"].shape == (bs, seq_len)
    assert batch["inputs"].max() <= EOD
    assert f"{data.tokens.n_empty} empty" in data.describe()


def test_load_data_errors(tmp_path):
    src = _saved(tmp_path, _corpus(30))
    cfg = _cfg(tmp_path, src, seq_len=16, val_tokens=100)
    with pytest.raises(ConfigError) as e:
        load_data(cfg, vocab_size=200, batch_size=2, seed=0)
    assert "model.vocab_size" in str(e.value) and "257" in str(e.value)

    with pytest.raises(ConfigError) as e:
        load_data(cfg, vocab_size=320, batch_size=100_000, seed=0)
    msg = str(e.value)
    assert "one global batch" in msg and "train.batch_size=100000" in msg and "data.seq_len=16" in msg

    big = _cfg(tmp_path, src, seq_len=16, val_tokens=10**9)
    with pytest.raises(ConfigError) as e:
        load_data(big, vocab_size=320, batch_size=2, seed=0)
    assert "no training documents" in str(e.value) and "data.val_tokens" in str(e.value)
    suggested = int(str(e.value).split("e.g. data.val_tokens=")[1].split(",")[0])
    load_data(dataclasses.replace(big, val_tokens=suggested), vocab_size=320, batch_size=2, seed=0)  # it fits

    # val_tokens=1 holds out one document, shorter than seq_len + 1 tokens: no validation window.
    tiny_val = _cfg(tmp_path, src, seq_len=200, val_tokens=1)
    with pytest.raises(ConfigError) as e:
        load_data(tiny_val, vocab_size=320, batch_size=2, seed=0)
    assert "data.val_tokens=1" in str(e.value) and "data.seq_len" in str(e.value)


def test_a_hold_out_of_every_document_names_a_fix_that_works(tmp_path):
    """Issue 65, item 4: a one-document .txt with data.val_tokens=1024 was told to lower it, to a tenth of the file
    (1608), and then told the same again: no value splits one document. It names data.text_unit instead, and with
    two documents the value it suggests is one that leaves a training document."""
    one = tmp_path / "one.txt"
    one.write_text("".join(f"line {i} of the only document\n" for i in range(200)))
    with pytest.raises(ConfigError) as e:
        load_data(_cfg(tmp_path, one, seq_len=16, val_tokens=1024), vocab_size=320, batch_size=2, seed=0)
    msg = str(e.value)
    assert "in 1 document" in msg and "data.text_unit=line or data.text_unit=paragraph" in msg, msg
    assert "Lower" not in msg and "data.val_tokens=0" in msg
    lines = load_data(_cfg(tmp_path, one, seq_len=16, val_tokens=1024, text_unit="line"), 320, 2, seed=0)
    assert len(lines.tokens.val) >= 1024 and lines.tokens.n_docs == 200  # the fix it names works
    jsonl = _write_jsonl(tmp_path / "one.jsonl", ["just one record"])
    with pytest.raises(ConfigError) as e:  # not .txt: no text_unit to change
        load_data(_cfg(tmp_path, jsonl, seq_len=4, val_tokens=8), 320, 1, seed=0)
    assert "in 1 document" in str(e.value) and "text_unit" not in str(e.value)
    two = _write_jsonl(tmp_path / "two.jsonl", ["a short one", "a much longer document " * 40])
    with pytest.raises(ConfigError) as e:
        load_data(_cfg(tmp_path, two, seq_len=4, val_tokens=10**6), 320, 1, seed=0)
    most = int(str(e.value).split("at most ")[1].split(",")[0])
    load_data(_cfg(tmp_path, two, seq_len=4, val_tokens=most), 320, 1, seed=0)  # the largest value that works
    with pytest.raises(ConfigError, match="no training documents"):
        load_data(_cfg(tmp_path, two, seq_len=4, val_tokens=most + 1), 320, 1, seed=0)


# ---------------------------------------------------------------------------------------------- HF tokenizers

SENTENCES = [
    "the cat sat on the mat",
    "a dog ran far away from the cat",
    "the end of the story",
    "one more line for the tokenizer",
]


def _word_level(special_tokens: list[str], eod_post_processor: bool = False):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=special_tokens))
    if eod_post_processor:
        eod = tok.token_to_id("<|endoftext|>")
        tok.post_processor = processors.TemplateProcessing(
            single="$A <|endoftext|>", special_tokens=[("<|endoftext|>", eod)]
        )
    return tok


def test_hf_tokenizer_from_local_path(tmp_path):
    tok = _word_level(["[UNK]", "<|endoftext|>"], eod_post_processor=True)
    d = tmp_path / "tok"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    for spec in (str(d / "tokenizer.json"), str(d)):
        t = load_tokenizer(spec)
        assert isinstance(t, HFTokenizer)
        assert t.vocab_size == tok.get_vocab_size(with_added_tokens=True)
        assert t.eod_id == tok.token_to_id("<|endoftext|>")
        # The model's own special tokens (here: a post-processor appending EOD) are not added.
        (ids,) = t.encode_batch(["the cat sat"])
        assert list(ids) == tok.encode("the cat sat", add_special_tokens=False).ids
        assert t.decode(ids) == "the cat sat"
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)


def test_load_data_with_hf_tokenizer(tmp_path):
    tok = _word_level(["[UNK]", "<|endoftext|>"], eod_post_processor=True)
    tok_file = tmp_path / "tokenizer.json"
    tok.save(str(tok_file))
    eod = tok.token_to_id("<|endoftext|>")
    texts = [SENTENCES[i % len(SENTENCES)] + f" {'the cat ' * (i % 5)}".rstrip() for i in range(40)]
    texts[3] = ""
    texts[7] = "   "  # no tokens at all: skipped like an empty document
    seq_len = 8
    cfg = _cfg(tmp_path, _saved(tmp_path, texts), tokenizer=str(tok_file), seq_len=seq_len, val_tokens=30)
    data = load_data(cfg, vocab_size=64, batch_size=4, seed=0)
    assert data.tokenizer.eod_id == eod
    assert data.tokens.n_empty == 2
    n_docs = len(texts) - 2
    assert data.tokens.n_docs == n_docs
    both = np.concatenate([data.tokens.train, data.tokens.val])
    assert int((both == eod).sum()) == n_docs
    assert data.tokens.train[-1] == eod and data.tokens.val[-1] == eod
    expected = sorted(tuple(tok.encode(t, add_special_tokens=False).ids) for t in texts if t.strip())
    got = []
    for stream in (data.tokens.train, data.tokens.val):
        start = 0
        for c in np.flatnonzero(stream == eod):
            got.append(tuple(int(x) for x in stream[start:c]))
            start = c + 1
    assert sorted(got) == expected
    assert data.train.batch(0)["inputs"].max() < data.tokenizer.vocab_size
    with pytest.raises(ConfigError, match="model.vocab_size"):
        load_data(cfg, vocab_size=tok.get_vocab_size() - 1, batch_size=4, seed=0)


def test_token_cache_follows_tokenizer_changes(tmp_path):
    # Same path, same vocabulary, different behaviour (a lowercasing normalizer): the cached token streams
    # of the old tokenizer must not be reused.
    from tokenizers import normalizers

    texts = ["The Cat sat on The Mat", "A Dog ran far away", "the end"]
    f = tmp_path / "tokenizer.json"
    plain = _word_level(["[UNK]", "<|endoftext|>"])
    plain.save(str(f))
    src = _saved(tmp_path, texts)
    cfg = _cfg(tmp_path, src, tokenizer=str(f), val_tokens=0)
    first = tokenize(load_documents(cfg), load_tokenizer(str(f)), cfg, seed=0)

    lower = _word_level(["[UNK]", "<|endoftext|>"])
    lower.normalizer = normalizers.Lowercase()
    assert lower.get_vocab() == plain.get_vocab()
    lower.save(str(f))
    second = tokenize(load_documents(cfg), load_tokenizer(str(f)), cfg, seed=0)
    expected = []
    for t in texts:
        expected += lower.encode(t, add_special_tokens=False).ids + [lower.token_to_id("<|endoftext|>")]
    assert not np.array_equal(first.train, second.train)
    np.testing.assert_array_equal(second.train, expected)


def test_hf_tokenizer_without_eod_token(tmp_path):
    f = tmp_path / "tokenizer.json"
    _word_level(["[UNK]"]).save(str(f))
    with pytest.raises(ConfigError) as e:
        load_tokenizer(str(f))
    assert "end-of-document" in str(e.value) and "<|endoftext|>" in str(e.value)


def test_hf_tokenizer_missing_path(tmp_path):
    missing = tmp_path / "no-such-tokenizer.json"
    with pytest.raises(ConfigError) as e:
        load_tokenizer(str(missing))
    assert str(missing) in str(e.value) and "no such file" in str(e.value)


def test_a_directory_without_tokenizer_files_says_so_instead_of_suggesting_transformers(tmp_path):
    """Issue 42, item 10: a directory with no tokenizer in it (a model's weights only, a wrong path) said
    `pip install transformers`, which would not have helped."""
    d = tmp_path / "weights-only"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"this directory holds no tokenizer \(no tokenizer.json, and none of "
                                          r"tokenizer.model, .*found: config.json, model.safetensors\)") as e:  # fmt: skip
        load_tokenizer(str(d))
    assert "pip install" not in str(e.value)


def test_a_broken_jsonl_or_csv_line_is_named_by_file_and_line(tmp_path):
    """Issue 42, item 10: a line that does not parse gave datasets' Arrow message, naming neither file nor line."""
    jsonl = tmp_path / "j" / "a.jsonl"
    jsonl.parent.mkdir()
    jsonl.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(40)) + '{"text": "cut\n')
    with pytest.raises(ConfigError, match=rf"{jsonl} line 41, column 10: not valid JSON \(Unterminated string"):
        load_documents(_cfg(tmp_path, jsonl.parent))
    csv = tmp_path / "c" / "a.csv"
    csv.parent.mkdir()
    csv.write_text("text,label\n" + "".join(f'"doc {i}",1\n' for i in range(30)) + '"odd",1,2\n')
    with pytest.raises(ConfigError, match=rf"{csv} line 32: 3 fields where the header has 2 \(text, label\); fix"):
        load_documents(_cfg(tmp_path / "x", csv))


def test_reading_local_files_prints_no_download_or_split_generation_bars(tmp_path, capfd):
    """Issue 42, item 13: datasets printed "Downloading data" and "Generating train split" for local files."""
    import datasets

    f = _write_jsonl(tmp_path / "quiet" / "docs.jsonl", [f"document {i}" for i in range(20)])
    capfd.readouterr()
    load_documents(_cfg(tmp_path, f))
    err = capfd.readouterr().err
    assert "Generating train split" not in err and "Downloading data" not in err, err
    assert not datasets.are_progress_bars_disabled()  # jdp's own bars (tokenizing) stay on


def test_a_file_that_is_not_a_tokenizer_names_data_tokenizer(tmp_path):
    f = tmp_path / "tokenizer.json"
    f.write_text('{"version": 1 "oops": 2}')
    with pytest.raises(ConfigError) as e:
        load_tokenizer(str(f))
    assert f"data.tokenizer={f}" in str(e.value) and "not a Hugging Face tokenizer" in str(e.value)


def _latin1_corpus(tmp_path):
    (tmp_path / "a.txt").write_text("clean text\n" * 2000)
    (tmp_path / "b.txt").write_bytes(b"line one\n" * 3000 + b"caf\xe9 au lait\n" + b"tail\n" * 10)
    return tmp_path / "b.txt", 9 * 3000 + 3, 3001  # the file, the offset of 0xe9, its line


def test_a_byte_that_is_not_utf8_names_the_file_offset_and_the_lenient_setting(tmp_path):
    bad, offset, line = _latin1_corpus(tmp_path)
    with pytest.raises(ConfigError) as e:
        load_documents(DataConfig(source=str(tmp_path / "*.txt")))
    msg = str(e.value)
    assert f"{bad} is not valid UTF-8: byte 0xe9 at offset {offset:,} (line {line:,})" in msg, msg
    assert "data.encoding_errors=replace" in msg
    ds = load_documents(DataConfig(source=str(tmp_path / "*.txt"), encoding_errors="replace"))
    assert any("caf\ufffd au lait" in text for text in ds["text"])  # read leniently when asked


def test_a_local_path_that_does_not_exist_is_reported_before_any_hub_lookup(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail(f"looked it up: {a}"))
    for typo in ("data/corpus_typo", "data/sub/corpus", "./corpus"):
        with pytest.raises(ConfigError) as e:
            load_documents(DataConfig(source=typo))
        assert "no such file or directory" in str(e.value) and typo.lstrip("./") in str(e.value)


# ---------------------------------------------------------------------------------------------- validation splits


def _splits(tmp_path: Path, splits: dict[str, list[str]], name: str = "saved-splits") -> Path:
    d = tmp_path / name
    datasets.DatasetDict({n: datasets.Dataset.from_dict({"text": t}) for n, t in splits.items()}).save_to_disk(str(d))
    return d


VAL_DOCS = [f"validation document {i}: " + "v" * (20 + i) for i in range(8)]
TEST_DOCS = ["the test split's only document, long enough for a window"]


def _n_tokens(texts: list[str]) -> int:
    return sum(len(t.encode()) + 1 for t in texts if t)


def test_a_validation_split_validates_and_nothing_is_held_out_of_training(tmp_path):
    train_docs = _corpus(40)
    src = _splits(tmp_path, {"train": train_docs, "validation": VAL_DOCS, "test": TEST_DOCS})
    data = load_data(_cfg(tmp_path, src, seq_len=16, val_tokens=10**6), 320, 4, seed=0)
    assert data.val_split == "validation"
    assert _split_docs(data.tokens.train) == [t for t in train_docs if t]  # every training document, in order
    assert _split_docs(data.tokens.val) == VAL_DOCS  # all of it: data.val_tokens is more than the split holds
    assert f"val {_n_tokens(VAL_DOCS):,} tokens from split 'validation'" in data.describe()
    # data.val_tokens bounds it, as it bounds a hold-out: whole documents of the split, chosen by the seed.
    small = load_data(_cfg(tmp_path, src, seq_len=16, val_tokens=100), 320, 4, seed=0)
    val = _split_docs(small.tokens.val)
    assert set(val) < set(VAL_DOCS) and len(small.tokens.val) >= 100
    assert len(small.tokens.val) - max(len(t) + 1 for t in val) < 100
    np.testing.assert_array_equal(small.tokens.train, data.tokens.train)
    # data.val_tokens=0 still switches evaluation off.
    off = load_data(_cfg(tmp_path, src, seq_len=16, val_tokens=0), 320, 4, seed=0)
    assert len(off.tokens.val) == 0 and "no validation" in off.describe()
    # holdout: documents held out of the training split, as before, whatever splits the source has.
    held = load_data(_cfg(tmp_path, src, seq_len=16, val_tokens=100, val_split="holdout"), 320, 4, seed=0)
    assert held.val_split == "" and "held out of the training documents" in held.describe()
    assert set(_split_docs(held.tokens.val)) <= set(train_docs)
    assert Counter(_split_docs(held.tokens.train) + _split_docs(held.tokens.val)) == Counter(t for t in train_docs if t)
    # A split by name.
    test = load_data(_cfg(tmp_path, src, seq_len=16, val_split="test"), 320, 4, seed=0)
    assert _split_docs(test.tokens.val) == TEST_DOCS and "from split 'test'" in test.describe()


def test_val_split_auto_takes_test_without_validation_and_holds_out_without_either(tmp_path):
    train_docs = _corpus(20)
    with_test = jd.open_corpus(_cfg(tmp_path, _splits(tmp_path, {"train": train_docs, "test": TEST_DOCS}, "t")))
    assert with_test.val_split == "test" and with_test.val["text"] == TEST_DOCS
    # Training on the validation split: auto looks for another one (here none: a hold-out).
    src = _splits(tmp_path, {"train": train_docs, "validation": VAL_DOCS}, "v")
    on_val = jd.open_corpus(_cfg(tmp_path, src, split="validation"))
    assert on_val.val_split == "" and on_val.val is None and on_val.train["text"] == VAL_DOCS
    single = jd.open_corpus(_cfg(tmp_path, _saved(tmp_path, train_docs)))
    assert single.val_split == "" and single.val is None


def test_val_split_errors_name_the_splits_there_are(tmp_path):
    src = _splits(tmp_path, {"train": _corpus(10), "validation": VAL_DOCS})
    cases = {
        "dev": ["data.val_split=dev", "no such split", "['train', 'validation']", "auto or holdout"],
        "train": ["data.val_split=train is also data.split", "data.val_split=holdout"],
        "": ["data.val_split is empty", "auto, holdout"],
    }
    for val_split, words in cases.items():
        with pytest.raises(ConfigError) as e:
            jd.open_corpus(_cfg(tmp_path, src, val_split=val_split))
        assert all(w in str(e.value) for w in words), str(e.value)
    with pytest.raises(ConfigError) as e:
        jd.open_corpus(_cfg(tmp_path, _saved(tmp_path, _corpus(10)), val_split="validation"))
    assert "has no named splits" in str(e.value) and "data.val_split=auto or holdout" in str(e.value)
    # A validation split too short for one window says so (not "raise data.val_tokens").
    tiny = _splits(tmp_path, {"train": _corpus(40), "validation": ["short"]}, "tiny")
    with pytest.raises(ConfigError) as e:
        load_data(_cfg(tmp_path, tiny, seq_len=16), 320, 4, seed=0)
    assert "its validation split 'validation' holds 6 tokens" in str(e.value) and "holdout" in str(e.value)


def test_a_directory_of_train_and_validation_files_validates_on_those_files(tmp_path):
    d = tmp_path / "named"
    _write_jsonl(d / "train.jsonl", DOCS)
    _write_jsonl(d / "validation.jsonl", VAL_DOCS)
    corpus = jd.open_corpus(_cfg(tmp_path, d))
    assert corpus.train["text"] == DOCS and corpus.val_split == "validation" and corpus.val["text"] == VAL_DOCS
    # A file whose name says no split: the names do not cover every file, so all of them are training data.
    _write_jsonl(d / "extra.jsonl", ["an extra document"])
    corpus = jd.open_corpus(_cfg(tmp_path, d))
    assert corpus.val is None and sorted(corpus.train["text"]) == sorted(DOCS + VAL_DOCS + ["an extra document"])


def test_a_hub_dataset_validates_on_its_validation_split(monkeypatch):
    every_split = datasets.DatasetDict(
        {n: datasets.Dataset.from_dict({"text": t}) for n, t in (("train", DOCS), ("validation", VAL_DOCS))}
    )
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: every_split)  # offline stand-in for the hub
    corpus = jd.open_corpus(DataConfig(source="someone/corpus"))
    assert corpus.train["text"] == DOCS and corpus.val_split == "validation" and corpus.val["text"] == VAL_DOCS


# ---------------------------------------------------------------------------------------------- local or hub


def test_a_hub_failure_is_one_error_naming_the_dataset_and_the_offline_switch(monkeypatch):
    def unreachable(path, *args, **kwargs):
        raise ConnectionError(f"Couldn't reach '{path}' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    for streaming in (False, True):
        with pytest.raises(ConfigError) as e:
            jd.open_corpus(DataConfig(source="someone/corpus", name="en"), streaming=streaming)
        msg = str(e.value)
        assert msg.startswith("data.source=someone/corpus: no local file or directory of that name"), msg
        assert "hub dataset 'someone/corpus' (configuration 'en')" in msg
        assert "ConnectionError: Couldn't reach 'someone/corpus' on the Hub" in msg and "HF_HUB_OFFLINE=1" in msg


def test_an_existing_directory_named_without_dot_slash_is_read_locally(tmp_path, monkeypatch):
    _stories(tmp_path)
    monkeypatch.chdir(tmp_path)
    builders, load = set(jd.BUILDERS.values()), datasets.load_dataset
    hub = lambda path, *a, **k: load(path, *a, **k) if path in builders else pytest.fail(f"hub lookup: {path}")  # noqa: E731
    monkeypatch.setattr(datasets, "load_dataset", hub)
    assert load_documents(DataConfig(source="stories"))["text"] == list(STORIES.values())
    assert [d["text"] for d in jd.open_stream(DataConfig(source="stories"))] == list(STORIES.values())


def _jdp_train(cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    small = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "train.steps=2", "train.batch_size=8"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "JDP_CACHE": str(cwd / "cache")}
    argv = [sys.executable, "-m", "jdp.cli", "train", "tiny", *small, f"train.run_dir={cwd / 'run'}", *overrides]
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, cwd=cwd)


def test_jdp_train_on_a_hub_name_that_cannot_load_exits_2_with_one_line(tmp_path):
    out = _jdp_train(tmp_path, "data.source=jdp-test-no-such-dataset")
    assert out.returncode == 2, out.stderr[-2000:]
    error = [line for line in out.stderr.splitlines() if line.startswith("jdp: error:")]
    assert len(error) == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "data.source=jdp-test-no-such-dataset: no local file or directory of that name" in error[0]
    assert "hub dataset 'jdp-test-no-such-dataset'" in error[0] and "HF_HUB_OFFLINE=1" in error[0]


def test_jdp_train_on_a_directory_of_stories_trains_on_whole_files_and_validates_on_its_validation_file(tmp_path):
    stories = tmp_path / "mystories"
    stories.mkdir()
    for i in range(3):
        (stories / f"train-{i}.txt").write_text(f"Story {i}.\n\n" + "Once upon a time, a cat sat.\n" * 20)
    (stories / "validation.txt").write_text("A story kept for validation.\n" * 20)
    out = _jdp_train(tmp_path, "data.source=mystories", "data.seq_len=32", "data.val_tokens=100")
    assert out.returncode == 0, out.stderr[-3000:]
    banner = next(line for line in out.stdout.splitlines() if line.startswith("jdp | data "))
    assert banner.startswith("jdp | data 3 documents (one per .txt file, data.text_unit=file; 0 empty, skipped)")
    assert "tokens from split 'validation'" in banner, banner


@pytest.mark.parametrize("suffix", [".jsonl", ".txt"])
def test_a_file_rewritten_under_touch_r_is_read_again(tmp_path, suffix):
    # Copy tools and sync jobs keep a file's size and mtime (`touch -r`); its inode's ctime still moves.
    f = tmp_path / f"c{suffix}"
    old, new = ["first run's text", "second doc"], ["other run's text", "second doc"]
    write = (lambda texts: _write_jsonl(f, texts)) if suffix == ".jsonl" else (lambda t: f.write_text("\n".join(t)))
    write(old)
    cfg = _cfg(tmp_path, f, val_tokens=0, seq_len=4, text_unit="line")
    assert _split_docs(load_data(cfg, 320, 2, 0).tokens.train) == old
    before = f.stat()
    write(new)
    os.utime(f, ns=(before.st_atime_ns, before.st_mtime_ns))  # what `touch -r` does
    assert (f.stat().st_size, f.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert load_documents(cfg)["text"] == new  # not datasets' parse of the old file
    assert _split_docs(load_data(cfg, 320, 2, 0).tokens.train) == new  # nor jdp's tokens of it


def test_a_saved_dataset_rewritten_in_place_is_tokenized_again(tmp_path):
    src = _saved(tmp_path, ["first run's text", "second doc"])
    cfg = _cfg(tmp_path, src, val_tokens=0, seq_len=4)
    load_data(cfg, 320, 2, 0)
    state = (src / "state.json").read_text()
    arrows = {p: p.stat() for p in src.glob("data-*.arrow")}
    tmp = _saved(tmp_path, ["other run's text", "second doc"], "other")
    for p, st in arrows.items():  # the same fingerprint in state.json, the same sizes and mtimes
        p.write_bytes((tmp / p.name).read_bytes())
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    (src / "state.json").write_text(state)
    assert _split_docs(load_data(cfg, 320, 2, 0).tokens.train) == ["other run's text", "second doc"]


def test_a_damaged_token_cache_is_tokenized_again_and_a_full_disk_is_named(tmp_path, capsys):
    """The token cache is written atomically, but a disk or a hand can still cut a file of it afterwards: it is
    rebuilt with a warning, never read half. A cache disk that fills while it is written is one error naming the
    cache, the bytes needed and free, and leaves no partial files."""
    import subprocess

    texts = _corpus(200)
    src = _write_jsonl(tmp_path / "c.jsonl", texts)
    cfg = _cfg(tmp_path, src, val_tokens=0, seq_len=4)
    first = load_data(cfg, 320, 2, 0)
    good = np.array(first.tokens.train)  # a copy: the cache's files are memory-mapped, and cut below
    del first
    (cache,) = (tmp_path / "cache").glob("tokens-*[!k]")  # not the .lock
    train_npy = cache / "train.npy"
    train_npy.write_bytes(train_npy.read_bytes()[: train_npy.stat().st_size // 2])
    again = load_data(cfg, 320, 2, 0)
    assert f"jdp: warning: the token cache {cache} is damaged; tokenizing again" in capsys.readouterr().err
    np.testing.assert_array_equal(np.asarray(again.tokens.train), good)

    small = tmp_path / "small"
    small.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(small)], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"mounting a small tmpfs needs root: {e}")
    try:
        full = dataclasses.replace(cfg, cache_dir=str(small))
        big = _write_jsonl(tmp_path / "big.jsonl", ["x" * 4000 + str(i) for i in range(40)])  # 160 KB of tokens
        with pytest.raises(
            ConfigError,
            match=r"the token cache .* could not be written: (No space left on device|the disk is full) \(320,220 bytes needed, [\d,]+ free there\)",
        ):
            load_data(dataclasses.replace(full, source=str(big)), 320, 2, 0)
        assert not [p.name for p in small.iterdir() if ".tmp" in p.name]  # no partial cache left
    finally:
        subprocess.run(["umount", str(small)], check=True)
