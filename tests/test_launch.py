"""`jdp launch` with real processes: exact training across process layouts, and failures that never hang."""

import json
import os
import signal
import subprocess
import sys
import time

import inject
import psutil
import pytest
from test_faults import DDP, JOB, SMALL, launched_2x2, run, summary

from jdp.job.xla import SCRATCH_LATE
from jdp.metrics import read_metrics

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return {**os.environ, "JDP_CACHE": str(tmp_path_factory.mktemp("cache")), "PYTHONUNBUFFERED": "1"}


def jdp(args, env, timeout=400, **kw):
    return subprocess.run(
        [sys.executable, "-m", "jdp.cli", *args], capture_output=True, text=True, env=env, timeout=timeout, **kw
    )


def test_launch_layouts_train_exactly_like_one_process(tmp_path, env, reference_runs, made_once):
    """launch-2x2 (docs/multihost.md's first command, with test_faults' small model and job): 2 x 2 = 1 x 4 = one
    device (`jdp train` on a machine with one: the same global batch, every loss and grad_norm and the final
    eval_loss to 1e-5, the final parameters leaf by leaf). Both references are shared: the 1 x 4 run with test_zero1
    and test_fsdp, the 2 x 2 run with test_faults' kill. Processes of one device each: 2 x 1 = 1 x 4 in
    test_faults' restore (after a checkpoint at step 4), 4 x 1 on one host = 2 hosts x 2 in test_hosts (4 x 1
    here cost CI ~70 s of four processes' start-up)."""
    base = reference_runs("ddp", DDP)
    one = tmp_path / "1x1"
    one_out = run(one, {**env}, (1, 1), JOB)
    two, two_out = launched_2x2(made_once, env)
    for out in (one_out.stdout + one_out.stderr, two_out):
        assert SCRATCH_LATE not in out  # malloc set before any thread: no page faults every step
    assert "[rank 0] jdp | process 0 of" in two_out  # every line carries its rank
    assert "jdp | model" not in two_out.replace("[rank 0] jdp | model", "")  # one voice: rank 0 only
    assert "[Gloo] Rank" not in two_out  # gloo's "Rank 0 is connected" per process: dropped
    base_metrics, base_summary = read_metrics(base / "metrics.jsonl"), summary(base)
    for d, (nproc, devices_each) in [(one, (1, 1)), (two, (2, 2))]:
        metrics, s = read_metrics(d / "metrics.jsonl"), summary(d)
        assert s["devices"] == nproc * devices_each and (nproc == 1 or f"of {nproc}" in s["world"])
        assert [r["step"] for r in metrics] == [r["step"] for r in base_metrics]
        assert any("eval_loss" in r for r in base_metrics)
        for a, b in zip(base_metrics, metrics, strict=True):
            for key in ("loss", "grad_norm", "eval_loss"):
                if key in a:
                    assert abs(a[key] - b[key]) <= 1e-5 * abs(a[key]), (nproc, key, a, b)
        # Final parameters, leaf by leaf: the norm, and the projection on a fixed Gaussian vector, which is
        # within 6 |a - b| of zero for any difference a - b, so a mismatch above 1e-5 relative would show.
        for name, (_, norm_a, proj_a) in base_summary["params_fingerprint"].items():
            _, norm_b, proj_b = s["params_fingerprint"][name]
            assert abs(norm_a - norm_b) <= 1e-5 * norm_a, name
            assert abs(proj_a - proj_b) <= 6e-5 * norm_a, name


@pytest.fixture
def launched():
    """Launchers started by a test; whatever is left of them and their workers is killed afterwards."""
    procs = []
    yield procs
    for p in procs:
        if p.poll() is None:
            for child in psutil.Process(p.pid).children(recursive=True):
                child.kill()
            p.kill()
            p.wait()


def start_launch(tmp_path, env, launched, nproc=2, extra=()):
    args = [sys.executable, "-m", "jdp.cli", "launch", "--nproc-per-node", str(nproc), "--grace-s", "3", *extra, "--"]
    args += ["train", "configs/tiny.yaml", *FAULTS_RUN, "train.steps=100000"]  # the small model: compiled once
    args += [f"train.run_dir={tmp_path / 'long'}", "parallel.heartbeat_timeout_s=10"]
    launched.append(subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return launched[-1]


def wait_for_training(tmp_path, launcher, timeout=180):
    metrics = tmp_path / "long" / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert launcher.poll() is None, launcher.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "training never started"
        time.sleep(0.5)
    workers = psutil.Process(launcher.pid).children(recursive=True)
    assert len([w for w in workers if "jdp.cli" in " ".join(w.cmdline())]) == 2
    return workers


def worker_with_rank(workers, rank):
    return next(
        w for w in workers if w.environ().get("JAX_PROCESS_ID") == str(rank) and "jdp.cli" in " ".join(w.cmdline())
    )


def assert_all_gone(workers):
    gone, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, [p.cmdline() for p in alive]


@pytest.mark.alone
def test_killed_worker_stops_the_job_within_a_minute_and_is_named(tmp_path, env, launched):
    launcher = start_launch(tmp_path, env, launched)
    workers = wait_for_training(tmp_path, launcher)
    victim = worker_with_rank(workers, 1)
    killed_at = time.monotonic()
    victim.send_signal(signal.SIGKILL)
    _, err = launcher.communicate(timeout=60)
    assert time.monotonic() - killed_at < 60
    assert launcher.returncode != 0
    assert "worker rank 1" in err and "SIGKILL" in err, err[-3000:]
    assert_all_gone(workers)


@pytest.mark.alone
def test_sigterm_to_the_launcher_reaches_every_worker(tmp_path, env, launched):
    launcher = start_launch(tmp_path, env, launched)
    workers = wait_for_training(tmp_path, launcher)
    launcher.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=60)
    assert "passing it to the workers" in err
    assert_all_gone(workers)


def test_max_restarts_restarts_the_group_then_gives_up(tmp_path, env):
    out = jdp(
        ["launch", "--nproc-per-node", "2", "--max-restarts", "1", "--", "train", "train.steps=-1"], env, timeout=120
    )
    assert out.returncode != 0
    assert out.stderr.count("started ranks [0, 1] of 2") == 2
    assert "restarting the group (restart 1 of 1)" in out.stderr and "giving up" in out.stderr
    assert "train.steps=-1 must be positive" in out.stderr  # the worker's own error, prefixed by its rank


@pytest.mark.alone
@pytest.mark.parametrize("present, words", [(0, "all 2 processes to register"), (1, "the coordinator (process 0)")])
def test_a_worker_that_never_arrives_is_a_clear_error_within_the_timeout(tmp_path, env, present, words):
    # Only one of the job's two processes is ever started.
    penv = {**env, "JAX_COORDINATOR_ADDRESS": "127.0.0.1:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(present)}
    if present == 0:
        from jdp.job.launch import free_port

        penv["JAX_COORDINATOR_ADDRESS"] = f"127.0.0.1:{free_port()}"
    start = time.monotonic()
    out = jdp(["train", "parallel.init_timeout_s=5", f"train.run_dir={tmp_path / 'x'}"], penv, timeout=90)
    assert out.returncode != 0
    assert time.monotonic() - start < 60
    assert words in out.stderr and "phase: initialization" in out.stderr and "after 5 s" in out.stderr, out.stderr[
        -2000:
    ]


def test_launch_refuses_bad_options(env):
    out = jdp(["launch", "--nproc-per-node", "2", "--nnodes", "2", "--", "train"], env, timeout=60)
    assert out.returncode == 2 and "--coordinator" in out.stderr
    out = jdp(["launch", "--nproc-per-node", "2"], env, timeout=60)
    assert out.returncode == 2 and "nothing to launch" in out.stderr
    env_gpus = {**env, "CUDA_VISIBLE_DEVICES": "0,1,2"}
    out = jdp(["launch", "--nproc-per-node", "2", "--", "train"], env_gpus, timeout=60)
    assert out.returncode == 2 and "3 GPUs do not split evenly" in out.stderr
    # --live (docs/live.md): members are `jdp train`; several nodes need where the Lighthouse is
    out = jdp(["launch", "--live", "--nproc-per-node", "2", "--", "plot", "runs/x"], env, timeout=60)
    assert out.returncode == 2 and "--live starts `jdp train` members" in out.stderr, out.stderr[-2000:]
    out = jdp(["launch", "--live", "--nproc-per-node", "2", "--nnodes", "2", "--", "train"], env, timeout=60)
    assert out.returncode == 2 and "--coordinator HOST:PORT (where node 0 starts the Lighthouse" in out.stderr
    out = jdp(["launch", "--live", "--nproc-per-node", "2", "--min-members", "0", "--", "train"], env, timeout=60)
    assert out.returncode == 2 and "--min-members 0" in out.stderr, out.stderr[-2000:]


def test_launch_names_the_option_that_is_wrong_first(env):
    """`--nproc-per-node 0` led with `--node-rank 0 must be in [0, --nnodes 1)`, which was right."""
    out = jdp(["launch", "--nproc-per-node", "0", "--", "train"], env, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1].startswith("jdp launch: error: --nproc-per-node 0: start at least 1")
    assert "--node-rank" not in out.stderr
    out = jdp(["launch", "--nproc-per-node", "1", "--node-rank", "3", "--", "train"], env, timeout=60)
    assert out.returncode == 2 and "--node-rank 3 must be in [0, --nnodes 1)" in out.stderr, out.stderr[-2000:]


def test_cpu_workers_get_disjoint_core_sets():
    from jdp.job.launch import cpu_groups

    cores = sorted(os.sched_getaffinity(0))
    groups = cpu_groups(len(cores))
    assert groups is not None and len(groups) == len(cores)
    assert set().union(*groups) == set(cores) and all(len(g) == 1 for g in groups)
    assert cpu_groups(len(cores) + 1) is None  # fewer cores than workers: no pinning


def test_gloos_connected_lines_are_dropped_even_when_two_clients_interleave_them():
    """gloo's C++ writes its "connected" line in pieces; two CPU clients in one process interleave them (seen in CI:
    "[Gloo] Rank [Gloo] Rank 0 is connected ..." and then "0 is connected ..."). Every such line is dropped; a line
    with anything else in it is kept."""
    from jdp.job.launch import _gloo_noise

    whole = b"[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1"
    interleaved = [b"[Gloo] Rank [Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1",
                   b"0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1",
                   b"[Gloo] Rank 0 is connected to 1[Gloo] Rank 1 is connected to 1",
                   b" peer ranks. Expected number of connected peer ranks is : 1",
                   # seen in CI (2026-12-07): the second client's "[Gloo] Rank" between the first's "peer ranks." and "Expected"
                   b"[Gloo] Rank 0 is connected to 1 peer ranks. [Gloo] Rank Expected number of connected peer ranks is"
                   b" : 01 is connected to"]  # fmt: skip
    assert _gloo_noise(whole) and all(_gloo_noise(line) for line in interleaved)
    for kept in [b"[Gloo] Rank 0: connection refused", b"12", b"", b"jdp | step 3", whole + b" jdp | model"]:
        assert not _gloo_noise(kept), kept


# test_faults' small model and settings: its 2 x 1 jobs and these compile the same step, cached for the session
FAULTS_RUN = SMALL


def _exited(p: psutil.Process) -> bool:
    """Gone, or a zombie: it has exited and holds nothing but its entry in the process table."""
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.alone
def test_workers_of_a_launcher_killed_with_sigkill_stop_at_an_agreed_step_within_seconds(tmp_path, env):
    d = tmp_path / "orphans"
    args = ["launch", "--nproc-per-node", "2", "--grace-s", "8", "--", "train", "configs/tiny.yaml", *FAULTS_RUN]
    args += ["train.steps=100000", "train.ckpt_every=0", f"train.run_dir={d}"]
    launcher = subprocess.Popen(
        [sys.executable, "-m", "jdp.cli", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    workers = []
    try:
        deadline = time.monotonic() + 180
        while not ((d / "metrics.jsonl").exists() and len(read_metrics(d / "metrics.jsonl")) >= 3):
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()[1][-3000:]
            time.sleep(0.3)
        workers = psutil.Process(launcher.pid).children(recursive=True)
        assert len(workers) >= 2
        launcher.kill()  # SIGKILL: no forwarding, and the workers' output pipes now lead nowhere
        launcher.wait()
        launcher.stdout.close()
        launcher.stderr.close()
        gone, alive = psutil.wait_procs(workers, timeout=10)
        alive = [p for p in alive if not _exited(p)]  # an orphan's exit is reaped by init, whenever it gets to it
        assert not alive, f"workers alive 10 s after their launcher was killed: {alive}"
        stopped = json.loads((d / "summary.json").read_text())  # and they stopped cleanly, with a checkpoint
        assert stopped["preempted"] and (d / "checkpoints" / str(stopped["steps"])).is_dir()
    finally:
        for p in [launcher, *workers]:
            try:
                p.kill()
            except (ProcessLookupError, psutil.NoSuchProcess):
                pass


def test_a_process_that_leaves_outside_a_step_is_named_by_the_others_within_seconds(tmp_path, env, spawn):
    """No launcher to stop the others: the process that fails says so in the job's key-value store, and the
    others stop (non-zero) naming it and its phase, instead of waiting for it in a collective or a barrier.
    Process 0 (the coordinator) leaves while saving (a callback's phase: the other waits in the checkpoint's
    barrier); process 1 while logging (the step's phase: the other waits in the next step's collective). An error
    while evaluating is a callback's phase as saving is (it cost CI another ~30 s job)."""
    for where, pid in [("save", 0), ("log", 1)]:
        d = tmp_path / f"{where}-{pid}"
        argv = ["-m", "jdp.cli", "train", "configs/tiny.yaml", *FAULTS_RUN, "train.steps=100000", f"train.run_dir={d}"]
        argv += ["train.ckpt_every=5", "train.eval_every=5", "data.val_tokens=4096"]
        start = time.monotonic()
        faulty, override = inject.register(env, JDP_TEST_FAIL=f"5:{where}:{pid}")
        results = spawn([*argv, override], 2, 1, env=faulty, timeout=240)
        assert time.monotonic() - start < 200
        phase = {"save": "saving the checkpoint at step 5", "log": "running step 5", "eval": "evaluating at step 5"}
        # Process 0 may be aborted by JAX as its peers go, after its own message.
        assert results[pid][0] != 0 and f"failed while {phase[where]}" in results[pid][2], results[pid][2][-2000:]
        other = results[1 - pid]
        assert other[0] != 0
        assert f"process {pid} failed while {phase[where]}" in other[2], other[2][-2000:]
        # The bound docs/faults.md promises (<= 60 s, parallel.heartbeat_timeout_s's default is 30): measured here.
        apart = abs(results.ended[1 - pid] - results.ended[pid])
        print(f"{where}, process {pid} leaves: the other exits {apart:.1f} s apart")
        assert apart < 60


def test_a_worker_runs_a_jdp_command_or_a_script_with_the_launchers_python():
    from jdp.job.launch import worker_argv

    assert worker_argv(["train", "tiny"]) == [sys.executable, "-m", "jdp.cli", "train", "tiny"]
    assert worker_argv(["python", "x.py", "--a"]) == [sys.executable, "x.py", "--a"]
    assert worker_argv(["x.py"]) == [sys.executable, "x.py"]
    assert worker_argv(["./run.sh", "1"]) == ["./run.sh", "1"]
