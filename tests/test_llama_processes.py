"""The Llama family (model.arch=llama) under `jdp train`: a run killed with SIGKILL and run again ends with the
uninterrupted run's every loss and bit-identical parameters. (Its 4 devices = 1: test_llama.py's
test_four_devices_train_as_one; 2 processes x 2 devices = 1 x 4, the same for every family: test_launch.py's
layouts, whose 2 x 2 comparison for a Llama cost CI ~30 s more.)"""

import json
import os
import subprocess
import sys
from pathlib import Path

import inject
import pytest

from jdp.metrics import read_metrics

pytestmark = pytest.mark.slow

# A small grouped-query Llama (one block, 4 query heads on 2 key/value heads, an untied output) on the embedded
# corpus, without evaluation: each run is mostly start-up and compilation, and the depth changes nothing here.
SMALL = ["model.n_layers=1", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.max_seq_len=64"]
SMALL += ["data.seq_len=64", "data.val_tokens=0", "train.batch_size=16", "train.steps=4", "train.ckpt_every=2"]
SMALL += ["train.log_every=1", "train.progress=false"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return {**os.environ, "JDP_CACHE": str(tmp_path_factory.mktemp("cache")), "PYTHONUNBUFFERED": "1"}


def run(run_dir: Path, env: dict, layout: tuple[int, int], hooks=None) -> subprocess.CompletedProcess:
    """`jdp train configs/llama-tiny.yaml` as 1 process with N devices, or through `jdp launch` as P x D."""
    nproc, devices = layout
    args = ["train", "configs/llama-tiny.yaml", *SMALL, f"train.run_dir={run_dir}"]
    if hooks:  # faults to inject: the tests' own callback (tests/inject.py)
        env, override = inject.register(env, **hooks)
        args.append(override)
    if nproc == 1:
        env = {**env, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    else:
        launch = ["launch", "--nproc-per-node", str(nproc), "--devices-per-proc", str(devices), "--grace-s", "20"]
        args = [*launch, "--", *args]
    out = subprocess.run([sys.executable, "-m", "jdp.cli", *args], capture_output=True, text=True, env=env, timeout=300)
    assert hooks or out.returncode == 0, out.stderr[-4000:]
    return out


def metrics(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def ckpt_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


def test_a_sigkilled_llama_run_resumes_bit_identically(tmp_path, env):
    """1 x 4 uninterrupted; 1 x 4 killed with SIGKILL while it writes its step-4 checkpoint, then run again (= the
    uninterrupted run, bit for bit). The two runs after the first take their compiled step from the persistent
    cache."""
    one, killed = tmp_path / "1x4", tmp_path / "1x4-killed"
    run(one, env, (1, 4))
    assert any("gate" in k for k in summary(one)["params_fingerprint"])  # a Llama's tree: SwiGLU's gate
    out = run(killed, env, (1, 4), hooks={"JDP_TEST_KILL": "4:save"})
    # orbax finished step 2's checkpoint before it started step 4's, which is never seen (atomic)
    assert out.returncode != 0 and ckpt_steps(killed) == [2], (ckpt_steps(killed), out.stderr[-3000:])
    out = run(killed, env, (1, 4))
    assert "resuming from the checkpoint at step 2" in out.stdout
    assert summary(killed)["params_sha256"] == summary(one)["params_sha256"]  # bit-identical parameters
    assert [(r["step"], r["loss"]) for r in metrics(killed)] == [(r["step"], r["loss"]) for r in metrics(one)]
    assert [r["step"] for r in metrics(one)] == [1, 2, 3, 4]
