"""Weighted mixtures (data.sources): the schedule of rows, each source's exactly-once order, the shares in
metrics.jsonl, per-source evaluation, weights changed on resume, and the same batches on any layout of processes."""

import json
import random
from pathlib import Path

import datasets
import numpy as np
import pytest
from test_faults import ckpt_steps, losses, run, summary

from jdp.checkpoint import config_differences
from jdp.config import ConfigError, DataConfig, load_config, source_labels, validate
from jdp.data import load_data
from jdp.data.mixture import MAX_PERIOD, Pattern, Schedule, integer_weights
from jdp.data.tokens import ByteTokenizer
from jdp.metrics import read_metrics

EOD = ByteTokenizer.eod_id


@pytest.fixture(autouse=True)
def _isolated_caches(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("JDP_CACHE", str(tmp_path / "jdp-env-cache"))


def sources(root: Path, big: int = 200, small: int = 30) -> tuple[Path, Path]:
    """Two local sources of distinct documents: `web` (big) and `code` (small), each document naming itself."""
    rng = random.Random(0)
    out = []
    for name, n in (("web", big), ("code", small)):
        d = root / name
        d.mkdir(parents=True, exist_ok=True)
        with open(d / "docs.jsonl", "w") as f:
            for i in range(n):
                words = " ".join(
                    rng.choice(["lorem", "ipsum", "dolor", "sit", "amet"]) for _ in range(rng.randint(10, 60))
                )
                f.write(json.dumps({"text": f"<{name} {i}> {words}"}) + "\n")
        out.append(d)
    return out[0], out[1]


def mixture(web: Path, code: Path, w=(3, 1)) -> str:
    return f"data.sources=[{{source: {web}, weight: {w[0]}}}, {{source: {code}, weight: {w[1]}}}]"


# ---------------------------------------------------------------------------------------------- the schedule


def test_integer_weights_keep_the_ratio_and_bound_the_period():
    assert integer_weights([3, 1]) == (3, 1)
    assert integer_weights([0.7, 0.3]) == (7, 3)
    assert integer_weights([2, 2, 4]) == (1, 1, 2)
    rounded = integer_weights([1, 1e-3 + 1 / 7919])  # no small exact ratio: shares of MAX_PERIOD
    assert sum(rounded) <= MAX_PERIOD + 2 and rounded[1] >= 1
    with pytest.raises(ConfigError, match="positive finite"):
        integer_weights([1, 0])


@pytest.mark.parametrize("weights", [(3, 1), (7, 3, 5), (1, 1), (1, 9)])
def test_every_period_holds_each_source_by_its_weight_and_rows_count_up(weights):
    pattern, schedule = Pattern(weights), Schedule(weights)
    assert [int((pattern.source == k).sum()) for k in range(len(weights))] == list(weights)
    src, within = schedule.rows(np.arange(5 * pattern.period + 3))
    for r in range(0, len(src), 3):
        assert (np.bincount(src[:r], minlength=len(weights)) == schedule.counts(r)).all()
    for k in range(len(weights)):  # source k's rows are its 0th, 1st, 2nd ... in order: none skipped or repeated
        assert (within[src == k] == np.arange((src == k).sum())).all()
        gaps = np.diff(np.flatnonzero(src == k))  # spread out, not in runs: no gap longer than its fair share + 1
        assert gaps.max() <= -(-pattern.period // weights[k]) + 1


def test_new_weights_on_resume_keep_the_past_and_every_source_goes_on_where_it_stood():
    old = Schedule((3, 1))
    new = old.reweighted((1, 1), 64)
    s_old, w_old = old.rows(np.arange(64))
    s_new, w_new = new.rows(np.arange(128))
    assert (s_new[:64] == s_old).all() and (w_new[:64] == w_old).all()  # the batches already trained are the same
    for k in range(2):  # after the change each source continues with its next row: none repeated, none skipped
        assert (w_new[s_new == k] == np.arange((s_new == k).sum())).all()
    assert list(np.bincount(s_new[64:], minlength=2)) == [32, 32]
    assert Schedule.from_json(new.to_json()).to_json() == new.to_json()
    assert old.reweighted((3, 1), 64) is old  # the same weights add nothing


# ---------------------------------------------------------------------------------------------- config


def test_data_sources_from_yaml_and_the_command_line(tmp_path):
    path = tmp_path / "mix.yaml"
    path.write_text("data:\n  sources:\n    - {source: data/web/*.jsonl, weight: 3}\n"
                    "    - {source: data/code, weight: 1, text_column: content}\n")  # fmt: skip
    cfg = load_config(path)
    assert cfg.data.sources[1] == {"source": "data/code", "weight": 1.0, "text_column": "content"}
    assert source_labels(cfg.data.sources) == ["web", "code"]
    cli = load_config(None, ["data.sources=[{source: a.parquet, weight: 0.5}, {source: stdlib, label: books}]"])
    assert source_labels(cli.data.sources) == ["a", "books"]


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.sources=[{sorce: a}]", "unknown key.*did you mean source"),
        ("data.sources=[{weight: 2}]", "has no 'source:'"),
        ("data.sources={source: a}", "expected a list of sources"),
        ("data.sources=[{source: a, weight: heavy}]", "weight: expected float"),
    ],
)
def test_a_malformed_source_is_named_as_the_config_is_read(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.sources=[{source: a, weight: 0}]"], "weights must be > 0"),
        (["data.sources=[{source: x/a}, {source: y/a}]"], "more than one source is labelled a"),
        (["data.source=books", "data.sources=[{source: a}]"], "both set"),
        (["data.sources=[{source: a, text_unit: word}]"], "text_unit='word' must be one of"),
    ],
)
def test_a_mixture_that_cannot_run_is_refused_before_any_data(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(load_config(None, overrides), 1)


def test_a_resume_may_change_the_weights_but_not_the_sources():
    saved = json.loads(json.dumps(load_config(None, ["data.sources=[{source: a, weight: 3}, {source: b}]"]).to_dict()))
    reweighted = load_config(None, ["data.sources=[{source: a, weight: 1}, {source: b, weight: 5}]"]).to_dict()
    assert config_differences(saved, json.loads(json.dumps(reweighted))) == []
    other = load_config(None, ["data.sources=[{source: a, weight: 3}, {source: c}]"]).to_dict()
    assert [d.split(":")[0] for d in config_differences(saved, json.loads(json.dumps(other)))] == ["data.sources"]


# ---------------------------------------------------------------------------------------------- the loader


def test_every_window_of_each_source_once_per_its_own_epoch_and_documents_whole(tmp_path):
    web, code = sources(tmp_path / "src")
    entries = ({"source": str(web), "weight": 3.0}, {"source": str(code), "weight": 1.0})
    cfg = DataConfig(sources=entries, seq_len=32, val_tokens=0, cache_dir=str(tmp_path / "cache"))
    data = load_data(cfg, 320, batch_size=16, seed=5)
    m = data.train
    sizes = m.sizes
    rows = {0: [], 1: []}  # each source's windows in the order the batches take them
    steps = int(3 * sizes[1] * 4 / 16) + 2  # the small source through three of its epochs
    for step in range(steps):
        src, idx = m.rows_of(step)
        for k in (0, 1):
            rows[k] += list(idx[src == k])
        batch = m.batch(step)
        for j in range(16):  # each row is its source's window, read from that source's stream
            start = idx[j] * 32
            assert (batch["inputs"][j] == m.sources[src[j]].stream[start : start + 32]).all()
    for k in (0, 1):
        n = int(sizes[k])
        for e in range(len(rows[k]) // n):  # every whole epoch of source k: each of its windows exactly once
            assert sorted(rows[k][e * n : (e + 1) * n]) == list(range(n)), (k, e)
        assert rows[k][:n] != rows[k][n : 2 * n] or len(rows[k]) < 2 * n  # a fresh order each epoch
    # the windows of one epoch of the small source hold each of its documents, whole, once
    n = int(sizes[1])
    text = b"".join(bytes(m.sources[1].stream[i * 32 : i * 32 + 32].astype(np.uint8)) for i in sorted(rows[1][:n]))
    assert [text.count(f"<code {i}>".encode()) for i in range(30)] == [1] * 30
    shares = np.bincount(np.concatenate([m.rows_of(s)[0] for s in range(steps)]), minlength=2) / (16 * steps)
    assert abs(shares[0] - 0.75) < 1e-9  # 16 rows a batch, a period of 4: exact
    assert m.stats(steps)["epochs/code"] == pytest.approx(len(rows[1]) / n)


def alphabets(root: Path) -> tuple[Path, Path]:
    """Two sources whose documents use letters of their own (a-m and n-z), in several files each (shards)."""
    rng = np.random.default_rng(0)
    out = []
    for name, letters, n in (("low", "abcdefghijklm", 120), ("high", "nopqrstuvwxyz", 10)):
        d = root / name
        d.mkdir(parents=True, exist_ok=True)
        for shard in range(2):
            with open(d / f"part{shard}.jsonl", "w") as f:
                for _ in range(n // 2):
                    words = ["".join(rng.choice(list(letters), rng.integers(2, 7))) for _ in range(rng.integers(5, 30))]
                    f.write(json.dumps({"text": " ".join(words)}) + "\n")
        out.append(d)
    return out[0], out[1]


def test_a_streamed_mixture_takes_each_row_from_its_scheduled_source_and_resumes_exactly(tmp_path):
    low, high = alphabets(tmp_path / "src")
    entries = ({"source": str(low), "weight": 3.0}, {"source": str(high), "weight": 1.0})
    cfg = DataConfig(sources=entries, seq_len=16, val_tokens=100, streaming=True, cache_dir=str(tmp_path / "cache"))
    data = load_data(cfg, 320, batch_size=8, seed=0)
    m = data.train
    batches = [data.local_batch(s) for s in range(60)]  # several epochs of the small source
    for step, batch in enumerate(batches):
        sources, _ = m.schedule.rows(step * 8 + np.arange(8))
        for row, k in zip(batch["inputs"], sources, strict=True):
            letters = {chr(t) for t in row if t < 256} - {" "}
            assert letters <= set("abcdefghijklm" if k == 0 else "nopqrstuvwxyz"), (step, k, letters)
    assert m.streams[1].epoch_count >= 1 and m.stats(60)["tokens/low"] == 3 * m.stats(60)["tokens/high"]
    again = load_data(cfg, 320, batch_size=8, seed=0)
    for s in range(12):
        again.local_batch(s)
    position = json.loads(json.dumps(again.position()))  # as saved beside a checkpoint
    resumed = load_data(cfg, 320, batch_size=8, seed=0)
    resumed.train.load_state_dict(position)
    for s in range(12, 60):
        got = resumed.local_batch(s)
        assert all((got[k] == batches[s][k]).all() for k in batches[s]), (
            s,
            [s.epoch_count for s in resumed.train.streams],
        )


def test_a_source_without_one_window_is_named(tmp_path):
    web, code = sources(tmp_path / "src")
    tiny = tmp_path / "src" / "tiny"
    tiny.mkdir()
    (tiny / "t.jsonl").write_text(json.dumps({"text": "short"}) + "\n")
    entries = ({"source": str(web)}, {"source": str(tiny)})
    cfg = DataConfig(sources=entries, seq_len=32, val_tokens=0, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match="source 'tiny'.*not one window"):
        load_data(cfg, 320, batch_size=16, seed=0)


# ---------------------------------------------------------------------------------------------- jdp train


TINY = ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.max_seq_len=32", "data.seq_len=32",
        "train.batch_size=8", "train.progress=false", "train.ckpt_every=0", "data.val_tokens=600"]  # fmt: skip


@pytest.mark.slow
def test_jdp_train_shares_tokens_by_weight_evaluates_each_source_and_reweights_on_resume(tmp_path, monkeypatch):
    """3:1 over 200 steps: metrics.jsonl's per-source tokens within 1% of 75/25 at every record; eval_loss per
    source and overall (their token-weighted mean); summary.json's account. Resumed with 1:1, every source goes on
    from where it stood and the 20 new steps split 1:1."""
    web, code = sources(tmp_path / "src", big=300, small=40)
    d = tmp_path / "run"
    env = {**__import__("os").environ, "JDP_CACHE": str(tmp_path / "cache")}
    common = [*TINY, f"train.run_dir={d}", "train.log_every=20", "train.eval_every=100"]
    first = run(d, env, (1, 1), [mixture(web, code), "train.steps=200", *common], timeout=600)
    assert "| code: 40 documents" in first.stdout and "share 25.0%" in first.stdout, first.stdout[-3000:]
    records = read_metrics(d / "metrics.jsonl")
    trained = [r for r in records if "loss" in r]
    assert [r["step"] for r in trained] == list(range(20, 201, 20))
    for r in trained:
        total = r["tokens/web"] + r["tokens/code"]
        assert total == r["tokens"] and abs(r["tokens/web"] / total - 0.75) < 0.01, r
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [100, 200]
    for r in evals:
        mean = (r["eval_loss/web"] * r["eval_tokens/web"] + r["eval_loss/code"] * r["eval_tokens/code"]) / r[
            "eval_tokens"
        ]
        assert r["eval_loss"] == pytest.approx(mean, rel=1e-6)
    account = summary(d)["sources"]
    assert account["code"]["epochs"] > 1 > account["web"]["epochs"]  # the small source repeats: said, not hidden
    at200 = trained[-1]

    resumed = run(d, env, (1, 1), [mixture(web, code, (1, 1)), "train.steps=220", *common], timeout=600)
    assert "data.sources weights 3:1 -> 1:1 from step 200" in resumed.stdout
    last = [r for r in read_metrics(d / "metrics.jsonl") if "loss" in r][-1]
    assert last["step"] == 220
    assert last["tokens/web"] - at200["tokens/web"] == last["tokens/code"] - at200["tokens/code"] == 10 * 8 * 32


@pytest.mark.slow
def test_a_sigkilled_run_of_a_mixture_resumes_bit_identically(tmp_path):
    """A 1 x 4 run killed after step 6 resumes from its checkpoint at 4 to the uninterrupted run's every loss and
    parameters, bit for bit, and its account of the sources; a step's tokens split 3:1. (Any layout of processes:
    test_each_process_reads_its_rows_of_the_one_process_batches below, and test_launch's for `jdp train`.)"""
    web, code = sources(tmp_path / "src")
    env = {**__import__("os").environ, "JDP_CACHE": str(tmp_path / "cache")}
    job = [mixture(web, code), "train.steps=8", "train.ckpt_every=4", "data.val_tokens=600"]
    ref, killed = tmp_path / "1x4", tmp_path / "killed"
    run(ref, {**env}, (1, 4), job)
    by_step = {r["step"]: r for r in read_metrics(ref / "metrics.jsonl") if "loss" in r}
    assert by_step[8]["tokens/web"] == 3 * by_step[8]["tokens/code"]
    kill = {"JDP_TEST_KILL_ONCE": f"6:0:{tmp_path / 'killed-once'}"}  # once the checkpoint at 4 is on disk
    out = run(killed, env, (1, 4), job, hooks=kill, check=False)
    assert out.returncode != 0 and ckpt_steps(killed) == [4]
    again = run(killed, {**env}, (1, 4), job)
    assert "resuming from the checkpoint at step 4" in again.stdout
    assert losses(killed) == losses(ref)
    assert summary(killed)["params_sha256"] == summary(ref)["params_sha256"]
    assert summary(killed)["sources"] == summary(ref)["sources"]


def test_each_process_reads_its_rows_of_the_one_process_batches(tmp_path):
    """Two processes (rows 0-7 and 8-15 of each global batch of 16) read, from every source, their rows of the
    one-process batches, and of each source's validation batches; their accounts of the sources are the same. So
    any layout of processes trains the same mixture (it cost CI ~60 s as 1 x 4 against 2 x 2 `jdp train` runs)."""
    web, code = sources(tmp_path / "src")
    entries = ({"source": str(web), "weight": 3.0}, {"source": str(code), "weight": 1.0})
    cfg = DataConfig(sources=entries, seq_len=32, val_tokens=600, cache_dir=str(tmp_path / "cache"))
    whole = load_data(cfg, 320, batch_size=16, seed=5)
    halves = [load_data(cfg, 320, 16, 5, rows=slice(8 * r, 8 * r + 8), rank=r, world=2) for r in (0, 1)]
    for step in range(40):  # several epochs of the small source
        batch, parts = whole.local_batch(step), [h.local_batch(step) for h in halves]
        assert batch.keys() == parts[0].keys() == parts[1].keys()
        for k in batch:
            assert (np.concatenate([parts[0][k], parts[1][k]]) == batch[k]).all(), (step, k)
    assert whole.train.stats(40) == halves[0].train.stats(40) == halves[1].train.stats(40)
    sets = [whole.eval_sets(), *(h.eval_sets() for h in halves)]
    assert [[label for label, _ in s] for s in sets] == [["web", "code"]] * 3
    for (label, every), (_, first), (_, second) in zip(*sets, strict=True):
        every, first, second = list(every), list(first), list(second)
        assert len(every) == len(first) == len(second) > 0, label
        for g, x, y in zip(every, first, second, strict=True):
            for k in g:
                assert (np.concatenate([x[k], y[k]]) == g[k]).all(), (label, k)


def test_jdp_train_on_a_streamed_mixture_resumes_where_an_uninterrupted_run_goes(tmp_path):
    """A streamed mixture through the trainer: a run stopped at its checkpoint at step 4 and resumed to step 8 trains
    the same losses and parameters as a run of 8 (constant learning rate, so the step count changes nothing else)."""
    from jdp.lm import train

    low, high = alphabets(tmp_path / "src")
    common = [
        f"data.sources=[{{source: {low}, weight: 3}}, {{source: {high}, weight: 1}}]", "data.streaming=true",
        "data.seq_len=32", "model.max_seq_len=32", "model.n_layers=1", "model.d_model=32", "model.n_heads=2",
        "data.val_tokens=200", "train.batch_size=8", "train.log_every=1", "train.eval_every=4", "train.ckpt_every=4",
        "train.progress=false", "optim.warmup_steps=0", "optim.min_lr_ratio=1", f"data.cache_dir={tmp_path / 'c'}",
    ]  # fmt: skip
    whole = train(load_config(None, [*common, "train.steps=8", f"train.run_dir={tmp_path / 'whole'}"]))
    train(load_config(None, [*common, "train.steps=4", f"train.run_dir={tmp_path / 'parts'}"]))
    parts = train(load_config(None, [*common, "train.steps=8", f"train.run_dir={tmp_path / 'parts'}"]))
    assert parts["params_sha256"] == whole["params_sha256"]
    assert losses(tmp_path / "parts") == losses(tmp_path / "whole")
    last = [r for r in read_metrics(tmp_path / "whole" / "metrics.jsonl") if "loss" in r][-1]
    assert last["tokens/low"] == 3 * last["tokens/high"] == 3 * 8 * 2 * 32
    evals = [r for r in read_metrics(tmp_path / "whole" / "metrics.jsonl") if "eval_loss" in r]
    assert {"eval_loss/low", "eval_loss/high"} <= set(evals[-1])


def test_each_source_of_a_mixture_is_fingerprinted_and_a_change_names_that_source(tmp_path):
    """The checkpoint record's fingerprint is per source: editing one source's file changes its entry alone, and
    the resume check names it (issue 42, item 1); a copy of the same files elsewhere changes nothing."""
    from jdp.checkpoint import data_changes

    web, code = sources(tmp_path / "src")
    cfg = DataConfig(sources=({"source": str(web)}, {"source": str(code)}), seq_len=32, val_tokens=0,
                     cache_dir=str(tmp_path / "cache"))  # fmt: skip
    before = load_data(cfg, 320, batch_size=16, seed=0).fingerprint()
    assert set(before) == {"web", "code"} and all(len(v["sha256"]) == 16 for v in before.values())
    with open(code / "docs.jsonl", "a") as f:
        f.write(json.dumps({"text": "<code 30> a document added after the checkpoint"}) + "\n")
    after = load_data(cfg, 320, batch_size=16, seed=0).fingerprint()
    assert after["web"] == before["web"] and after["code"] != before["code"]
    changes = data_changes({"data": {"fingerprint": before}}, after)
    assert len(changes) == 1 and changes[0].startswith("source 'code': tokens ") and "sha256" in changes[0]
    moved = tmp_path / "elsewhere"
    for d in (web, code):
        (moved / d.name).mkdir(parents=True)
        (moved / d.name / "docs.jsonl").write_bytes((d / "docs.jsonl").read_bytes())
    cfg2 = DataConfig(sources=({"source": str(moved / "web")}, {"source": str(moved / "code")}), seq_len=32,
                      val_tokens=0, cache_dir=str(tmp_path / "cache"))  # fmt: skip
    assert load_data(cfg2, 320, batch_size=16, seed=0).fingerprint() == after


def test_a_sources_problem_is_named_as_that_source_and_the_same_data_twice_is_refused(tmp_path):
    """Issue 42, item 10: a source of data.sources reported its problems as `data.source=PATH` and suggested the
    global data.val_tokens; the same documents listed twice (a directory and a file in it) trained twice per epoch
    without a word."""
    web, code = sources(tmp_path / "src")

    def load(*entries):
        cfg = DataConfig(sources=entries, seq_len=32, val_tokens=0, cache_dir=str(tmp_path / "cache"))
        return load_data(cfg, 320, batch_size=16, seed=0)

    with pytest.raises(ConfigError, match=rf"^data.sources: source 'gone' \({tmp_path}/gone\): no data files found"):
        load({"source": str(web)}, {"source": str(tmp_path / "gone")})
    with pytest.raises(ConfigError, match=r"^data.sources: source 'code' \(.*\): holding out its val_tokens: 100,000 "
                                          r"for validation .* Lower its val_tokens to at most \d+, e.g. its val_tokens: "):  # fmt: skip
        load({"source": str(web)}, {"source": str(code), "val_tokens": 100_000})
    with pytest.raises(ConfigError, match=rf"sources 'src' and 'docs' both read {web}/docs.jsonl: each epoch would "
                                          r"train its documents twice"):  # fmt: skip
        load({"source": str(tmp_path / "src")}, {"source": str(web / "docs.jsonl")})
    with pytest.raises(ConfigError, match=r"sources 'a' and 'b' both read"):
        load({"source": str(code), "label": "a"}, {"source": str(code), "label": "b"})
