"""DiLoCo against ddp across a slow, lossy link, measured: 2 "hosts" (network namespaces, tests/hosts.py) of 2
processes each, host 1's link at 20 ms +- 5 ms each way and 1% loss, and the same job on one host (4 processes on
the loopback). Same config, steps and tokens for every variant; prints a table (ms/step, tokens/s, bytes across
the slow link per step, final eval loss) and writes it as JSON with a plot of eval loss against tokens and wall
time (docs/diloco.md). Needs root (namespaces); every namespace and process it makes is removed on every path.

    python scripts/bench_diloco.py                      # tiny, 300 steps: one host, ddp, H=10, 50, 100, streaming
    python scripts/bench_diloco.py --config llama-tiny --steps 1000 --skip-ddp --out runs/bench-diloco-llama
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from hosts import Hosts, unavailable  # noqa: E402

from jdp.metrics import read_metrics  # noqa: E402

PORT = 29500
SMALL = "model.n_layers=4 model.d_model=64 model.max_seq_len=64 data.seq_len=64 train.batch_size=16"


def launch(hosts: Hosts | None, i: int, run_dir: Path, argv: list[str], env: dict, nproc: int) -> subprocess.Popen:
    """`jdp launch` on host i (or, hosts None, one host of 4 processes on the loopback)."""
    if hosts is None:
        cmd = [sys.executable, "-m", "jdp.cli", "launch", "--nproc-per-node", str(nproc), "--", *argv]
        log = open(run_dir.parent / f"{run_dir.name}.log", "w")  # noqa: SIM115 (closed with the process)
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    cmd = [sys.executable, "-m", "jdp.cli", "launch", "--nnodes", str(hosts.n), "--node-rank", str(i),
           "--nproc-per-node", str(nproc), "--coordinator", f"{hosts.addresses[0]}:{PORT}", "--", *argv]  # fmt: skip
    return hosts.run(i, cmd, log=run_dir.parent / f"{run_dir.name}-host{i}.log", env=env)


def ms_per_step(run_dir: Path) -> float:
    """Median ms per step over the logged steps after the first (which compiles), from tokens/s."""
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("tokens_per_sec") and r["step"] > 1]
    return float(np.median([r["tokens"] / r["step"] / r["tokens_per_sec"] * 1000 for r in rows]))


def variant(name: str, run_dir: Path, argv: list[str], env: dict, hosts: Hosts | None, timeout: float) -> dict:
    start = time.monotonic()
    procs = [launch(hosts, i, run_dir, argv, env, 2 if hosts else 4) for i in range(hosts.n if hosts else 1)]
    try:
        codes = [p.wait(timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    wall = time.monotonic() - start
    if codes != [0] * len(procs):
        logs = sorted(run_dir.parent.glob(f"{run_dir.name}*.log"))
        raise SystemExit(f"{name}: exit codes {codes}; logs: {[str(p) for p in logs]}")
    records = read_metrics(run_dir / "metrics.jsonl")
    evals = [r for r in records if "eval_loss" in r]
    outer = [r for r in records if "outer_bytes_per_step" in r]
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    first = next(r for r in records if "tokens" in r)
    tokens_per_step = first["tokens"] / first["step"]
    ms = ms_per_step(run_dir)
    return {
        "variant": name,
        "ms_per_step": ms,
        "tokens_per_s": tokens_per_step / ms * 1000,
        "outer_bytes_per_step": outer[-1]["outer_bytes_per_step"] if outer else None,
        "eval_loss": evals[-1]["eval_loss"],
        "evals": [(r["step"], r["eval_loss"]) for r in evals],
        "tokens_per_step": tokens_per_step,
        "wall_s": wall,
        "steps": summary.get("steps"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--every", default="10,50,100", help="the H values of plain DiLoCo")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--dtype", default="int4", help="parallel.outer_dtype of the low-bandwidth variants")
    ap.add_argument("--fragments", type=int, default=4, help="streaming DiLoCo's fragments (at most the blocks)")
    ap.add_argument("--skip-ddp", action="store_true", help="leave out ddp across the slow link (the slowest)")
    ap.add_argument("--out", default="runs/bench-diloco")
    ap.add_argument("--set", default=SMALL, help="config overrides every variant shares (default: the small model "
                    "tests/test_hosts.py trains, with 4 blocks for 4 fragments)")
    args = ap.parse_args()
    if why := unavailable():
        raise SystemExit(f"this benchmark makes network namespaces: {why}")
    out = (ROOT / args.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "JDP_CACHE": str(out / "cache"), "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    common = ["train", args.config, f"train.steps={args.steps}", f"train.eval_every={args.eval_every}",
              "train.log_every=10", "train.progress=false", "train.ckpt_every=0", "parallel.heartbeat_timeout_s=30",
              "train.step_timeout_s=600", *args.set.split()]  # fmt: skip
    diloco = ["parallel.sync=diloco"]  # one group per host: the slow link is between the groups
    plan = [("one host, ddp", [], None)]
    if not args.skip_ddp:
        plan.append(("ddp across the link", [], "hosts"))
    plan += [(f"DiLoCo H={h}", [*diloco, f"parallel.outer_every={h}"], "hosts") for h in args.every.split(",")]
    h = args.every.split(",")[-1]
    plan.append((f"DiLoCo H={h}, {args.dtype}", [*diloco, f"parallel.outer_every={h}",
                                               f"parallel.outer_dtype={args.dtype}"], "hosts"))  # fmt: skip
    f = args.fragments
    delay = min(5, int(h) // f - 1)
    plan.append((f"streaming F={f} H={h} delay {delay}, {args.dtype}",
                 ["parallel.sync=streaming", f"parallel.fragments={f}", f"parallel.outer_every={h}",
                  f"parallel.outer_delay={delay}", f"parallel.outer_dtype={args.dtype}"], "hosts"))  # fmt: skip
    results = []
    for i, (name, extra, where) in enumerate(plan):
        run_dir = out / f"v{i}"
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
        argv = [*common, f"train.run_dir={run_dir}", *extra]
        print(f"[{i + 1}/{len(plan)}] {name} ...", flush=True)
        if where is None:
            r = variant(name, run_dir, argv, env, None, 3600)
        else:
            with Hosts(2, shaped=(1,)) as hosts:
                hosts.shape(1, delay_ms=20, jitter_ms=5, loss_pct=1)
                r = variant(name, run_dir, argv, env, hosts, 3600)
        results.append(r)
        print(f"    {r['ms_per_step']:.0f} ms/step, eval loss {r['eval_loss']:.4f}, {r['wall_s']:.0f} s", flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    base = results[0]
    # ddp across the link computes the one-host run's every loss (the same programs): either is the reference
    ddp = next((r for r in results if r["variant"] == "ddp across the link"), base)
    print(f"\n{args.config} ({args.set}), {args.steps} steps, 2 hosts x 2 processes, host 1's link 20 +- 5 ms, 1% loss")
    print("| run | ms/step | vs one host | tokens/s | outer bytes/step | eval loss | vs ddp |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        vs = f"{(r['eval_loss'] / ddp['eval_loss'] - 1) * 100:+.1f}%"
        b = f"{r['outer_bytes_per_step']:,.0f}" if r["outer_bytes_per_step"] else "-"
        print(f"| {r['variant']} | {r['ms_per_step']:.0f} | {r['ms_per_step'] / base['ms_per_step']:.2f}x | "
              f"{r['tokens_per_s']:,.0f} | {b} | {r['eval_loss']:.4f} | {vs} |")  # fmt: skip
    plot(results, out / "diloco.png", args)


def plot(results: list[dict], path: Path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        steps, losses = zip(*r["evals"], strict=True)
        tokens = [s * r["tokens_per_step"] / 1e6 for s in steps]
        seconds = [s * r["ms_per_step"] / 1000 for s in steps]
        a.plot(tokens, losses, marker="o", label=r["variant"])
        b.plot(seconds, losses, marker="o", label=r["variant"])
    a.set_xlabel("tokens (millions)")
    b.set_xlabel("training seconds (ms/step x steps)")
    b.set_xscale("log")
    for ax in (a, b):
        ax.set_ylabel("eval loss")
        ax.grid(alpha=0.3)
    a.legend(fontsize=8)
    fig.suptitle(f"{args.config}: 2 hosts x 2 processes, 20 +- 5 ms 1% loss between them")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
