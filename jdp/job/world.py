"""Which job this process belongs to, before JAX touches a device: explicit options, or what a launcher says
(JAX's, torchrun's, SLURM's or Open MPI's variables), one detector each; one process alone when none says. JAX is
not imported here, so the command line resolves a job (and prints help) without it. Joining the job is join.py's.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass

from jdp.log import logger

__all__ = ["COORDINATOR_PORT_ENV", "DESCRIBED", "SCHEDULERS", "World", "WorldError", "resolve_world", "slurm_step"]

log = logger("jdp.world")


@dataclass(frozen=True)
class World:
    """How this process joins a job: which coordinator, how many processes, which one it is."""

    coordinator: str | None  # HOST:PORT; None for one process, or when JAX's cluster detection finds it
    num_processes: int
    process_id: int
    source: str  # where the description came from, printed at start
    local_device_ids: tuple[int, ...] | None = None  # this process's GPUs; None: every visible one
    auto_detect: bool = False  # let jax.distributed find the job itself (SLURM, Open MPI)

    def describe(self) -> str:
        if self.num_processes == 1:
            return f"single process ({self.source})"
        where = self.coordinator or "auto-detected by JAX"
        return f"process {self.process_id} of {self.num_processes}, coordinator {where} (from {self.source})"


class WorldError(ValueError):
    """A job description that is incomplete or contradicts itself."""


def _int(source: str, name: str, value) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise WorldError(f"{source}: {name}={value!r} is not an integer") from None


def _checked(source: str, coordinator, n, pid, local_ids=None) -> World:
    missing = [
        k for k, v in (("coordinator", coordinator), ("number of processes", n), ("process id", pid)) if v in (None, "")
    ]
    if missing:
        raise WorldError(f"incomplete multi-process job description from {source}: missing {', '.join(missing)}")
    n, pid = _int(source, "number of processes", n), _int(source, "process id", pid)
    if n < 1 or not 0 <= pid < n:
        raise WorldError(f"{source}: process id {pid} is not in [0, {n}) for {n} processes")
    host, _, port = str(coordinator).rpartition(":")
    if n > 1 and (not host or not port.isdigit()):
        raise WorldError(f"{source}: coordinator {coordinator!r} must be HOST:PORT")
    return World(str(coordinator) if n > 1 else None, n, pid, source, local_ids)


def _slurm_coordinator(env: Mapping[str, str]) -> str:
    """The first host of the step's node list and JAX's port for this job id (as jax's SlurmCluster does)."""
    nodes = env["SLURM_STEP_NODELIST"]
    cut = next((i for i, ch in enumerate(nodes) if ch in ",["), len(nodes))
    host = nodes[:cut]
    if cut < len(nodes) and nodes[cut] == "[":
        rest = nodes[cut + 1 :]
        host += rest[: next((i for i, ch in enumerate(rest) if ch in ",-]"), len(rest))]
    return f"{host}:{int(env['SLURM_JOB_ID']) % 2**12 + (65535 - 2**12 + 1)}"


COORDINATOR_PORT_ENV = "JDP_COORDINATOR_PORT"  # the coordination service's port under torchrun's variables


def _torchrun_port(env: Mapping[str, str]) -> str | None:
    """The coordination service's port in a job described by torchrun's variables.

    torchrun itself (its elastic agent: TORCHELASTIC_RUN_ID is set) already listens on MASTER_PORT with its own
    TCPStore, so JAX's coordination service takes the next port, MASTER_PORT + 1. Where the variables were set by
    something else (a PyTorchJob pod, a script), MASTER_PORT is free and is used as is. $JDP_COORDINATOR_PORT
    overrides both.
    """
    if env.get(COORDINATOR_PORT_ENV):
        return str(_int(COORDINATOR_PORT_ENV, "port", env[COORDINATOR_PORT_ENV]))
    port = env.get("MASTER_PORT")
    if port and env.get("TORCHELASTIC_RUN_ID"):
        return str(_int("torchrun", "MASTER_PORT", port) + 1)
    return port


def _slurm_gpus(env: Mapping[str, str]) -> tuple[int, ...] | None:
    """This task's GPUs (ordinals among those it sees); None: every one it sees.

    One task per node (scripts/slurm.sbatch's default) drives all of its node's GPUs, and a task that SLURM gave
    GPUs of its own (--gpus-per-task) sees only those: None. Several tasks that share a node and all see its GPUs
    split them evenly, in SLURM_LOCALID order (as `jdp launch` splits them; one each with --gpus-per-node=8
    --ntasks-per-node=8), like torchrun's LOCAL_RANK. JAX's own SLURM detection gives every task the GPU numbered
    SLURM_LOCALID instead: GPU 0 alone with one task per node, and a GPU that is not there under --gpus-per-task.
    """
    tasks = _int("SLURM", "SLURM_STEP_NUM_TASKS", env.get("SLURM_STEP_NUM_TASKS", env["SLURM_NTASKS"]))
    per_node = tasks // max(_int("SLURM", "SLURM_STEP_NUM_NODES", env.get("SLURM_STEP_NUM_NODES", "1")), 1)
    visible = [g for g in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    if per_node <= 1 or len(visible) == 1:
        return None
    local = _int("SLURM", "SLURM_LOCALID", env["SLURM_LOCALID"])
    each = len(visible) // per_node if visible and len(visible) % per_node == 0 else 1
    return tuple(range(local * each, (local + 1) * each))


def _from_jax(env: Mapping[str, str]) -> World | None:
    """JAX's own variables (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID; jdp launch sets them)."""
    if not any(env.get(k) for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")):
        return None
    ids = env.get("JDP_LOCAL_DEVICE_IDS")
    local = tuple(_int("JDP_LOCAL_DEVICE_IDS", "id", i) for i in ids.split(",")) if ids else None
    coord, n, pid = env.get("JAX_COORDINATOR_ADDRESS"), env.get("JAX_NUM_PROCESSES"), env.get("JAX_PROCESS_ID")
    return _checked("JAX_* variables", coord, n, pid, local)


def _from_torchrun(env: Mapping[str, str]) -> World | None:
    """torchrun's variables (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK, LOCAL_RANK, LOCAL_WORLD_SIZE)."""
    if not any(env.get(k) for k in ("WORLD_SIZE", "RANK")):
        return None
    addr, port = env.get("MASTER_ADDR"), _torchrun_port(env)
    n = env.get("WORLD_SIZE")
    coord = f"{addr}:{port}" if addr and port else ("localhost:0" if n == "1" else None)
    # torchrun starts one process per GPU: LOCAL_RANK picks this process's GPU.
    per_node = _int("torchrun", "LOCAL_WORLD_SIZE", env.get("LOCAL_WORLD_SIZE", "1"))
    local = (_int("torchrun", "LOCAL_RANK", env["LOCAL_RANK"]),) if per_node > 1 and env.get("LOCAL_RANK") else None
    return _checked("torchrun variables (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK)", coord, n, env.get("RANK"), local)


def _from_slurm(env: Mapping[str, str]) -> World | None:
    """SLURM's variables, inside a job step (srun)."""
    if not all(k in env for k in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
                                  "SLURM_LOCALID")):  # fmt: skip
        return None
    n = _int("SLURM", "SLURM_NTASKS", env["SLURM_NTASKS"])
    return _checked("SLURM variables", _slurm_coordinator(env), n, env["SLURM_PROCID"], _slurm_gpus(env))


def slurm_step(env: Mapping[str, str]) -> tuple[int, int, str] | None:
    """Inside a SLURM job step (srun): (its tasks, this task's rank, the first node and JAX's port for the job id);
    None elsewhere (a batch script, an salloc shell, no SLURM). `jdp launch` run by srun takes each task for one
    node of the launch from it."""
    if not all(k in env for k in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_STEP_NUM_TASKS", "SLURM_PROCID")):
        return None
    tasks = _int("SLURM", "SLURM_STEP_NUM_TASKS", env["SLURM_STEP_NUM_TASKS"])
    return tasks, _int("SLURM", "SLURM_PROCID", env["SLURM_PROCID"]), _slurm_coordinator(env)


def _from_open_mpi(env: Mapping[str, str]) -> World | None:
    """Open MPI's variables (mpirun): JAX finds the coordinator itself."""
    if "OMPI_COMM_WORLD_SIZE" not in env:
        return None
    n, pid = env["OMPI_COMM_WORLD_SIZE"], env.get("OMPI_COMM_WORLD_RANK")
    world = _checked("Open MPI variables", "auto:0", n, pid)
    return dataclasses.replace(world, coordinator=None, auto_detect=world.num_processes > 1)


# How a job describes itself, one detector each (env -> World, or None when it finds nothing): a new launcher is
# one more entry. DESCRIBED ones must agree where more than one is found; a SCHEDULER's is only consulted when none
# is (a launcher running inside a SLURM allocation describes its own workers with JAX's variables).
DESCRIBED = (_from_jax, _from_torchrun)
SCHEDULERS = (_from_slurm, _from_open_mpi)


def resolve_world(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: tuple[int, ...] | None = None,
    env: Mapping[str, str] | None = None,
) -> World:
    """The job this process belongs to, from the first of: explicit options, then the detectors (DESCRIBED: JAX's
    variables, torchrun's; SCHEDULERS: SLURM's, Open MPI's); one process alone when none finds one.

    The explicit options and the DESCRIBED detectors must agree where more than one is given; the SCHEDULERS are
    only consulted when none is.
    """
    env = os.environ if env is None else env
    found: list[World] = []
    if any(v is not None for v in (coordinator, num_processes, process_id)):
        found.append(_checked("explicit options", coordinator, num_processes, process_id, local_device_ids))
    found += [w for detect in DESCRIBED if (w := detect(env)) is not None]
    if found:
        first = found[0]
        for other in found[1:]:
            if (other.num_processes, other.process_id) != (first.num_processes, first.process_id) or (
                other.num_processes > 1 and other.coordinator != first.coordinator
            ):
                raise WorldError(
                    f"contradictory job description: {first.source} say process {first.process_id} of "
                    f"{first.num_processes} at {first.coordinator}, {other.source} say process {other.process_id} "
                    f"of {other.num_processes} at {other.coordinator}; remove one of them"
                )
        return first
    for detect in SCHEDULERS:
        if (world := detect(env)) is not None:
            return world
    return World(None, 1, 0, "no job description found")
