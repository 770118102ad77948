"""The examples as users run them: `python examples/classifier.py` on 1 device and on 2 processes x 2 devices
(`jdp launch -- python ...`) trains the same model (global batch statistics, row-keyed dropout); killed with SIGKILL
and run again it ends with the parameters of an uninterrupted run (its BatchNorm statistics and dropout keys
included). A 2 x 2 job killed and run again: test_faults.py's test_sigkill_then_resume_is_bit_identical."""

import json
import os
import subprocess
import sys
from pathlib import Path

import inject
import pytest

from jdp.metrics import read_metrics

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
STEPS = ["--steps", "24", "--ckpt-every", "8"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return {**os.environ, "JDP_CACHE": str(tmp_path_factory.mktemp("cache")), "PYTHONUNBUFFERED": "1"}


def classifier(run_dir, env, layout=(1, 4), hooks=None, check=True, script="classifier.py", args=STEPS):
    """The example as one process with N devices, or through `jdp launch` as P processes x D devices."""
    nproc, devices = layout
    cmd = [sys.executable, str(ROOT / "examples" / script), "--run-dir", str(run_dir), *args]
    if hooks:  # faults to inject: the tests' own callback (tests/inject.py), given as a config override
        env, override = inject.register(env, **hooks)
        cmd.append(override)
    env = {**env, "JAX_PLATFORMS": "cpu"}
    if nproc == 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    else:
        launch = ["-m", "jdp.cli", "launch", "--nproc-per-node", str(nproc), "--devices-per-proc", str(devices)]
        cmd = [sys.executable, *launch, "--grace-s", "20", "--", *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=420, cwd=ROOT)
    if check:
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out


def summary(run_dir) -> dict:
    return json.loads((Path(run_dir) / "summary.json").read_text())


def losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(Path(run_dir) / "metrics.jsonl") if "loss" in r}


@pytest.fixture(scope="module")
def one(env, made_once):
    return made_once("classifier-one", lambda d: classifier(d / "run", env, (1, 1))) / "run"


def test_one_device_and_four_train_the_same_classifier(one, env, tmp_path):
    """The four devices on 2 processes x 2 (through `jdp launch`): BatchNorm's statistics over both processes' rows
    and the devices' within each, every row's dropout mask the one it has on one device."""
    classifier(tmp_path / "four", env, (2, 2))
    four, single = summary(tmp_path / "four"), summary(one)
    assert four["devices"] == 4 and single["devices"] == 1
    assert four["loss"] == pytest.approx(single["loss"], rel=1e-5)
    assert four["eval_loss"] == pytest.approx(single["eval_loss"], rel=1e-5)
    assert losses(tmp_path / "four").keys() == losses(one).keys()
    for step, loss in losses(tmp_path / "four").items():
        assert loss == pytest.approx(losses(one)[step], rel=1e-5), step
    assert single["loss"] < losses(one)[10]  # it learns


def test_killed_and_run_again_ends_like_an_uninterrupted_run(one, env, tmp_path):
    # SIGKILL just after the save of step 16 started (which first waited for step 8's): 16 is left half-written
    killed = classifier(tmp_path / "run", env, (1, 1), hooks={"JDP_TEST_KILL": "16:save"}, check=False)
    assert killed.returncode != 0
    assert [int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit()] == [8]
    again = classifier(tmp_path / "run", env, (1, 1))
    assert "resuming from the checkpoint at step 8" in again.stdout
    assert summary(tmp_path / "run")["params_sha256"] == summary(one)["params_sha256"]
    assert losses(tmp_path / "run") == losses(one)


def test_the_regression_example_learns(env, tmp_path):
    out = classifier(tmp_path / "reg", env, (1, 2), script="regression.py", args=["--steps", "300"])
    assert "regression: mean squared error" in out.stdout
    # the target's variance is 0.61 (a model predicting the mean); the MLP fits it to about 0.005
    assert summary(tmp_path / "reg")["loss"] < 0.05 and summary(tmp_path / "reg")["eval_loss"] < 0.05
