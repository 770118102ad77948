"""Is the input pipeline ever the bottleneck? The loader's tokens/s next to what one training step consumes.

    python scripts/bench_loader.py [--configs tiny gpt2-small] [--out DIR]

For each config: the map-style loader's tokens/s (this process's rows of each global batch, host only), the
streaming loader's tokens/s (tokenizing and packing on the fly), and the tokens/s of the jitted train step on
this machine's devices, measured one after another in the same run. `loader_vs_step` above 1 means the
loader outruns the step; the prefetch thread then hides it completely. On a CPU the GPT-2-small step is
measured on a smaller global batch (`--step-batch`): its tokens/s barely depends on the batch size there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jdp import parallel
from jdp.config import load_config, validate
from jdp.data import load_data
from jdp.metrics import flops_per_token
from jdp.models import make_model
from jdp.models.common import lm_loss
from jdp.optim import make_optimizer


def loader_tokens_per_sec(data, steps: int, tokens_per_batch: int) -> float:
    data.local_batch(0)
    start = time.perf_counter()
    for step in range(1, steps + 1):
        data.local_batch(step)
    return steps * tokens_per_batch / (time.perf_counter() - start)


def step_tokens_per_sec(cfg, steps: int) -> float:
    mesh = parallel.make_mesh()
    t = cfg.train
    optimizer, schedule = make_optimizer(cfg.optim, t.steps)
    graphdef, state = parallel.init_state(make_model(cfg.model, nnx.Rngs(0)), optimizer, mesh)
    train_step = parallel.make_train_step(graphdef, lm_loss, optimizer, mesh, t.grad_accum, schedule)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (t.batch_size, cfg.data.seq_len + 1)).astype(np.int32)
    local = {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "weights": np.ones((t.batch_size, cfg.data.seq_len), np.float32),
    }
    batch = parallel.shard_batch(local, mesh, t.batch_size)
    state, m = train_step(state, batch)  # compile
    jax.block_until_ready(m)
    start = time.perf_counter()
    for _ in range(steps):
        state, m = train_step(state, batch)
    jax.block_until_ready(m)
    return steps * t.batch_size * cfg.data.seq_len / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=["tiny", "gpt2-small"])
    ap.add_argument("--loader-steps", type=int, default=50)
    ap.add_argument("--train-steps", type=int, default=5)
    ap.add_argument("--step-batch", type=int, default=0, help="global batch for the step on CPU (0: config's)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    n = jax.device_count()
    cpu = jax.devices()[0].platform == "cpu"
    results = {}
    for name in args.configs:
        cfg = load_config(name, ["train.run_dir=/dev/null"])
        validate(cfg, n)
        B, L = cfg.train.batch_size, cfg.data.seq_len
        data = load_data(cfg.data, cfg.model.vocab_size, B, cfg.train.seed)
        mapped = loader_tokens_per_sec(data, args.loader_steps, B * L)
        streamed_cfg = dataclasses.replace(cfg.data, streaming=True, val_tokens=0)
        streamed = loader_tokens_per_sec(
            load_data(streamed_cfg, cfg.model.vocab_size, B, 0), max(args.loader_steps // 5, 3), B * L
        )
        # A CPU would need minutes for a step of over a TFLOP: time it on one sequence per device instead.
        too_big = cpu and flops_per_token(cfg) * B * L > 1e12
        step_batch = args.step_batch or (n if too_big else B)
        step_cfg = cfg
        if step_batch != B:
            step_cfg = dataclasses.replace(
                cfg, train=dataclasses.replace(cfg.train, batch_size=step_batch, grad_accum=1)
            )
        step = step_tokens_per_sec(step_cfg, args.train_steps)
        results[name] = {
            "loader_tokens_per_sec": mapped,
            "streaming_loader_tokens_per_sec": streamed,
            "step_tokens_per_sec": step,
            "step_global_batch": step_batch,
            "loader_vs_step": mapped / step,
            "streaming_vs_step": streamed / step,
            "devices": f"{n} x {jax.devices()[0].device_kind}",
        }
        print(f"{name}: done", flush=True)
    print(
        f"\n{'config':<12} {'loader tok/s':>14} {'streaming tok/s':>16} {'step tok/s':>12} {'loader/step':>12} {'stream/step':>12}"
    )
    for name, r in results.items():
        print(
            f"{name:<12} {r['loader_tokens_per_sec']:>14,.0f} {r['streaming_loader_tokens_per_sec']:>16,.0f} "
            f"{r['step_tokens_per_sec']:>12,.0f} {r['loader_vs_step']:>12,.0f} {r['streaming_vs_step']:>12,.1f}"
        )
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "bench_loader.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
