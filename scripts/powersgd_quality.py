"""PowerSGD's quality: the same training with plain all-reduces, PowerSGD with error feedback and without it.

    python scripts/powersgd_quality.py --out DIR [--devices 4] [--rank 4] [--warmup 100] [key=value ...]

Runs `jdp train tiny train.steps=300` (override with key=value) three times on N simulated CPU devices, one
after another, then prints each run's final eval loss and its distance from the uncompressed run, and plots the
three loss curves (`jdp plot`) to DIR/powersgd.png. key=value overrides apply to all three runs, e.g.
parallel.powersgd_uncompressed=embed. About 8 minutes on a 2-core CPU (docs/performance.md, Communication hooks and PowerSGD).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=100, help="plain all-reduce steps first (the default)")
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={a.devices}", "JAX_PLATFORMS": "cpu"}
    powersgd = ["parallel.compression=powersgd", f"parallel.powersgd_rank={a.rank}"]
    powersgd += [f"parallel.powersgd_warmup={a.warmup}"]
    runs = {
        "plain": [],
        "powersgd": powersgd,
        "powersgd-no-feedback": [*powersgd, "parallel.powersgd_error_feedback=false"],
    }
    final = {}
    for name, extra in runs.items():
        run_dir = a.out / name
        cmd = [sys.executable, "-m", "jdp.cli", "train", a.config, "train.steps=300", "train.progress=false"]
        cmd += [f"train.run_dir={run_dir}", "train.resume=false", *a.overrides, *extra]
        print(f"[powersgd] {name}: {' '.join(cmd[3:])}", flush=True)
        subprocess.run(cmd, env=env, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        final[name] = json.loads((run_dir / "summary.json").read_text())["eval_loss"]
    for name, loss in final.items():
        print(f"{name:<22} final eval loss {loss:.4f}  {100 * (loss / final['plain'] - 1):+.1f}% against plain")
    png = a.out / "powersgd.png"
    subprocess.run(
        [sys.executable, "-m", "jdp.cli", "plot", *(str(a.out / n) for n in runs), "-o", str(png)], check=True
    )
    (a.out / "powersgd.json").write_text(json.dumps(final, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
