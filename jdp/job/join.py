"""Joining the job through `jax.distributed`: where the coordination service listens (never every interface
unless asked), a taken port or a failed join named in one line, the join's watchdog, and where gloo (the CPU
collectives) meets the other processes."""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
from collections.abc import Mapping

from jdp.job.world import COORDINATOR_PORT_ENV, World
from jdp.job.xla import no_cache_across_processes
from jdp.log import PLAIN, logger, set_rank

__all__ = [
    "BIND_ENV",
    "GLOO_IFNAME",
    "HOST_NAME",
    "JoinError",
    "bind_address",
    "check_port_free",
    "gloo_endpoint",
    "initialize",
    "source_address",
    "use_gloo_on",
]


log = logger("jdp.join")


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
    no_cache_across_processes()  # before anything compiles (xla.CACHE_OFF_ACROSS_PROCESSES says why)
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
