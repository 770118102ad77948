"""The input pipeline at scale: world-size invariance, resume from the step, streaming resume, prefetch."""

from __future__ import annotations

import json

import datasets
import numpy as np
import pytest

from jdp.config import ConfigError, DataConfig
from jdp.data import Batches, Prefetcher, load_data
from jdp.data.corpus import open_stream
from jdp.data.stream import StreamBatches, hold_out
from jdp.data.tokens import ByteTokenizer

EOD = ByteTokenizer.eod_id


@pytest.fixture(autouse=True)
def _offline(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("JDP_CACHE", str(tmp_path / "cache"))


def rank_rows(batch_size: int, world: int, rank: int) -> slice:
    per = batch_size // world
    return slice(rank * per, (rank + 1) * per)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_world_sizes_see_identical_global_batches_and_every_sample_once(world):
    stream = np.arange(10 * 37 + 1, dtype=np.uint16)  # 37 windows of 10 tokens
    B, steps = 8, 37  # 37 * 8 = 8 whole epochs; batches straddle epoch boundaries
    reference = Batches(stream, 10, B, seed=3)
    loaders = [Batches(stream, 10, B, seed=3) for _ in range(world)]  # one loader per rank
    seen = []
    for step in range(steps):
        parts = [loaders[r].batch(step, rank_rows(B, world, r)) for r in range(world)]
        glued = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        full = reference.batch(step)
        for k in full:
            np.testing.assert_array_equal(glued[k], full[k])
        seen.extend(glued["inputs"][:, 0] // 10)  # window index from its first token
    seen = np.asarray(seen)
    for epoch in range(len(seen) // 37):
        assert sorted(seen[epoch * 37 : (epoch + 1) * 37]) == list(range(37))  # exactly once per epoch


@pytest.mark.parametrize("world_before, world_after", [(1, 1), (2, 4), (4, 1)])
def test_resume_mid_epoch_with_another_world_size_continues_exactly(world_before, world_after):
    stream = np.arange(8 * 50 + 1, dtype=np.uint16)
    B, stop_at, total = 8, 9, 20  # stop in the middle of the second epoch (50 windows per epoch)
    uninterrupted = [Batches(stream, 8, B, seed=1).batch(s)["inputs"] for s in range(total)]
    before = [Batches(stream, 8, B, seed=1).batch(s)["inputs"] for s in range(stop_at)]
    # The restarted job knows nothing but the step it resumes from; its ranks use new loaders.
    after = []
    for s in range(stop_at, total):
        ranks = [Batches(stream, 8, B, seed=1).batch(s, rank_rows(B, world_after, r)) for r in range(world_after)]
        after.append(np.concatenate([p["inputs"] for p in ranks]))
    del world_before  # the past world size cannot matter: batches are a function of (seed, step)
    for a, b in zip(before + after, uninterrupted, strict=True):
        np.testing.assert_array_equal(a, b)


def test_prefetcher_resumes_at_a_step_and_measures_waiting():
    stream = np.arange(8 * 20 + 1, dtype=np.uint16)
    batches = Batches(stream, 8, 4, seed=0)
    full = list(Prefetcher(lambda s: batches.batch(s), 0, 12, depth=3))
    resumed = list(Prefetcher(lambda s: batches.batch(s), 5, 12, depth=3))
    assert [s for s, _ in full] == list(range(12)) and [s for s, _ in resumed] == list(range(5, 12))
    for (s1, b1), (s2, b2) in zip(full[5:], resumed, strict=True):
        assert s1 == s2
        np.testing.assert_array_equal(b1["inputs"], b2["inputs"])

    import time

    slow = Prefetcher(lambda s: time.sleep(0.05) or s, 0, 4, depth=1)
    assert [s for s, _ in slow] == [0, 1, 2, 3]
    assert slow.wait_s >= 0.1  # the consumer really waited for a slow producer, and it was counted


def test_prefetcher_reraises_loader_errors():
    def broken(step):
        if step == 2:
            raise ValueError("bad row 2")
        return step

    it = Prefetcher(broken, 0, 5, depth=2)
    assert next(it) == (0, 0) and next(it) == (1, 1)
    with pytest.raises(RuntimeError, match="data loader") as info:
        next(it)
    assert "bad row 2" in str(info.value.__cause__)


# ------------------------------------------------------------------------------------------- streaming


def write_shards(tmp_path, n_files=4, docs_per_file=6):
    texts = []
    for f in range(n_files):
        with open(tmp_path / f"part-{f}.jsonl", "w") as fh:
            for i in range(docs_per_file):
                text = f"file {f} document {i} " + "x" * ((7 * f + 3 * i) % 23)
                texts.append(text)
                fh.write(json.dumps({"text": text}) + "\n")
            fh.write(json.dumps({"text": ""}) + "\n")  # an empty row: skipped and counted
    return texts


def stream_cfg(tmp_path, **kw):
    return DataConfig(
        **{"source": str(tmp_path / "part-*.jsonl"), "seq_len": 16, "streaming": True, "val_tokens": 0, **kw}
    )


def test_streaming_reads_every_document_once_per_epoch_across_ranks(tmp_path):
    texts = write_shards(tmp_path)
    cfg = stream_cfg(tmp_path)
    ds = open_stream(cfg)
    docs = []
    for rank in range(2):
        loader = StreamBatches(ds, ByteTokenizer(), cfg, rows=1, rank=rank, world=2, exclude=set())
        tokens = []
        while loader.epoch_count == 0:
            tokens.append(loader.next_batch()["inputs"][0])
        stream = np.concatenate(tokens)
        assert loader.n_empty == 2  # this rank's two files each hold one empty row
        # Cut the packed tokens back into documents at the end-of-document ids: the rank's own shards.
        cut = np.flatnonzero(stream == EOD)
        pieces = np.split(stream[: cut[-1]], cut[:-1] + 1) if len(cut) else []
        docs += [bytes(p[p != EOD].astype(np.uint8)).decode() for p in pieces if len(p)]
    counts = {t: docs.count(t) for t in texts}
    # Every document appears, and exactly once, before either rank wraps into its second epoch
    # (a rank's epoch may end mid-window, so at most its last document can be cut off here).
    assert max(counts.values()) == 1
    assert sum(counts.values()) >= len(texts) - 2


def test_streaming_resume_from_state_dict_repeats_and_skips_nothing(tmp_path):
    write_shards(tmp_path)
    cfg = stream_cfg(tmp_path)
    ds = open_stream(cfg)
    straight = StreamBatches(ds, ByteTokenizer(), cfg, rows=2, rank=0, world=1, exclude=set())
    expected = [straight.next_batch()["inputs"] for _ in range(30)]  # several epochs

    for stop in (1, 7, 13, 29):
        first = StreamBatches(ds, ByteTokenizer(), cfg, rows=2, rank=0, world=1, exclude=set())
        got = [first.next_batch()["inputs"] for _ in range(stop)]
        state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint would hold
        second = StreamBatches(open_stream(cfg), ByteTokenizer(), cfg, rows=2, rank=0, world=1, exclude=set())
        second.load_state_dict(state)
        got += [second.next_batch()["inputs"] for _ in range(30 - stop)]
        for a, b in zip(got, expected, strict=True):
            np.testing.assert_array_equal(a, b)


def test_streaming_state_is_refused_on_another_world_size(tmp_path):
    write_shards(tmp_path)
    cfg = stream_cfg(tmp_path)
    ds = open_stream(cfg)
    one = StreamBatches(ds, ByteTokenizer(), cfg, rows=2, rank=0, world=1, exclude=set())
    one.next_batch()
    two = StreamBatches(ds, ByteTokenizer(), cfg, rows=1, rank=0, world=2, exclude=set())
    with pytest.raises(ConfigError, match="world size"):
        two.load_state_dict(one.state_dict())


def test_streaming_validation_is_held_out_from_training(tmp_path):
    texts = write_shards(tmp_path)
    cfg = stream_cfg(tmp_path, val_tokens=60)
    ds = open_stream(cfg)
    val, exclude = hold_out(ds, ByteTokenizer(), cfg)
    held = [t for t in texts if t.encode() in bytes(val[val != EOD].astype(np.uint8))]
    assert len(val) >= 60 and len(exclude) == len(held) >= 2
    loader = StreamBatches(ds, ByteTokenizer(), cfg, rows=1, rank=0, world=1, exclude=exclude)
    parts = []
    while loader.epoch_count == 0:  # one whole epoch
        parts.append(loader.next_batch()["inputs"][0])
    tokens = np.concatenate(parts)
    # Skipped once per epoch: in epoch 0, and again at the start of epoch 1, where the held-out documents
    # (the head of the stream) come first and the batch that crossed the boundary was being filled.
    assert loader.n_excluded == len(held) * 2
    train_text = bytes(tokens[tokens != EOD].astype(np.uint8))
    assert not [t for t in held if t.encode() in train_text]


def test_load_data_streaming_and_its_errors(tmp_path):
    write_shards(tmp_path, n_files=2)
    data = load_data(stream_cfg(tmp_path, val_tokens=40), 320, 4, seed=0, rows=slice(0, 2), rank=0, world=2)
    b = data.local_batch(0)
    assert b["inputs"].shape == (2, 16) and b["weights"].sum() == 32
    assert "streaming" in data.describe()
    with pytest.raises(ConfigError, match="no column 'body'"):
        load_data(stream_cfg(tmp_path, text_column="body"), 320, 4, seed=0)
    with pytest.raises(ConfigError, match="no data files"):
        load_data(DataConfig(source=str(tmp_path / "nothing-*.jsonl"), streaming=True), 320, 4, seed=0)
    # One document for two processes: the second would have nothing to train on; refuse, naming it.
    (tmp_path / "single").mkdir()
    (tmp_path / "single" / "one.jsonl").write_text(json.dumps({"text": "only one"}) + "\n" + json.dumps({"text": ""}))
    cfg = DataConfig(source=str(tmp_path / "single"), seq_len=4, streaming=True, val_tokens=0)
    starving = load_data(cfg, 320, 2, seed=0, rows=slice(1, 2), rank=1, world=2)
    with pytest.raises(ConfigError, match="process 1 of 2 got no training documents"):
        starving.local_batch(0)


def test_streaming_names_a_file_that_is_not_utf8_and_reads_it_leniently_when_asked(tmp_path):
    (tmp_path / "a.txt").write_text("clean text\n" * 200)
    (tmp_path / "b.txt").write_bytes(b"line one\n" * 300 + b"caf\xe9 au lait\n" + b"tail\n" * 10)
    cfg = DataConfig(source=str(tmp_path / "*.txt"), streaming=True, val_tokens=0, seq_len=16)
    with pytest.raises(ConfigError) as e:
        loader = StreamBatches(open_stream(cfg), ByteTokenizer(), cfg, rows=2, rank=0, world=1, exclude=set())
        for _ in range(1000):
            loader.next_batch()
    msg = str(e.value)
    assert f"{tmp_path / 'b.txt'} is not valid UTF-8: byte 0xe9 at offset {9 * 300 + 3:,} (line 301)" in msg, msg
    assert "data.encoding_errors=replace" in msg
    lenient = DataConfig(source=str(tmp_path / "*.txt"), streaming=True, val_tokens=0, seq_len=16,
                         encoding_errors="replace")  # fmt: skip
    loader = StreamBatches(open_stream(lenient), ByteTokenizer(), lenient, rows=2, rank=0, world=1, exclude=set())
    seen = b"".join(bytes(loader.next_batch()["inputs"].ravel().astype(np.uint8)) for _ in range(600))
    assert "caf\ufffd au lait".encode() in seen.replace(bytes([EOD % 256]), b"")


def test_streaming_honours_data_text_unit(tmp_path):
    a, b = "Once upon a time\nthere was a cat.\n\nThe cat sat.\n", "def main():\n    return 0\n"
    (tmp_path / "a.txt").write_text(a)
    (tmp_path / "b.txt").write_text(b)
    by_unit = {
        unit: [d["text"] for d in open_stream(DataConfig(source=str(tmp_path / "*.txt"), text_unit=unit))]
        for unit in ("file", "line", "paragraph")
    }
    assert by_unit["file"] == [a, b]  # the default: whole files, newlines kept
    assert by_unit["line"] == [*a.splitlines(), *b.splitlines()]
    assert by_unit["paragraph"] == ["Once upon a time\nthere was a cat.", "The cat sat.\n", b]


def test_streaming_validates_on_a_validation_split_and_trains_on_every_training_document(tmp_path):
    train_docs = [f"training document {i} " + "t" * (i % 7) for i in range(24)]
    val_docs = [f"validation document {i} " + "v" * i for i in range(6)]
    src = tmp_path / "saved"
    splits = {"train": train_docs, "validation": val_docs}
    datasets.DatasetDict({n: datasets.Dataset.from_dict({"text": t}) for n, t in splits.items()}).save_to_disk(str(src))
    cfg = DataConfig(source=str(src), seq_len=16, streaming=True, val_tokens=60)
    data = load_data(cfg, 320, 2, seed=0, rows=slice(0, 2), rank=0, world=1)
    assert data.val_split == "validation" and "from split 'validation'" in data.describe()
    val = bytes(data.tokens.val[data.tokens.val != EOD].astype(np.uint8)).decode()
    assert val.startswith(val_docs[0]) and len(data.tokens.val) >= 60  # the head of the split, whole documents
    assert data.train.exclude == set()  # nothing of the training split is held out
    parts = []
    while data.train.epoch_count == 0:
        parts.append(data.local_batch(0)["inputs"].ravel())
    text = bytes(np.concatenate(parts)[np.concatenate(parts) != EOD].astype(np.uint8)).decode()
    assert all(t in text for t in train_docs[:-1]) and not any(v in text for v in val_docs)
    assert data.train.n_excluded == 0
