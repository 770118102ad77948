"""`jdp plot RUN_DIR [RUN_DIR ...] -o FILE.png`: loss against steps and tokens, and throughput, from metrics.jsonl.

One run or several overlaid (one colour per run; training loss solid, validation loss dashed with markers). A run
of a preference objective (docs/preference.md) adds the reward margin (rewards/margins) by step beside them.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from jdp.errors import ConfigError
from jdp.metrics import read_metrics
from jdp.rundir import RunDir

__all__ = ["count_label", "figure", "load_run", "plot", "run"]

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def load_run(run_dir: Path) -> dict[str, list]:
    path = RunDir(run_dir).metrics
    if not path.exists():
        raise ConfigError(f"{run_dir} is not a jdp run directory: it has no metrics.jsonl")
    records = read_metrics(path)
    train = [r for r in records if r.get("loss") is not None]
    evals = [r for r in records if r.get("eval_loss") is not None]
    if not train:
        raise ConfigError(f"{path} has no training records yet")
    counted = all(isinstance(r.get("tokens"), (int, float)) for r in train)  # else no loss-by-tokens curve
    tokens_per_step = train[-1]["tokens"] / train[-1]["step"] if counted else 0
    return {
        "step": [r["step"] for r in train],
        "tokens": [r["tokens"] for r in train] if counted else [],
        "loss": [r["loss"] for r in train],
        "tps_step": [r["step"] for r in train if r.get("tokens_per_sec")],
        "tps": [r["tokens_per_sec"] for r in train if r.get("tokens_per_sec")],
        "eval_step": [r["step"] for r in evals],
        "eval_tokens": [r["step"] * tokens_per_step for r in evals] if counted else [],
        "eval_loss": [r["eval_loss"] for r in evals],
        "margin_step": [r["step"] for r in train if "rewards/margins" in r],
        "margin": [r["rewards/margins"] for r in train if "rewards/margins" in r],
        "eval_margin_step": [r["step"] for r in evals if "eval_rewards/margins" in r],
        "eval_margin": [r["eval_rewards/margins"] for r in evals if "eval_rewards/margins" in r],
    }


def figure(run_dirs: list[Path]) -> Figure:
    """The plot of these runs as a matplotlib Figure: loss by step, loss by tokens, throughput, and the reward margin
    by step where a run has one."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    runs = {d: load_run(d) for d in run_dirs}
    margins = any(r["margin"] for r in runs.values())
    fig, axes = plt.subplots(1, 3 + margins, figsize=(16 + 5 * margins, 4.5))
    by_step, by_tokens, speed = axes[:3]
    for i, (d, r) in enumerate(runs.items()):
        color, name = f"C{i}", _label(d, run_dirs)
        for ax, x, ex in ((by_step, "step", "eval_step"), (by_tokens, "tokens", "eval_tokens")):
            if not r[x]:
                continue  # records without a token count (written before jdp counted them): by step only
            ax.plot(r[x], r["loss"], color=color, label=f"{name} train")
            if r["eval_loss"]:
                ax.plot(r[ex], r["eval_loss"], "o--", color=color, label=f"{name} validation")
        speed.plot(r["tps_step"], r["tps"], color=color, label=name)
        if margins and r["margin"]:
            axes[3].plot(r["margin_step"], r["margin"], color=color, label=f"{name} train")
            if r["eval_margin"]:
                axes[3].plot(r["eval_margin_step"], r["eval_margin"], "o--", color=color, label=f"{name} validation")
    if margins:
        axes[3].set(xlabel="step", ylabel="rewards/margins", title="reward margin (chosen - rejected) by step")
        axes[3].xaxis.set_major_formatter(FuncFormatter(count_label))
    by_step.set(xlabel="step", ylabel="loss", title="loss by step")
    by_tokens.set(xlabel="tokens", ylabel="loss", title="loss by tokens seen")
    speed.set(xlabel="step", ylabel="tokens / s", title="throughput")
    speed.set_ylim(bottom=0)
    # matplotlib writes counts below a million in full (100000 200000 ...), and side by side they run together
    for axis in (by_step.xaxis, by_tokens.xaxis, speed.xaxis, speed.yaxis):
        axis.set_major_formatter(FuncFormatter(count_label))
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot(run_dirs: list[Path], out: Path) -> Path:
    """Write the plot of these runs to `out` (a PNG)."""
    import matplotlib.pyplot as plt

    fig = figure(run_dirs)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=110)
    except OSError as e:
        plt.close(fig)
        raise ConfigError(f"cannot write {out}: {e.strerror or e} ({e.filename or out.parent}); give -o a writable "
                          f"FILE.png") from None  # fmt: skip
    plt.close(fig)
    return out


def count_label(x: float, _pos: int | None = None) -> str:
    """A tick's count in a few characters: 50, 1.5k, 800k, 3.2M, 2B."""
    for size, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= size:
            return f"{x / size:.4g}{unit}"
    return f"{x:.4g}"


def _label(run_dir: Path, all_dirs: list[Path]) -> str:
    names = [d.resolve().name for d in all_dirs]
    name = run_dir.resolve().name
    return str(run_dir) if names.count(name) > 1 else name


def run(args: argparse.Namespace) -> int:
    out = Path(args.out) if args.out else RunDir(args.run_dirs[0]).plot
    if out.is_dir():
        out = out / "plot.png"  # -o DIR: a file in it (matplotlib would write DIR.png and the message say DIR)
    elif not out.suffix:
        out = out.with_suffix(".png")  # what matplotlib writes for a name without one: say so
    from matplotlib.backend_bases import FigureCanvasBase

    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    if out.suffix.lower().lstrip(".") not in formats:
        raise ConfigError(f"-o {args.out}: matplotlib cannot write .{out.suffix.lstrip('.')} files; name a .png (or "
                          f"{', '.join(f'.{x}' for x in formats if x != 'png')})")  # fmt: skip
    print(f"jdp plot: wrote {plot(args.run_dirs, out)}")
    return 0
