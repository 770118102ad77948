"""PyTorch's own torchrun starting `jdp train`: one node (with a restart that resumes), two nodes (c10d rendezvous,
DiLoCo), each against the same run under `jdp launch`, started beside it.

torchrun's agent holds MASTER_PORT for its own store; jdp's coordination service takes MASTER_PORT + 1 there
(jdp/job/world.py). These tests run where torch is installed (CI: the oldest stack, torch 2.13.0 from this machine's
disk); elsewhere they are skipped with that reason, printed by CI (`pytest -rs`).
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from jdp.job.launch import free_port
from jdp.metrics import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.alone]  # torchrun's rendezvous, restarts
BIN = Path(sys.executable).parent
TORCHRUN = BIN / "torchrun"
if not TORCHRUN.exists():
    pytest.skip(
        f"torchrun is not installed beside {sys.executable} (pip install torch); CI runs these on its oldest stack, "
        "which has torch",
        allow_module_level=True,
    )

# A small, fast model on the embedded corpus; 2 processes x 2 CPU devices.
TRAIN = ["train", "configs/tiny.yaml", "model.n_layers=2", "model.d_model=64", "model.max_seq_len=64"]
TRAIN += ["data.seq_len=64", "train.batch_size=16", "data.val_tokens=4096", "train.log_every=1"]
TRAIN += ["train.eval_every=6", "train.progress=false", "train.steps=12", "train.ckpt_every=4"]
FOREIGN = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "MASTER_ADDR", "MASTER_PORT", "RANK")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    base = {k: v for k, v in os.environ.items() if k not in FOREIGN and not k.startswith(("SLURM_", "TORCHELASTIC"))}
    return base | {
        "JDP_CACHE": str(tmp_path_factory.mktemp("cache")),
        "PYTHONUNBUFFERED": "1",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",  # each worker: 2 CPU devices
    }


def run(argv, env, timeout=300):
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)


def metrics(run_dir):
    return {r["step"]: r for r in read_metrics(Path(run_dir) / "metrics.jsonl")}


def losses(run_dir):
    return {s: r["loss"] for s, r in metrics(run_dir).items() if "loss" in r}


def summary(run_dir):
    return json.loads((Path(run_dir) / "summary.json").read_text())


def assert_same_training(a, b, rel=1e-5):
    ma, mb = metrics(a), metrics(b)
    assert sorted(ma) == sorted(mb)
    for step, ra in ma.items():
        for key in ("loss", "grad_norm", "eval_loss"):
            if key in ra:
                assert abs(ra[key] - mb[step][key]) <= rel * abs(ra[key]), (step, key, ra, mb[step])


def launch(run_dir: Path, argv: list[str], env) -> subprocess.Popen:
    """The reference: `jdp launch` with the same two processes x two devices, started beside the torchrun run (its
    output beside run_dir, in NAME.log)."""
    launcher = [str(BIN / "jdp"), "launch", "--nproc-per-node", "2", "--devices-per-proc", "2", "--"]
    log = (run_dir.parent / f"{run_dir.name}.log").open("w")
    return subprocess.Popen([*launcher, *argv, f"train.run_dir={run_dir}"], env=env, stdout=log, stderr=log)


def finish(p: subprocess.Popen, run_dir: Path) -> None:
    assert p.wait(timeout=600) == 0, (run_dir.parent / f"{run_dir.name}.log").read_text()[-4000:]


def kill_tree(p: subprocess.Popen) -> None:
    for child in psutil.Process(p.pid).children(recursive=True):
        child.kill()
    p.kill()
    p.communicate()


def test_torchrun_on_one_node_trains_like_jdp_launch_and_restarts_resume_bit_identically(env, tmp_path):
    """`torchrun --nproc-per-node 2 --max-restarts 1 -m jdp.cli train ...`, as a DDP user types it: jdp reads
    torchrun's variables (process 0 of 2, 4 devices) and its coordination service is on MASTER_PORT + 1, not on the
    port torchrun's own store holds. A worker killed after the checkpoint at step 4 makes torchrun restart the group,
    which resumes from that checkpoint and ends with the uninterrupted `jdp launch` run's every loss, gradient norm,
    evaluation and parameter, bit for bit (the one-node comparison and the restart, in one run).

    The survivor stops within parallel.heartbeat_timeout_s (JAX's heartbeat finds the dead peer) or at torchrun's
    SIGKILL, whichever is first; 10 s here."""
    reference, d, master_port = launch(tmp_path / "launch", TRAIN, env), tmp_path / "run", free_port()
    argv = [str(TORCHRUN), "--nproc-per-node", "2", "--max-restarts", "1", "--master-port", str(master_port)]
    agent = subprocess.Popen(
        [*argv, "-m", "jdp.cli", *TRAIN, f"train.run_dir={d}", "parallel.heartbeat_timeout_s=10"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        # Once the checkpoint at step 4 is complete (orbax renames it to its step when every process is done).
        while not (d / "checkpoints" / "4").is_dir():
            assert agent.poll() is None and time.monotonic() < deadline, agent.communicate()[1][-3000:]
            time.sleep(0.1)
        victim = next(
            p
            for p in psutil.Process(agent.pid).children(recursive=True)
            if p.environ().get("RANK") == "1" and p.environ().get("TORCHELASTIC_RESTART_COUNT") == "0"
        )
        victim.send_signal(signal.SIGKILL)
        killed_after = max(metrics(d), default=0)
        out, err = agent.communicate(timeout=300)
        finish(reference, tmp_path / "launch")
    finally:
        for p in (agent, reference):
            if p.poll() is None:
                kill_tree(p)
    assert agent.returncode == 0, err[-4000:]
    assert "process 0 of 2" in out and "(from torchrun variables" in out, out[:2000]
    assert f"coordination service listens on 127.0.0.1:{master_port + 1} " in out, out[:2000]
    assert "resuming from the checkpoint at step" in out, out[-3000:]
    assert max(metrics(d)) == 12 and (d / "metrics.superseded.jsonl").exists() is (killed_after > 4)
    assert summary(d)["devices"] == 4 and summary(d)["steps"] == 12
    assert summary(d)["params_sha256"] == summary(tmp_path / "launch")["params_sha256"]
    assert_same_training(tmp_path / "launch", d)
    assert losses(d) == losses(tmp_path / "launch")


def test_torchrun_on_two_nodes_with_c10d_rendezvous_trains_diloco_as_jdp_launch_does(env, tmp_path):
    """Two torchrun agents (one per "node", here both on the loopback) meet at a c10d rendezvous endpoint; the
    worker is jdp's console script, the `$(which jdp)` form. The run is parallel.sync=diloco (a group per process:
    parallel.groups=2, H=4, fsdp inside each group of 2 devices, on JAX 0.10 in CI): every loss and the round's
    parameters equal the same run under `jdp launch` bit for bit: the one check, on JAX 0.10, that DiLoCo on a world
    from another launcher trains as under `jdp launch` (tests/test_slurm.py relies on it; across hosts:
    tests/test_hosts.py)."""
    diloco = [*TRAIN, "train.steps=8", "train.eval_every=0", "parallel.sync=diloco", "parallel.groups=2",
              "parallel.outer_every=4", "parallel.strategy=fsdp"]  # fmt: skip
    reference, d, endpoint = launch(tmp_path / "launch", diloco, env), tmp_path / "run", f"127.0.0.1:{free_port()}"
    agents = [
        subprocess.Popen(
            [str(TORCHRUN), "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d"]
            + ["--rdzv-endpoint", endpoint, "--rdzv-id", "jdp-test", str(BIN / "jdp"), *diloco, f"train.run_dir={d}"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        outs = [a.communicate(timeout=600) for a in agents]
        finish(reference, tmp_path / "launch")
    finally:
        for a in [*agents, reference]:
            if a.poll() is None:
                kill_tree(a)
    assert all(a.returncode == 0 for a in agents), [o[1][-3000:] for o in outs]
    assert sum("process 0 of 2" in o[0] for o in outs) == 1  # one voice, on whichever node got rank 0
    assert "parallel.sync=diloco: 2 groups, synced every 4 steps" in "".join(o[0] + o[1] for o in outs)
    steps = [read_metrics(tmp_path / r / "metrics.jsonl") for r in ("launch", "run")]
    a, b = ({r["step"]: r["loss"] for r in records if "loss" in r} for records in steps)
    assert a == b and sorted(b) == list(range(1, 9))
    assert [r["step"] for r in steps[1] if "outer_grad_norm" in r] == [4, 8]
    assert summary(tmp_path / "launch")["params_sha256"] == summary(d)["params_sha256"]


def test_a_taken_coordinator_port_is_one_jdp_error_line_not_a_traceback(env, tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        out = run(
            [str(TORCHRUN), "--nproc-per-node", "2", "--master-port", str(free_port()), "-m", "jdp.cli"]
            + [*TRAIN, f"train.run_dir={tmp_path / 'run'}"],
            env | {"JDP_COORDINATOR_PORT": str(taken)},
            timeout=120,
        )
    assert out.returncode != 0
    errors = [line for line in out.stderr.splitlines() if line.startswith("jdp: error:")]
    assert len(errors) == 1 and f"127.0.0.1:{taken}" in errors[0] and "JDP_COORDINATOR_PORT" in errors[0], out.stderr
    # torchrun prints its own summary (with its own traceback); none comes from jdp's code.
    assert "jdp/job/world.py" not in out.stderr and "jdp/job/join.py" not in out.stderr and "jax/_src" not in out.stderr, (
        out.stderr[-3000:]
    )
    assert not (tmp_path / "run").exists()
