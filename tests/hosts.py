"""Several "hosts" on this machine: Linux network namespaces, each with its own network stack and one address on
a bridge that lives in a namespace of its own (nothing is added to this machine's own network), for multi-node
tests and scripts. Needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN) and `ip`; `unavailable()` says why not.

    with Hosts(2, shaped=(1,)) as hosts:
        procs = [hosts.run(i, ["jdp", "launch", ...]) for i in range(2)]
        hosts.partition(1); hosts.heal(1); hosts.shape(1, delay_ms=20, jitter_ms=5, loss_pct=1); hosts.kill(1)

Traffic goes only between the addresses made here (10.213.X.1, .2, ...; each namespace's loopback). Everything
made is removed on every path: leaving the `with`, an exception, SIGTERM or SIGINT to the process holding it, and
the next Hosts() removes what a killed holder (SIGKILL) left (namespaces are named after the holder's pid).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

PREFIX = "jdp-t"  # every namespace made here: jdp-t<holder pid>-<n>-{sw,h0,h1,...}


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str:
    """Why network namespaces cannot be made here ('' when they can): not root, no `ip`, or the kernel refuses."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    name = f"{PREFIX}{os.getpid()}-probe"
    made = _ip("netns", "add", name, check=False)
    if made.returncode:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return ""


def namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)]


def _holder_alive(name: str) -> bool:
    pid = name[len(PREFIX) :].split("-")[0]
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Remove the namespaces of holders that are gone (a test killed with SIGKILL), with their processes."""
    stale = [n for n in namespaces() if not _holder_alive(n)]
    for name in stale:
        _kill_in(name)
        _ip("netns", "del", name, check=False)
    return stale


def _pids_in(name: str) -> list[int]:
    out = _ip("netns", "pids", name, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _kill_in(name: str, sig: int = signal.SIGKILL) -> list[int]:
    pids = _pids_in(name)
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return pids


_count = 0


class Hosts:
    """n hosts, host i at address `addresses[i]` on one bridge (in its own namespace `switch`)."""

    def __init__(self, n: int, shaped: tuple[int, ...] = ()):
        """`shaped`: the hosts whose link `shape` may slow down later: a veth pair with `tc netem` where the kernel
        has sch_netem, else a link in user space (tests/wire.py) between two TAP devices."""
        global _count
        _count += 1
        remove_stale()
        self.n = n
        tag = f"{PREFIX}{os.getpid()}-{_count}"
        self.switch = f"{tag}-sw"
        self.names = [f"{tag}-h{i}" for i in range(n)]
        subnet = 100 + (os.getpid() + _count) % 150
        self.addresses = [f"10.213.{subnet}.{i + 1}" for i in range(n)]
        self._made: list[str] = []
        self._old_handlers: dict = {}
        self._wires: dict[int, subprocess.Popen] = {}
        self.shaped = tuple(shaped)
        self.wired = () if not netem_unavailable() else self.shaped

    # -- making and removing ---------------------------------------------------------------------------------------

    def __enter__(self) -> Hosts:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old_handlers[sig] = signal.getsignal(sig)
            signal.signal(sig, self._on_signal)
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _on_signal(self, sig, frame) -> None:
        self.close()
        signal.signal(sig, self._old_handlers.get(sig, signal.SIG_DFL))
        os.kill(os.getpid(), sig)

    def _make(self) -> None:
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, (name, address) in enumerate(zip(self.names, self.addresses, strict=True)):
            _ip("netns", "add", name)
            self._made.append(name)
            if i in self.wired:
                self._wire(i)
            else:  # the pair is made inside the namespaces: one end the host's eth0, the other a port of the bridge
                _ip("-n", self.switch, "link", "add", f"p{i}", "type", "veth", "peer", "name", "eth0", "netns", name)
            _ip("-n", self.switch, "link", "set", f"p{i}", "master", "br0", "up")
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            _ip("-n", name, "link", "set", "lo", "up")

    def _wire(self, i: int) -> None:
        """Host i's link through tests/wire.py: both TAP ends made in the switch's namespace by the wire process,
        then one moved into the host's namespace as its eth0 (the process keeps it open there)."""
        wire = subprocess.Popen([*self.command_in(self.switch), sys.executable, str(Path(__file__).with_name("wire.py")),
                                 f"t{i}", f"p{i}"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
        self._wires[i] = wire
        if wire.stdout.readline().strip() != "ready":
            raise RuntimeError(f"tests/wire.py for host {i} did not start (exit {wire.wait(10)})")
        _ip("-n", self.switch, "link", "set", f"t{i}", "netns", self.names[i])
        _ip("-n", self.names[i], "link", "set", f"t{i}", "name", "eth0")

    def close(self) -> None:
        """Kill every process in the hosts, remove every namespace made (the veth pairs and bridge go with them)."""
        for name in reversed(self._made):
            _kill_in(name)
        for name in reversed(self._made):
            for _ in range(50):  # a process just killed may hold the namespace a moment
                if _ip("netns", "del", name, check=False).returncode == 0 or name not in namespaces():
                    break
                time.sleep(0.1)
        self._made.clear()
        for wire in self._wires.values():
            wire.kill()
            wire.wait()
        self._wires.clear()
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()

    # -- running and faults ----------------------------------------------------------------------------------------

    def command(self, i: int, argv: list[str]) -> list[str]:
        return [*self.command_in(self.names[i]), *argv]

    @staticmethod
    def command_in(namespace: str) -> list[str]:
        return ["ip", "netns", "exec", namespace]

    def run(self, i: int, argv: list[str], log: Path | None = None, env: dict | None = None) -> subprocess.Popen:
        """Start argv on host i (stdout and stderr to `log`, else captured)."""
        out = open(log, "w") if log is not None else subprocess.PIPE  # noqa: SIM115 (the process owns it)
        return subprocess.Popen(self.command(i, argv), stdout=out, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True)  # fmt: skip

    def pids(self, i: int) -> list[int]:
        return _pids_in(self.names[i])

    def kill(self, i: int) -> list[int]:
        """SIGKILL every process on host i (its launcher included): the host is lost. Returns their pids."""
        return _kill_in(self.names[i])

    def signal(self, i: int, sig: int, pid: int) -> None:
        if pid not in self.pids(i):
            raise ValueError(f"process {pid} is not on host {i}")
        os.kill(pid, sig)

    def partition(self, i: int) -> None:
        """Host i's link down: it and its processes live on but reach no one (nor are reached)."""
        _ip("-n", self.switch, "link", "set", f"p{i}", "down")

    def heal(self, i: int) -> None:
        _ip("-n", self.switch, "link", "set", f"p{i}", "up")

    def shape(self, i: int, delay_ms: float = 0, jitter_ms: float = 0, loss_pct: float = 0) -> None:
        """Delay (with jitter) and loss on host i's link, both ways: tc netem on each end of its veth pair, or its
        user-space wire. Only for a host made with `Hosts(n, shaped=(i, ...))`."""
        if i not in self.shaped:
            raise ValueError(f"host {i} was not made shapeable: Hosts(n, shaped=({i},))")
        if i in self.wired:
            wire = self._wires[i]
            wire.stdin.write(json.dumps({"delay_ms": delay_ms, "jitter_ms": jitter_ms, "loss_pct": loss_pct}) + "\n")
            wire.stdin.flush()
            return
        for namespace, device in ((self.names[i], "eth0"), (self.switch, f"p{i}")):
            self._netem(namespace, device, delay_ms, jitter_ms, loss_pct)

    def _netem(self, namespace: str, device: str, delay_ms: float, jitter_ms: float, loss_pct: float) -> None:
        netem = ["delay", f"{delay_ms}ms", f"{jitter_ms}ms"] if delay_ms else []
        netem += ["loss", f"{loss_pct}%"] if loss_pct else []
        done = subprocess.run([*self.command_in(namespace), "tc", "qdisc", "replace", "dev", device, "root", "netem",
                               *netem], capture_output=True, text=True, timeout=30)  # fmt: skip
        if done.returncode:
            raise RuntimeError(f"tc netem on {device} in {namespace}: {done.stderr.strip()}")


def shape_unavailable() -> str:
    """Why no link can be shaped here ('' when one can): neither tc netem nor a TAP device (tests/wire.py)."""
    if not netem_unavailable():
        return ""
    if not os.path.exists("/dev/net/tun"):
        return f"{netem_unavailable()}, and /dev/net/tun (for tests/wire.py's TAP devices) is missing"
    return ""


def netem_unavailable() -> str:
    """Why `tc netem` cannot shape a link here ('' when it can): e.g. a kernel built without sch_netem."""
    if shutil.which("tc") is None:
        return "the `tc` command (iproute2) is not installed"
    try:
        import gzip

        config = gzip.decompress(Path("/proc/config.gz").read_bytes()).decode()
    except OSError:
        return ""  # the kernel does not say: try it
    if "CONFIG_NET_SCH_NETEM=y" not in config and "CONFIG_NET_SCH_NETEM=m" not in config:
        return "this kernel is built without sch_netem (CONFIG_NET_SCH_NETEM is not set in /proc/config.gz)"
    return ""
