"""Run directories written by an earlier jdp resume under this one bit for bit.

tests/data/run-before-redesign/ was written by main before the model families moved into jdp/models/ (commit
b30014c): a GPT trained 8 steps on its own small corpus with checkpoints at 4 and 8; the step-8 checkpoint, the
summary and the metrics after step 4 were then removed. expected.json holds that uninterrupted run's losses and its
final parameters' digest. Resuming from step 4 here must give the same, to the bit. Pinned again once, where a change
moved the update's arithmetic on purpose (issue 44: the in-place update moved the parameters in the last bit, the
training losses stayed equal; expected.json's "repinned" says what moved and keeps the old numbers). XLA's
arithmetic moves between jaxlib releases too (0.12.1: the same losses, the update fused otherwise), and between CPUs
with and without AVX-512: the step-8 pins are per jaxlib and CPU kind (pin_key), and one with none compares to
float32 rounding.
"""

import json
import math
import os
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

FIXTURE = Path(__file__).resolve().parent / "data" / "run-before-redesign"
ARGS = ["train", "tiny", "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.max_seq_len=32",
        "data.seq_len=32", "data.source=corpus", "data.val_tokens=512", "train.batch_size=8", "train.steps=8",
        "train.ckpt_every=4", "train.log_every=1", "train.eval_every=4", "train.progress=false",
        "train.tensorboard=false", "train.run_dir=run"]  # fmt: skip


@pytest.mark.slow
def test_a_run_written_before_the_redesign_resumes_bit_for_bit(tmp_path):
    shutil.copytree(FIXTURE, tmp_path, dirs_exist_ok=True)
    expected = json.loads((tmp_path / "expected.json").read_text())
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu",
           "JDP_CACHE": str(tmp_path / "cache")}  # fmt: skip
    out = subprocess.run([sys.executable, "-m", "jdp.cli", *ARGS], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resuming from the checkpoint at step 4" in out.stdout + out.stderr
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = {str(r["step"]): r["loss"] for r in records if "loss" in r}
    evals = {str(r["step"]): r["eval_loss"] for r in records if "eval_loss" in r}
    # steps 1-4 kept from before, 5-8 computed now: equal to the bit on the jaxlibs pinned (the reading is what is
    # tested: a leaf, a moment or the data position read wrong moves them far more than float32 rounding)
    pinned = expected["at_8"].get(pin_key())
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    print(f"{pin_key()}: eval loss at 8 {evals.get('8')!r}, params_sha256 {summary['params_sha256']}")
    if pinned is None:
        print(f"{pin_key()} has no pin: the losses and the eval loss to float32 rounding")
        assert losses.keys() == expected["losses"].keys()
        assert all(math.isclose(losses[k], v, rel_tol=1e-6) for k, v in expected["losses"].items()), losses
        assert math.isclose(evals.pop("8"), expected["at_8"]["0.12.0.1"]["eval_loss"], rel_tol=1e-6)
        assert evals == expected["eval_losses"]
        return
    assert losses == {**expected["losses"], **pinned.get("losses", {})}
    assert evals == {**expected["eval_losses"], "8": pinned["eval_loss"]}
    assert summary["params_sha256"] == pinned["params_sha256"]


def pin_key() -> str:
    """The pins' key: the jaxlib, and " avx2" on a CPU without AVX-512 (XLA:CPU's kernels, and so the last bits of
    the steps computed here, differ between the two: an AVX2-only AMD EPYC's step-5 loss is 8e-8 off a Zen 4's)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        flags = "avx512f"
    return version("jaxlib") + ("" if "avx512f" in flags else " avx2")
