"""Goodput under failures: the restart path (`jdp launch --max-restarts`, resuming from the checkpoint) against live
membership (`jdp launch --live`, torchft), the same model, batch and steps, one worker SIGKILLed every --every seconds.

    python scripts/live_goodput.py --every 20 --steps 3000

Both run 4 processes on this machine (loopback); `--hosts` runs the live path on 4 hosts instead (network
namespaces, tests/hosts.py: root only), one process each, and every `--every` s kills a whole host (its launcher and
member; hosts 1 to 3 in turn, host 0 holding the Lighthouse) and starts its launcher again, as a replaced node.
Goodput = the steps' own time (steps x the median step of a run without failures) over the wall-clock time, and
past the start: over the wall less what a run without failures spends besides its steps (starting, compiling: paid
once, whatever fails later); lost per failure = (wall - that - the steps' own time) / failures. Needs torchft
(`pip install 'jdp[live]'`). Prints a table and writes live_goodput.json; every process it starts is ended.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SEQ = {"small": 64, "medium": 128}  # --size: small, a ~29 ms step here; medium, ~330 ms (llama-tiny's widths)
MODELS = {"small": ["model.n_layers=2", "model.d_model=64"], "medium": ["model.n_layers=4", "model.d_model=256"]}
TRAIN = ["train", "configs/tiny.yaml", "train.batch_size=16", "train.progress=false", "train.log_every=1",
         "train.eval_every=0"]  # fmt: skip


N = 4  # processes
TOKENS = 16 * SEQ["small"]  # a step's tokens: train.batch_size x data.seq_len


def use_size(size: str) -> None:
    """The model and window of --size, for every run this script starts."""
    global TRAIN, TOKENS
    TRAIN, TOKENS = [*TRAIN, *MODELS[size], f"model.max_seq_len={SEQ[size]}", f"data.seq_len={SEQ[size]}"], 16 * SEQ[size]


def children(pid: int) -> list[int]:
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def run_killing(args: list[str], log_path: Path, every: float, victims) -> tuple[float, int, int]:
    """Run the launcher `args` to its end, SIGKILLing the last of `victims(launcher pid)` every `every` s; (wall
    seconds, failures, exit code). Every process it started is ended."""
    start, failures = time.time(), 0
    with log_path.open("w") as log:
        launcher = subprocess.Popen(args, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            next_kill = start + every
            while launcher.poll() is None:
                if time.time() >= next_kill and (pids := victims(launcher.pid)):
                    os.kill(pids[-1], signal.SIGKILL)
                    failures += 1
                    next_kill = time.time() + every
                time.sleep(0.2)
        finally:
            for pid in [*children(launcher.pid), launcher.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            launcher.wait()
    return time.time() - start, failures, launcher.returncode


def restart_path(tmp: Path, steps: int, every: float, ckpt_every: int) -> dict:
    """jdp launch with 4 workers; every `every` s one worker is SIGKILLed: the job stops and restarts from its
    checkpoint (--max-restarts)."""
    run = tmp / "restart"
    args = [sys.executable, "-m", "jdp.cli", "launch", "--nproc-per-node", str(N), "--max-restarts", "1000", "--",
            *TRAIN, f"train.steps={steps}", f"train.ckpt_every={ckpt_every}", f"train.run_dir={run}"]  # fmt: skip
    wall, failures, rc = run_killing(args, tmp / "restart.log", every, children)
    return {"wall_s": wall, "failures": failures, "rc": rc}


def live_path(tmp: Path, steps: int, every: float, timeout: float) -> dict:
    """`jdp launch --live` with 4 members (a quorum needs 3); every `every` s one member is SIGKILLed, and the
    launcher starts a new process in its slot (it joins with a peer's state) while the others go on."""
    run = tmp / "live"
    args = [sys.executable, "-m", "jdp.cli", "launch", "--live", "--nproc-per-node", str(N), "--min-members", "3",
            "--max-restarts", "1000", "--", *TRAIN, f"train.steps={steps}", f"train.run_dir={run}",
            f"train.live_timeout_s={timeout}"]  # fmt: skip
    wall, failures, rc = run_killing(args, tmp / "live.log", every, _members)
    first = min(run.glob("live-*.jsonl"), key=lambda f: int(f.stem.rpartition("_")[2]))  # a member never killed
    return live_row(wall, failures, rc, first)


def live_row(wall: float, failures: int, rc: int, lines: Path) -> dict:
    """A live path's row: its wall time, failures and exit code, and the steps of the member whose lines are `lines`
    (one never killed): each step's seconds, failed attempts included."""
    step_s = [json.loads(line)["s"] for line in lines.read_text().splitlines()]
    return {"wall_s": wall, "failures": failures, "rc": rc, "slowest_step_s": max(step_s),
            "median_step_s": float(np.median(step_s)), "steps_s": sum(step_s)}  # fmt: skip


def live_on_hosts(tmp: Path, steps: int, every: float, timeout: float) -> dict:
    """The live path with each process a host of its own (tests/hosts.py's namespaces): `jdp launch --live` on each,
    node 0's launcher holding the Lighthouse; every `every` s one of hosts 1-3 is killed whole and its launcher
    started again, whose new member joins with a peer's state. Every process and namespace it made is removed."""
    sys.path.insert(0, str(ROOT / "tests"))
    from hosts import Hosts, unavailable

    if why := unavailable():
        raise SystemExit(f"--hosts needs network namespaces: {why}")
    run, env = tmp / "live-hosts", {**os.environ, "GLOO_SOCKET_IFNAME": "eth0"}
    with Hosts(N) as hosts:

        def launch(i: int, log: str):
            return hosts.run(i, [sys.executable, "-m", "jdp.cli", "launch", "--live", "--nnodes", str(N),
                                 "--nproc-per-node", "1", "--min-members", "3", "--node-rank", str(i), "--coordinator",
                                 f"{hosts.addresses[0]}:29510", "--max-restarts", "1000", "--", *TRAIN,
                                 f"train.steps={steps}", f"train.run_dir={run}", f"train.live_timeout_s={timeout}"],
                             log=tmp / log, env=env)  # fmt: skip

        start, failures = time.time(), 0
        launchers = [launch(i, f"host{i}.log") for i in range(N)]
        next_kill = start + every
        while launchers[0].poll() is None:  # node 0's members end with the run
            if time.time() >= next_kill:
                victim = failures % (N - 1) + 1
                hosts.kill(victim)
                launchers[victim].wait()
                failures += 1
                launchers[victim] = launch(victim, f"host{victim}-{failures}.log")  # the node replaced
                next_kill = time.time() + every
            time.sleep(0.2)
        wall, rc = time.time() - start, launchers[0].returncode
    first = next(run.glob(f"live-{hosts.addresses[0]}_*.jsonl"))  # host 0's member: never killed
    return live_row(wall, failures, rc, first)


def _members(launcher: int) -> list[int]:
    """The launcher's members (not its Lighthouse)."""
    import psutil

    try:
        return [c.pid for c in psutil.Process(launcher).children() if "jdp.cli" in c.cmdline()]
    except psutil.NoSuchProcess:
        return []


def step_time(tmp: Path, steps: int) -> tuple[float, float]:
    """The median step of 4 processes without failures (jdp launch; the steps' own time), and the run's seconds
    besides its steps (the processes' start, compiling, the end): what any run pays once."""
    run, start = tmp / "clean", time.time()
    subprocess.run([sys.executable, "-m", "jdp.cli", "launch", "--nproc-per-node", str(N), "--", *TRAIN,
                    f"train.steps={steps}", "train.ckpt_every=0", f"train.run_dir={run}"], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    step = float(np.median([TOKENS / x["tokens_per_sec"] for x in lines if x.get("tokens_per_sec")][5:]))
    return step, time.time() - start - steps * step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--every", type=float, default=20.0, help="seconds between failures")
    ap.add_argument("--ckpt-every", type=int, default=200, help="the restart path's checkpoint cadence, in steps")
    ap.add_argument("--only", choices=("restart", "live"), help="run one path")
    ap.add_argument("--live-timeout", type=float, default=10.0, help="the live path's train.live_timeout_s")
    ap.add_argument("--size", choices=tuple(SEQ), default="small", help="the model (small: a step of ~29 ms here)")
    ap.add_argument("--out", default="live_goodput.json")
    ap.add_argument("--keep", help="a directory to keep the runs in (default: a temporary one, removed)")
    ap.add_argument("--hosts", action="store_true", help="the live path on 4 hosts (network namespaces; root)")
    a = ap.parse_args()
    use_size(a.size)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(a.keep or d)
        tmp.mkdir(parents=True, exist_ok=True)
        step, once = step_time(tmp, 200)
        paths = {"restart": lambda: restart_path(tmp, a.steps, a.every, a.ckpt_every),
                 "live": lambda: live_path(tmp, a.steps, a.every, a.live_timeout)}  # fmt: skip
        if a.hosts:  # a host killed whole and its node replaced; the restart path's numbers are loopback's
            paths = {"live on hosts": lambda: live_on_hosts(tmp, a.steps, a.every, a.live_timeout)}
        rows = {name: run() for name, run in paths.items() if a.only in (None, name.split()[0])}
    useful = a.steps * step
    print(f"{a.steps} steps of {step * 1e3:.1f} ms ({useful:.1f} s of steps), {'a host killed' if a.hosts else 'a worker SIGKILLed'} every {a.every:g} s")
    print(f"a run without failures spends {once:.1f} s besides its steps (the start, compiling): 'past the start' "
          f"leaves it out, as a long run amortises it")  # fmt: skip
    print(f"{'path':<14} {'wall s':>8} {'failures':>9} {'lost/failure s':>15} {'goodput':>8} {'past the start':>15}")
    for name, r in rows.items():
        r["goodput"], r["goodput_past_start"] = useful / r["wall_s"], useful / (r["wall_s"] - once)
        r["lost_per_failure_s"] = (r["wall_s"] - once - useful) / max(r["failures"], 1)
        print(f"{name:<14} {r['wall_s']:>8.1f} {r['failures']:>9} {r['lost_per_failure_s']:>15.2f} {r['goodput']:>8.1%}"
              f" {r['goodput_past_start']:>15.1%}")  # fmt: skip
        if "median_step_s" in r:  # the live step itself is slower (torchft's quorum and commit RPCs, host copies)
            own = a.steps * r["median_step_s"]
            r["own_goodput"] = own / (r["wall_s"] - once)
            r["own_lost_per_failure_s"] = (r["wall_s"] - once - own) / max(r["failures"], 1)
            print(f"  live against its own failure-free step ({r['median_step_s'] * 1e3:.1f} ms): "
                  f"{r['own_lost_per_failure_s']:.2f} s lost per failure, goodput past the start {r['own_goodput']:.1%}")
    record = {"steps": a.steps, "every_s": a.every, "size": a.size, "hosts": a.hosts, "step_s": step, "once_s": once,
              **rows}  # fmt: skip
    Path(a.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
