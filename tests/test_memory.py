"""The memory check: a run too large is refused before anything is allocated, with what would fit instead."""

import json
import os
import re
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from jdp import memory, parallel, plan
from jdp.config import ConfigError, load_config, validate

TINY = ["train.batch_size=32"]  # 8 sequences per device on the tests' 4 devices
# About 103 billion parameters: 1.7 TB per device, 6.6 TB for a process's 4 simulated CPU devices.
HUGE = ["model.d_model=16384", "model.n_layers=32", "model.n_heads=32"]
ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "JAX_PLATFORMS": "cpu"}
# `jdp train` with at most 4 GiB of data: one that allocated the model after all fails there (exit 1) instead of
# reaching the machine's OOM killer.
GUARDED_JDP = [
    "-c",
    "import resource, sys; resource.setrlimit(resource.RLIMIT_DATA, (4 << 30, 4 << 30)); "
    "from jdp.cli import main; sys.exit(main())",
]


@pytest.mark.slow
def test_a_model_too_large_is_refused_before_anything_is_allocated(tmp_path):
    cfg = load_config("tiny", HUGE)
    need = 4 * plan.device_memory(cfg, 4, 8, fused=False).total  # the planner's numbers, from shapes
    if (host := memory.host_available_bytes()) is None or host >= need:
        pytest.skip(f"this host has {host} bytes available: the model would fit")
    env = {**os.environ, **ENV, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JDP_CACHE": str(tmp_path)}
    args = ["train", "tiny", *HUGE, f"train.run_dir={tmp_path / 'run'}"]
    started = time.monotonic()
    # Linux counts a forked child's copy of its parent in the child's peak resident memory (kept across exec), and
    # this pytest process may be large: a small Python process starts `jdp train` and reports its peak.
    measure = (
        "import json, os, subprocess, sys; "
        "p = subprocess.Popen(sys.argv[3:], stdout=open(sys.argv[1], 'w'), stderr=open(sys.argv[2], 'w')); "
        "_, status, usage = os.wait4(p.pid, 0); "
        "print(json.dumps([os.waitstatus_to_exitcode(status), usage.ru_maxrss]))"
    )
    cmd = [sys.executable, "-c", measure, str(tmp_path / "out"), str(tmp_path / "err"), sys.executable, *GUARDED_JDP]
    code, maxrss = json.loads(subprocess.run([*cmd, *args], env=env, capture_output=True, text=True).stdout)
    took, stderr = time.monotonic() - started, (tmp_path / "err").read_text()
    assert code == 2, stderr[-3000:]
    assert stderr.startswith("jdp: error: this run does not fit in memory: each device needs ")
    assert f"needs {memory._gb(need / 4)} (parameters " in stderr  # the planner's bytes per device
    assert f"{memory._gb(need)} for this process's 4 devices" in stderr  # simulated devices share the host
    for text in ("Nothing was allocated", "train a smaller model", "train.memory_check=false starts anyway"):
        assert text in stderr
    assert "Traceback" not in stderr
    assert (tmp_path / "out").read_text() == ""  # refused before the banner
    assert took < 120  # imports and a shape trace; allocating 6.6 TB would never end (or end at the 4 GiB limit)
    assert maxrss * 1024 < 2e9  # kilobytes on Linux: the interpreter and JAX, not the model


@pytest.mark.slow
def test_every_process_of_a_job_refuses_and_none_hangs(spawn, tmp_path):
    env = {**ENV, "JDP_CACHE": str(tmp_path)}
    argv = [*GUARDED_JDP, "train", "tiny", *HUGE, "train.batch_size=8", f"train.run_dir={tmp_path / 'run'}"]
    results = spawn(argv, 2, 2, env=env, timeout=240)
    for code, _, err in results:
        assert code == 2 and "this run does not fit in memory" in err and "Traceback" not in err, err[-3000:]
    assert max(results.ended) - min(results.ended) < 60


def _setup(overrides: list[str]):
    cfg = load_config("tiny", [*TINY, *overrides])
    mesh = parallel.make_mesh()
    return cfg, validate(cfg, mesh.devices.size), mesh


def _one_gpu(available: int, larger: int | None = None) -> memory.Pool:
    return memory.Pool(4, False, available, "free on a test device", larger)


def test_memory_check_false_skips_the_check():
    cfg, derived, mesh = _setup([])
    with pytest.raises(ConfigError, match="(?s)does not fit in memory.*train.memory_check=false starts anyway"):
        memory.check_memory(cfg, derived, mesh, _one_gpu(1))
    cfg, derived, mesh = _setup(["train.memory_check=false"])
    assert memory.check_memory(cfg, derived, mesh, _one_gpu(1)) is None


def test_a_tiny_run_fits_this_machine():
    cfg, derived, mesh = _setup([])
    pool = memory.local_pool(jax.local_devices())
    assert pool.shared and pool.devices == 4 and pool.available > 0
    assert memory.check_memory(cfg, derived, mesh) is None


def _fits(overrides: list[str], pool: memory.Pool) -> bool:
    cfg, derived, _ = _setup(overrides)
    return memory.refusal(cfg, derived, pool, "cpu") is None


def test_what_would_fit_is_computed():
    cfg, derived, _ = _setup([])
    state = plan.abstract_state(cfg)
    ddp = plan.device_memory(cfg, 4, 8, False, state=state)
    zero1 = plan.device_memory(cfg, 4, 8, False, "zero1", state)
    pool = _one_gpu(zero1.total)  # zero1 fits exactly, ddp does not
    text = memory.refusal(cfg, derived, pool, "cpu")
    assert f"each device needs {memory._gb(ddp.total)}" in text
    assert (
        f"parallel.strategy=zero1 (each device keeps 1/4 of the optimizer state, {memory._gb(zero1.opt_state)})" in text
    )
    batch = int(re.search(r"train\.batch_size=(\d+)", text)[1])
    accum = int(re.search(r"train\.grad_accum=(\d+)", text)[1])
    assert _fits([f"train.batch_size={batch}"], pool) and not _fits([f"train.batch_size={batch + 4}"], pool)
    assert _fits([f"train.grad_accum={accum}"], pool)
    assert not any(_fits([f"train.grad_accum={k}"], pool) for k in range(2, accum) if 8 % k == 0)

    smaller = _one_gpu(zero1.total - 1)  # zero1 alone no longer fits: not suggested
    text = memory.refusal(cfg, derived, smaller, "cpu")
    assert "parallel.strategy=zero1 (" not in text and "train.batch_size=" in text
    fixed = ddp.with_activations(0).total  # the state, and the bucket in flight at the end of backward
    # ddp's state alone fills the device: fsdp, which splits it, is what would fit (with a smaller batch here)
    split = memory.refusal(cfg, derived, _one_gpu(fixed), "cpu")
    assert "What would fit" in split and "parallel.strategy=fsdp" in split
    fsdp = plan.device_memory(cfg, 4, 8, False, "fsdp", state)
    hopeless = memory.refusal(cfg, derived, _one_gpu(fsdp.with_activations(0).total), "cpu")  # fsdp's state too
    assert "What would fit" not in hopeless and f"alone need {memory._gb(fixed)}" in hopeless
    assert memory.refusal(cfg, derived, _one_gpu(ddp.total), "cpu") is None
    # Neither zero1 nor a smaller batch alone: the two together, one sequence per device.
    both = _one_gpu(zero1.with_activations(plan.activation_bytes(cfg, 1, False)).total)
    text = memory.refusal(cfg, derived, both, "cpu")
    assert "parallel.strategy=zero1 train.batch_size=4 (1 sequence(s) per device" in text
    assert _fits(["parallel.strategy=zero1", "train.batch_size=4"], both) and not _fits(["train.batch_size=4"], both)


def test_dp_counts_its_master():
    cfg, derived, _ = _setup(["parallel.strategy=dp"])
    master = plan.device_memory(cfg, 4, 8, False)
    assert master.grads == 4 * master.params  # every device's gradients, gathered
    other = master.total - master.opt_state - master.grads + master.params  # no optimizer state, own gradients
    host = memory.Pool(4, True, 1, "on a test host")
    assert f"dp's master device needs {memory._gb(master.total)}" in memory.refusal(cfg, derived, host, "cpu")
    assert f"{memory._gb(master.total + 3 * other)} for this process's 4 devices" in memory.refusal(
        cfg, derived, host, "cpu"
    )
    ddp = plan.device_memory(cfg, 4, 8, False, "ddp")
    text = memory.refusal(cfg, derived, _one_gpu(ddp.total), "cpu")
    assert "parallel.strategy=ddp (no master gathers every device's gradients)" in text


def test_cpu_devices_share_the_host():
    cfg, derived, _ = _setup([])
    per_device = plan.device_memory(cfg, 4, 8, False).total
    host = memory.Pool(4, True, 3 * per_device, "on a test host")  # three devices' worth for four
    text = memory.refusal(cfg, derived, host, "cpu")
    assert f"{memory._gb(4 * per_device)} for this process's 4 devices" in text
    assert memory.refusal(cfg, derived, memory.Pool(4, True, 4 * per_device, "on a test host"), "cpu") is None


class FakeGpu:
    platform, device_kind = "gpu", "NVIDIA H100 80GB HBM3"

    def __init__(self, limit: int, in_use: int):
        self.stats = {"bytes_limit": limit, "bytes_in_use": in_use}

    def memory_stats(self):
        return self.stats


def test_a_gpu_has_what_its_pool_has_and_more_with_a_larger_fraction(monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    pool = memory.local_pool([FakeGpu(60_000, 1_000), FakeGpu(60_000, 3_000)])
    assert (pool.available, pool.larger, pool.shared) == (57_000, 76_000 - 3_000, False)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", ".9")
    assert memory.local_pool([FakeGpu(60_000, 0)]).larger is None  # the user chose the fraction
    cfg, derived, _ = _setup(["model.dtype=bfloat16"])
    m = plan.device_memory(cfg, 4, 8, fused=True)  # "auto" attention is cuDNN's on a GPU
    text = memory.refusal(cfg, derived, _one_gpu(m.total - 1, larger=m.total), "gpu")
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 in the environment" in text
    assert memory.refusal(cfg, derived, _one_gpu(m.total), "gpu") is None


def test_host_memory_is_the_tighter_of_meminfo_and_the_cgroup_limit(tmp_path):
    proc, cgroups = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal: 32000000 kB\nMemAvailable:   20000000 kB\n")
    (proc / "self" / "cgroup").write_text("0::/job/step\n")
    assert memory.host_available_bytes(proc, cgroups) == 20_000_000 * 1024  # no cgroup files: MemAvailable
    step, job = cgroups / "job" / "step", cgroups / "job"
    step.mkdir(parents=True)
    (step / "memory.max").write_text("max\n")
    (step / "memory.current").write_text("1000000000\n")
    (job / "memory.max").write_text("8000000000\n")  # the parent's limit binds
    (job / "memory.current").write_text("3000000000\n")
    assert memory.host_available_bytes(proc, cgroups) == 5_000_000_000
    (job / "memory.stat").write_text("anon 2000000000\ninactive_file 1000000000\n")  # cache it can drop
    assert memory.host_available_bytes(proc, cgroups) == 6_000_000_000
    (proc / "self" / "cgroup").write_text("4:memory:/docker/abc\n1:cpu:/\n")  # cgroup v1
    v1 = cgroups / "memory" / "docker" / "abc"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text("4000000000\n")
    (v1 / "memory.usage_in_bytes").write_text("500000000\n")
    assert memory.host_available_bytes(proc, cgroups) == 3_500_000_000
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert memory.host_available_bytes(proc, cgroups) == 20_000_000 * 1024


def test_a_process_that_fits_refuses_when_another_does_not(monkeypatch):
    cfg, derived, mesh = _setup([])
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(memory.multihost_utils, "process_allgather", lambda x: np.array([0, 1], np.int32))
    with pytest.raises(ConfigError, match=r"process\(es\) 1 cannot hold this run"):
        memory.check_memory(cfg, derived, mesh, _one_gpu(10**12))
