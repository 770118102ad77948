"""Every way of describing a multi-process job resolves to the right coordinator, count and id."""

import os

import pytest

from jdp.job.world import WorldError, resolve_world


def test_nothing_means_one_plain_process():
    w = resolve_world(env={})
    assert (w.num_processes, w.process_id, w.coordinator) == (1, 0, None)


def test_explicit_options():
    w = resolve_world("10.0.0.1:1234", 8, 3, (2, 3), env={})
    assert (w.coordinator, w.num_processes, w.process_id, w.local_device_ids) == ("10.0.0.1:1234", 8, 3, (2, 3))
    assert w.source == "explicit options" and not w.auto_detect


def test_jax_variables():
    env = {"JAX_COORDINATOR_ADDRESS": "host0:5000", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "2"}
    w = resolve_world(env=env)
    assert (w.coordinator, w.num_processes, w.process_id) == ("host0:5000", 4, 2)
    assert "JAX_" in w.source


def test_torchrun_variables_and_local_rank_picks_the_gpu():
    env = {"MASTER_ADDR": "node7", "MASTER_PORT": "29500", "WORLD_SIZE": "16", "RANK": "9"}
    w = resolve_world(env={**env, "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "8"})
    assert (w.coordinator, w.num_processes, w.process_id, w.local_device_ids) == ("node7:29500", 16, 9, (1,))
    # One process per node (all its GPUs): no device restriction.
    assert resolve_world(env={**env, "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}).local_device_ids is None


def test_under_torchrun_the_coordinator_takes_the_port_after_its_store():
    env = {"MASTER_ADDR": "node7", "MASTER_PORT": "29500", "WORLD_SIZE": "2", "RANK": "0"}
    # torchrun's agent (TORCHELASTIC_RUN_ID) holds MASTER_PORT with its own TCPStore.
    assert resolve_world(env={**env, "TORCHELASTIC_RUN_ID": "none"}).coordinator == "node7:29501"
    assert resolve_world(env={**env, "TORCHELASTIC_RUN_ID": "x", "JDP_COORDINATOR_PORT": "41000"}).coordinator == (
        "node7:41000"
    )
    with pytest.raises(WorldError, match="JDP_COORDINATOR_PORT"):
        resolve_world(env={**env, "JDP_COORDINATOR_PORT": "next"})


@pytest.mark.parametrize(
    "nodelist, host",
    [("gpu001", "gpu001"), ("gpu001,gpu002", "gpu001"), ("gpu[003-010],cpu1", "gpu003"), ("n[007,009-011]", "n007")],
)
def test_slurm_variables(nodelist, host):
    env = {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": nodelist, "SLURM_NTASKS": "4", "SLURM_PROCID": "3"}
    w = resolve_world(env={**env, "SLURM_LOCALID": "1"})
    # The same port JAX's own SLURM detection computes from the job id.
    assert w.coordinator == f"{host}:{4242 % 4096 + 65535 - 4096 + 1}"
    # jdp hands this description to JAX itself: JAX's own detection would pin every task to GPU SLURM_LOCALID.
    assert (w.num_processes, w.process_id, w.auto_detect) == (4, 3, False)


@pytest.mark.parametrize(
    "tasks, nodes, visible, gpus",
    [
        (2, 2, "0,1,2,3,4,5,6,7", None),  # one task per node drives all of its GPUs (scripts/slurm.sbatch)
        (16, 2, "0,1,2,3,4,5,6,7", (1,)),  # one task per GPU, each seeing the node's 8: SLURM_LOCALID's
        (4, 2, "0,1,2,3,4,5,6,7", (4, 5, 6, 7)),  # two tasks per node: half each
        (16, 2, "5", None),  # --gpus-per-task=1: the one GPU SLURM gave the task
        (2, 1, None, (1,)),  # no GPUs that SLURM manages: one per task, as JAX would
    ],
)
def test_slurm_tasks_get_their_share_of_the_gpus_they_see(tasks, nodes, visible, gpus):
    env = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_NTASKS": str(tasks), "SLURM_PROCID": "1"}
    env |= {"SLURM_LOCALID": "1", "SLURM_STEP_NUM_TASKS": str(tasks), "SLURM_STEP_NUM_NODES": str(nodes)}
    if visible:
        env["CUDA_VISIBLE_DEVICES"] = visible
    assert resolve_world(env=env).local_device_ids == gpus


@pytest.mark.parametrize(
    "env, given, placed",
    [
        # srun -n 2 (a task per node): each task one node, the coordinator the step's first node at JAX's port
        ({"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1"}, {}, ("2", 1, f"gpu003:{4242 % 4096 + 61440}")),
        ({"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "0"}, {"lighthouse": "http://lh:29510"}, ("2", 0, None)),
        ({"SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "3"}, {"nnodes": "2:4"}, ("2:4", 3, f"gpu003:{4242 % 4096 + 61440}")),
        ({"SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"}, {}, ("1", 0, None)),  # one node: loopback, as ever
        # what the user gave is kept
        ({"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1"}, {"nnodes": "1", "node_rank": 0}, ("1", 0, None)),
        # a batch script or an salloc shell is no step: one node
        ({"SLURM_STEP_NODELIST": None, "SLURM_PROCID": "0"}, {}, ("1", 0, None)),
    ],
)
def test_jdp_launch_under_srun_takes_each_task_for_a_node(monkeypatch, env, given, placed):
    from argparse import Namespace

    from jdp.job.launch import place

    for k in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(k)
    for k, v in {"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "gpu[003-004]", **env}.items():
        if v is not None:
            monkeypatch.setenv(k, v)
    args = Namespace(**{"nnodes": None, "node_rank": None, "coordinator": None, "lighthouse": None, **given})
    place(args)
    assert (args.nnodes, args.node_rank, args.coordinator) == placed


def test_open_mpi_variables_leave_the_address_to_jax():
    w = resolve_world(env={"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"})
    assert (w.num_processes, w.process_id, w.coordinator, w.auto_detect) == (2, 1, None, True)


def test_priority_explicit_then_jax_then_torchrun_then_slurm():
    slurm = {
        "SLURM_JOB_ID": "1",
        "SLURM_STEP_NODELIST": "a",
        "SLURM_NTASKS": "2",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
    }
    jax_vars = {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "8", "JAX_PROCESS_ID": "5"}
    # A launcher inside a SLURM allocation describes its workers with JAX's variables: they win over SLURM's.
    assert resolve_world(env={**slurm, **jax_vars}).num_processes == 8
    assert resolve_world("h:1", 8, 5, env=jax_vars).source == "explicit options"


@pytest.mark.parametrize(
    "kwargs, env, words",
    [
        ({}, {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2"}, ["incomplete", "JAX_", "process id"]),
        ({}, {"WORLD_SIZE": "4", "RANK": "1"}, ["incomplete", "torchrun", "coordinator"]),
        ({"num_processes": 2, "process_id": 0}, {}, ["incomplete", "explicit", "coordinator"]),
        ({}, {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"}, ["not in [0, 2)"]),
        ({}, {"JAX_COORDINATOR_ADDRESS": "h", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}, ["HOST:PORT"]),
        ({}, {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "1"}, ["not an integer"]),
        (
            {},
            {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}
            | {"MASTER_ADDR": "h", "MASTER_PORT": "1", "WORLD_SIZE": "4", "RANK": "1"},
            ["contradictory", "JAX_", "torchrun", "of 2", "of 4"],
        ),
        (
            {"coordinator": "a:1", "num_processes": 2, "process_id": 0},
            {"JAX_COORDINATOR_ADDRESS": "b:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"},
            ["contradictory", "a:1", "b:1"],
        ),
    ],
)
def test_incomplete_or_contradictory_descriptions_are_clear_errors(kwargs, env, words):
    with pytest.raises(WorldError) as info:
        resolve_world(**kwargs, env=env)
    for word in words:
        assert word in str(info.value), str(info.value)


def test_agreeing_sources_are_fine():
    env = {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}
    env |= {"MASTER_ADDR": "h", "MASTER_PORT": "1", "WORLD_SIZE": "2", "RANK": "1"}
    assert resolve_world(env=env).process_id == 1


def test_cluster_scripts_describe_a_consistent_job():
    import subprocess
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[1]
    assert subprocess.run(["bash", "-n", str(root / "scripts/slurm.sbatch")]).returncode == 0
    service, job = yaml.safe_load_all((root / "scripts/k8s-job.yaml").read_text())
    spec = job["spec"]
    env = {e["name"]: e for e in spec["template"]["spec"]["containers"][0]["env"]}
    n = int(env["JAX_NUM_PROCESSES"]["value"])
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == n
    assert "job-completion-index" in env["JAX_PROCESS_ID"]["valueFrom"]["fieldRef"]["fieldPath"]
    host, port = env["JAX_COORDINATOR_ADDRESS"]["value"].split(":")
    assert (
        host == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
        and int(port) == service["spec"]["ports"][0]["port"]
    )
    # What a pod of that job resolves to.
    pod = {"JAX_COORDINATOR_ADDRESS": f"{host}:{port}", "JAX_NUM_PROCESSES": str(n), "JAX_PROCESS_ID": "1"}
    w = resolve_world(env=pod)
    assert (w.num_processes, w.process_id, w.coordinator) == (n, 1, f"{host}:{port}")
