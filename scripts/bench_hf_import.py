"""How long importing a Hugging Face directory takes, and the host memory it peaks at, against the weights' size.

    python scripts/bench_hf_import.py [--model gpt2-small] [--devices 4] [--place state] [--dir /tmp/gpt2-random]
    python scripts/bench_hf_import.py --model llama-1b --dtype bfloat16 --devices 1 --place params

Writes a model of random weights with the architecture's names, shapes and config.json (GPT-2 small: 124M
parameters, 498 MB of float32; llama-1b: Llama-3.2-1B's shape, 1.24B parameters, 4.9 GB of float32 or 2.5 GB of
bfloat16 in shards of at most 1 GB, as published checkpoints are; no torch needed) unless --dir already holds one,
then, in a fresh process with N simulated CPU devices, does what `jdp train CONFIG train.init_from=DIR` does before
compiling: check the config, read every tensor into float32 parameters, place them on the N devices (--place state:
parameters replicated and AdamW's state, as `parallel.init_state` does; params: the parameters alone; none). Prints
each phase's seconds and the process's peak resident memory (VmHWM) after each, and, after the read, how much of the
resident memory is the process's own (anonymous) and how much is mapped files.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MODELS = {
    "gpt2-small": {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 50257, "n_positions": 1024,
        "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None, "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True, "bos_token_id": 50256, "eos_token_id": 50256,
    },
    "llama-1b": {  # meta-llama/Llama-3.2-1B's config.json, as transformers v4 writes it
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048,
        "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 64, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "hidden_act": "silu",
        "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False, "bos_token_id": 128000,
        "eos_token_id": 128001, "torch_dtype": "bfloat16",
    },
}  # fmt: skip
SHARD_BYTES = 1 << 30


def write_random(path: Path, config: dict, dtype: str) -> None:
    """Random tensors of the architecture's names and shapes (those of jdp's model for config.json, transposed
    where the architecture stores [out, in]), written a shard at a time so the writer never holds them all."""
    import ml_dtypes
    import numpy as np
    from flax import nnx
    from safetensors.numpy import save_file

    from jdp import hf
    from jdp.config import ModelConfig
    from jdp.models import make_model

    m, arch = dataclasses.replace(ModelConfig(), **hf.model_fields(config)), hf.architecture(config)
    abstract = dict(nnx.to_flat_state(nnx.state(nnx.eval_shape(lambda: make_model(m, nnx.Rngs(0))), nnx.Param)))
    rng, np_dtype = np.random.default_rng(0), {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}[dtype]
    path.mkdir(parents=True, exist_ok=True)
    shards, shard, size = [], {}, 0

    def flush() -> None:
        nonlocal shard, size
        shards.append((f"part-{len(shards)}.safetensors", list(shard)))
        save_file(shard, str(path / shards[-1][0]), metadata={"format": "pt"})
        shard, size = {}, 0

    for name, slot in arch.table(m).items():
        shape = abstract[slot.path].get_value().shape
        x = (0.02 * rng.standard_normal(shape[::-1] if slot.transposed else shape, np.float32)).astype(np_dtype)
        shard[arch.file_name(name)], size = x, size + x.nbytes
        if size >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    n = len(shards)
    names = {
        old: (hf.WEIGHTS if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors")
        for i, (old, _) in enumerate(shards)
    }
    for old, new in names.items():
        (path / old).rename(path / new)
    if n > 1:
        weight_map = {t: names[old] for old, tensors in shards for t in tensors}
        (path / hf.INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    (path / hf.CONFIG).write_text(json.dumps(config, indent=1))


def _memory() -> dict:
    """This process's peak and current resident memory, and the current split into its own and mapped files (MB)."""
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    kb = lambda key: int(status[key].split()[0]) / 1024  # noqa: E731
    return {"peak_mb": kb("VmHWM"), "rss_mb": kb("VmRSS"), "anon_mb": kb("RssAnon"), "file_mb": kb("RssFile")}


def measure(config: str, path: str, place: str) -> dict:
    import time

    import jax
    from flax import nnx

    from jdp import hf, parallel
    from jdp.config import load_config
    from jdp.optim import make_optimizer

    out = {"devices": jax.device_count(), "before": _memory()}
    cfg = load_config(config, [f"train.init_from={path}"])
    t0 = time.perf_counter()
    m = hf.adopt(cfg.model, path).model
    model, info = hf.load_model(m, path)
    t1 = time.perf_counter()
    out.update(n_params=info.n_params, read_s=t1 - t0, after_read=_memory())
    out["file_mb"] = sum(p.stat().st_size for p in Path(path).glob("*.safetensors")) / 2**20
    out["param_mb"] = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param))) / 2**20
    if place == "state":
        optimizer, _ = make_optimizer(cfg.optim, cfg.train.steps)
        _, state = parallel.init_state(model, optimizer, parallel.make_mesh(), cfg.parallel.strategy)
        jax.block_until_ready(state)
    elif place == "params":
        mesh = parallel.make_mesh()
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        params = jax.device_put(nnx.state(model, nnx.Param), replicated)
        del model
        jax.block_until_ready(params)
    out.update(place_s=time.perf_counter() - t1, after_place=_memory())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=MODELS, default="gpt2-small")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="of the written file")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--place", choices=["state", "params", "none"], default="state")
    parser.add_argument("--config", default="", help="default: gpt2-finetune for GPT-2, hf-finetune otherwise")
    parser.add_argument("--dir", type=Path, help="a directory to read (default: a random one, made and deleted)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    config = args.config or ("gpt2-finetune" if args.model == "gpt2-small" else "hf-finetune")
    if args.child:
        print(json.dumps(measure(config, str(args.dir), args.place)))
        return
    with tempfile.TemporaryDirectory(prefix=f"jdp-{args.model}-random-") as tmp:
        path = args.dir or Path(tmp)
        if not (path / "config.json").is_file():
            print(f"writing a random {args.model} ({args.dtype}) to {path} ...", flush=True)
            write_random(path, MODELS[args.model], args.dtype)
        env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={args.devices}"}
        env.setdefault("JAX_PLATFORMS", "cpu")
        argv = [sys.executable, __file__, "--child", "--config", config, "--dir", str(path), "--place", args.place]
        child = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
        if child.returncode:
            sys.exit(child.stderr)
        r = json.loads(child.stdout.strip().splitlines()[-1])
    read, placed = r["after_read"], r["after_place"]
    print(
        f"import of {r['n_params']:,} parameters ({r['file_mb']:,.0f} MB of {args.dtype} files -> "
        f"{r['param_mb']:,.0f} MB of parameters) into {config} on {r['devices']} CPU devices:\n"
        f"  read (check config.json, every tensor): {r['read_s']:.1f} s, peak host memory {read['peak_mb']:,.0f} MB "
        f"(before: {r['before']['peak_mb']:,.0f} MB; after: {read['anon_mb']:,.0f} MB the process's own, "
        f"{read['file_mb']:,.0f} MB mapped files)\n"
        f"  place ({args.place}): {r['place_s']:.1f} s, peak host memory {placed['peak_mb']:,.0f} MB"
    )
    print(json.dumps(r))


if __name__ == "__main__":
    main()
