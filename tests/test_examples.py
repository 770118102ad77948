"""The examples as users run them: `python examples/classifier.py` on 1 and 4 devices trains the same model
(global batch statistics, row-keyed dropout); killed with SIGKILL and run again it ends with the parameters of an
uninterrupted run, on one process and on 2 processes x 2 devices (`jdp launch -- python ...`)."""

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
def four(env, made_once):
    return made_once("classifier-four", lambda d: classifier(d / "run", env, (1, 4))) / "run"


def test_one_device_and_four_train_the_same_classifier(four, env, tmp_path):
    classifier(tmp_path / "one", env, (1, 1))
    one, many = summary(tmp_path / "one"), summary(four)
    assert many["devices"] == 4 and one["devices"] == 1
    assert many["loss"] == pytest.approx(one["loss"], rel=1e-5)
    assert many["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-5)
    assert losses(four).keys() == losses(tmp_path / "one").keys()
    for step, loss in losses(four).items():
        assert loss == pytest.approx(losses(tmp_path / "one")[step], rel=1e-5), step
    assert one["loss"] < losses(four)[10]  # it learns


@pytest.mark.parametrize("layout", [(1, 4), (2, 2)], ids=["1x4", "2x2"])
def test_killed_and_run_again_ends_like_an_uninterrupted_run(four, env, tmp_path, layout):
    # SIGKILL just after the save of step 16 started (which first waited for step 8's): 16 is left half-written
    killed = classifier(tmp_path / "run", env, layout, hooks={"JDP_TEST_KILL": "16:save"}, check=False)
    assert killed.returncode != 0
    assert [int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit()] == [8]
    again = classifier(tmp_path / "run", env, layout)
    assert "resuming from the checkpoint at step 8" in again.stdout
    if layout == (1, 4):
        assert summary(tmp_path / "run")["params_sha256"] == summary(four)["params_sha256"]
    else:  # gloo sums in another order than one process's all-reduce: compare with 2 x 2 uninterrupted
        classifier(tmp_path / "whole", env, layout)
        assert summary(tmp_path / "run")["params_sha256"] == summary(tmp_path / "whole")["params_sha256"]
        assert summary(tmp_path / "run")["loss"] == pytest.approx(summary(four)["loss"], rel=1e-5)


def test_the_regression_example_learns(env, tmp_path):
    out = classifier(tmp_path / "reg", env, (1, 2), script="regression.py", args=["--steps", "300"])
    assert "regression: mean squared error" in out.stdout
    # the target's variance is 0.61 (a model predicting the mean); the MLP fits it to about 0.005
    assert summary(tmp_path / "reg")["loss"] < 0.05 and summary(tmp_path / "reg")["eval_loss"] < 0.05
