"""A data format is one registry entry (jdp/data/formats.py): one defined in tests/format_reversed.py and registered
from here, with no file under jdp/ naming it, feeds the trainer its own windows, and a run of it killed and run
again under `jdp train` ends with the uninterrupted run's every loss and parameters, bit for bit."""

import json
import os
import subprocess
import sys
from pathlib import Path

import format_reversed
import inject
import pytest

from jdp.config import ConfigError, load_config, validate
from jdp.data import formats, load_data

TESTS = Path(__file__).resolve().parent
CORPUS = TESTS / "data" / "run-before-redesign" / "corpus"
formats.register(format_reversed.REVERSED)
SMALL = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.max_seq_len=32", "data.seq_len=32",
         f"data.source={CORPUS}", "data.format=reversed", "data.val_tokens=512", "train.batch_size=8"]  # fmt: skip
JDP_WITH_FORMAT = (
    "import sys, format_reversed; from jdp.data import formats; formats.register(format_reversed.REVERSED); "
    "from jdp.cli import main; sys.exit(main(sys.argv[1:]))"
)


def test_the_trainer_reads_the_formats_own_windows(tmp_path, monkeypatch):
    monkeypatch.setenv("JDP_CACHE", str(tmp_path))
    cfg = load_config("tiny", [*SMALL, "train.run_dir=unused"])
    validate(cfg, 1)
    data = load_data(cfg.data, cfg.model.vocab_size, 8, seed=0)
    text = bytes(int(t) for t in data.local_batch(0)["inputs"].ravel() if t < 256).decode("utf-8", "replace")
    assert text.count(" eht ") > text.count(" the "), text[:300]  # read backwards ("the" -> "eht")
    assert data.describe().startswith(f"{data.tokens.n_docs:,} documents")
    assert [label for label, _ in data.eval_sets()] == [""]


def test_its_refusals_are_the_configs():
    assert "reversed" in formats.names()
    with pytest.raises(ConfigError, match="streamed reversed text is not supported yet"):
        validate(load_config("tiny", [*SMALL, "data.streaming=true", "train.run_dir=u"]), 1)
    with pytest.raises(ConfigError, match="jdp's own format"):
        formats.register(formats.Format("text", "text", lambda d: [], load=format_reversed.load))
    with pytest.raises(ConfigError, match="data.format='nope' must be one of text, chat, prompt, preference, reversed"):
        formats.get("nope")


def test_jdps_own_formats_have_their_loaders_in_a_fresh_process():
    """`jdp train data.format=chat` failed ("'NoneType' object is not callable") in a process where nothing had
    imported jdp/data/sft.py (the tests do): the text pipeline, which reads every format, imports jdp's own."""
    probe = ("from jdp.data import formats, load_data; "
             "print([(f.load is None, f.mix is None, f.stream is None) for f in map(formats.get, formats.names())])")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=TESTS.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["[(False,", "False,", "False),", "(False,", "False,", "False),", "(False,", "False,",
                                  "False),", "(False,", "True,", "True)]"]  # fmt: skip  (preference: neither mixed nor streamed)


@pytest.mark.slow
def test_a_run_of_it_killed_and_run_again_is_the_uninterrupted_run(tmp_path):
    def run(run_dir: Path, **faults: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu",
               "JDP_CACHE": str(tmp_path / "cache")}  # fmt: skip
        env, override = inject.register(env, **faults)
        args = ["train", "tiny", *SMALL, "train.steps=8", "train.ckpt_every=4", "train.log_every=1",
                "train.eval_every=4", "train.progress=false", "train.tensorboard=false", f"train.run_dir={run_dir}",
                override]  # fmt: skip
        return subprocess.run([sys.executable, "-c", JDP_WITH_FORMAT, *args], env=env, capture_output=True,
                              text=True, timeout=600)  # fmt: skip

    straight = run(tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr[-3000:]
    killed = run(tmp_path / "killed", JDP_TEST_KILL_ONCE=f"6:0:{tmp_path / 'killed-once'}")
    assert killed.returncode != 0 and (tmp_path / "killed-once").exists(), killed.stderr[-3000:]
    again = run(tmp_path / "killed", JDP_TEST_KILL_ONCE=f"6:0:{tmp_path / 'killed-once'}")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resuming from the checkpoint at step 4" in again.stdout + again.stderr

    def losses(run_dir: Path) -> dict:
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return {(r["step"], k): r[k] for r in records for k in ("loss", "eval_loss") if k in r}

    assert losses(tmp_path / "killed") == losses(tmp_path / "straight")
    assert len(losses(tmp_path / "straight")) == 8 + 2
    digest = [
        json.loads((d / "summary.json").read_text())["params_sha256"]
        for d in (tmp_path / "straight", tmp_path / "killed")
    ]
    assert digest[0] == digest[1]


def test_nothing_under_jdp_names_it():
    for path in (TESTS.parent / "jdp").rglob("*.py"):
        assert "format_reversed" not in path.read_text() and '"reversed"' not in path.read_text(), path
