"""Tests run on 4 simulated CPU devices: forced here, before anything imports jax."""

import os

N_DEVICES = 4
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={N_DEVICES}"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
from jdp.job.xla import set_xla_flags  # noqa: E402  (imports jax, but touches no device yet)

set_xla_flags()  # as `jdp train` does: compiled steps keep jdp's gradient buckets
# Not keep_scratch_memory(): one malloc arena made this compile-heavy, many-threaded process ~30% slower
# (tests/test_parallel.py + test_train.py: 200 s against 154 s). `jdp train` processes the tests start use it.
# Many tests compile the same small steps in fresh processes: share compiled programs within the session.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jdp-test-xla-cache-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    # removed by the process that made it (xdist's workers inherit it and end first): ~85 MB a session otherwise
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

# A suite started as `cmd &` from a script (no job control) starts with SIGINT ignored, which every process it
# starts inherits and jdp then respects ("Ctrl-C is not for this process"): test_faults.py's Ctrl-C tests would
# fail. Caught here instead, the signal is back at its default in every process the tests start (exec resets it).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Every `jdp train` on CPU measures the host's matmul rate for MFU at start (half a second on every core, in each
# process): the tests' hundreds of processes take it from one measurement per pytest process instead.
if "JDP_CPU_PEAK_FLOPS" not in os.environ:
    os.environ["JDP_CPU_PEAK_FLOPS"] = subprocess.run(
        [sys.executable, "-c", "from jdp.metrics import measure_matmul_flops as m; print(repr(m()))"],
        capture_output=True, text=True, check=True, timeout=120,
    ).stdout.strip()  # fmt: skip
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from jdp.job.launch import free_port  # noqa: E402


def pytest_runtest_logreport(report):
    """JDP_TEST_TIMES=FILE: every phase's seconds appended to FILE (nodeid, phase, seconds; tab-separated), from
    the process that reports (with pytest-xdist, the controller): where CI's time goes, test by test."""
    if (path := os.environ.get("JDP_TEST_TIMES")) and "PYTEST_XDIST_WORKER" not in os.environ:
        with open(path, "a") as f:
            f.write(f"{report.nodeid}\t{report.when}\t{report.duration:.2f}\n")


class Results(list):
    ended: list[float]


def spawn_processes(
    argv: list[str], n_processes: int, devices_each: int, env: dict | None = None, timeout: float = 300
):
    """Run `python argv...` as n real processes of one jax.distributed job on 127.0.0.1; wait for all.

    Returns [(returncode, stdout, stderr)] by process id, with `.ended`: when each process exited
    (time.monotonic()). Every process is killed at the timeout.
    """
    port = free_port()
    procs = []
    for pid in range(n_processes):
        penv = {
            **os.environ,
            **(env or {}),
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices_each}",
            "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
            "JAX_NUM_PROCESSES": str(n_processes),
            "JAX_PROCESS_ID": str(pid),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, *argv], env=penv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    results, ended, outputs = Results(), [0.0] * len(procs), [None] * len(procs)

    def wait(i: int, p: subprocess.Popen) -> None:
        try:
            outputs[i] = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            outputs[i] = p.communicate()
        ended[i] = time.monotonic()

    threads = [threading.Thread(target=wait, args=(i, p), daemon=True) for i, p in enumerate(procs)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for p, (out, err) in zip(procs, outputs, strict=True):
            results.append((p.returncode, out, err))
        results.ended = ended
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


@pytest.fixture
def spawn():
    return spawn_processes


@pytest.fixture(scope="session")
def made_once(tmp_path_factory):
    """made_once(name, make) -> the directory `make(path)` filled, made once per test session however many
    pytest-xdist workers ask (the first makes it under their common base directory, holding a lock; the others wait
    for it and read it): a module fixture's runs are not done again on the other core. Tests copy what they would
    change. Without xdist, the session's own base directory."""
    import fcntl
    import shutil

    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base

    def get(name: str, make) -> Path:
        path, done = root / f"once-{name}", root / f"once-{name}.done"
        with open(root / f"once-{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also when a worker dies
            if not done.exists():
                shutil.rmtree(path, ignore_errors=True)
                path.mkdir()
                make(path)
                done.touch()
        return path

    return get


@pytest.fixture(scope="session")
def reference_runs(tmp_path_factory, made_once):
    """reference_runs(name, extra) -> the run directory of an uninterrupted 8-step `jdp train` run on 1 process x
    4 devices, checkpointing every 4 steps, with `extra` overrides: made once per session, on one worker
    (test_zero1.py and test_fsdp.py continue from the same ddp run; tests copy a reference before changing
    anything)."""
    import hashlib

    from test_faults import run

    env = {**os.environ, "JDP_CACHE": str(tmp_path_factory.mktemp("reference-cache")), "PYTHONUNBUFFERED": "1"}

    def get(name: str, extra: list[str]):
        key = hashlib.sha256(repr(tuple(extra)).encode()).hexdigest()[:8]
        return made_once(f"reference-{name}-{key}",
                         lambda d: run(d, env, (1, 4), ["train.steps=8", "train.ckpt_every=4", *extra]))  # fmt: skip

    return get
