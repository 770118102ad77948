"""How long importing a GPT-2-small-sized Hugging Face directory takes, and the host memory it peaks at.

    python scripts/bench_hf_import.py [--devices 4] [--config gpt2-finetune] [--dir /tmp/gpt2-random]

Writes a GPT-2 small of random weights (124M parameters, GPT-2's names and config.json, 498 MB of float32
safetensors; no torch needed) unless --dir already holds one, then, in a fresh process with N simulated CPU
devices, does what `jdp train CONFIG train.init_from=DIR` does before compiling: check the config, read every
tensor, place the state (parameters replicated, AdamW's state) on the N devices. Prints each phase's seconds and
the process's peak resident memory after each, against the parameter bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

GPT2_SMALL = {
    "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 50257, "n_positions": 1024,
    "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None, "activation_function": "gelu_new",
    "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True, "bos_token_id": 50256, "eos_token_id": 50256,
}  # fmt: skip


def write_random_gpt2(path: Path) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    from jdp.hf import GPT2

    c, rng = GPT2_SMALL, np.random.default_rng(0)
    d, v, p = c["n_embd"], c["vocab_size"], c["n_positions"]
    shapes = {"wte.weight": (v, d), "wpe.weight": (p, d), "ln_f.weight": (d,), "ln_f.bias": (d,)}
    block = {"ln_1.weight": (d,), "ln_1.bias": (d,), "attn.c_attn.weight": (d, 3 * d), "attn.c_attn.bias": (3 * d,),
             "attn.c_proj.weight": (d, d), "attn.c_proj.bias": (d,), "ln_2.weight": (d,), "ln_2.bias": (d,),
             "mlp.c_fc.weight": (d, 4 * d), "mlp.c_fc.bias": (4 * d,), "mlp.c_proj.weight": (4 * d, d),
             "mlp.c_proj.bias": (d,)}  # fmt: skip
    assert set(block) == set(GPT2.block)
    for i in range(c["n_layer"]):
        shapes.update({f"h.{i}.{k}": s for k, s in block.items()})
    tensors = {GPT2.prefix + k: (0.02 * rng.standard_normal(s, np.float32)) for k, s in shapes.items()}
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(c, indent=1))


def measure(config: str, path: str) -> dict:
    import resource
    import time

    import jax

    from jdp import hf, parallel
    from jdp.config import load_config
    from jdp.optim import make_optimizer

    peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # noqa: E731  (MB)
    out = {"devices": jax.device_count(), "peak_mb_before": peak()}
    cfg = load_config(config, [f"train.init_from={path}"])
    t0 = time.perf_counter()
    m = hf.adopt(cfg.model, path).model
    model, info = hf.load_model(m, path)
    t1 = time.perf_counter()
    out.update(n_params=info.n_params, read_s=t1 - t0, peak_mb_after_read=peak())
    optimizer, _ = make_optimizer(cfg.optim, cfg.train.steps)
    _, state = parallel.init_state(model, optimizer, parallel.make_mesh(), cfg.parallel.strategy)
    jax.block_until_ready(state)
    out.update(place_s=time.perf_counter() - t1, peak_mb_after_place=peak())
    out["param_mb"] = info.n_params * 4 / 2**20
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--config", default="gpt2-finetune")
    parser.add_argument("--dir", type=Path, help="a GPT-2 small directory to read (default: a random one, made)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.config, str(args.dir))))
        return
    with tempfile.TemporaryDirectory(prefix="jdp-gpt2-random-") as tmp:
        path = args.dir or Path(tmp)
        if not (path / "config.json").is_file():
            print(f"writing a random GPT-2 small to {path} ...", flush=True)
            write_random_gpt2(path)
        env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={args.devices}"}
        env.setdefault("JAX_PLATFORMS", "cpu")
        argv = [sys.executable, __file__, "--child", "--config", args.config, "--dir", str(path)]
        child = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
        if child.returncode:
            sys.exit(child.stderr)
        r = json.loads(child.stdout.strip().splitlines()[-1])
    print(
        f"import of {r['n_params']:,} parameters ({r['param_mb']:,.0f} MB float32) into {args.config} on "
        f"{r['devices']} CPU devices:\n"
        f"  read (check config.json, every tensor):  {r['read_s']:.1f} s, peak host memory {r['peak_mb_after_read']:,.0f} MB"
        f" (before: {r['peak_mb_before']:,.0f} MB)\n"
        f"  place (replicated params + AdamW state): {r['place_s']:.1f} s, peak host memory {r['peak_mb_after_place']:,.0f} MB"
    )
    print(json.dumps(r))


if __name__ == "__main__":
    main()
