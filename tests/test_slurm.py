"""jdp under real SLURM (a one-node cluster of our own, tests/slurm.py): `srun` and `sbatch scripts/slurm.sbatch`
start real `jdp train` jobs that find their world from SLURM's variables; `scancel` and a killed task stop them.

Every run is the same 2-process x 2-CPU-device training (RUN below), so the compiled step is shared through the
module's jdp cache and the srun run is the uninterrupted reference for the preempted and resumed sbatch runs.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import pytest
from slurm import KILL_WAIT_S, Cluster, unavailable

from jdp.metrics import read_metrics

_why_not = unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.alone, pytest.mark.skipif(_why_not is not None, reason=str(_why_not))]

REPO = Path(__file__).resolve().parents[1]
JDP = Path(sys.executable).parent / "jdp"  # the console script of the running venv
STEPS = 32  # room for two stops: each comes a few steps after its scancel, on any CPU
RUN = ["configs/tiny.yaml", f"train.steps={STEPS}", "train.progress=false", "train.log_every=1", "train.eval_every=8"]
# A smaller model than tiny's: compiling and starting dominate these runs (as in tests/test_launch.py).
RUN += ["model.n_layers=2", "model.d_model=64", "model.max_seq_len=64", "data.seq_len=64", "data.val_tokens=4096"]
CPU_OVERRIDES = ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1"]  # what scripts/slurm.sbatch documents
# Metrics that are a function of the computation alone (not of the clock): equal bit for bit across resumes.
EXACT = ("loss", "grad_norm", "eval_loss", "lr", "tokens", "epoch", "skipped_steps", "skipped_total")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with Cluster(tmp_path_factory.mktemp("slurm")) as c:
        yield c


@pytest.fixture(scope="module")
def env(cluster, made_once):
    """What the jobs are submitted with: the cluster's clean environment (no JAX_*, MASTER_*, SLURM_* of the
    test process), this venv's jdp first on PATH, and 2 simulated CPU devices per process (sbatch and srun hand
    the submitting environment to every task). The data tokenized once for the session's `alone` tests of the same
    small model (test_hosts, test_k8s)."""
    return {
        **cluster.env,
        "PATH": f"{JDP.parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "JDP_CACHE": str(made_once("alone-jdp-cache", lambda d: None)),
        "PYTHONUNBUFFERED": "1",
        "JAX_PLATFORMS": "cpu",  # names no job; keeps a machine with a GPU plugin on the CPU like the rest of the suite
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
    }


def coordinator_port(job_id: str) -> int:
    """The port JAX's SLURM detection (and jdp) derive from the job id."""
    return int(job_id) % 2**12 + (65535 - 2**12 + 1)


def slurm_lines(text: str, also: tuple[str, ...] = ()) -> str:
    """What SLURM itself (srun, slurmstepd) printed into a job's output, indented, for the test's log."""
    return "".join(f"    {ln}\n" for ln in text.splitlines() if ln.startswith(("srun", "slurmstepd", *also)))


def exact(records: list[dict]) -> list[tuple]:
    """Each training or evaluation record's step and deterministic values (a stopped run's goodput record, the
    only other kind, is left out: the uninterrupted run has none)."""
    return [(r["step"], *(r.get(k) for k in EXACT)) for r in records if "loss" in r or "eval_loss" in r]


@pytest.fixture(scope="module")
def srun_run(cluster, env, tmp_path_factory):
    """`srun -n 2 jdp train`, SLURM's variables alone describing the job: (output, metrics, summary)."""
    run_dir = tmp_path_factory.mktemp("srun") / "run"
    start = time.monotonic()
    out = subprocess.run(
        ["srun", "--kill-on-bad-exit=1", "-n", "2", str(JDP), "train", *RUN, f"train.run_dir={run_dir}"],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    print(f"srun -n 2 jdp train ({STEPS} steps): {time.monotonic() - start:.1f} s")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    return out, read_metrics(run_dir / "metrics.jsonl"), summary


def test_srun_trains_like_jdp_launch(srun_run, env, tmp_path):
    """`srun -n 2 jdp train` (SLURM's variables) and `srun -n 2 jdp launch` (a launcher task per node) train alike.
    What SLURM gives jdp is the world (processes, coordinator, devices), whatever the run does with it: DiLoCo on a
    world from a launcher trains bit for bit as under `jdp launch` in test_torchrun.py (torchrun's variables, JAX
    0.10) and test_hosts.py (a group per host across hosts), on 2 processes in test_diloco.py."""
    out, metrics, summary = srun_run
    m = re.search(r"process 0 of 2, coordinator (\S+):(\d+) \(from SLURM variables\)", out.stdout)
    assert m, out.stdout[-3000:]
    assert m.group(1) == socket.gethostname() and 65535 - 2**12 < int(m.group(2)) <= 65535, m.group(0)
    assert summary["devices"] == 4, "XLA_FLAGS did not reach both tasks: 2 processes x 2 CPU devices expected"

    # The same job as `jdp launch` run by srun: each task one node of the launch (nothing per task on the command
    # line), one worker of 2 CPU devices each, the job described to the workers by the launchers.
    launched = tmp_path / "launch"
    args = ["srun", "--kill-on-bad-exit=1", "-n", "2", str(JDP), "launch", "--nproc-per-node", "1",
            "--devices-per-proc", "2", "--", "train", *RUN]  # fmt: skip
    ref = subprocess.run(
        [*args, f"train.run_dir={launched}"], env=env, cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    for rank in (0, 1):
        assert f"from SLURM's job step: node {rank} of 2 (srun task {rank} of 2)" in ref.stderr, ref.stderr[-3000:]
    # the launchers describe the job to their workers (JAX_* variables), on the step's first node
    banner = rf"process 0 of 2, coordinator {re.escape(socket.gethostname())}:\d+ \(from JAX_\* variables\)"
    assert re.search(banner, ref.stdout), ref.stdout[-3000:]
    ref_metrics, ref_summary = (
        read_metrics(launched / "metrics.jsonl"),
        json.loads((launched / "summary.json").read_text()),
    )
    assert [r["step"] for r in metrics] == [r["step"] for r in ref_metrics]
    assert sorted({r["step"] for r in metrics}) == list(range(1, STEPS + 1))
    for a, b in zip(ref_metrics, metrics, strict=True):
        for key in ("loss", "grad_norm", "eval_loss"):
            assert (key in a) == (key in b), (key, a, b)
            if key in a:
                assert abs(a[key] - b[key]) <= 1e-5 * abs(a[key]), (key, a, b)
    for name, (_, norm_a, proj_a) in ref_summary["params_fingerprint"].items():
        _, norm_b, proj_b = summary["params_fingerprint"][name]
        assert abs(norm_a - norm_b) <= 1e-5 * norm_a, name
        assert abs(proj_a - proj_b) <= 6e-5 * norm_a, name


def sbatch(cluster, env, run_dir: Path, logs: Path) -> str:
    """Submit scripts/slurm.sbatch with the documented CPU overrides; the job id."""
    out = cluster.client(
        "sbatch", "--parsable", *CPU_OVERRIDES, f"--output={logs}/job-%j.out",
        str(REPO / "scripts" / "slurm.sbatch"), *RUN,
        env={**env, "RUN_DIR": str(run_dir)}, cwd=REPO,
    )  # fmt: skip
    return out.stdout.strip().split(";")[0]


def wait_for_steps(cluster, job: str, metrics: Path, output: Path, after: int, timeout: float = 240) -> None:
    """Until metrics.jsonl has a record past step `after`: the job is training (its SIGTERM handler is set)."""
    deadline = time.monotonic() + timeout
    while not (metrics.exists() and any(r["step"] > after for r in read_metrics(metrics))):
        ended = cluster.job_state(job) not in ("PENDING", "RUNNING")
        if ended or time.monotonic() > deadline:
            tail = output.read_text()[-3000:] if output.exists() else "(no output)"
            why = "ended" if ended else f"did not train past step {after} in {timeout:g} s"
            pytest.fail(f"job {job} {why}: {cluster.job(job)}\n{tail}")
        time.sleep(0.1)


def wait_gone(cluster, job: str, timeout: float = 120) -> float:
    """Seconds until the job has left the queue (squeue no longer lists it)."""
    start = time.monotonic()
    while cluster.client("squeue", "-h", "-j", job, "-o", "%T", check=False).stdout.strip():
        assert time.monotonic() - start < timeout, f"job {job} still queued {timeout:g} s later: {cluster.job(job)}"
        time.sleep(0.2)
    return time.monotonic() - start


@dataclass
class Phase:
    """What one job of the preempted run left behind."""

    job: str
    state: str  # JobState in scontrol
    gone_s: float | None  # seconds from scancel until the job left the queue
    checkpoints: list[int]
    summary: dict
    output: str  # the job's output file (sbatch --output)


@pytest.fixture(scope="module")
def preempted(cluster, env, tmp_path_factory):
    """One run directory and scripts/slurm.sbatch, as a user would drive it: job 1 is stopped with
    `scancel --signal=TERM`; job 2 (the same command submitted again) resumes and is stopped with a plain
    `scancel`; `scontrol requeue` of job 2 runs it again, and it resumes and finishes. Returns the three phases
    and the finished run's metrics."""
    base = tmp_path_factory.mktemp("sbatch")
    run_dir, metrics = base / "run", base / "run" / "metrics.jsonl"

    def phase(job: str, gone_s: float | None) -> Phase:
        ckpts = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
        summary = json.loads((run_dir / "summary.json").read_text())
        return Phase(job, cluster.job_state(job), gone_s, ckpts, summary, (base / f"job-{job}.out").read_text())

    phases = []
    for how in (["--signal=TERM"], []):
        done = max((r["step"] for r in read_metrics(metrics)), default=0) if metrics.exists() else 0
        job = sbatch(cluster, env, run_dir, base)
        wait_for_steps(cluster, job, metrics, base / f"job-{job}.out", after=done)
        cluster.client("scancel", *how, job)
        gone_s = wait_gone(cluster, job)
        phases.append(phase(job, gone_s))
        print(f"scancel {' '.join([*how, job])}: the job left the queue {gone_s:.1f} s later, {phases[-1].state}")
        print(slurm_lines(phases[-1].output), end="")
    # slurmctld holds a requeued job for about 2 minutes (its EligibleTime); a user (or the test) can start it now.
    cluster.client("scontrol", "requeue", job)
    assert cluster.job_state(job) == "PENDING", cluster.job(job)
    cluster.client("scontrol", "update", f"JobId={job}", "StartTime=now")
    wait_gone(cluster, job, timeout=240)
    phases.append(phase(job, None))
    return phases, read_metrics(metrics)


def test_scancel_signal_term_stops_at_an_agreed_step_and_the_run_resumes_bit_identically(preempted, srun_run):
    (first, _, last), metrics = preempted
    stop = first.summary["steps"]
    assert first.summary["preempted"] and 0 < stop < STEPS, first.summary
    assert first.checkpoints[-1] == stop, f"no checkpoint at the agreed step {stop}: {first.checkpoints}"
    assert "every process will stop at an agreed step and save" in first.output, first.output[-3000:]
    assert f"stopped by a signal after step {stop}; checkpoint saved" in first.output, first.output[-3000:]
    assert first.state == "COMPLETED", f"jdp saved and exited 0, so the job completed: {first.state}"
    where = f"coordinator {socket.gethostname()}:{coordinator_port(first.job)} (from SLURM variables)"
    assert where in first.output, first.output[-3000:]
    assert "cpu x 4, 2 local" in first.output, "each task should have the 2 CPU devices XLA_FLAGS asked for"
    assert first.gone_s < 60, f"job {first.job} left the queue {first.gone_s:.0f} s after scancel --signal=TERM"

    assert last.state == "COMPLETED", (last.state, last.output[-3000:])
    assert not last.summary["preempted"] and last.summary["steps"] == STEPS, last.summary
    _, ref_metrics, ref_summary = srun_run  # the same training, never interrupted
    resumed, ref = exact(metrics), exact(ref_metrics)
    assert [r[0] for r in resumed] == [r[0] for r in ref], "a step missing or logged twice"
    assert resumed == ref, "the resumed run's metrics differ from the uninterrupted run's"
    assert last.summary["params_sha256"] == ref_summary["params_sha256"]


def test_plain_scancel_saves_at_the_agreed_step_within_kill_wait_and_a_requeue_resumes_from_it(preempted):
    (first, second, last), _ = preempted
    stop = second.summary["steps"]
    assert f"resuming from the checkpoint at step {first.summary['steps']}" in second.output, second.output[-3000:]
    assert second.summary["preempted"] and first.summary["steps"] < stop < STEPS, second.summary
    assert second.checkpoints[-1] == stop, f"no checkpoint at the agreed step {stop}: {second.checkpoints}"
    assert second.state == "CANCELLED", second.state
    # SIGKILL comes KillWait seconds after SIGTERM: jdp stopped, saved and exited before it.
    assert f"stopped by a signal after step {stop}; checkpoint saved" in second.output, second.output[-3000:]
    assert "second SIGTERM" not in second.output, "a plain scancel must reach each process once"
    assert second.gone_s < KILL_WAIT_S + 30, f"job {second.job} left the queue {second.gone_s:.0f} s after scancel"
    # The requeued job is job 2 again: same id, same RUN_DIR, and its output appended (--open-mode=append).
    assert last.job == second.job and last.output.startswith(second.output), "the requeued job's output was cut"
    assert f"resuming from the checkpoint at step {stop}" in last.output[len(second.output) :], last.output[-3000:]


def jdp_tasks(cluster) -> list[psutil.Process]:
    """This cluster's `jdp train` task processes (found by the SLURM_CONF they inherit from the submission)."""
    return [p for p in cluster.strays() if "train" in " ".join(_cmdline(p)) and str(JDP) in " ".join(_cmdline(p))]


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def test_a_task_killed_with_sigkill_ends_the_srun_step_and_leaves_no_process(cluster, env, tmp_path):
    run_dir = tmp_path / "run"
    args = ["srun", "--kill-on-bad-exit=1", "-n", "2", str(JDP), "train", *RUN, f"train.run_dir={run_dir}"]
    srun = subprocess.Popen(args, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and len(read_metrics(metrics)) >= 2):
            assert srun.poll() is None, srun.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "training never started"
            time.sleep(0.3)
        tasks = jdp_tasks(cluster)
        victim = next((p for p in tasks if p.environ().get("SLURM_PROCID") == "1"), None)
        assert victim is not None, f"no jdp task with SLURM_PROCID=1 among {[p.pid for p in tasks]}"
        killed = time.monotonic()
        victim.send_signal(signal.SIGKILL)
        _, err = srun.communicate(timeout=120)
        seconds = time.monotonic() - killed
        print(
            f"task 1 SIGKILLed: srun exited {srun.returncode} {seconds:.1f} s later\n{slurm_lines(err, ('jdp: error',))}",
            end="",
        )
        assert srun.returncode != 0, err[-3000:]
        # srun terminates the step at once: SIGTERM to the other task, SIGKILL KillWait seconds later if it is
        # still in a collective with the dead one (it may also fail on its own first, "Connection reset by peer").
        assert seconds < KILL_WAIT_S + 20, f"srun took {seconds:.0f} s to end the step after a task was killed"
        assert "task 1: Killed" in err, err[-3000:]
        _, alive = psutil.wait_procs(tasks, timeout=10)
        assert not alive and not jdp_tasks(cluster), f"jdp processes alive after the step ended: {alive}"
    finally:
        if srun.poll() is None:
            srun.kill()
            srun.communicate()


@pytest.mark.skipif(
    not (JDP.parent / "torchft_lighthouse").exists(),
    reason=f"torchft is not installed beside {sys.executable} (pip install 'jdp[live]'); CI runs this test on its "
    "oldest stack, which has torch",
)
def test_srun_jdp_launch_live_replaces_a_killed_member_and_the_others_go_on(cluster, env, tmp_path):
    """`srun --kill-on-bad-exit=0 -n 2 jdp launch --live`, nothing per task on the command line: each srun task is
    one node of the launch (SLURM_PROCID its rank, node 0 starts the Lighthouse on the step's first node at JAX's
    port for the job id). Task 1's member, SIGKILLed at step 8, is replaced in its slot and joins with a peer's state
    while task 0's member goes on; srun exits 0 once the run is done, every row once, the members end equal."""
    from live_logs import TRAIN, check_rows, end, lines, member_pids, params, wait_for_step

    steps, run, log = 300, tmp_path / "run", tmp_path / "srun.log"
    cmd = ["srun", "--kill-on-bad-exit=0", "-n", "2", str(JDP), "launch", "--live", "--nproc-per-node", "1",
           "--min-members", "1", "--max-restarts", "1", "--grace-s", "5", "--", *TRAIN, f"train.steps={steps}",
           f"train.run_dir={run}"]  # fmt: skip
    srun = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while len(pids := member_pids(run)) < 2:
            assert time.monotonic() < deadline and srun.poll() is None, log.read_text()[-3000:]
            time.sleep(0.1)
        tasks = {psutil.Process(pid).environ().get("SLURM_PROCID"): pid for pid in pids}
        assert sorted(tasks) == ["0", "1"], f"each srun task should run one member: {tasks}"
        wait_for_step(run, tasks["0"], 8)
        os.kill(tasks["1"], signal.SIGKILL)
        assert srun.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        if srun.poll() is None:
            srun.kill()  # srun's SIGKILL ends the step: slurmstepd kills every process of both tasks
            srun.wait()
    text = log.read_text()
    where = f"coordinator {socket.gethostname()}:"
    for rank in (0, 1):
        assert f"from SLURM's job step: node {rank} of 2 (srun task {rank} of 2), {where}" in text, text[-3000:]
    assert "started torchft's Lighthouse" in text and "replaced by pid" in text, text[-3000:]
    final = member_pids(run)
    (joiner,) = set(final) - set(pids)
    a, j = lines(run, tasks["0"]), lines(run, joiner)
    assert end(run, tasks["0"])["step"] == end(run, joiner)["step"] == steps, "a member did not finish"
    assert j[0]["step"] > 8 and sorted([tasks["0"], joiner]) in [m["members"] for m in a]
    check_rows(run, [tasks["0"], joiner], final, steps)
    np.testing.assert_array_equal(params(run, tasks["0"]), params(run, joiner))
