"""`jdp launch --live`: this node's live members (jdp/live.py), started, watched and replaced, never restarted as a
group. Node 0 starts torchft's Lighthouse (unless --lighthouse names one); every slot runs `jdp train ...
train.live=true` against it; a member that fails is replaced in its slot by a new process, which joins at a step
boundary with a peer's state while the others go on (up to --max-restarts replacements on this node)."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from jdp.job.join import source_address
from jdp.job.launch import (
    LaunchError,
    Slots,
    Worker,
    check_command,
    check_counts,
    free_port,
    nodes_range,
    place,
    say,
    signal_workers,
    spawn,
    worker_argv,
)

__all__ = ["Members", "launch_live"]

CONFIG_ERROR = 2  # `jdp train`'s exit code for a refused config: every replacement would be refused too


def host_port(url: str) -> tuple[str, str]:
    """http://HOST:PORT[/] -> (HOST, PORT)."""
    host, _, port = url.split("://", 1)[-1].rstrip("/").rpartition(":")
    return host, port


def lighthouse_binary() -> str:
    """torchft's Lighthouse, installed beside this Python by `pip install 'jdp[live]'`."""
    found = Path(sys.executable).parent / "torchft_lighthouse"
    if found.exists():
        return str(found)
    if which := shutil.which("torchft_lighthouse"):
        return which
    raise LaunchError("--live needs torchft's Lighthouse (torchft_lighthouse): pip install 'jdp[live]'")


class Members:
    """This node's slots, each holding one live member at a time."""

    def __init__(self, args, command: list[str]):
        self.args, self.command = args, command
        self.slots = Slots(args)
        self.workers: list[Worker] = []
        self.lighthouse: subprocess.Popen | None = None
        self.signalled, self.kill_at, self.replaced = 0, float("inf"), 0
        total = args.nnodes * args.nproc_per_node  # the most members the job has
        self.min = args.min_members or total // 2 + 1  # a majority: no two quorums can form (docs/live.md)

    def address(self) -> tuple[str, str]:
        """(the Lighthouse's URL, this node's address for the other members)."""
        a = self.args
        url = a.lighthouse or (f"http://{a.coordinator}" if a.coordinator else "")
        if not url:  # one node, its own Lighthouse on loopback
            a.coordinator = f"127.0.0.1:{free_port()}"
            url = f"http://{a.coordinator}"
        host, port = host_port(url)
        mine = a.local_addr or source_address(host.strip("[]"), int(port)) or "127.0.0.1"
        return url, mine

    def start_lighthouse(self, url: str) -> None:
        host, port = host_port(url)
        bind = "[::]" if ":" in host else "0.0.0.0"  # every address of the family --coordinator's host is in
        self.lighthouse = subprocess.Popen(
            [lighthouse_binary(), "--min_replicas", str(self.min), "--join_timeout_ms", "1000", "--quorum_tick_ms",
             "100", "--bind", f"{bind}:{port}"],
            stdout=subprocess.DEVNULL, start_new_session=True,  # its warnings and errors on our stderr, unread by us
            env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")},  # (info: a line per quorum)
        )  # fmt: skip
        say(f"started torchft's Lighthouse on port {port} (a quorum needs {self.min} members)")

    def start(self, local: int, url: str, mine: str) -> Worker:
        env, pin = self.slots.env(local)
        env.update(JDP_LIVE_ADDR=mine)
        live = ["train.live=true", f"train.lighthouse={url}", f"train.live_min={self.min}"]
        return spawn(worker_argv([*self.command, *live]), env, self.args.node_rank * self.args.nproc_per_node + local,
                     local, pin)  # fmt: skip

    def on_signal(self, sig, frame) -> None:
        self.signalled += 1
        if self.signalled == 1:
            say(f"got {signal.Signals(sig).name}: passing it to the members; they get {self.args.grace_s:g} s to exit",
                logging.WARNING)  # fmt: skip
            self.kill_at = time.monotonic() + self.args.grace_s
        self.signal_all(sig if self.signalled == 1 else signal.SIGKILL)

    def signal_all(self, sig: int) -> None:
        signal_workers(self.workers, sig)

    def run(self) -> int:
        a = self.args
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self.on_signal)
        url, mine = self.address()
        if a.node_rank == 0 and not a.lighthouse:
            self.start_lighthouse(url)
        try:
            self.workers = [self.start(local, url, mine) for local in range(a.nproc_per_node)]
            say(f"started live members {[w.rank for w in self.workers]} ({self.slots.describe()}), Lighthouse {url}, "
                f"this node's address {mine}")  # fmt: skip
            self.watch(url, mine)
        finally:
            self.signal_all(signal.SIGKILL)  # only after a signal's grace, or an error of our own: all are done
            for w in self.workers:
                w.proc.wait()
                for t in w.threads:
                    t.join(timeout=2)
            if self.lighthouse is not None:
                self.lighthouse.kill()
                self.lighthouse.wait()
        codes = [w.proc.returncode for w in self.workers]
        if 0 in codes:
            say("the run finished" + ("" if set(codes) == {0} else f" (members' exit codes {codes})"))
            return 0
        return next(c for c in codes if c) if codes else 1

    def watch(self, url: str, mine: str) -> None:
        """Until every slot's member has exited: a failed one is replaced while replacements are left."""
        a, ended = self.args, set()
        while any(w.proc.poll() is None or id(w) not in ended for w in self.workers):
            if self.signalled and time.monotonic() > self.kill_at:
                self.signal_all(signal.SIGKILL)
            for local, w in enumerate(self.workers):
                code = w.proc.poll()
                if code is None or id(w) in ended:
                    continue
                ended.add(id(w))
                if code == 0 or self.signalled:
                    continue
                what = f"live member {w.rank} (pid {w.proc.pid}) exited {code}: {w.last_error()}"
                if code == CONFIG_ERROR:
                    say(f"{what}; not replaced (a refused config refuses its replacement too)", logging.ERROR)
                elif self.replaced < a.max_restarts:
                    self.replaced += 1
                    self.workers[local] = self.start(local, url, mine)
                    say(f"{what}; replaced by pid {self.workers[local].proc.pid}, which joins the others with a "
                        f"peer's state (replacement {self.replaced} of {a.max_restarts})", logging.WARNING)  # fmt: skip
                else:
                    say(f"{what}; no replacements left (--max-restarts {a.max_restarts}): the others go on without "
                        f"it", logging.ERROR)  # fmt: skip
            time.sleep(0.05)


def launch_live(args, command: list[str]) -> int:
    """`jdp launch --live -- train CONFIG ...`: checked before anything starts."""
    command = check_command(command)
    if command[0] != "train":
        raise LaunchError("--live starts `jdp train` members: give -- train CONFIG [key=value ...]")
    check_counts(args)
    place(args)
    args.min_nodes, args.nnodes = nodes_range(args.nnodes)
    if not 0 <= args.node_rank < args.nnodes:
        raise LaunchError(f"--node-rank {args.node_rank} must be in [0, --nnodes {args.nnodes})")
    if args.nnodes > 1 and not (args.coordinator or args.lighthouse):
        raise LaunchError("--live on several nodes needs --coordinator HOST:PORT (where node 0 starts the "
                          "Lighthouse, reachable from every node) or --lighthouse URL (one already running)")  # fmt: skip
    if args.min_members is not None and args.min_members < 1:
        raise LaunchError(f"--min-members {args.min_members}: a step needs at least one member")
    if not args.lighthouse:
        lighthouse_binary()  # torchft is there, before any member starts
    return Members(args, command).run()
