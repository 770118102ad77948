"""Multi-node jobs for real: "hosts" as Linux network namespaces on one bridge (tests/hosts.py), each running
`jdp launch --nnodes N --node-rank R --coordinator HOST0:PORT`, as a job of several machines runs: its own
address, the coordinator reached over the bridge, the CPU collectives (gloo) between the hosts' addresses.
Skipped, with the reason printed, where namespaces cannot be made (not root).

Each worker a process costs the suite its start (imports, data, the compile cache): one test runs hosts of two
processes (what is about processes within a host: where they meet, a stuck one among them, the restart of them all),
the others one process per host (what is about hosts: lost, partitioned, elastic)."""

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hosts import Hosts, shape_unavailable, unavailable
from test_faults import SMALL, losses, run, summary
from test_zero1 import close

from jdp.metrics import read_metrics

WHY = unavailable()
pytestmark = [
    pytest.mark.skipif(bool(WHY), reason=f"multi-host tests need network namespaces: {WHY}"),
    pytest.mark.slow,
    pytest.mark.alone,  # namespaces, a fixed port, bounds in seconds
]
PORT = 29400
HEARTBEAT_S = 6  # parallel.heartbeat_timeout_s in these jobs: a lost host is noticed within it
STEPS = ["train.steps=20", "train.ckpt_every=5", "train.log_every=1"]  # the job every test runs or starts
DILOCO = ["parallel.sync=diloco", "parallel.outer_every=4"]  # one group per host: the slow link between the groups
BOUND_S = HEARTBEAT_S + 20  # what the docs promise: the heartbeat timeout, the launcher's grace and a few seconds
SHAPED = pytest.mark.skipif(bool(shape_unavailable()), reason=f"no link can be shaped here: {shape_unavailable()}")


@pytest.fixture(scope="module")
def env(made_once):
    """The data tokenized once for the session's `alone` tests of the same small model (test_slurm, test_k8s)."""
    return {**os.environ, "JDP_CACHE": str(made_once("alone-jdp-cache", lambda d: None)), "PYTHONUNBUFFERED": "1"}


def launch(hosts: Hosts, i: int, run_dir: Path, extra=(), nproc=1, log: Path | None = None, env=None, launcher=()):
    """`jdp launch` on host i of the job: nproc workers of one CPU device each, host 0 the coordinator."""
    argv = [sys.executable, "-m", "jdp.cli", "launch", "--nnodes", str(hosts.n), "--node-rank", str(i),
            "--nproc-per-node", str(nproc), "--coordinator", f"{hosts.addresses[0]}:{PORT}", "--grace-s", "5",
            *launcher, "--", "train", "configs/tiny.yaml", *SMALL, f"train.run_dir={run_dir}",
            f"parallel.heartbeat_timeout_s={HEARTBEAT_S}", *extra]  # fmt: skip
    return hosts.run(i, argv, log=log or run_dir.parent / f"{run_dir.name}-host{i}.log", env=env)


def wait_all(procs, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    return codes


@pytest.fixture(scope="module")
def reference(env, tmp_path_factory):
    """The same job as 1 host x 4 processes on the loopback, uninterrupted (its checkpoints change no number: one,
    at the end)."""
    d = tmp_path_factory.mktemp("reference") / "run"
    run(d, env, (4, 1), [*STEPS, "train.ckpt_every=0", f"parallel.heartbeat_timeout_s={HEARTBEAT_S}"])
    return d


@pytest.fixture(scope="module")
def diloco_reference(env, tmp_path_factory):
    """The DiLoCo job (H=4) as 1 host x 2 processes in 2 groups, uninterrupted: what a group per host must equal."""
    d = tmp_path_factory.mktemp("diloco-reference") / "run"
    run(d, env, (2, 1), [*STEPS, "train.ckpt_every=0", f"parallel.heartbeat_timeout_s={HEARTBEAT_S}", *DILOCO,
                         "parallel.groups=2"])  # fmt: skip
    return d


def started(run_dir: Path, timeout: float = 240, after_checkpoint: bool = False) -> None:
    """Wait until the job has logged a training step (every process past setup), or saved a checkpoint."""
    deadline = time.monotonic() + timeout
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        if after_checkpoint and any(p.name.isdigit() for p in (run_dir / "checkpoints").glob("*")):
            return
        if not after_checkpoint and metrics.exists() and '"loss"' in metrics.read_text():
            return
        time.sleep(0.2)
    raise AssertionError(f"no training step logged in {timeout} s")


def exits(procs, timeout: float) -> tuple[list, float]:
    """(each launcher's exit code, seconds until the last exited) from now."""
    start = time.monotonic()
    codes = wait_all(procs, timeout)
    return codes, time.monotonic() - start


def wait_for(path: Path, text: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text():
            return
        time.sleep(0.2)
    raise AssertionError(
        f"{text!r} not in {path} after {timeout} s:\n{path.read_text()[-3000:] if path.exists() else ''}"
    )


def ms_per_step(run_dir: Path) -> float:
    """Median milliseconds per step from metrics.jsonl (steps after the first, which compiles)."""
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("tokens_per_sec")]
    return float(np.median([r["tokens"] / r["step"] / r["tokens_per_sec"] * 1000 for r in rows]))


@SHAPED
def test_two_hosts_of_two_processes_over_a_slow_lossy_link_stop_for_a_stuck_worker_and_restart_as_one_of_four(
    env, tmp_path, reference
):
    """2 hosts x 2 processes, host 1's link 20 ms +- 5 ms each way with 1% loss (tc netem, or tests/wire.py where the
    kernel has no netem), `--max-restarts 1` on both launchers. After the checkpoint at step 10, SIGSTOP to one
    worker on host 1: alive to the kernel, silent to everyone. No process waits in a collective for it: within the
    bound every worker has stopped, host 0's naming it, and host 1's launcher has killed it (after --grace-s); both
    launchers restart their workers, and the job resumes from step 10 and ends bit for bit as 1 host x 4 processes
    uninterrupted (every loss and grad_norm, the parameters' digest): no spurious failure over the link either. Each
    host's processes advertise its own address for the CPU collectives (a loopback one would refuse every connection
    from the other host); the banner names the hosts; the coordination service listens on the job address only. The
    milliseconds per step against the reference are printed (docs/multihost.md). A launcher giving up when a host is
    lost: the partition below; a killed host: the elastic tests (a host killed outright stops the others' workers
    as fast there, the launcher's giving up or restarting after it aside)."""
    d, logs = tmp_path / "run", [tmp_path / f"run-host{i}.log" for i in range(2)]
    with Hosts(2, shaped=(1,)) as hosts:
        hosts.shape(1, delay_ms=20, jitter_ms=5, loss_pct=1)
        start = time.monotonic()
        procs = [launch(hosts, i, d, [*STEPS, "train.ckpt_every=10"], nproc=2, env=env,
                        launcher=["--max-restarts", "1"]) for i in range(2)]  # fmt: skip
        started(d, after_checkpoint=True)
        workers = [set(hosts.pids(i)) - {procs[i].pid} for i in range(2)]
        hosts.signal(1, signal.SIGSTOP, max(workers[1]))  # the later-started worker: local rank 1, process 3
        stopped = time.monotonic()
        for log in logs:
            wait_for(log, "restarting the group (restart 1 of 1)", BOUND_S + 60)
        seconds = time.monotonic() - stopped
        left = [sorted(workers[i] & set(hosts.pids(i))) for i in range(2)]
        codes = wait_all(procs, 400)
        total = time.monotonic() - start
        text = [log.read_text() for log in logs]
    print(f"a worker on host 1 stopped: every worker stopped, both launchers restarting, after {seconds:.1f} s")
    assert codes == [0, 0], "\n\n".join(t[-3000:] for t in text)
    assert seconds <= BOUND_S, (seconds, "\n\n".join(t[-2500:] for t in text))
    assert left == [[], []], left
    assert "process 3" in text[0].split("restarting the group")[0], text[0][-3000:]
    assert "resuming from the checkpoint at step 10" in text[0], text[0][-3000:]
    records = {r["step"]: r for r in read_metrics(d / "metrics.jsonl") if "loss" in r}
    expected = {r["step"]: r for r in read_metrics(reference / "metrics.jsonl") if "loss" in r}
    assert sorted(records) == sorted(expected) == list(range(1, 21))
    assert all(records[s]["loss"] == expected[s]["loss"] and records[s]["grad_norm"] == expected[s]["grad_norm"]
               for s in expected)  # fmt: skip
    assert summary(d)["params_sha256"] == summary(reference)["params_sha256"]
    for i, log in enumerate(text):
        assert f"CPU collectives on {hosts.addresses[i]}" in log, log[-3000:]
    a0, a1 = hosts.addresses
    name = socket.gethostname()
    assert f"2 hosts: {name} {a0} (processes 0-1), {name} {a1} (processes 2-3)" in text[0]
    assert f"the coordination service listens on {a0}:{PORT}" in text[0]
    shaped, clean = ms_per_step(d), ms_per_step(reference)
    how = "tc netem" if not hosts.wired else "tests/wire.py (no sch_netem in this kernel)"
    print(f"20 steps over a 20 +- 5 ms, 1% loss link ({how}), a restart among them: {total:.1f} s, {shaped:.0f} "
          f"ms/step against {clean:.0f} on one host ({shaped / clean:.1f}x)")  # fmt: skip


@SHAPED
def test_a_partitioned_diloco_host_on_a_slow_lossy_link_stops_both_sides_within_the_bound_and_the_rerun_resumes(
    env, tmp_path, diloco_reference
):
    """parallel.sync=diloco (a group per host, H=4, one process per host) over host 1's 20 +- 5 ms, 1% loss link.
    After the first checkpoint (mid-round), host 1's link goes down with its process alive: no connection is reset,
    only heartbeats stop, and nothing crosses between the hosts for 3 steps of 4 anyway. Both sides exit non-zero
    within the bound (the partitioned one too: it cannot reach the coordinator), nothing is left. Healed, the same
    commands resume from the last checkpoint (mid-round) and end bit for bit as the same DiLoCo job uninterrupted
    on 1 host x 2 processes as 2 groups (every loss, the round's parameters); its steps are timed against that run
    (printed). Under every-step sync the same heartbeats stop a partitioned job (the stuck worker above: its
    collectives wait on a silent peer as a partitioned host's do), and the restart resumes bit for bit there too."""
    reference, d = diloco_reference, tmp_path / "run"
    with Hosts(2, shaped=(1,)) as hosts:
        hosts.shape(1, delay_ms=20, jitter_ms=5, loss_pct=1)
        procs = [launch(hosts, i, d, [*STEPS, *DILOCO], env=env) for i in range(2)]
        started(d, after_checkpoint=True)
        hosts.partition(1)
        codes, seconds = exits(procs, BOUND_S + 90)
        left = [hosts.pids(i) for i in range(2)]
        logs = [(tmp_path / f"run-host{i}.log").read_text() for i in range(2)]
        hosts.heal(1)
        again = [launch(hosts, i, d, [*STEPS, *DILOCO], env=env, log=tmp_path / f"again-host{i}.log")
                 for i in range(2)]  # fmt: skip
        rerun = wait_all(again, 400)
        resumed = (tmp_path / "again-host0.log").read_text()
    print(f"host 1 partitioned: launchers exited {codes} after {seconds:.1f} s")
    assert all(c not in (0, None) for c in codes), "\n\n".join(log[-2500:] for log in logs)
    assert seconds <= BOUND_S, (seconds, "\n\n".join(log[-2500:] for log in logs))
    assert left == [[], []], left
    assert "lost process 1 (node 1)" in logs[0], logs[0][-3000:]
    assert "this worker lost the job's coordinator" in logs[1], logs[1][-3000:]
    assert "parallel.sync=diloco: a group per host, synced every 4 steps" in logs[0]
    assert rerun == [0, 0] and re.search(r"resuming from the checkpoint at step (5|10|15)\b", resumed), resumed[-3000:]
    mine, theirs = read_metrics(d / "metrics.jsonl"), read_metrics(reference / "metrics.jsonl")
    assert {r["step"]: r["loss"] for r in mine if "loss" in r} == {r["step"]: r["loss"] for r in theirs if "loss" in r}
    assert [r["step"] for r in mine if "outer_grad_norm" in r][-4:] == [8, 12, 16, 20]
    assert summary(d)["params_sha256"] == summary(reference)["params_sha256"]
    print(
        f"DiLoCo H=4 over the slow link: {ms_per_step(d):.0f} ms/step against {ms_per_step(reference):.0f} on one host"
    )


def lose(hosts: Hosts, lost: int, launchers: list, log: Path) -> tuple[float, list[int]]:
    """Kill host `lost` of an elastic job of 2 (every process, its launcher too): (seconds until the other host's
    launcher has stopped its workers to re-form the job, those of them still alive then)."""
    survivor = 1 - lost
    workers = set(hosts.pids(survivor)) - {launchers[survivor].pid}
    hosts.kill(lost)
    start = time.monotonic()
    wait_for(log, "restarting the group (restart 1 of", BOUND_S + 60)
    seconds = time.monotonic() - start
    print(f"host {lost} killed: host {survivor}'s launcher stopped its workers after {seconds:.1f} s")
    return seconds, sorted(workers & set(hosts.pids(survivor)))


def test_elastic_diloco_goes_on_with_the_groups_it_has(env, tmp_path):
    """parallel.sync=diloco (a group per host, H=4, one process per host) under --nnodes 1:2: the coordinator's host
    (host 0) killed for good after the checkpoint at step 5 (mid-round). Host 1's worker says it lost the job's
    coordinator (process 0), and within the bound its launcher has stopped it; no host keeps the membership (the
    files in --rdzv-dir), so host 1 re-forms the job alone as node 0, the coordinator now, a group of its own, from
    the round's parameters, logged, and trains every step to the end, the group syncing on its cadence. (Taking a
    host back is test_elastic_membership_goes_on_without_a_lost_host_and_takes_it_back_at_the_next_restart's; more
    groups from a checkpoint of fewer, test_diloco.py::test_checkpoints_move_between_every_step_sync_and_diloco's.)"""
    d, log1 = tmp_path / "run", tmp_path / "run-host1.log"
    elastic = ["--nnodes", "1:2", "--rdzv-dir", str(tmp_path / "rdzv"), "--rdzv-timeout", "3", "--max-restarts", "1"]
    with Hosts(2) as hosts:
        first = [launch(hosts, i, d, [*STEPS, *DILOCO], env=env, launcher=[*elastic, "--node-rank", str(i)])
                 for i in range(2)]  # fmt: skip
        started(d, after_checkpoint=True)
        seconds, left = lose(hosts, 0, first, log1)
        codes = wait_all([first[1]], 400)
        log = log1.read_text()
    assert codes == [0], log[-3000:]
    assert seconds <= BOUND_S and left == [], (seconds, left, log[-3000:])
    assert "lost the job's coordinator (process 0)" in log.split("restarting the group")[0], log[-3000:]
    assert re.search(r"rendezvous round 1: 1 of 1-2 nodes \(.*\); this node is node 0", log), log[-3000:]
    assert re.search(r"saved with parallel.sync=diloco and 2 groups: 1 groups now: every group starts from the "
                     r"round's parameters", log)  # fmt: skip
    mine = read_metrics(d / "metrics.jsonl")
    assert sorted({r["step"] for r in mine if "loss" in r}) == list(range(1, 21))
    assert [r["step"] for r in mine if "outer_grad_norm" in r][-2:] == [16, 20]
    end = summary(d)
    assert end["steps"] == 20 and end["resumed_from"] in (5, 10)
    loss = {r["step"]: r["loss"] for r in mine if "loss" in r}
    assert np.isfinite(end["eval_loss"]) and loss[20] < loss[1]


def test_elastic_membership_goes_on_without_a_lost_host_and_takes_it_back_at_the_next_restart(env, tmp_path, reference):
    """--nnodes 1:2, one process per host: host 1 is lost for good after the checkpoint at step 5 (killed: every
    process, its launcher too). Host 0's worker names the lost host's address (from the broken connection) and
    within the bound its launcher has stopped it; it re-forms the job alone (round 1: 1 process), which resumes from
    the last checkpoint with the batches the full job would have seen. Host 1 comes back and waits; when host 0's
    worker fails at step 15 the next round takes both hosts again from the checkpoint at 15. Every loss equals the
    uninterrupted 4-process run's to rounding (the batches do not depend on the number of processes)."""
    import inject

    d = tmp_path / "run"
    faults, override = inject.register(env, JDP_TEST_KILL_ONCE=f"15:0:{tmp_path / 'killed'}")
    elastic = ["--nnodes", "1:2", "--rdzv-dir", str(tmp_path / "rdzv"), "--rdzv-timeout", "3", "--max-restarts", "2"]
    log0, again = tmp_path / "run-host0.log", tmp_path / "again-host1.log"
    with Hosts(2) as hosts:
        first = [launch(hosts, i, d, [*STEPS, override], env=faults, launcher=[*elastic, "--node-rank", str(i)])
                 for i in range(2)]  # fmt: skip
        started(d, after_checkpoint=True)
        seconds, left = lose(hosts, 1, first, log0)
        wait_for(log0, "rendezvous round 1: 1 of 1-2 nodes")
        back = launch(hosts, 1, d, [*STEPS, override], env=faults, log=again, launcher=[*elastic, "--node-rank", "1"])
        codes = wait_all([first[0], back], 400)
        logs = [log0.read_text(), again.read_text()]
    assert codes == [0, 0], "\n\n".join(log[-3000:] for log in logs)
    assert seconds <= BOUND_S and left == [], (seconds, left, logs[0][-3000:])
    lost = [ln for ln in logs[0].split("restarting the group")[0].splitlines() if hosts.addresses[1] in ln]
    assert any("hosts:" not in ln for ln in lost), lost  # named by the failure, not only by the banner
    assert "rendezvous round 2: 2 of 1-2 nodes" in logs[0] and "rendezvous round 2: 2 of 1-2 nodes" in logs[1]
    assert (tmp_path / "killed").exists()
    assert close(losses(reference), losses(d)) and sorted(losses(d)) == list(range(1, 21))
    a, b = summary(reference)["params_fingerprint"], summary(d)["params_fingerprint"]
    assert all(np.allclose(a[k], b[k], rtol=1e-5, atol=1e-6) for k in a)
