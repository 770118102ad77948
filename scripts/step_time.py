"""Milliseconds per train step for a config on this machine's devices: the quick check behind
docs/performance.md's notes (what each XLA option or model change is worth).

    python scripts/step_time.py tiny [section.key=value ...] [--steps 10]
    XLA_FLAGS=--xla_cpu_use_thunk_runtime=false taskset -c 0 python scripts/step_time.py tiny train.batch_size=16

jdp's own XLA options are added as `jdp train` adds them (yours in XLA_FLAGS win). Random tokens, so no
data is loaded; compare two settings by running them alternately, a few times each.
"""

from __future__ import annotations

import argparse
import time

from jdp.config import load_config, split_config_args
from jdp.job import xla


def compiled_step(config: str | None, overrides: list[str]):
    """jdp's train step for a config as `jdp train` builds it (its XLA options, its malloc settings), its state and
    one batch of random tokens on this process's devices: (step, state, batch, cfg)."""
    cfg = load_config(config, ["train.run_dir=/dev/null", *overrides])
    from jdp.parallel import strategies

    strategies.get(cfg.parallel.strategy).set_xla_flags(cfg.parallel.bucket_mb)
    xla.keep_scratch_memory()

    import numpy as np

    from jdp import parallel
    from jdp.build import build

    mesh = parallel.make_mesh()
    _, state, step, *_ = build(cfg, mesh)
    rng = np.random.default_rng(0)
    shape = (cfg.train.batch_size, cfg.data.seq_len)
    local = {
        "inputs": rng.integers(0, cfg.model.vocab_size, shape).astype(np.int32),
        "targets": rng.integers(0, cfg.model.vocab_size, shape).astype(np.int32),
        "weights": np.ones(shape, np.float32),
    }
    return step, state, parallel.shard_batch(local, mesh, cfg.train.batch_size), cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("args", nargs="*", metavar="[CONFIG] [section.key=value ...]")
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args()
    step, state, batch, cfg = compiled_step(*split_config_args(a.args))
    import jax

    shape = (cfg.train.batch_size, cfg.data.seq_len)
    for _ in range(3):  # compile and warm up
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for _ in range(a.steps):
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    dt = (time.perf_counter() - start) / a.steps
    print(f"{jax.device_count()} device(s): {dt * 1e3:.0f} ms/step, {shape[0] * shape[1] / dt:,.0f} tokens/s")


if __name__ == "__main__":
    main()
