"""End to end: `jdp train` on the tiny config, errors before compilation, and 1 vs 4 devices."""

import dataclasses
import json
import os

import pytest

import jdp.parallel
from jdp.cli import main
from jdp.config import ConfigError, load_config
from jdp.lm import train
from jdp.metrics import read_metrics


@pytest.fixture(scope="session")
def cache(tmp_path_factory):
    """One embedded corpus and token cache for the whole session."""
    path = tmp_path_factory.mktemp("jdp-cache")
    os.environ["JDP_CACHE"] = str(path)
    return path


@pytest.fixture
def no_compile(monkeypatch):
    """Fail the test if anything reaches state placement or step compilation."""

    def refuse(*args, **kwargs):
        raise AssertionError("reached compilation: the error should have come first")

    for name in ("init_state", "make_train_step", "make_eval_step"):
        monkeypatch.setattr(jdp.parallel, name, refuse)


def run_cli(args, capsys):
    code = main(["train", *args])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    "args, words",
    [
        (["train.batch_size=30"], ["train.batch_size=30", "not divisible", "devices (4)", "multiple of 4"]),
        (["train.batch_size=32", "train.grad_accum=3"], ["train.grad_accum (3)", "multiple of 12"]),
        (["data.seq_len=512"], ["data.seq_len=512", "model.max_seq_len=128"]),
        (["train.stepz=3"], ["unknown config key 'train.stepz': did you mean train.steps"]),
        (["train.steps=many"], ["train.steps=many", "expected int"]),
        (["data.source=/nonexistent/corpus/*.jsonl"], ["no data files found", "/nonexistent/corpus"]),
    ],
)
def test_bad_config_is_a_clear_error_before_compiling(args, words, capsys, no_compile, cache, tmp_path):
    code, err = run_cli(["configs/tiny.yaml", f"train.run_dir={tmp_path / 'run'}", *args], capsys)
    assert code == 2
    for word in words:
        assert word in err, err


def test_missing_text_column_is_a_clear_error(capsys, no_compile, cache, tmp_path):
    data = tmp_path / "docs.jsonl"
    data.write_text('{"body": "hello world"}\n' * 50)
    code, err = run_cli([f"data.source={data}", "data.text_column=text", f"train.run_dir={tmp_path / 'r'}"], capsys)
    assert code == 2
    assert "no column 'text'" in err and "body" in err


def test_the_cpu_peak_is_measured_at_start_or_taken_from_jdp_cpu_peak_flops(monkeypatch):
    from jdp.metrics import peak_flops

    monkeypatch.delenv("JDP_CPU_PEAK_FLOPS", raising=False)
    rate, source = peak_flops("float32", 4)
    assert 1e9 < rate < 1e15 and source.startswith("measured float32 matmul rate")
    monkeypatch.setenv("JDP_CPU_PEAK_FLOPS", "3e11")
    assert peak_flops("float32", 4) == (3e11, "JDP_CPU_PEAK_FLOPS=3e11 per host (not measured)")


@pytest.mark.parametrize("value", ["fast", "0", "-2e11", "nan", "inf"])
def test_a_bad_jdp_cpu_peak_flops_is_a_clear_error_before_compiling(value, monkeypatch, capsys, no_compile, cache,
                                                                     tmp_path):  # fmt: skip
    monkeypatch.setenv("JDP_CPU_PEAK_FLOPS", value)
    code, err = run_cli(["configs/tiny.yaml", f"train.run_dir={tmp_path / 'run'}"], capsys)
    assert code == 2 and f"JDP_CPU_PEAK_FLOPS={value!r} is not a positive number" in err, err
    assert not (tmp_path / "run").exists()


def test_old_metrics_in_a_run_dir_without_checkpoints_are_kept_aside(cache, tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    small = ["model.n_layers=1", "model.d_model=32", "train.steps=2", "train.eval_every=0", "train.log_every=1"]
    train(load_config("tiny", [*small, f"train.run_dir={tmp_path}", "train.progress=false"]))
    assert (tmp_path / "metrics.superseded.jsonl").read_text() == '{"step": 1, "loss": 1.0}\n'  # never lost
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r] == [1, 2]  # never mixed


@pytest.mark.slow
def test_tiny_config_trains_loss_falls(cache, tmp_path):
    cfg = load_config(
        "tiny",
        [
            f"train.run_dir={tmp_path}",
            "train.steps=40",
            "train.log_every=5",
            "train.eval_every=20",
            "train.progress=false",
        ],
    )
    result = train(cfg)
    records = read_metrics(tmp_path / "metrics.jsonl")
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in steps] == list(range(5, 41, 5))
    assert [r["step"] for r in evals] == [20, 40]
    for r in steps:  # a CPU's peak is a half-second matmul measurement on a shared machine: a run can beat it
        assert {"step", "loss", "grad_norm", "lr", "tokens_per_sec", "mfu", "data_wait_s"} <= set(r)
        assert r["tokens_per_sec"] > 0 and 0 < r["mfu"] < 3 and r["data_wait_s"] >= 0
    # Uniform guessing over 320 ids is ln 320 = 5.77; 40 steps of the tiny config get far below.
    assert steps[-1]["loss"] < steps[0]["loss"] - 1.0
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"] < 5.0
    assert result["eval_loss"] == evals[-1]["eval_loss"]
    assert load_config(tmp_path / "config.yaml") == cfg  # the resolved config, loadable again
    assert jdp.parallel.replica_mismatches(result["state"].params) == []


# The command line on one device against four: tests/test_launch.py's layouts (1 x 1 = 1 x 4 = 2 x 2 = 4 x 1).


def test_streaming_training_end_to_end(tmp_path, cache):
    files = tmp_path / "shards"
    files.mkdir()
    for f in range(4):
        lines = [json.dumps({"text": f"shard {f} line {i}: " + "abc " * (i % 9)}) for i in range(40)]
        (files / f"part-{f}.jsonl").write_text("\n".join(lines))
    cfg = load_config(
        "tiny",
        [f"data.source={files}", "data.streaming=true", "data.val_tokens=512", "data.seq_len=32", "train.batch_size=8"]
        + [
            "train.steps=4",
            "train.log_every=2",
            "train.eval_every=0",
            f"train.run_dir={tmp_path / 'run'}",
            "train.progress=false",
        ],
    )
    result = train(cfg)
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [2, 4, 4, 4]  # logs, the final evaluation, the goodput summary
    assert records[-2]["eval_tokens"] > 0 and result["loss"] < 6 and "goodput" in records[-1]
    # The stream position saved beside the checkpoint, cut off by a crash: named with its path, not a traceback.
    position = tmp_path / "run" / "data_state" / "4" / "process_0.json"
    position.write_text(position.read_text()[:20])
    more = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=6))
    with pytest.raises(ConfigError, match=rf"{position}: the stream position saved with the checkpoint at step 4"):
        train(more)
