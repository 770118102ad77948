"""Start-up: everything that happens before JAX touches a device.

Which job this process belongs to (explicit options, JAX's, torchrun's, SLURM's or Open MPI's variables), joining
it through `jax.distributed` with a watchdog, the XLA options jdp wants, and the host allocator setting. JAX is
imported only where a job is joined, so the command line can resolve a job (and print help) without it.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from jdp.log import PLAIN, logger, set_rank

__all__ = [
    "BIND_ENV",
    "COORDINATOR_PORT_ENV",
    "LAUNCHER_GRACE_S",
    "LAUNCHER_PID",
    "JoinError",
    "World",
    "WorldError",
    "bind_address",
    "check_port_free",
    "collective_flags",
    "flush_every_line",
    "initialize",
    "keep_scratch_memory",
    "resolve_world",
    "set_xla_flags",
    "tolerate_broken_pipes",
    "use_compilation_cache",
    "watch_launcher",
]

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


BIND_ENV = "JAX_COORDINATOR_BIND_ADDRESS"  # JAX's own variable; `jdp launch --coordinator-bind` sets it


def bind_address(
    coordinator: str | None, bind: str = "", env: Mapping[str, str] | None = None
) -> tuple[str | None, str]:
    """(HOST:PORT where process 0's coordination service listens, why). JAX's default is every interface,
    and the service has no authentication: jdp binds only where the other processes connect.

    An explicit address (parallel.coordinator_bind, else $JAX_COORDINATOR_BIND_ADDRESS; a HOST takes the
    coordinator's port) wins. Otherwise the coordinator's own address: a loopback one (a single-node job) stays on
    the loopback, an IP is bound as is, a host name is resolved here. A name that resolves to a loopback address
    on this host (Debian's 127.0.1.1 for its own name) says nothing about where other nodes connect from, so that
    case alone binds every interface, with a warning naming the fix. None: JAX finds the job (Open MPI) and binds.
    """
    env = os.environ if env is None else env
    explicit = bind or env.get(BIND_ENV, "")
    if coordinator is None:
        return (explicit or None), (
            "as asked" if explicit else "JAX's default (every interface): the job is auto-detected"
        )
    host, _, port = coordinator.rpartition(":")
    if explicit:
        has_port = "]:" in explicit if explicit.startswith("[") else explicit.count(":") == 1
        return (explicit if has_port else f"{explicit}:{port}"), "as asked"
    name = host.strip("[]")
    if name.lower() in ("localhost", "ip6-localhost"):
        return f"127.0.0.1:{port}", "the coordinator is on the loopback"
    try:
        ip = ipaddress.ip_address(name)
    except ValueError:
        try:
            ip = ipaddress.ip_address(socket.getaddrinfo(name, None)[0][4][0])
        except (OSError, ValueError):
            return f"[::]:{port}", f"{name} does not resolve here: every interface"
        if ip.is_loopback:
            return f"[::]:{port}", (
                f"{name} resolves to the loopback address {ip} on this host, so where other nodes connect from is "
                f"unknown: every interface (set parallel.coordinator_bind=ADDRESS to listen on one)"
            )
    where = f"[{ip}]" if ip.version == 6 else str(ip)
    return f"{where}:{port}", ("the coordinator is on the loopback" if ip.is_loopback else "the coordinator's address")


class JoinError(RuntimeError):
    """This process could not join its job: the coordination service's port is taken, or joining failed."""


def _where_the_port_comes_from(world: World) -> str:
    if world.source.startswith("torchrun"):
        return (
            "under torchrun jdp's coordination service takes MASTER_PORT + 1 (torchrun's own store holds "
            f"MASTER_PORT): set {COORDINATOR_PORT_ENV}=PORT to a free port on the first node"
        )
    if world.source.startswith("SLURM"):
        return (
            "under SLURM the port follows from the job id (JAX's rule): submit again, or pass --coordinator HOST:PORT"
        )
    if world.source.startswith("JAX_"):
        return "set JAX_COORDINATOR_ADDRESS to HOST:PORT with a free port (jdp launch: --coordinator)"
    return "pass --coordinator HOST:PORT with a free port"


def check_port_free(address: str, world: World) -> None:
    """Refuse, with the way out, a coordination-service address whose port another program holds on this host.

    gRPC cannot bind it either, and JAX then fails in ways that name nothing (a log line and a traceback, or a
    crash: jaxlib 0.10 segfaults), so process 0 tries the bind itself first (SO_REUSEADDR, as gRPC: a port in
    TIME_WAIT is fine).
    """
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        return  # no such address family here: nothing to learn, let JAX try
    with sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, int(port)))
        except OSError as e:
            raise JoinError(
                f"process 0 of {world.num_processes} cannot start the job's coordination service on {address}: "
                f"{e.strerror or e}. Another program holds port {port} on this host; {_where_the_port_comes_from(world)}"
            ) from None


def initialize(world: World, init_timeout_s: int = 300, heartbeat_timeout_s: int = 30, bind: str = "") -> str:
    """Join the job `world` describes (nothing to do for one process); returns the address this process meets the
    others on ('' when gloo chose it, or for one process). Call before anything touches devices.

    If the other processes have not all arrived within init_timeout_s, this process exits with a message
    naming the phase and what it waited for, instead of JAX's abort from deep inside its runtime. Process 0's
    coordination service listens only where bind_address says.
    """
    if world.num_processes == 1:
        return ""
    address, why = bind_address(world.coordinator, bind)
    if world.process_id == 0 and address is not None:
        check_port_free(address, world)
    if world.process_id == 0:  # JAX has not started: the rank is the World's
        warn = address is None or address.startswith(("[::]", "0.0.0.0"))
        text = f"the coordination service listens on {address or 'every interface'} ({why})"
        if warn and why != "as asked":
            log.warning(text, extra={"rank": 0})
        else:  # a notice; on stderr where it listens on every interface, as asked
            log.info(text, extra={**PLAIN, "rank": 0, "stderr": warn})
    import jax

    # CPU collectives across processes need gloo; GPU collectives use NCCL regardless of this setting.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    joined = threading.Event()

    def watchdog() -> None:
        if not joined.wait(init_timeout_s):
            waited_for = (
                f"all {world.num_processes} processes to register with this coordinator"
                if world.process_id == 0
                else f"the coordinator (process 0) at {world.coordinator or 'the auto-detected address'}"
            )
            log.error(
                f"process {world.process_id} of {world.num_processes} gave up after {init_timeout_s} s "
                f"waiting for {waited_for} (phase: initialization). A process never started, died before "
                f"joining, or cannot reach the coordinator; check the other processes' logs and the address, "
                f"or raise parallel.init_timeout_s.",
                extra={"rank": world.process_id},
            )
            os._exit(3)

    threading.Thread(target=watchdog, daemon=True, name="jdp-init-watchdog").start()
    meets_on = _gloo_for(world)
    kwargs = {}
    if not world.auto_detect:
        kwargs = dict(
            coordinator_address=world.coordinator,
            num_processes=world.num_processes,
            process_id=world.process_id,
            # jdp has described the job: inside any SLURM allocation (a `jdp launch` or torchrun worker in an
            # sbatch job too) JAX's detection would still replace local_device_ids=None by [SLURM_LOCALID].
            cluster_detection_method="deactivate",
        )
    try:
        jax.distributed.initialize(
            **kwargs,
            local_device_ids=list(world.local_device_ids) if world.local_device_ids else None,
            coordinator_bind_address=address,
            initialization_timeout=init_timeout_s + 30,  # our watchdog speaks first
            heartbeat_timeout_seconds=heartbeat_timeout_s,
            # A process that exits waits at most this long in JAX's shutdown barrier for peers that may be gone.
            shutdown_timeout_seconds=heartbeat_timeout_s,
        )
        jax.devices()  # the backend joins here too: on CPUs gloo connects the processes (names, addresses)
    except Exception as e:  # JAX's errors here are XlaRuntimeError, RuntimeError or ValueError, by version
        joined.set()
        first = _gloo_hint((str(e).strip().splitlines() or [type(e).__name__])[0], meets_on)
        raise JoinError(
            f"process {world.process_id} of {world.num_processes} could not join the job at "
            f"{world.coordinator or 'the auto-detected coordinator'} ({world.source}): {first}"
        ) from e
    joined.set()
    set_rank(jax.process_index())  # process 0 speaks for the job (jdp.log)
    return meets_on


def _gloo_hint(first: str, meets_on: str) -> str:
    """A failed join's first line, with how to fix gloo's address where gloo chose it (the host's own name)."""
    if "gloo" not in first or meets_on:
        return first
    name = socket.gethostname()
    return (
        f"{first}. gloo, the CPU collectives, found the address it listens on from this host's own name ({name}): "
        f"make `getent hosts {name}` answer with an address the other hosts reach, or name the interface in "
        f"${GLOO_IFNAME}"
    )


def _gloo_for(world: World) -> str:
    """use_gloo_on, said once per host (its first process); returns the address this process meets the others on
    ('' when gloo chose it)."""
    meets_on, line = use_gloo_on(world)
    if os.environ.get("LOCAL_RANK", "0") == "0":
        log.info(f"process {world.process_id}: {line}", extra={**PLAIN, "rank": 0})
    return meets_on


HOST_NAME = "this host's name"  # where gloo listens when jdp does not choose
GLOO_IFNAME = "GLOO_SOCKET_IFNAME"  # PyTorch's name for the interface gloo uses; jdp honours it too


def gloo_endpoint(world: World, env: Mapping[str, str] | None = None) -> tuple[dict, str]:
    """(how gloo, the CPU collectives, finds the address it listens on and tells the others, why).

    Left alone, gloo takes the address this host's own name resolves to: on many hosts (and in every network
    namespace of one machine) a loopback address, which the other hosts cannot reach ("Connection refused,
    remote=[127.0.0.1]"). jdp gives it the interface the user names ($GLOO_SOCKET_IFNAME), else the address this host
    reaches the coordinator from (a UDP socket's source address: nothing is sent), which is on the job's network
    by construction; for a single-host job that is the loopback, as before. {}: the job is auto-detected (no
    coordinator address to route to): gloo's own choice."""
    env = os.environ if env is None else env
    if iface := env.get(GLOO_IFNAME, "").split(",")[0].strip():
        return {"interface": iface}, f"${GLOO_IFNAME}"
    if not world.coordinator:
        return {}, "gloo's own choice (this host's name); set $GLOO_SOCKET_IFNAME to name the interface"
    host, _, port = world.coordinator.rpartition(":")
    address = source_address(host.strip("[]"), int(port))
    if address is None:
        return {}, f"gloo's own choice: no route to the coordinator {world.coordinator} from here"
    return {"hostname": address}, f"the address this host reaches the coordinator {world.coordinator} from"


def source_address(host: str, port: int) -> str | None:
    """The address this host sends from to reach host:port (a UDP socket's source: nothing is sent); None if
    there is no route."""
    try:
        family, kind, proto, _, where = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.connect(where)
            return probe.getsockname()[0]
    except OSError:
        return None


def use_gloo_on(world: World) -> tuple[str, str]:
    """Make JAX's CPU backend use gloo on gloo_endpoint's address (before any device is touched); returns the line
    that says where. JAX builds gloo from its own defaults; jdp registers the CPU backend's factory again with
    gloo made on that address (JAX's private API: jdp/jax_private.py).
    Returns (the address or interface gloo uses, '' where gloo chose it; the line)."""
    options, why = gloo_endpoint(world)
    where = options.get("hostname") or options.get("interface") or ""
    line = f"CPU collectives on {where or HOST_NAME} ({why})"
    if not options:
        return "", line
    try:
        from jdp.jax_private import use_gloo_cpu_backend

        use_gloo_cpu_backend(options)
    except (ImportError, AttributeError, TypeError, RuntimeError) as e:  # another JAX: its defaults, said so
        return (
            "",
            f"CPU collectives on this host's name: JAX {type(e).__name__} ({e}) kept jdp from choosing {where}",
        )
    return where, line


LAUNCHER_PID, LAUNCHER_GRACE_S = "JDP_LAUNCHER_PID", "JDP_LAUNCHER_GRACE_S"  # what `jdp launch` tells its workers


_watching = False


def watch_launcher(environ: Mapping[str, str] | None = None, poll_s: float = 0.5) -> bool:
    """In a worker of `jdp launch`: when the launcher dies (SIGKILL, OOM, scancel), stop too, never outlive it.

    The worker sends itself SIGTERM, which the training loop turns into a stop at a step every worker agrees on
    (they all lose the launcher at once) and a checkpoint; if it has not exited after the launcher's grace
    period, it exits anyway. True if this process is such a worker.
    """
    global _watching
    environ = os.environ if environ is None else environ
    if not environ.get(LAUNCHER_PID, "").isdigit():
        return False
    if _watching:  # once per process: the command line and the trainer both ask
        return True
    _watching = True
    launcher, grace_s = int(environ[LAUNCHER_PID]), float(environ.get(LAUNCHER_GRACE_S, "30"))

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(poll_s)
        log.error(
            f"the launcher (pid {launcher}) is gone; stopping this worker at a step the workers agree on (exiting "
            f"in at most {grace_s:g} s)"
        )
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        log.error(f"still running {grace_s:g} s after the launcher died; exiting")
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="jdp-launcher-watch").start()
    return True


class _Unbreakable:
    """A text stream whose writes never raise once its reader is gone (a dead launcher, a closed pipe): the
    output is lost, the process goes on (and so never dies in a way that strands its peers)."""

    def __init__(self, stream):
        self._stream, self.broken = stream, False

    def write(self, text: str) -> int:
        if not self.broken:
            try:
                return self._stream.write(text)
            except (BrokenPipeError, ConnectionResetError, ValueError):  # ValueError: written after close
                self.broken = True
        return len(text)

    def flush(self) -> None:
        if not self.broken:
            try:
                self._stream.flush()
            except (BrokenPipeError, ConnectionResetError, ValueError):
                self.broken = True

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def flush_every_line() -> None:
    """Line-buffer sys.stdout and sys.stderr: output to a file is otherwise held in a block buffer, and a process
    killed by SIGKILL (an OOM kill) would leave no line of what it was doing."""
    for stream in (sys.stdout, sys.stderr):
        if (reconfigure := getattr(stream, "reconfigure", None)) is not None:
            reconfigure(line_buffering=True)


def tolerate_broken_pipes() -> None:
    """Make sys.stdout and sys.stderr writes that find their pipe closed harmless (the output is dropped)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _Unbreakable):
            setattr(sys, name, _Unbreakable(stream))


def collective_flags(bucket_mb: float, combine_cpu_all_reduces: bool = False) -> dict[str, str]:
    """The XLA options jdp wants for its gradient collectives (see set_xla_flags). combine_cpu_all_reduces: the
    strategy's all-reduces are scalars only (zero1), so XLA:CPU may merge them (strategies/__init__.py)."""
    threshold = int(bucket_mb * 2**20) if bucket_mb > 0 else 2**40
    flags = {
        # GPUs: collectives already run asynchronously by default in this XLA; the latency-hiding scheduler
        # moves each bucket's all-reduce-start as early as its gradients exist, so it overlaps the rest of
        # backward, and a dedicated high-priority stream keeps it from queueing behind compute kernels.
        "xla_gpu_enable_latency_hiding_scheduler": "true",
        "xla_gpu_enable_highest_priority_async_stream": "true",
        # XLA merges neighbouring collectives up to this size: the bucket size, so it keeps jdp's buckets (zero1's
        # reduce-scatters and all-gathers too), and merges the small all-reduces (loss, norms) into one.
        "xla_gpu_all_reduce_combine_threshold_bytes": str(threshold),
        "xla_gpu_reduce_scatter_combine_threshold_bytes": str(threshold),
        "xla_gpu_all_gather_combine_threshold_bytes": str(threshold),
    }
    if not combine_cpu_all_reduces:
        # CPU: XLA would merge every all-reduce of the step into one; keep the buckets as planned. zero1's only
        # all-reduces are scalars (a gradient norm's partial sum per parameter): merged, they are one round trip.
        flags["xla_disable_hlo_passes"] = "cpu-all-reduce-combiner"
    return flags


def set_xla_flags(
    bucket_mb: float = 25.0, environ: dict | None = None, combine_cpu_all_reduces: bool = False
) -> list[str]:
    """Add jdp's collective options to XLA_FLAGS where the user has not set them; returns the ones added.

    XLA reads XLA_FLAGS once, when JAX first touches a device: call this before that (`jdp train` does).
    A flag already in XLA_FLAGS is left exactly as the user set it. No XLA:CPU speed option is added: none
    measured faster on every kind of CPU this project runs on (docs/performance.md), so XLA's defaults stand.
    """
    environ = os.environ if environ is None else environ
    current = environ.get("XLA_FLAGS", "")
    present = set(re.findall(r"--([\w]+)", current))
    wanted = collective_flags(bucket_mb, combine_cpu_all_reduces)
    added = [f"--{k}={v}" for k, v in wanted.items() if k not in present]
    if added:
        environ["XLA_FLAGS"] = " ".join([current, *added]).strip()
    return added


def use_compilation_cache(directory: str | Path) -> str:
    """Keep compiled programs in JAX's persistent cache at `directory`, unless JAX_COMPILATION_CACHE_DIR (or
    jax.config) already names one: a restart, a resume or a second run of the same config then loads its
    step instead of compiling it. Call before the first compilation. Returns the directory in use."""
    import jax

    if jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    Path(directory).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    if jax.config.jax_compilation_cache_max_size < 0:
        # Bounded; and with a bound JAX takes a file lock around every read and write, so the processes of a
        # job (or two jobs) sharing the directory never read a half-written entry.
        jax.config.update("jax_compilation_cache_max_size", 8 * 2**30)
    return str(directory)


_GPU_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin")


def keep_scratch_memory(environ: dict | None = None) -> bool:
    """Keep XLA:CPU's per-step scratch memory mapped from one step to the next; True if this changed malloc.

    XLA:CPU allocates a step's temporaries as one large block from a worker thread. glibc serves a block that
    large from a thread's arena with a fresh mmap and unmaps it when freed, so every step page-faults all of it
    in again (docs/performance.md has the measurement). One arena (the main heap, which has no size cap), no
    mmap and no trimming keep the block between steps, as PyTorch's caching allocators keep theirs; the price
    is that freed host memory goes back to the OS only at exit. Call it before JAX first touches a device
    (`jdp train` does). It does nothing where the C library is not glibc, where a GPU plugin is installed and
    JAX_PLATFORMS does not say cpu (temporaries live on the GPU there), or where the user set malloc options of
    their own (MALLOC_*, GLIBC_TUNABLES).
    """
    import ctypes
    import importlib.util
    import platform

    environ = os.environ if environ is None else environ
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    if any(k.startswith("MALLOC_") for k in environ) or "glibc.malloc" in environ.get("GLIBC_TUNABLES", ""):
        return False
    cpu_only = environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu"
    if not cpu_only and any(importlib.util.find_spec(name) for name in _GPU_PLUGINS):
        return False
    mallopt = ctypes.CDLL(None).mallopt
    M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8  # <malloc.h>
    return bool(mallopt(M_ARENA_MAX, 1) & mallopt(M_MMAP_MAX, 0) & mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
