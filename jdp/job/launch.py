"""`jdp launch`, the torchrun of jdp: start this node's workers, watch them, and never hang when one fails."""

from __future__ import annotations

import difflib
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from jdp.job.join import source_address
from jdp.job.process import INTERRUPTED_EXIT
from jdp.job.rendezvous import Rendezvous, RendezvousError
from jdp.job.world import slurm_step
from jdp.log import logger

__all__ = [
    "worker_argv",
    "LaunchError",
    "Launcher",
    "Slots",
    "Worker",
    "check_command",
    "check_counts",
    "cpu_flags",
    "cpu_groups",
    "free_port",
    "gpu_groups",
    "launch",
    "place",
    "say",
    "signal_workers",
    "spawn",
]

log = logger("jdp.launch")
# Variables of other launchers that would contradict the JAX_* description given to each worker.
_FOREIGN = ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE", "GROUP_RANK")


class LaunchError(ValueError):
    """A launch that cannot start: bad options, devices that do not split over the workers."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpu_groups(nproc: int) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES for each worker: this node's GPUs split into equal contiguous groups."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [x.strip() for x in visible.split(",") if x.strip()]
    elif shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
        ids = [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]
    else:
        ids = []
    if not ids:
        return None
    if len(ids) % nproc:
        raise LaunchError(f"{len(ids)} GPUs do not split evenly over --nproc-per-node {nproc} workers")
    k = len(ids) // nproc
    return [",".join(ids[i * k : (i + 1) * k]) for i in range(nproc)]


def cpu_groups(nproc: int) -> list[set[int]] | None:
    """This process's allowed cores split into nproc equal disjoint sets (None if there are too few)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    each = len(cores) // nproc
    if each == 0:
        return None
    return [set(cores[i * each : (i + 1) * each]) for i in range(nproc)]


def cpu_flags(devices_each: int) -> str:
    """XLA_FLAGS for a worker that simulates `devices_each` CPU devices (the user's other flags kept)."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")).strip()
    return f"{flags} --xla_force_host_platform_device_count={devices_each}".strip()


@dataclass
class Worker:
    rank: int  # global process id
    local_rank: int
    proc: subprocess.Popen
    last_err: deque = field(default_factory=lambda: deque(maxlen=200))  # a C++ abort prints ~60 frames
    threads: list = field(default_factory=list)

    def last_error(self, nproc_per_node: int = 0) -> str:
        lines = [ln.strip() for ln in self.last_err if ln.strip()]
        if lost := lost_peers(lines, nproc_per_node):
            return lost
        lines = [ln for ln in lines if not ln.startswith(("@ 0x", "*** Check failure"))]  # a C++ stack's frames
        errors = [ln for ln in lines if re.search(r"error|Error|Exception|Traceback|Killed|Aborted", ln)]
        return (errors or lines or ["(no output on stderr)"])[-1][:500]


def lost_peers(lines: list[str], nproc_per_node: int = 0) -> str:
    """What JAX's coordination service said when it ended a worker for a lost peer, in a sentence: which
    processes (and nodes) stopped sending heartbeats, or that this worker lost the coordinator. '' if neither."""
    for i, line in enumerate(lines):
        if "tasks are unhealthy" in line:
            ids = []
            for later in lines[i + 1 :]:
                if not later.isdigit():
                    break
                ids.append(int(later))
            ids.sort()
            nodes = sorted({r // nproc_per_node for r in ids}) if nproc_per_node and ids else []
            where = f" (node{'s' if len(nodes) > 1 else ''} {', '.join(map(str, nodes))})" if nodes else ""
            who = f"process{'es' if len(ids) > 1 else ''} {', '.join(map(str, ids))}{where}" if ids else "processes"
            return (f"the job's coordination service lost {who}: no heartbeat within parallel.heartbeat_timeout_s "
                    f"(a host died, hangs, or its network is cut)")  # fmt: skip
    for i, line in enumerate(lines):
        if "detected fatal errors" not in line:
            continue
        after = " ".join(lines[i : i + 4])
        if "/Heartbeat" in after:
            return ("this worker lost the job's coordinator (process 0): its heartbeats went unanswered for "
                    "parallel.heartbeat_timeout_s (the coordinator's host died, hangs, or the network to it is cut)")  # fmt: skip
        if "Socket closed" in after or "Stream removed" in after or "Connection reset" in after:
            return ("this worker lost the job's coordinator (process 0): its connection closed (the coordinator's "
                    "process or host is gone)")  # fmt: skip
        return "JAX's coordination service ended this worker: " + line.split("absl::Status:")[-1].strip()[:300]
    return ""


# gloo's C++ writes "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1" once per
# CPU client at start, in pieces (one per `<<`); two clients in one process interleave them ("[Gloo] Rank [Gloo] Rank 0
# is ...", "... peer ranks. [Gloo] Rank Expected number ..."), so a line is gloo's when it holds a piece of that
# message and nothing but its pieces and numbers.
_GLOO_PIECES = (b"Expected number of connected peer ranks is :", b"[Gloo] Rank", b"is connected to", b"peer ranks.")
_GLOO_REST = re.compile(rb"|".join(re.escape(p) for p in _GLOO_PIECES) + rb"|\d+|\s+")


def _gloo_noise(text: bytes) -> bool:
    """Whether a line is (pieces of) gloo's connected message: noise, nothing to act on."""
    return any(p in text for p in _GLOO_PIECES) and not _GLOO_REST.sub(b"", text)


def _pump(worker: Worker, stream, out, keep: bool) -> None:
    """Copy a worker's output to ours, each line prefixed with its rank (progress bars' \\r lines too)."""
    prefix = f"[rank {worker.rank}] ".encode()
    pending = b""
    for chunk in iter(lambda: stream.read1(65536), b""):
        pending += chunk
        parts = re.split(rb"(\r|\n)", pending)
        pending = parts.pop()  # an unfinished line waits for the rest
        for text, end in zip(parts[0::2], parts[1::2], strict=True):
            if _gloo_noise(text):
                continue
            out.write(prefix + text + end)
            if keep:
                worker.last_err.append(text.decode(errors="replace"))
        out.flush()
    if pending:
        out.write(prefix + pending + b"\n")
        if keep:
            worker.last_err.append(pending.decode(errors="replace"))
        out.flush()


def spawn(argv: list[str], env: dict, rank: int, local: int, pin: set[int] | None = None) -> Worker:
    """Start one worker in its own process group (we can stop it and everything it started), its output copied to
    ours line by line with its rank; on `pin`'s cores when given."""
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    if pin:
        # XLA:CPU sizes its thread pool to the cores it may run on, when JAX first touches a device (seconds after
        # start): give each worker its own share (torchrun's OMP_NUM_THREADS=1, done per core set) instead of every
        # worker using every core. Threads inherit the mask.
        os.sched_setaffinity(proc.pid, pin)
    w = Worker(rank, local, proc)
    w.threads = [
        threading.Thread(target=_pump, args=(w, proc.stdout, sys.stdout.buffer, False), daemon=True),
        threading.Thread(target=_pump, args=(w, proc.stderr, sys.stderr.buffer, True), daemon=True),
    ]
    for t in w.threads:
        t.start()
    return w


def signal_workers(workers: list[Worker], sig: int) -> None:
    """`sig` to each running worker's process group (the worker and everything it started)."""
    for w in workers:
        if w.proc.poll() is None:
            try:
                os.killpg(w.proc.pid, sig)
            except ProcessLookupError:
                pass


def say(msg: str, level: int = logging.INFO, prefix: str = "jdp launch: ") -> None:
    """The launcher's own lines: on stderr (its stdout carries the workers' output), from every node's launcher."""
    log.log(level, msg, extra={"prefix": prefix, "stderr": True, "all_ranks": True})


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class Slots:
    """This node's worker slots: each one's GPUs (or simulated CPU devices and its share of the cores) and the
    environment every worker of `jdp launch` gets, whatever job it joins."""

    def __init__(self, args):
        self.args, self.gpus = args, gpu_groups(args.nproc_per_node)
        self.cores = cpu_groups(args.nproc_per_node) if self.gpus is None and args.pin_cpus else None

    def env(self, local: int) -> tuple[dict, set[int] | None]:
        """Slot `local`'s environment and the cores to pin it to (None: not pinned)."""
        a = self.args
        env = {k: v for k, v in os.environ.items() if k not in _FOREIGN}
        env.update(
            LOCAL_RANK=str(local),
            PYTHONUNBUFFERED="1",
            # The worker stops (at an agreed step, then for good after --grace-s) if this launcher dies.
            JDP_LAUNCHER_PID=str(os.getpid()),
            JDP_LAUNCHER_GRACE_S=str(a.grace_s),
        )
        if self.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.gpus[local]
            return env, None
        env["XLA_FLAGS"] = cpu_flags(a.devices_per_proc)
        env.setdefault("JAX_PLATFORMS", "cpu")
        return env, self.cores[local] if self.cores else None

    def describe(self) -> str:
        where = f"GPUs {self.gpus}" if self.gpus else f"{self.args.devices_per_proc} CPU device(s) each"
        return where + (f", cores {[sorted(c) for c in self.cores]}" if self.cores else "")


class Launcher:
    def __init__(self, args, command: list[str]):
        self.args, self.command = args, command
        self.workers: list[Worker] = []
        self.signalled = 0
        self.kill_at = float("inf")

    def start(self, coordinator: str, node_rank: int, nnodes: int) -> None:
        a = self.args
        world, slots = nnodes * a.nproc_per_node, Slots(a)
        self.workers = []
        for local in range(a.nproc_per_node):
            rank = node_rank * a.nproc_per_node + local
            env, pin = slots.env(local)
            env.update(JAX_COORDINATOR_ADDRESS=coordinator, JAX_NUM_PROCESSES=str(world), JAX_PROCESS_ID=str(rank))
            if a.coordinator_bind:  # where node 0's coordination service listens (jdp.job.join.bind_address)
                env["JAX_COORDINATOR_BIND_ADDRESS"] = a.coordinator_bind
            self.workers.append(spawn(worker_argv(self.command), env, rank, local, pin))
        say(f"started ranks {[w.rank for w in self.workers]} of {world} ({slots.describe()}), coordinator {coordinator}")

    def rendezvous(self) -> Rendezvous | None:
        """The elastic rendezvous (--nnodes MIN:MAX), or None for a fixed world."""
        a = self.args
        if a.min_nodes == a.nnodes:
            return None
        host, _, port = a.coordinator.rpartition(":")
        address = a.local_addr or source_address(host.strip("[]"), int(port)) or socket.gethostname()
        return Rendezvous(a.rdzv_dir, a.min_nodes, a.nnodes, a.nproc_per_node, address, a.node_rank, a.rdzv_timeout)

    def signal_all(self, sig: int) -> None:
        signal_workers(self.workers, sig)

    def stop_all(self) -> None:
        """SIGTERM every worker still running, then SIGKILL what is left after the grace period."""
        self.signal_all(signal.SIGTERM)
        deadline = time.monotonic() + self.args.grace_s
        while time.monotonic() < deadline and any(w.proc.poll() is None for w in self.workers):
            time.sleep(0.05)
        self.signal_all(signal.SIGKILL)
        for w in self.workers:
            w.proc.wait()
            for t in w.threads:
                t.join(timeout=2)

    def watch(self) -> tuple[int, Worker | None]:
        """Wait until every worker exits 0 (returns 0) or one fails (returns its code and the worker)."""
        while True:
            if self.signalled and time.monotonic() > self.kill_at:
                say(f"workers still running {self.args.grace_s:g} s after the signal: killing them", logging.WARNING)
                self.signal_all(signal.SIGKILL)
                self.kill_at = float("inf")
            for w in self.workers:
                code = w.proc.poll()
                if code not in (None, 0):
                    return code, w
            if all(w.proc.poll() == 0 for w in self.workers):
                return 0, None
            time.sleep(0.05)

    def on_signal(self, sig, frame) -> None:
        self.signalled += 1
        if self.signalled == 1:
            say(
                f"got {signal.Signals(sig).name}: passing it to the workers; they get {self.args.grace_s:g} s "
                f"to exit (send it again to kill them at once)",
                logging.WARNING,
            )
            self.kill_at = time.monotonic() + self.args.grace_s
            self.signal_all(sig)
        else:
            self.signal_all(signal.SIGKILL)

    def run(self) -> int:
        a = self.args
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self.on_signal)
        try:
            rdzv = self.rendezvous()
            r = rdzv.first_round() if rdzv else 0
        except RendezvousError as e:  # the directory cannot be used: before any worker starts
            say(str(e), logging.ERROR, prefix="jdp launch: error: ")
            return 2
        for attempt in range(a.max_restarts + 1):
            coordinator = a.coordinator or f"127.0.0.1:{free_port()}"
            node_rank, nnodes = a.node_rank, a.nnodes
            if rdzv is not None:
                try:
                    joined = rdzv.join(r, say)
                except RendezvousError as e:
                    say(str(e), logging.ERROR)
                    return 1
                if joined is None:
                    say("the job finished while this node waited to join it")
                    return 0
                r, node_rank, nnodes = joined.round, joined.node_rank, joined.nnodes
                coordinator = f"{joined.coordinator_host}:{a.coordinator.rpartition(':')[2]}"
                say(f"rendezvous round {r}: {nnodes} of {a.min_nodes}-{a.nnodes} nodes ({', '.join(joined.members)}); "
                    f"this node is node {node_rank}")  # fmt: skip
            self.start(coordinator, node_rank, nnodes)
            code, failed = self.watch()
            if rdzv is not None and failed is None:
                rdzv.end(r, ok=True)
            if failed is None:
                for w in self.workers:
                    for t in w.threads:
                        t.join(timeout=2)
                say("all workers finished")
                return 0
            if self.signalled and code == INTERRUPTED_EXIT:  # stopped on the interrupt every worker was passed
                say(f"worker rank {failed.rank} stopped on the interrupt; waiting for the others to stop on it too")
                while time.monotonic() < self.kill_at and any(w.proc.poll() is None for w in self.workers):
                    time.sleep(0.05)  # each says why it stopped (rank 0 for the job) before the rest are ended
            else:
                say(
                    f"worker rank {failed.rank} (local rank {failed.local_rank}, pid {failed.proc.pid}) "
                    f"{_describe_exit(code)}; last error: {failed.last_error(a.nproc_per_node)}",
                    logging.ERROR,
                )
                say("stopping the other workers")
            self.stop_all()
            if rdzv is not None:  # in the next round before this one ends: a waiting node cannot close it alone
                r += 1
                if attempt < a.max_restarts and not self.signalled:
                    rdzv.enter(r)
                rdzv.end(r - 1, ok=False)
            if self.signalled:
                return 128 + signal.SIGTERM if code < 0 else code or 1
            if attempt < a.max_restarts:
                say(f"restarting the group (restart {attempt + 1} of {a.max_restarts})")
        say(
            f"giving up: rank {failed.rank} failed" + (f" after {a.max_restarts} restarts" if a.max_restarts else ""),
            logging.ERROR,
        )
        return code if code > 0 else 1


JDP_COMMANDS = ("train", "allreduce", "plot", "generate", "export", "eval", "plan")


def nodes_range(value) -> tuple[int, int]:
    """--nnodes N or MIN:MAX (torchrun's elastic range) -> (MIN, MAX)."""
    text = str(value)
    low, colon, high = text.partition(":")
    try:
        lo, hi = int(low), int(high if colon else low)
    except ValueError:
        raise LaunchError(f"--nnodes {text}: give a number of nodes, or MIN:MAX for an elastic job") from None
    if not 1 <= lo <= hi:
        raise LaunchError(f"--nnodes {text}: need 1 <= MIN <= MAX")
    return lo, hi


def place(args) -> None:
    """--nnodes, --node-rank and --coordinator where they are not given. Run by srun (in a SLURM job step), each task
    is one node of the launch: the step's tasks are the nodes, SLURM_PROCID this node's rank, the coordinator the
    step's first node at JAX's port for the job id (so `srun --ntasks-per-node=1 jdp launch ...` needs no per-task
    shell variables, which a batch script would expand once, for every task alike). Elsewhere: one node, node 0."""
    step = slurm_step(os.environ)
    if step is not None and (args.nnodes is None or args.node_rank is None):
        tasks, rank, coordinator = step
        args.nnodes = str(tasks) if args.nnodes is None else args.nnodes
        args.node_rank = rank if args.node_rank is None else args.node_rank
        if args.coordinator is None and tasks > 1 and not getattr(args, "lighthouse", None):
            args.coordinator = coordinator
        say(f"from SLURM's job step: node {args.node_rank} of {args.nnodes} (srun task {rank} of {tasks})"
            + (f", coordinator {args.coordinator}" if args.coordinator else ""))  # fmt: skip
    args.nnodes = "1" if args.nnodes is None else args.nnodes
    args.node_rank = 0 if args.node_rank is None else args.node_rank


def worker_argv(command: list[str]) -> list[str]:
    """What each worker runs: a jdp command (`train ...`) with this Python; a Python script (`python x.py ...` or
    `x.py ...`, as torchrun runs one) with this Python too, so the workers see the launcher's environment; any
    other program as given."""
    if command[0] in JDP_COMMANDS:
        return [sys.executable, "-m", "jdp.cli", *command]
    if command[0] in ("python", "python3"):
        return [sys.executable, *command[1:]]
    if command[0].endswith(".py"):
        return [sys.executable, *command]
    return list(command)


def check_counts(args) -> None:
    """The launcher's numbers in range (argparse gives any int): workers, restarts, simulated devices."""
    if args.nproc_per_node < 1:
        raise LaunchError(f"--nproc-per-node {args.nproc_per_node}: start at least 1 worker on this node (its GPUs' "
                          f"number, or the processes to simulate on a CPU)")  # fmt: skip
    if args.max_restarts < 0:
        raise LaunchError(f"--max-restarts {args.max_restarts}: give 0 (no restart, the default) or more")
    if args.devices_per_proc < 1:
        raise LaunchError(f"--devices-per-proc {args.devices_per_proc}: each worker needs at least 1 (simulated CPU) "
                          f"device")  # fmt: skip


def check_command(command: list[str]) -> list[str]:
    """The command after `--`, without the `--`: a jdp command, a Python script, or a program on PATH."""
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise LaunchError(
            "nothing to launch: give a jdp command or a script after --, e.g. jdp launch --nproc-per-node 2 -- train, "
            "or -- python my_training.py"
        )
    first = command[0]
    if first in JDP_COMMANDS or first in ("python", "python3") or first.endswith(".py") or shutil.which(first):
        return command
    close = difflib.get_close_matches(first, JDP_COMMANDS, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise LaunchError(f"-- {first}: not a jdp command{hint}, a Python script or a program on PATH (the jdp commands: "
                      f"{', '.join(JDP_COMMANDS)})")  # fmt: skip


def launch(args, command: list[str]) -> int:
    command = check_command(command)
    check_counts(args)
    for option, value in (("--lighthouse", getattr(args, "lighthouse", None)),
                          ("--min-members", getattr(args, "min_members", None))):  # fmt: skip
        if value is not None:
            raise LaunchError(f"{option} {value} is read by --live only: leave it out, or add --live")
    place(args)
    args.min_nodes, args.nnodes = nodes_range(args.nnodes)
    if args.min_nodes < 1:
        raise LaunchError(f"--nnodes {args.min_nodes}: a job needs at least 1 node")
    if not 0 <= args.node_rank < args.nnodes:
        raise LaunchError(f"--node-rank {args.node_rank} must be in [0, --nnodes {args.nnodes})")
    if args.nnodes > 1 and not args.coordinator:
        raise LaunchError("--nnodes > 1 needs --coordinator HOST:PORT (an address of node 0 that every node reaches)")
    if args.min_nodes < args.nnodes and not getattr(args, "rdzv_dir", None):
        raise LaunchError(
            f"--nnodes {args.min_nodes}:{args.nnodes} (elastic) needs --rdzv-dir DIR: a directory every node sees "
            f"(shared storage, e.g. beside the run directory), where the nodes agree who is in the job"
        )
    return Launcher(args, command).run()
