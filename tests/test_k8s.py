"""`scripts/k8s-job.yaml` as a pod of it would run: its environment, its command, the headless Service's names.

No Kubernetes cluster runs here. Each "pod" is `jdp train` in a mount and UTS namespace of its own: its host name
is the pod's (`jdp-0`, `jdp-1`), its /etc/hosts resolves the headless Service's names (`jdp-0.jdp`) as the
cluster's DNS would (to this machine's loopback, the one network the pods share here), and its environment is
exactly what the Indexed Job gives the container: the YAML's `env` (the completion-index annotation filled in),
JOB_COMPLETION_INDEX and HOSTNAME. Needs root (namespaces); skipped with that reason otherwise.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from jdp.job.launch import free_port
from jdp.metrics import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.alone]  # names and addresses of its own, bounds in seconds
ROOT = Path(__file__).resolve().parents[1]
SMALL = ["model.n_layers=2", "model.d_model=64", "model.max_seq_len=64", "data.seq_len=64", "train.batch_size=16"]
SMALL += ["data.val_tokens=4096", "train.log_every=1", "train.eval_every=0", "train.progress=false", "train.steps=4"]

if os.geteuid() != 0 or not shutil.which("unshare"):
    pytest.skip(
        "the pods run in mount and UTS namespaces of their own: needs root and unshare", allow_module_level=True
    )


def pod_environment(job: dict, index: int) -> dict[str, str]:
    """What the Indexed Job sets in pod `index`'s container: its `env` list, the fieldRefs resolved."""
    container = job["spec"]["template"]["spec"]["containers"][0]
    annotations = {"batch.kubernetes.io/job-completion-index": str(index)}
    env = {"JOB_COMPLETION_INDEX": str(index), "HOSTNAME": f"{job['metadata']['name']}-{index}"}
    for var in container["env"]:
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            path = var["valueFrom"]["fieldRef"]["fieldPath"]
            assert path.startswith("metadata.annotations['"), f"a fieldRef this test cannot fill in: {path}"
            env[var["name"]] = annotations[path.split("'")[1]]
    return env


def run_hosts(hosts: list[tuple[Path, str, dict]], argv: list[str], timeout: float) -> list[tuple[int, str, str]]:
    """Run `argv` once per (hosts file, host name, environment), each in a mount and UTS namespace of its own with
    that /etc/hosts and host name; wait for all. Returns (returncode, stdout, stderr) each; none outlives it."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "SLURM_", "MASTER_", "TORCHELASTIC"))}
    procs = []
    try:
        for hosts_file, hostname, env in hosts:
            setup = f'mount --bind "{hosts_file}" /etc/hosts && hostname "{hostname}" && exec "$@"'
            procs.append(
                subprocess.Popen(
                    ["unshare", "--mount", "--uts", "sh", "-c", setup, hostname, *argv],
                    env=base | env,
                    cwd=ROOT,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs, strict=True)]


@pytest.fixture(scope="module")
def cache(made_once) -> str:
    """The data (and a single process's compiled programs) tokenized once for the session's `alone` tests that
    train the same small model (test_hosts, test_slurm), not again per test: what a pod runs is not about a cold
    cache."""
    return str(made_once("alone-jdp-cache", lambda d: None))


def test_the_indexed_job_trains_from_what_its_pods_are_given(tmp_path, cache):
    service, job = yaml.safe_load_all((ROOT / "scripts/k8s-job.yaml").read_text())
    n, name, subdomain = (
        job["spec"]["completions"],
        job["metadata"]["name"],
        job["spec"]["template"]["spec"]["subdomain"],
    )
    assert subdomain == service["metadata"]["name"]
    # The names a pod resolves: its own (kubelet's /etc/hosts: pod IP, pod name) and, as the cluster DNS answers
    # for the headless Service, jdp-I.jdp for each pod. The "pod IP" is this machine's loopback.
    service_names = "".join(f"127.0.0.1 {name}-{i}.{subdomain}\n" for i in range(n))
    for i in range(n):
        (tmp_path / f"hosts-{i}").write_text(f"127.0.0.1 localhost\n127.0.0.1 {name}-{i}\n{service_names}")
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:3] == ["jdp", "train", "gpt2-small"]
    # The job's command, with the tiny model on this CPU and a run directory of the test's (every pod's "shared").
    argv = [str(Path(sys.executable).parent / "jdp"), "train", "configs/tiny.yaml", *SMALL]
    argv.append(f"train.run_dir={tmp_path / 'shared' / 'run'}")
    cpu = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JDP_CACHE": cache}
    pods = [(tmp_path / f"hosts-{i}", f"{name}-{i}", cpu | pod_environment(job, i)) for i in range(n)]
    results = run_hosts(pods, argv, timeout=300)
    assert all(code == 0 for code, _, _ in results), "\n".join(err[-3000:] for _, _, err in results)
    outs = [(out, err) for _, out, err in results]
    address = next(
        e["value"] for e in job["spec"]["template"]["spec"]["containers"][0]["env"] if "ADDRESS" in e["name"]
    )
    assert f"process 0 of {n}, coordinator {address} (from JAX_* variables)" in outs[0][0]
    assert "jdp | model" not in outs[1][0]  # one voice: pod 0
    steps = [r["step"] for r in read_metrics(tmp_path / "shared" / "run" / "metrics.jsonl") if "loss" in r]
    assert steps == [1, 2, 3, 4]


def test_a_host_whose_own_name_does_not_resolve_still_joins(tmp_path, cache):
    """gloo (CPU collectives) left alone advertises the address of the host's own name, and fails where that name
    does not resolve (or resolves to a loopback address other hosts cannot reach); jdp gives it the address this
    host reaches the coordinator from instead, so each process says where and the job trains."""
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n")
    port = free_port()
    cpu = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JDP_CACHE": cache}
    job = [
        {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(i)}
        for i in range(2)
    ]
    argv = [str(Path(sys.executable).parent / "jdp"), "train", "configs/tiny.yaml", *SMALL,
            f"train.run_dir={tmp_path / 'run'}"]  # fmt: skip
    results = run_hosts([(hosts, f"nowhere-{i}", cpu | job[i]) for i in range(2)], argv, timeout=240)
    for i, (code, out, err) in enumerate(results):
        assert code == 0, err[-3000:]
        said = out + err
        assert f"process {i}: CPU collectives on 127.0.0.1 (the address this host reaches the coordinator" in said
    steps = [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert steps == [1, 2, 3, 4]


@pytest.mark.skipif(
    not (Path(sys.executable).parent / "torchft_lighthouse").exists(),
    reason=f"torchft is not installed beside {sys.executable} (pip install 'jdp[live]'); CI runs this test on its "
    "oldest stack, which has torch",
)
def test_the_indexed_job_runs_live_members_with_the_documented_command(tmp_path):
    """docs/live.md's Kubernetes command, `jdp launch --live --node-rank $JOB_COMPLETION_INDEX --coordinator
    jdp-0.jdp:PORT`, as each pod's shell runs it: pod 0 starts the Lighthouse, each pod's member reaches it by the
    headless Service's name and tells the others its own address; both train every step in one quorum, every row
    once, and end with the same parameters."""
    from live_logs import TRAIN, check_rows, lines, member_pids, params

    service, job = yaml.safe_load_all((ROOT / "scripts/k8s-job.yaml").read_text())
    n, name, subdomain = job["spec"]["completions"], job["metadata"]["name"], service["metadata"]["name"]
    service_names = "".join(f"127.0.0.1 {name}-{i}.{subdomain}\n" for i in range(n))
    for i in range(n):
        (tmp_path / f"hosts-{i}").write_text(f"127.0.0.1 localhost\n127.0.0.1 {name}-{i}\n{service_names}")
    steps, run, port = 12, tmp_path / "shared" / "run", free_port()
    jdp = Path(sys.executable).parent / "jdp"
    command = (f"{jdp} launch --live --nnodes {n} --nproc-per-node 1 --node-rank $JOB_COMPLETION_INDEX "
               f"--coordinator {name}-0.{subdomain}:{port} -- {' '.join(TRAIN)} train.steps={steps} "
               f"train.run_dir={run}")  # fmt: skip
    # the pod's environment less the three JAX_ variables (the launcher describes the job: scripts/k8s-job.yaml)
    pods = [(tmp_path / f"hosts-{i}", f"{name}-{i}",
             {k: v for k, v in pod_environment(job, i).items() if not k.startswith("JAX_")}) for i in range(n)]  # fmt: skip
    results = run_hosts(pods, ["sh", "-c", command], timeout=240)
    assert all(code == 0 for code, _, _ in results), "\n".join(err[-3000:] for _, _, err in results)
    assert "started torchft's Lighthouse" in results[0][2], results[0][2][-3000:]
    pids = member_pids(run)
    assert len(pids) == n, f"one member per pod: {pids}"
    for pid in pids:
        assert [m["step"] for m in lines(run, pid)] == list(range(1, steps + 1))
        assert lines(run, pid)[-1]["members"] == pids
    check_rows(run, pids, pids, steps)
    np.testing.assert_array_equal(params(run, pids[0]), params(run, pids[1]))
