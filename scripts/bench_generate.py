"""Sampling speed with and without the KV cache: tokens/s of `jdp generate`'s two paths, measured in one run.

    python scripts/bench_generate.py [--configs tiny llama-tiny] [--new-tokens 200] [--out DIR]

For each config, a randomly initialised model (the speed does not depend on the weights) continues one prompt by
--new-tokens tokens, greedily and without stopping at the end-of-document token, once with the KV cache
(jdp/decode.py: prefill, then one token per step in one compiled loop) and once with `--no-cache`'s windowed
forward (every token re-runs the model over a max_seq_len window). Each path is compiled first, then timed, best
of --repeats. model.max_seq_len is raised to fit the prompt and the new tokens (--max-seq-len, default 256;
0 keeps the config's), so neither path slides its window and both see the whole text. Both paths must draw
the same tokens (checked). Writes DIR/bench_generate.json: per config the tokens/s of each path and
`cached_vs_uncached`, their ratio, with this host's CPU, cores and versions.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
from flax import nnx

from jdp import decode
from jdp.config import load_config
from jdp.hardware import host_description
from jdp.models import make_model
from jdp.models.common import count_params

PROMPT = list(b"def main():\n    ")


def tokens_per_sec(model, new_tokens: int, cache: bool, repeats: int) -> tuple[float, list[int]]:
    """(best tokens/s over `repeats` timed runs after one that compiles, the tokens drawn)."""
    tokens = decode.sample(model, [PROMPT], new_tokens, temperature=0.0, cache=cache)[0]
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        again = decode.sample(model, [PROMPT], new_tokens, temperature=0.0, cache=cache)[0]
        best = min(best, time.perf_counter() - start)
        assert again == tokens
    return new_tokens / best, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=["tiny", "llama-tiny"])
    ap.add_argument("--new-tokens", type=int, default=200)
    ap.add_argument("--max-seq-len", type=int, default=256, help="model.max_seq_len for the run; 0: the config's")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    results = {}
    for name in args.configs:
        overrides = [f"model.max_seq_len={args.max_seq_len}"] if args.max_seq_len else []
        cfg = load_config(name, overrides)
        model = make_model(cfg.model, nnx.Rngs(0))
        cached, cached_tokens = tokens_per_sec(model, args.new_tokens, True, args.repeats)
        uncached, uncached_tokens = tokens_per_sec(model, args.new_tokens, False, args.repeats)
        assert cached_tokens == uncached_tokens, f"{name}: the cached path drew other tokens than the uncached one"
        results[name] = {
            "arch": cfg.model.arch,
            "params": count_params(model),
            "max_seq_len": cfg.model.max_seq_len,
            "prompt_tokens": len(PROMPT),
            "new_tokens": args.new_tokens,
            "cached_tokens_per_sec": cached,
            "uncached_tokens_per_sec": uncached,
            "cached_vs_uncached": cached / uncached,
            "same_tokens": True,
            "device": f"1 x {jax.devices()[0].device_kind}",
        }
        print(f"{name}: done", flush=True)
    print(f"\n{'config':<12} {'cached tok/s':>13} {'uncached tok/s':>15} {'cached/uncached':>16}")
    for name, r in results.items():
        print(
            f"{name:<12} {r['cached_tokens_per_sec']:>13,.0f} {r['uncached_tokens_per_sec']:>15,.0f} "
            f"{r['cached_vs_uncached']:>16,.1f}"
        )
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        record = {"command": "python scripts/bench_generate.py " + " ".join(_argv(args)), "host": host_description()}
        (Path(args.out) / "bench_generate.json").write_text(json.dumps({**record, **results}, indent=2) + "\n")


def _argv(args: argparse.Namespace) -> list[str]:
    argv = ["--configs", *args.configs, "--new-tokens", str(args.new_tokens), "--max-seq-len", str(args.max_seq_len)]
    return [*argv, "--repeats", str(args.repeats), "--out", args.out]


if __name__ == "__main__":
    main()
