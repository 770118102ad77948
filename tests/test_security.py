"""Security: a job listens only where its processes connect, run directories cannot lead jdp out of themselves,
and secrets from the environment reach no file and no log."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jdp.config import ConfigError, load_config
from jdp.job.join import bind_address
from jdp.job.launch import free_port
from jdp.rundir import RunDir, RunDirEscape

SMALL = ["model.n_layers=1", "model.d_model=32", "model.max_seq_len=32", "data.seq_len=32", "train.batch_size=8"]
SMALL += ["train.log_every=1", "train.eval_every=0", "train.progress=false", "data.val_tokens=2048"]


def test_bind_address_is_where_the_others_connect(monkeypatch):
    env = {}
    assert bind_address("127.0.0.1:1234", env=env)[0] == "127.0.0.1:1234"
    assert bind_address("127.0.0.2:1234", env=env)[0] == "127.0.0.2:1234"
    assert bind_address("localhost:99", env=env)[0] == "127.0.0.1:99"
    assert bind_address("[::1]:99", env=env)[0] == "[::1]:99"
    assert bind_address("10.1.2.3:1234", env=env) == ("10.1.2.3:1234", "the coordinator's address")
    assert bind_address("[fd00::7]:5", env=env)[0] == "[fd00::7]:5"
    # explicit: the config's HOST (the coordinator's port), HOST:PORT as given, else JAX's variable
    assert bind_address("10.1.2.3:1234", "0.0.0.0", env=env) == ("0.0.0.0:1234", "as asked")
    assert bind_address("10.1.2.3:1234", "10.9.9.9:77", env=env)[0] == "10.9.9.9:77"
    assert bind_address("10.1.2.3:1234", "[::]", env=env)[0] == "[::]:1234"
    assert bind_address("10.1.2.3:1234", env={"JAX_COORDINATOR_BIND_ADDRESS": "10.4.4.4"})[0] == "10.4.4.4:1234"
    assert bind_address(None, env=env)[0] is None  # Open MPI: JAX finds the job, and says where it binds
    # a host name is resolved; one that resolves to a loopback address here says nothing about other nodes
    answers = {"node0": "10.0.0.5", "mybox": "127.0.1.1"}
    monkeypatch.setattr(socket, "getaddrinfo", lambda name, port: [(0, 0, 0, "", (answers[name], 0))])
    assert bind_address("node0:1234", env=env)[0] == "10.0.0.5:1234"
    address, why = bind_address("mybox:1234", env=env)
    assert address == "[::]:1234" and "parallel.coordinator_bind" in why


def _listening(pid: int) -> list[str]:
    """The TCP addresses process `pid` listens on, from /proc (IPv4 and IPv6)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            hex_ip, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_ip)
            if width == 8:
                ip = socket.inet_ntop(socket.AF_INET, raw[::-1])
            else:  # four little-endian 32-bit words
                ip = socket.inet_ntop(socket.AF_INET6, b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))
                ip = ip.removeprefix("::ffff:") if ip.startswith("::ffff:") and "." in ip else ip  # IPv4-mapped
            found.append(f"{ip}:{int(hex_port, 16)}")
    return found


def _children(pid: int) -> list[int]:
    return [
        int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and (p / "stat").exists() and _ppid(p) == pid
    ]


def _ppid(p: Path) -> int:
    try:
        return int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def _launch_and_look(tmp_path, extra: list[str]) -> tuple[dict[int, list[str]], str]:
    """Start a 2-process job with `jdp launch`, read every worker's listening sockets once both train, stop it."""
    run = tmp_path / "run"
    argv = [sys.executable, "-m", "jdp.cli", "launch", "--nproc-per-node", "2", "--grace-s", "20", *extra, "--"]
    argv += ["train", "tiny", *SMALL, "train.steps=100000", f"train.run_dir={run}"]
    launcher = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and launcher.poll() is None:  # both train once metrics appear
            if (run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().count('"loss"') >= 2:
                break
            time.sleep(0.5)
        assert launcher.poll() is None, launcher.communicate()[0][-3000:]
        workers = _children(launcher.pid)
        assert len(workers) == 2
        sockets = {pid: _listening(pid) for pid in workers}
    finally:
        launcher.send_signal(signal.SIGTERM)  # the workers save at an agreed step and exit
        try:
            out = launcher.communicate(timeout=120)[0]
        except subprocess.TimeoutExpired:
            launcher.kill()
            out = launcher.communicate()[0]
    return sockets, out


def _loopback(address: str) -> bool:
    ip = address.rsplit(":", 1)[0]
    return ip.startswith("127.") or ip == "::1"


@pytest.mark.alone
@pytest.mark.slow
def test_a_single_node_job_listens_on_the_loopback_only(tmp_path):
    sockets, out = _launch_and_look(tmp_path, [])
    every = [a for addresses in sockets.values() for a in addresses]
    assert every, "found no listening socket at all: the check would see nothing"
    assert all(_loopback(a) for a in every), f"listening beyond the loopback: {sockets}"
    assert "the coordination service listens on 127.0.0.1:" in out


@pytest.mark.alone
@pytest.mark.slow
def test_a_given_coordinator_address_is_bound_exactly(tmp_path):
    """As a multi-node job's node 0 binds the address its coordinator was given (127.0.0.2 stands for a
    node's address here), not every interface and not another loopback address."""
    port = free_port()
    sockets, out = _launch_and_look(tmp_path, ["--coordinator", f"127.0.0.2:{port}"])
    every = [a for addresses in sockets.values() for a in addresses]
    assert f"127.0.0.2:{port}" in every, sockets
    assert not [a for a in every if a.endswith(f":{port}") and a != f"127.0.0.2:{port}"], sockets
    assert all(_loopback(a) for a in every), sockets
    assert f"listens on 127.0.0.2:{port} (the coordinator is on the loopback)" in out


def test_links_out_of_a_run_directory_are_refused(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("precious\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").symlink_to(outside)
    with pytest.raises(RunDirEscape, match=r"metrics.jsonl is a link to .*outside.txt, outside the run directory"):
        RunDir(run).check_contained()
    from jdp.lm import train

    with pytest.raises(ConfigError, match="outside the run directory"):
        train(load_config("tiny", [*SMALL, "train.steps=2", f"train.run_dir={run}"]))
    assert outside.read_text() == "precious\n" and not (run / ".jdp-lock").exists()  # nothing written anywhere
    (run / "metrics.jsonl").unlink()
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "100").symlink_to(tmp_path, target_is_directory=True)
    from jdp.generate import load_run

    with pytest.raises(ConfigError, match="checkpoints/100 is a link"):
        load_run(run)
    (run / "checkpoints" / "100").unlink()
    (run / "inside").mkdir()
    (run / "alias").symlink_to(run / "inside")
    RunDir(run).check_contained()  # a link that stays inside is fine


def test_odd_step_names_are_not_steps_and_secrets_reach_no_file_or_log(tmp_path):
    """One real run with secrets in its environment (W&B offline, TensorBoard on), then odd names among its
    checkpoints: they are never read as steps, and export and generate still read the real one."""
    secrets = {
        "WANDB_API_KEY": "wandb-secret-0123456789abcdef0123456789abcdef0123",
        "HF_TOKEN": "hf_secretTOKENvalue42",
        "AWS_SECRET_ACCESS_KEY": "aws/SECRET+key/98765",
        "MY_DB_PASSWORD": "pa55-w0rd-secret",
    }
    run = tmp_path / "run"
    env = {**os.environ, **secrets, "WANDB_MODE": "offline", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    argv = ["train", "tiny", *SMALL, "train.steps=4", "train.ckpt_every=2", f"train.run_dir={run}"]
    argv += ["train.wandb_project=jdp-secrets-test"]
    done = subprocess.run(
        [sys.executable, "-m", "jdp.cli", *argv], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any("tensorboard" in str(p) for p in files) and any("wandb" in str(p) for p in files)
    for name, value in secrets.items():
        assert value not in done.stdout + done.stderr, f"{name} printed"
        for p in files:
            assert value.encode() not in p.read_bytes(), f"{name} written to {p}"

    checkpoints = run / "checkpoints"
    for odd in ["..x", "-1", "1e3", "12abc", " 7", "4.tmp"]:
        (checkpoints / odd).mkdir()
        (checkpoints / odd / "marker").write_text("x")
    from jdp.checkpoint import Checkpoints
    from jdp.generate import load_run

    ckpts = Checkpoints(run, keep=1, read_only=True)
    try:
        assert ckpts.steps() == [2, 4]
    finally:
        ckpts.close()
    cfg, _, _, step = load_run(run)
    assert step == 4
    out = tmp_path / "exported"
    exported = subprocess.run(
        [sys.executable, "-m", "jdp.cli", "export", str(run), str(out)], env=env, capture_output=True, text=True
    )
    assert exported.returncode == 0, exported.stderr[-2000:]
    assert json.loads((out / "config.json").read_text())["n_layer"] == 1
