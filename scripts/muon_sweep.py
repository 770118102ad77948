"""Muon against AdamW on the embedded corpus: the same steps and tokens, each at a few learning rates, and the step
time of both under ddp and fsdp on 4 simulated devices, side by side.

    python scripts/muon_sweep.py --out DIR [--configs tiny,llama-tiny] [--steps 200] [--lrs 1e-3,2e-3,4e-3]
                                 [--muon-lrs 2e-3,4e-3,8e-3]
    python scripts/muon_sweep.py --out DIR --timing [--steps 30]

The sweep runs `jdp train CONFIG optim.name=adamw|muon optim.lr=LR` (one device, evaluated every steps/8) one
after another (a run already in DIR is read, not run again), prints each run's final eval loss, the best rate of
each optimizer, how many tokens Muon's best run needed to reach AdamW's best final eval loss, and plots eval loss
against tokens to DIR/muon.png (docs/muon.md).
Muon's matrices take the same optim.lr (optim.muon_scale=rms: an update of AdamW's RMS). --timing alternates
adamw and muon under ddp and fsdp on 4 devices, twice, and prints the median ms/step of each (docs/muon.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from jdp.metrics import read_metrics  # noqa: E402


def train(run_dir: Path, config: str, extra: list[str], devices: int = 1, reuse: bool = False) -> list[dict]:
    if reuse and (run_dir / "summary.json").exists():  # a finished run of an earlier sweep: its records
        return read_metrics(run_dir / "metrics.jsonl")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    if devices > 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    cmd = [sys.executable, "-m", "jdp.cli", "train", config, "train.progress=false", f"train.run_dir={run_dir}",
           "train.resume=false", *extra]  # fmt: skip
    print(f"[muon] {' '.join(cmd[3:])}", flush=True)
    subprocess.run(cmd, env=env, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return read_metrics(run_dir / "metrics.jsonl")


def eval_curve(records: list[dict]) -> list[tuple[float, float]]:
    """(tokens, eval loss) at each evaluation."""
    per_step = next(r["tokens"] / r["step"] for r in reversed(records) if r.get("tokens") and r.get("step"))
    return [(r["step"] * per_step, r["eval_loss"]) for r in records if r.get("eval_loss") is not None]


def tokens_to_reach(curve: list[tuple[float, float]], target: float) -> float | None:
    """The tokens at which the curve first reaches `target` (linear between evaluations), or None."""
    for (t0, l0), (t1, l1) in zip(curve, curve[1:], strict=False):
        if l1 <= target:
            return t1 if l0 == l1 else t0 + (t1 - t0) * (l0 - target) / (l0 - l1)
    return None


def sweep(a) -> int:
    results = {}
    for config in a.configs.split(","):
        for optim in ("adamw", "muon"):
            for lr in (a.muon_lrs or a.lrs).split(",") if optim == "muon" else a.lrs.split(","):
                d = a.out / f"{config}-{optim}-{lr}"
                records = train(d, config, [f"optim.name={optim}", f"optim.lr={lr}", f"train.steps={a.steps}",
                                            f"train.eval_every={max(a.steps // 8, 1)}", "train.ckpt_every=0"],
                                reuse=True)  # fmt: skip
                curve = eval_curve(records)
                results[config, optim, lr] = curve
                print(f"{config:<11} {optim:<6} lr {lr:<7} final eval loss {curve[-1][1]:.4f}", flush=True)
    summary = {}
    for config in a.configs.split(","):
        best = {o: min((k for k in results if k[0] == config and k[1] == o), key=lambda k: results[k][-1][1])
                for o in ("adamw", "muon")}  # fmt: skip
        target = results[best["adamw"]][-1][1]
        reach = tokens_to_reach(results[best["muon"]], target)
        total = results[best["adamw"]][-1][0]
        summary[config] = {o: {"lr": k[2], "eval_loss": results[k][-1][1]} for o, k in best.items()}
        summary[config]["muon_tokens_to_adamw_loss"] = reach
        summary[config]["tokens"] = total
        words = f"{reach / total:.0%} of the tokens" if reach else "not within the run"
        print(f"{config}: best AdamW lr {best['adamw'][2]} -> {target:.4f}; best Muon lr {best['muon'][2]} -> "
              f"{results[best['muon']][-1][1]:.4f}; Muon reaches AdamW's final eval loss in {words}", flush=True)  # fmt: skip
    (a.out / "muon.json").write_text(json.dumps({"summary": summary, "curves": {"/".join(k): v for k, v in
                                                                                results.items()}}, indent=1))  # fmt: skip
    plot(results, summary, a.out / "muon.png")
    print(f"[muon] plot: {a.out / 'muon.png'}")
    return 0


def plot(results: dict, summary: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(summary)
    fig, axes = plt.subplots(1, len(configs), figsize=(6 * len(configs), 4.2), squeeze=False)
    for ax, config in zip(axes[0], configs, strict=True):
        for (c, optim, lr), curve in results.items():
            if c != config:
                continue
            best = summary[config][optim]["lr"] == lr
            ax.plot([t / 1e6 for t, _ in curve], [v for _, v in curve], color="C0" if optim == "adamw" else "C3",
                    alpha=1.0 if best else 0.3, lw=2 if best else 1, marker="o" if best else None, ms=3,
                    label=f"{optim} lr {lr}" + (" (best)" if best else ""))  # fmt: skip
        ax.set_title(f"{config}: eval loss, Muon vs AdamW")
        ax.set_xlabel("tokens (M)")
        ax.set_ylabel("eval loss")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def timing(a) -> int:
    """ms/step of adamw and muon under ddp and fsdp on 4 devices, alternated, twice; the median of each."""
    ms: dict = {}
    for round_ in range(2):
        for strategy in ("ddp", "fsdp"):
            for optim in ("adamw", "muon"):
                d = a.out / f"time-{strategy}-{optim}-{round_}"
                records = train(d, a.configs.split(",")[0], [f"optim.name={optim}", f"parallel.strategy={strategy}",
                                f"train.steps={a.steps}", "train.eval_every=0", "train.ckpt_every=0",
                                "train.log_every=1"], devices=4)  # fmt: skip
                steps = [r["tokens"] / r["step"] / r["tokens_per_sec"] * 1000 for r in records
                         if r.get("tokens_per_sec") and r["step"] > 3]  # fmt: skip
                ms.setdefault((strategy, optim), []).append(statistics.median(steps))
    for strategy in ("ddp", "fsdp"):
        adamw, muon = (statistics.median(ms[strategy, o]) for o in ("adamw", "muon"))
        print(f"{strategy:<5} adamw {adamw:7.1f} ms/step  muon {muon:7.1f} ms/step  ({muon / adamw:.2f}x)")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--configs", default="tiny,llama-tiny")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lrs", default="1e-3,2e-3,4e-3")
    ap.add_argument("--muon-lrs", default="", help="Muon's rates, if not --lrs")
    ap.add_argument("--timing", action="store_true", help="ms/step under ddp and fsdp on 4 devices instead")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    return timing(a) if a.timing else sweep(a)


if __name__ == "__main__":
    sys.exit(main())
