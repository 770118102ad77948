"""A real single-node SLURM cluster of our own, in a temporary directory: munged, slurmctld and slurmd.

The tests run jdp under real `srun`, `sbatch` and `scancel` with it, as a user on a cluster would. Nothing of the
machine's own configuration is used or touched: the cluster has its own munge key and socket, its own slurm.conf
(free ports, state, spool and logs in the directory), and every daemon runs in the foreground, so the PIDs started
here are the daemons. The client commands find the cluster through SLURM_CONF in `Cluster.env`, never through
os.environ. From a script:

    with Cluster(Path("/tmp/c")) as cluster:
        subprocess.run(["sinfo"], env=cluster.env)

Needs root (slurmd starts jobs as any user, munged and the daemons run as root here) and the Debian packages
`slurm-wlm` and `munge`; `unavailable()` says why not when they are missing.
"""

from __future__ import annotations

import functools
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil

DAEMONS = {"munged": "/usr/sbin/munged", "slurmctld": "/usr/sbin/slurmctld", "slurmd": "/usr/sbin/slurmd"}
CLIENTS = ("srun", "sbatch", "scancel", "squeue", "scontrol", "sinfo")
KILL_WAIT_S = 10  # slurm.conf's KillWait: seconds between scancel's SIGTERM and its SIGKILL
MARK = "JDP_TEST_SLURM_CLUSTER"  # in every daemon's environment (and so every slurmstepd's), naming the cluster

# Variables that would make a client command or a job find another cluster, job or launcher than this one.
_FOREIGN_PREFIXES = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "SQUEUE_", "SCANCEL_", "JAX_", "MASTER_", "OMPI_")
_FOREIGN = {"WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID"}
_FOREIGN |= {"JDP_LAUNCHER_PID", "JDP_LAUNCHER_GRACE_S", "JDP_LOCAL_DEVICE_IDS", "JDP_COORDINATOR_PORT"}


@functools.cache
def _die_with_parent() -> tuple[str, ...]:
    """A prefix that execs a command in its own place (its PID stays the command's) with SIGKILL as its
    parent-death signal, so a test run that is itself killed takes its daemons with it (util-linux's setpriv)."""
    setpriv = shutil.which("setpriv")
    if setpriv and "--pdeathsig" in subprocess.run([setpriv, "--help"], capture_output=True, text=True).stdout:
        return (setpriv, "--pdeathsig", "KILL")
    return ()


def unavailable() -> str | None:
    """Why a cluster cannot be started on this machine (None if it can)."""
    missing = [p for p in DAEMONS.values() if not os.access(p, os.X_OK)]
    missing += [c for c in CLIENTS if shutil.which(c) is None]
    if missing:
        return f"SLURM or munge is not installed (missing {', '.join(missing)}; apt-get install slurm-wlm munge)"
    if os.geteuid() != 0:
        return "a test SLURM cluster needs root (slurmd and munged run as root here)"
    try:
        socket.getaddrinfo(socket.gethostname(), None)
    except OSError as e:
        return f"this machine's own name {socket.gethostname()!r} does not resolve ({e}): SLURM names nodes by it"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def clean_env(base: dict | None = None) -> dict:
    """`base` (os.environ) without the variables of another SLURM job, launcher or JAX job."""
    base = dict(os.environ if base is None else base)
    return {k: v for k, v in base.items() if not k.startswith(_FOREIGN_PREFIXES) and k not in _FOREIGN}


class ClusterError(RuntimeError):
    """The cluster did not come up; the message holds the daemons' logs."""


class Cluster:
    """One node (this machine, by its own name) and one default partition; start() and stop(), or `with`."""

    def __init__(self, root: Path, cpus: int | None = None):
        self.root = Path(root)
        self.node = socket.gethostname()
        # Two at least: the tests run 2 tasks of one CPU each (config_overrides lets slurmd take the count).
        self.cpus = cpus or max(os.cpu_count() or 1, 2)
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = {**clean_env(), "SLURM_CONF": str(self.conf)}  # for the client commands and the jobs
        self.started_in_s: float | None = None

    # -- setup ------------------------------------------------------------------------------------------------
    def _write_files(self) -> None:
        r = self.root
        for d in ("munge", "state", "spool", "log"):
            (r / d).mkdir(parents=True, exist_ok=True, mode=0o755)  # munged wants its socket's directory open
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))  # what `dd if=/dev/urandom bs=1 count=1024` writes
        key.chmod(0o400)
        (r / "plugstack.conf").write_text("")  # not the machine's /etc/slurm/plugstack.conf
        # Job ids start at a random number: JAX derives the coordinator's port from the job id, and two test
        # sessions on one machine would otherwise both run job 1 on the same port.
        first_job_id = random.randrange(1000, 60000)
        self.conf.write_text(
            f"""\
# A one-node test cluster written by tests/slurm.py.
ClusterName=jdptest
SlurmctldHost={self.node}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
StateSaveLocation={r / "state"}
SlurmdSpoolDir={r / "spool"}
SlurmctldPidFile={r / "slurmctld.pid"}
SlurmdPidFile={r / "slurmd.pid"}
SlurmctldDebug=info
SlurmdDebug=info
PlugStackConfig={r / "plugstack.conf"}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
ReturnToService=2
# scancel without --signal: SIGCONT and SIGTERM, then SIGKILL this many seconds later (tests/test_slurm.py).
KillWait={KILL_WAIT_S}
InactiveLimit=0
MinJobAge=300
FirstJobId={first_job_id}
SlurmdParameters=config_overrides
NodeName={self.node} CPUs={self.cpus} RealMemory=1024 State=UNKNOWN
PartitionName=test Nodes={self.node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""
        )

    def _start(self, name: str, argv: list[str]) -> None:
        argv = [*_die_with_parent(), *argv]
        log = open(self.root / "log" / f"{name}.out", "wb")
        env = {**self.env, MARK: str(self.root)}
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.root)
        log.close()

    def logs(self, lines: int = 30) -> str:
        """The tail of every daemon's log, for an error message."""
        out = []
        for f in sorted((self.root / "log").glob("*")):
            text = f.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {f} ---\n" + "\n".join(text))
        return "\n".join(out)

    def client(
        self, *argv: str, timeout: float = 30, check: bool = True, env: dict | None = None, cwd: Path | None = None
    ) -> subprocess.CompletedProcess:
        """Run a SLURM client command (`squeue`, `sbatch`, ...) against this cluster (env: self.env or one
        derived from it)."""
        out = subprocess.run(list(argv), env=env or self.env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise ClusterError(f"{' '.join(argv)} exited {out.returncode}: {out.stderr.strip()}")
        return out

    def job(self, job_id: str) -> str:
        """`scontrol show job` of one job, on one line (finished jobs stay for MinJobAge, 300 s)."""
        return self.client("scontrol", "show", "job", "-o", job_id, check=False).stdout.strip()

    def job_state(self, job_id: str) -> str:
        """PENDING, RUNNING, COMPLETING, COMPLETED, CANCELLED, FAILED, ... ('' if slurmctld forgot the job)."""
        m = re.search(r"\bJobState=(\S+)", self.job(job_id))
        return m.group(1) if m else ""

    def node_state(self) -> str:
        out = self.client("sinfo", "-h", "-N", "-n", self.node, "-o", "%T", check=False, timeout=10)
        return out.stdout.strip().lower() if out.returncode == 0 else f"(sinfo: {out.stderr.strip()})"

    def start(self, timeout: float = 60) -> Cluster:
        """Start munged, slurmctld and slurmd; return once the node is idle. On failure nothing is left running."""
        t0 = time.monotonic()
        try:
            self._write_files()
            m = self.root / "munge"
            self._start(
                "munged",
                [DAEMONS["munged"], "-F", "--force", f"--key-file={m / 'munge.key'}", f"--socket={self.munge_socket}",
                 f"--pid-file={m / 'munged.pid'}", f"--log-file={self.root / 'log' / 'munged.log'}",
                 f"--seed-file={m / 'munged.seed'}"],
            )  # fmt: skip
            self._wait(lambda: self.munge_socket.exists(), timeout, "munged to create its socket")
            self._start("slurmctld", [DAEMONS["slurmctld"], "-D", "-i", "-f", str(self.conf)])
            self._start("slurmd", [DAEMONS["slurmd"], "-D", "-N", self.node, "-f", str(self.conf)])
            self._wait(lambda: self.node_state() == "idle", timeout, f"node {self.node} to be idle in sinfo")
        except BaseException:
            self.stop()
            raise
        self.started_in_s = time.monotonic() - t0
        print(f"slurm: one-node cluster ({self.node}, {self.cpus} CPUs) up in {self.started_in_s:.1f} s")
        return self

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [f"{n} (exit {p.returncode})" for n, p in self.procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"{', '.join(dead)} exited" if dead else f"gave up after {timeout:g} s"
                raise ClusterError(
                    f"test SLURM cluster in {self.root}: waiting for {what}: {why} (node state: {self.node_state()})"
                    f"\n{self.logs()}"
                )
            time.sleep(0.2)

    # -- teardown ---------------------------------------------------------------------------------------------
    def strays(self) -> list[psutil.Process]:
        """Processes of this cluster other than its daemons: slurmstepd (started by slurmd, then detached from
        it) and job tasks, found by the variables they inherit (MARK from the daemons, SLURM_CONF from a job's
        submission)."""
        mine, ours = {str(self.root)}, {str(self.conf)}
        found = []
        for p in psutil.process_iter():
            if p.pid in {d.pid for d in self.procs.values()} or p.pid == os.getpid():
                continue
            try:
                env = p.environ()
            except (psutil.Error, OSError):
                continue
            if env.get(MARK) in mine or env.get("SLURM_CONF") in ours:
                found.append(p)
        return found

    def stop(self, grace_s: float = 10) -> None:
        """Cancel every job, stop the daemons this object started (SIGTERM, SIGKILL after grace_s) and kill
        whatever process of the cluster is left (steps, tasks). Safe to call twice, and after a failed start."""
        if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            try:
                self.client("scancel", "--user=root", "--signal=KILL", "--full", check=False, timeout=10)
                self.client("scancel", "--user=root", check=False, timeout=10)
                deadline = time.monotonic() + grace_s
                while time.monotonic() < deadline and self.client("squeue", "-h", check=False, timeout=10).stdout:
                    time.sleep(0.3)
            except (subprocess.TimeoutExpired, OSError):
                pass
        for name in ("slurmd", "slurmctld", "munged"):  # the reverse of the start order
            p = self.procs.get(name)
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(grace_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        left = self.strays()
        for p in left:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(left, timeout=grace_s)

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
