"""jdp's speed, measured side by side in one run and reported as ratios (docs/performance.md).

    python scripts/bench.py --out DIR [--config tiny] [--processes 2] [--rounds 5] [--only powersgd ...]

Writes DIR/bench.json and prints a table. Every ratio compares two things timed in the same run,
alternating in rounds, so the machine's background load hits both sides alike:

  jdp_vs_bare       jdp's full training step (its loader, its prefetch thread, the sharded step, the lagged
                    metrics fetch: what `jdp train` does per step) against a minimal hand-written single-device
                    jitted step of the same model, optimizer and batch. Tokens/s ratio; ideal 1.0.
  jdp_vs_torch_ddp  tokens/s of `jdp launch` + `jdp train` against PyTorch DDP (scripts/bench_torch.py)
                    training the identical GPT (or Llama) with the same global batch and the same number of
                    processes (gloo on CPU, NCCL on GPUs).
  jdp_vs_torch_compile  (--only torch_compile) the same against a plain PyTorch loop under torch.compile, on 1
                    process and on 2 (DDP), with eager PyTorch beside it; the ratio written is 1 process's.
  matmul_peak       (--only peak) the best float32 matmul rate of XLA, numpy's BLAS and torch on this CPU.
  jdp_vs_maxtext    (--only maxtext) jdp against MaxText's own trainer (`pip install maxtext`, its CPU path on
                    synthetic data, no remat, no scan) on the config's Llama shape, one process, alternated;
                    `--maxtext-python` names the Python that has it (default: this one).
  ddp_vs_dp         step time of parallel.strategy=dp over that of ddp, at 1, 2, 4 and 8 devices (> 1: DDP is
                    faster). On a CPU the devices are simulated and share the same cores.
  zero1_vs_ddp      step time of parallel.strategy=zero1 over that of ddp (< 1: zero1 is faster), on 4 devices of
                    one process and on 2 processes (`jdp launch`), with the optimizer bytes one device holds.
  fsdp_vs_ddp       the same for parallel.strategy=fsdp, with the parameter and optimizer bytes one device holds.
  powersgd          parallel.compression=powersgd (rank 4, no warm-up) against plain ddp on 2 processes
                    (`jdp launch`, gloo on CPU): the bytes each step all-reduces (from the compiled programs, as
                    `jdp allreduce` reports them) and the step time ratio (> 1: PowerSGD is faster).
  remat             model.remat=dots and full against none on one device: step time over none's (> 1: slower) and
                    the compiled step's temporaries (the activations kept for backward) over none's.
  loader_vs_step    the loader's tokens/s over the tokens/s one training step consumes.
  mfu               achieved model FLOP/s over the peak: the measured matmul rate on a CPU, the datasheet on a GPU.

On a GPU machine: python scripts/bench.py --out DIR --config gpt2-small (bf16; torch needs `pip install
"jdp[bench]"`, which brings torch; the NCCL comparison uses every visible GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child(mode: str, devices: int, args: list[str], cpu_cores: str | None = None) -> dict:
    """Run one measurement in a fresh process (XLA reads its device count and flags once per process)."""
    env = dict(os.environ)
    if devices:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
    cmd = [sys.executable, __file__, "--child", mode, *args]
    if cpu_cores:
        cmd = ["taskset", "-c", cpu_cores, *cmd]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        raise RuntimeError(f"{mode} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return json.loads(next(line for line in out.stdout.splitlines() if line.startswith("{")))


# ---------------------------------------------------------------- measurements run inside a child process


def _setup(config: str, overrides: list[str]):
    from jdp.config import load_config
    from jdp.job import xla

    cfg = load_config(config, ["train.run_dir=/dev/null", "train.progress=false", *overrides])
    from jdp.parallel import strategies

    strategies.get(cfg.parallel.strategy).set_xla_flags(cfg.parallel.bucket_mb)  # as `jdp train`, before jax starts
    os.environ["JDP_BENCH_KEPT_SCRATCH"] = str(xla.keep_scratch_memory())
    return cfg


def measure_single(config: str, overrides: list[str], rounds: int, steps: int) -> dict:
    """jdp_vs_bare, loader_vs_step and mfu on one device."""
    cfg = _setup(config, overrides)
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from jdp import parallel
    from jdp.build import build
    from jdp.data import Prefetcher, load_data
    from jdp.metrics import flops_per_token, peak_flops
    from jdp.models import make_model
    from jdp.models.common import lm_loss
    from jdp.optim import make_optimizer

    t = cfg.train
    mesh = parallel.make_mesh(jax.devices()[:1])
    rows = parallel.process_rows(t.batch_size, mesh)
    data = load_data(cfg.data, cfg.model.vocab_size, t.batch_size, t.seed, rows)
    tokens_per_step = t.batch_size * cfg.data.seq_len

    # jdp: exactly the objects and per-step host work of jdp.train's loop.
    _, state, train_step, *_ = build(cfg, mesh)
    loader = Prefetcher(data.local_batch, 0, 10**9, cfg.data.prefetch)
    batches = iter(loader)
    pending = [None]

    def jdp_steps(n: int) -> None:
        nonlocal state
        for _ in range(n):
            _, local = next(batches)
            state, metrics = train_step(state, parallel.shard_batch(local, mesh, t.batch_size))
            if pending[0] is not None:
                jax.device_get(pending[0])  # the loop fetches the previous step's metrics
            pending[0] = metrics
        jax.device_get(pending[0])
        pending[0] = None

    # Bare: the same model, optimizer and batch in the most direct JAX there is.
    model = make_model(cfg.model, nnx.Rngs(t.seed))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    optimizer, _ = make_optimizer(cfg.optim, t.steps)
    opt_state = optimizer.init(params)

    def bare_step(params, opt_state, batch):
        def loss_fn(p):
            loss, weight = lm_loss(nnx.merge(graphdef, p, rest), batch)
            return loss / weight

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    bare_step = jax.jit(bare_step, donate_argnums=(0, 1))
    fixed = {k: jnp.asarray(v) for k, v in data.local_batch(0).items()}
    bare = [params, opt_state]

    def bare_steps(n: int) -> None:
        for _ in range(n):
            bare[0], bare[1], loss = bare_step(bare[0], bare[1], fixed)
        jax.block_until_ready(loss)

    jdp_steps(2)  # compile both, then one untimed round each: the first timed rounds were the noisiest
    bare_steps(2)
    jdp_steps(steps)
    bare_steps(steps)
    jdp_t, bare_t = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        jdp_steps(steps)
        jdp_t.append((time.perf_counter() - start) / steps)
        start = time.perf_counter()
        bare_steps(steps)
        bare_t.append((time.perf_counter() - start) / steps)
    loader.close()
    jdp_step, bare_step_s = statistics.median(jdp_t), statistics.median(bare_t)

    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < 2.0:
        data.local_batch(10_000 + n)
        n += 1
    loader_tps = n * tokens_per_step / (time.perf_counter() - start)
    peak, source = peak_flops(cfg.model.dtype, 1)
    jdp_tps = tokens_per_step / jdp_step
    return {
        "jdp_step_s": jdp_step,
        "bare_step_s": bare_step_s,
        "jdp_vs_bare": bare_step_s / jdp_step,
        "jdp_tokens_per_s": jdp_tps,
        "loader_tokens_per_s": loader_tps,
        "loader_vs_step": loader_tps / jdp_tps,
        "mfu": flops_per_token(cfg) * jdp_tps / peak,
        "peak_flops": peak,
        "peak_source": source,
        "device": jax.devices()[0].device_kind,
        "keep_scratch_memory": os.environ["JDP_BENCH_KEPT_SCRATCH"] == "True",
        "rounds": {"jdp_step_s": jdp_t, "bare_step_s": bare_t},
    }


def measure_ddp_dp(config: str, overrides: list[str], rounds: int, steps: int) -> dict:
    r = measure_strategies(config, overrides, rounds, steps, ("ddp", "dp"))
    return {**r, "ddp_vs_dp": r["dp_step_s"] / r["ddp_step_s"]}


def measure_zero1(config: str, overrides: list[str], rounds: int, steps: int) -> dict:
    r = measure_strategies(config, overrides, rounds, steps, ("ddp", "zero1"))
    return {**r, "zero1_vs_ddp": r["zero1_step_s"] / r["ddp_step_s"]}


def measure_fsdp(config: str, overrides: list[str], rounds: int, steps: int) -> dict:
    r = measure_strategies(config, overrides, rounds, steps, ("ddp", "fsdp"))
    return {**r, "fsdp_vs_ddp": r["fsdp_step_s"] / r["ddp_step_s"]}


def _random_batch(cfg):
    """Every device of this process (the mesh) and one random global batch of the config's shape on it."""
    import numpy as np

    from jdp import parallel

    mesh = parallel.make_mesh()
    t = cfg.train
    rng = np.random.default_rng(0)
    shape = (t.batch_size, cfg.data.seq_len)
    local = {
        "inputs": rng.integers(0, cfg.model.vocab_size, shape).astype(np.int32),
        "targets": rng.integers(0, cfg.model.vocab_size, shape).astype(np.int32),
        "weights": np.ones(shape, np.float32),
    }
    return mesh, parallel.shard_batch(local, mesh, t.batch_size)


def _alternating(runs: dict, batch, rounds: int, steps: int) -> dict:
    """Seconds per step of each [state, step] in `runs`, `rounds` rounds of `steps` steps each, taken in turn."""
    import jax

    times = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            for _ in range(steps):
                run[0], m = run[1](run[0], batch)
            jax.block_until_ready(m)
            times[name].append((time.perf_counter() - start) / steps)
    return times


def measure_strategies(config: str, overrides: list[str], rounds: int, steps: int, strategies: tuple) -> dict:
    """Step time of each strategy on every device of this process, alternating; optimizer bytes on one device."""
    cfg = _setup(config, overrides)
    import dataclasses

    import jax

    from jdp.build import build

    mesh, batch = _random_batch(cfg)
    runs, opt_bytes, param_bytes = {}, {}, {}
    first = mesh.devices.flat[0]
    for strategy in strategies:
        c = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, strategy=strategy))
        _, state, step, *_ = build(c, mesh)
        state, m = step(state, batch)
        jax.block_until_ready(m)
        runs[strategy] = [state, step]
        shards = [s for x in jax.tree.leaves(state.opt_state) for s in x.addressable_shards if s.device == first]
        opt_bytes[strategy] = sum(s.data.nbytes for s in shards)
        mine = [s for x in jax.tree.leaves(state.params) for s in x.addressable_shards if s.device == first]
        param_bytes[strategy] = sum(s.data.nbytes for s in mine)
    times = _alternating(runs, batch, rounds, steps)
    out = {"devices": mesh.devices.size}
    for s in strategies:
        out[f"{s}_step_s"] = statistics.median(times[s])
        out[f"{s}_opt_bytes_per_device"] = opt_bytes[s]
        out[f"{s}_param_bytes_per_device"] = param_bytes[s]
    return out


def measure_remat(config: str, overrides: list[str], rounds: int, steps: int) -> dict:
    """Step time and the compiled step's temporaries under each model.remat policy, alternating, on one device."""
    cfg = _setup(config, overrides)
    import dataclasses

    import jax

    from jdp.build import build

    mesh, batch = _random_batch(cfg)
    runs, temp = {}, {}
    for policy in ("none", "dots", "full"):
        c = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, remat=policy))
        _, state, step, *_ = build(c, mesh)
        temp[policy] = step.lower(state, batch).compile().memory_analysis().temp_size_in_bytes
        state, m = step(state, batch)
        jax.block_until_ready(m)
        runs[policy] = [state, step]
    times = _alternating(runs, batch, rounds, steps)
    out = {}
    for policy in runs:
        step_s = statistics.median(times[policy])
        out[policy] = {"step_s": step_s, "temp_bytes": temp[policy],
                       "time_vs_none": step_s / statistics.median(times["none"]),
                       "temp_vs_none": temp[policy] / temp["none"]}  # fmt: skip
    return out


# ---------------------------------------------------------------- jdp against PyTorch DDP, both as launched jobs


def jdp_launch_tps(config: str, overrides: list[str], processes: int, steps: int, out: Path, gpu: bool) -> float:
    run_dir = out / "jdp-run"
    cmd = [sys.executable, "-m", "jdp.cli", "launch", "--nproc-per-node", str(processes), "--", "train", config]
    cmd += [f"train.run_dir={run_dir}", "train.resume=false", f"train.steps={steps}", "train.progress=false"]
    cmd += ["train.log_every=5", "train.eval_every=0", "data.val_tokens=0", "train.ckpt_every=0"]
    cmd += ["train.check_replicas_every=0", *overrides]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if result.returncode:
        raise RuntimeError(f"jdp launch failed:\n{result.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tps = [r["tokens_per_sec"] for r in records if r.get("tokens_per_sec")]
    return statistics.median(tps[1:] if len(tps) > 2 else tps)  # past the first interval (warm-up)


def torch_ddp_tps(config: str, processes: int, batch: int, steps: int, dtype: str, *extra: str) -> float:
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_torch.py"), "--config", config, "--nproc", str(processes)]
    cmd += ["--global-batch", str(batch), "--steps", str(steps), "--dtype", dtype, *extra]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    line = next((x for x in result.stdout.splitlines() if x.startswith("BENCH_JSON ")), None)
    if line is None:
        raise RuntimeError(f"PyTorch DDP benchmark failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
    if result.returncode:  # gloo sometimes aborts in teardown, after the timed steps and the report
        print(f"[bench] note: PyTorch exited with {result.returncode} after reporting its timing", flush=True)
    return json.loads(line[len("BENCH_JSON ") :])["tokens_per_sec"]


# ---------------------------------------------------------------- the report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="directory for bench.json")
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--processes", type=int, default=0, help="processes for jdp vs torch (default: 2 on CPU)")
    ap.add_argument("--rounds", type=int, default=5, help="alternating timing rounds per comparison")
    ap.add_argument("--steps", type=int, default=5, help="steps per timing round")
    ap.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8], help="device counts for ddp_vs_dp")
    ap.add_argument("--skip-torch", action="store_true", help="no PyTorch comparison (torch not installed)")
    ap.add_argument("--only", nargs="+", choices=SECTIONS, default=SECTIONS, help="measure only these")
    ap.add_argument("--maxtext-python", help="the Python with maxtext installed (default: this one)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="section.key=value for the config")
    a = ap.parse_args()
    if a.child:
        fn = {"single": measure_single, "ddp_dp": measure_ddp_dp, "zero1": measure_zero1, "fsdp": measure_fsdp,
              "remat": measure_remat}[a.child]  # fmt: skip
        print(json.dumps(fn(a.config, a.overrides, a.rounds, a.steps)))
        return 0
    if not a.out:
        ap.error("--out DIR is required")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = _has_gpu()
    started = time.time()
    results: dict = {"config": a.config, "overrides": a.overrides, "platform": "gpu" if gpu else "cpu"}
    results["host"] = host(a.config, a.overrides)
    print(f"[bench] {describe_host(results['host'])}", flush=True)
    if "single" in a.only:
        single_device(a, gpu, results)
    if "ddp_dp" in a.only:
        ddp_vs_dp(a, gpu, results)
    if "zero1" in a.only:
        split_vs_ddp(a, gpu, out, results, "zero1")
    if "fsdp" in a.only:
        split_vs_ddp(a, gpu, out, results, "fsdp")
    if "powersgd" in a.only:
        powersgd_vs_ddp(a, gpu, out, results)
    if "remat" in a.only:
        print(f"[bench] model.remat none, dots, full on 1 device, {a.rounds} rounds of {a.steps} steps", flush=True)
        args = ["--config", a.config, "--rounds", str(a.rounds), "--steps", str(a.steps), *a.overrides]
        results["remat"] = child("remat", 0 if gpu else 1, args)
    if "torch" in a.only and not a.skip_torch:
        jdp_vs_torch(a, gpu, out, results)
    if "torch_compile" in a.only and not a.skip_torch:
        jdp_vs_torch_compile(a, gpu, out, results)
    if "maxtext" in a.only:
        jdp_vs_maxtext(a, gpu, out, results)
    if "peak" in a.only:
        results["matmul_peak"] = matmul_peak()
    results["wall_s"] = time.time() - started
    (out / "bench.json").write_text(json.dumps(results, indent=1))
    print(table(results))
    print(f"[bench] wrote {out / 'bench.json'} in {results['wall_s']:.0f} s")
    return 0


SECTIONS = ["single", "ddp_dp", "zero1", "fsdp", "powersgd", "remat", "torch", "torch_compile", "maxtext", "peak"]


def single_device(a, gpu: bool, results: dict) -> None:
    print(f"[bench] jdp vs bare JAX, loader, MFU: 1 device, {a.rounds} rounds of {a.steps} steps", flush=True)
    single = child(
        "single",
        0 if gpu else 1,
        ["--config", a.config, "--rounds", str(a.rounds), "--steps", str(a.steps), *a.overrides],
    )
    results.update({k: single[k] for k in ("jdp_vs_bare", "loader_vs_step", "mfu")})
    results["host"]["keep_scratch_memory"] = single["keep_scratch_memory"]
    results["single_device"] = single


def ddp_vs_dp(a, gpu: bool, results: dict) -> None:
    ddp_dp = {}
    counts = [n for n in a.devices if not gpu or n <= _gpu_count()]
    for n in counts:
        print(f"[bench] ddp vs dp on {n} device(s)", flush=True)
        args = ["--config", a.config, "--rounds", str(a.rounds), "--steps", str(a.steps), *a.overrides]
        ddp_dp[str(n)] = child("ddp_dp", 0 if gpu else n, args)
    results["ddp_vs_dp"] = {n: r["ddp_vs_dp"] for n, r in ddp_dp.items()}
    results["ddp_vs_dp_detail"] = ddp_dp


def split_vs_ddp(a, gpu: bool, out: Path, results: dict, strategy: str) -> None:
    """`strategy` (zero1 or fsdp) against ddp: on 4 devices of one process, then on 2 processes."""
    n = min(4, _gpu_count()) if gpu else 4
    print(f"[bench] {strategy} vs ddp on {n} device(s) of one process, then on 2 processes", flush=True)
    args = ["--config", a.config, "--rounds", str(a.rounds), "--steps", str(a.steps), *a.overrides]
    measured = child(strategy, 0 if gpu else n, args)
    steps = max(20, 4 * a.steps)
    launched = {"ddp": [], strategy: []}
    for _ in range(2):
        for name in launched:
            extra = [*a.overrides, f"parallel.strategy={name}"]
            launched[name].append(jdp_launch_tps(a.config, extra, 2, steps, out, gpu))
    measured["processes_tokens_per_s"] = launched
    results[f"{strategy}_vs_ddp"] = {
        f"{n}_devices": measured[f"{strategy}_vs_ddp"],
        "2_processes": statistics.median(launched["ddp"]) / statistics.median(launched[strategy]),
    }
    results[f"{strategy}_vs_ddp_detail"] = measured


def powersgd_vs_ddp(a, gpu: bool, out: Path, results: dict) -> None:
    print("[bench] PowerSGD vs plain ddp on 2 processes: bytes per step, then step time", flush=True)
    compress = ["parallel.compression=powersgd", "parallel.powersgd_rank=4", "parallel.powersgd_warmup=0"]
    cmd = [sys.executable, "-m", "jdp.cli", "allreduce", a.config, *a.overrides, *compress, "--devices", "2", "--json"]
    report = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=True)
    numbers = json.loads(report.stdout.strip().splitlines()[-1])
    steps = max(20, 4 * a.steps)
    launched = {"ddp": [], "powersgd": []}
    for _ in range(2):
        for name, extra in (("ddp", []), ("powersgd", compress)):
            launched[name].append(jdp_launch_tps(a.config, [*a.overrides, *extra], 2, steps, out, gpu))
    results["powersgd"] = {
        "bytes_per_step": numbers["bytes_per_step"],
        "bytes_per_step_uncompressed": numbers["bytes_per_step_uncompressed"],
        "speedup_2_processes": statistics.median(launched["powersgd"]) / statistics.median(launched["ddp"]),
        "tokens_per_s": launched,
    }


def jdp_vs_torch(a, gpu: bool, out: Path, results: dict) -> None:
    from jdp.config import load_config

    cfg = load_config(a.config, a.overrides)
    processes = a.processes or (_gpu_count() if gpu else 2)
    steps = max(20, 4 * a.steps)
    jdp_runs, torch_runs = [], []
    for r in range(max(2, a.rounds - 1)):
        print(f"[bench] jdp vs PyTorch DDP, {processes} processes, round {r + 1}", flush=True)
        jdp_runs.append(jdp_launch_tps(a.config, a.overrides, processes, steps, out, gpu))
        torch_runs.append(torch_ddp_tps(a.config, processes, cfg.train.batch_size, steps, cfg.model.dtype))
    results["jdp_vs_torch_ddp"] = statistics.median(jdp_runs) / statistics.median(torch_runs)
    results["torch_ddp"] = {"processes": processes, "jdp_tokens_per_s": jdp_runs, "torch_tokens_per_s": torch_runs}


def jdp_vs_torch_compile(a, gpu: bool, out: Path, results: dict) -> None:
    """jdp against a plain PyTorch loop under torch.compile (and eager, for reference) on the same model (the
    config's GPT or Llama rebuilt in torch), global batch and optimizer: on 1 process, then 2 (DDP; jdp launch),
    each round timing every side in turn."""
    from jdp.config import load_config

    cfg = load_config(a.config, a.overrides)
    steps, layouts = max(20, 4 * a.steps), {}
    for processes in (1, 2) if not gpu else (1, _gpu_count()):
        runs: dict[str, list[float]] = {"jdp": [], "torch_compile": [], "torch_eager": []}
        for r in range(max(2, a.rounds - 1)):
            print(f"[bench] jdp vs torch.compile, {processes} process(es), round {r + 1}", flush=True)
            runs["jdp"].append(jdp_launch_tps(a.config, a.overrides, processes, steps, out, gpu))
            for side, extra in (("torch_compile", ["--compile"]), ("torch_eager", [])):
                runs[side].append(torch_ddp_tps(a.config, processes, cfg.train.batch_size, steps, cfg.model.dtype,
                                                *extra))  # fmt: skip
        med = {k: statistics.median(v) for k, v in runs.items()}
        layouts[str(processes)] = {"tokens_per_s": runs, "jdp_vs_torch_compile": med["jdp"] / med["torch_compile"],
                                   "jdp_vs_torch_eager": med["jdp"] / med["torch_eager"],
                                   "ms_per_step": {k: cfg.train.batch_size * cfg.data.seq_len / v * 1e3
                                                   for k, v in med.items()}}  # fmt: skip
    results["jdp_vs_torch_compile"] = layouts["1"]["jdp_vs_torch_compile"]
    results["torch_compile"] = layouts


def maxtext_command(python: str, cfg, steps: int, out: Path) -> list[str]:
    """MaxText's pre-training entry point on the config's Llama (float32, no remat, no scan, plain dot-product
    attention, synthetic data, AdamW as jdp's), one device."""
    from jdp.models import llama

    m, o, t = cfg.model, cfg.optim, cfg.train
    if m.arch != "llama":
        raise ValueError(f"--only maxtext compares a Llama (model.arch=llama); {cfg.model.arch!r} has no MaxText twin here")
    where = "import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec('maxtext').origin).parent)"
    found = subprocess.run([python, "-c", where], capture_output=True, text=True)
    if found.returncode:
        raise RuntimeError(f"{python} has no maxtext (pip install maxtext): {found.stderr[-500:]}")
    base = Path(found.stdout.strip()) / "configs" / "base.yml"
    return [python, "-m", "maxtext.trainers.pre_train.train", str(base), "run_name=jdp-bench",
            f"base_output_directory={out / 'maxtext'}", "hardware=cpu", "skip_jax_distributed_system=true",
            "dataset_type=synthetic", f"steps={steps}", "enable_checkpointing=false", "decoder_block=llama2",
            f"base_emb_dim={m.d_model}", f"base_num_query_heads={m.n_heads}", f"base_num_kv_heads={m.kv_heads}",
            f"base_mlp_dim={llama.ff_width(m)}", f"base_num_decoder_layers={m.n_layers}",
            f"head_dim={m.head_width}", f"vocab_size={m.vocab_size}", f"max_target_length={cfg.data.seq_len}",
            f"per_device_batch_size={t.batch_size}", f"dtype={m.dtype}", f"weight_dtype={m.dtype}",
            "scan_layers=false", "remat_policy=none", "attention=dot_product", "enable_dropout=false",
            f"logits_via_embedding={str(m.tie_embeddings).lower()}", "opt_type=adamw", f"learning_rate={o.lr}",
            "adam_b1=0.9", "adam_b2=0.95", f"adam_weight_decay={o.weight_decay}", "gradient_clipping_threshold=1.0",
            "enable_goodput_recording=false", "monitor_goodput=false", "enable_tensorboard=false",
            "packing=false"]  # fmt: skip


def maxtext_step_s(cmd: list[str]) -> float:
    """Median seconds per step MaxText logs (`completed step: N, seconds: S`), past its first 3 steps."""
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    times = [float(x) for x in re.findall(r"completed step: \d+, seconds: ([\d.]+)", result.stdout + result.stderr)]
    if result.returncode or len(times) < 5:
        raise RuntimeError(f"MaxText failed (exit {result.returncode}):\n{(result.stdout + result.stderr)[-3000:]}")
    return statistics.median(times[3:])


def jdp_vs_maxtext(a, gpu: bool, out: Path, results: dict) -> None:
    """jdp (`jdp launch` + `jdp train`, one process) against MaxText's trainer on the same Llama, alternated."""
    from jdp.config import load_config

    cfg = load_config(a.config, a.overrides)
    steps = max(20, 4 * a.steps)
    cmd = maxtext_command(a.maxtext_python or sys.executable, cfg, steps, out)
    tokens = cfg.train.batch_size * cfg.data.seq_len
    runs: dict[str, list[float]] = {"jdp": [], "maxtext": []}
    for r in range(max(2, a.rounds - 1)):
        print(f"[bench] jdp vs MaxText, 1 process, round {r + 1}", flush=True)
        runs["jdp"].append(tokens / jdp_launch_tps(a.config, a.overrides, 1, steps, out, gpu) * 1e3)
        runs["maxtext"].append(maxtext_step_s(cmd) * 1e3)
    med = {k: statistics.median(v) for k, v in runs.items()}
    results["jdp_vs_maxtext"] = med["maxtext"] / med["jdp"]
    results["maxtext"] = {"ms_per_step": runs, "command": cmd}


def matmul_peak(n: int = 2048, seconds: float = 2.0) -> dict:
    """The best float32 matmul rate (FLOP/s) each library reaches on this machine's CPU, n x n, every core: XLA
    (what jdp's MFU divides by), numpy's BLAS and torch's (oneDNN/MKL) where installed. The best is the peak MFU
    should be stated against."""
    import numpy as np

    def rate(run) -> float:
        run()
        reps, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            run()
            reps += 1
        return 2.0 * n**3 * reps / (time.perf_counter() - start)

    x = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    found = {"numpy": rate(lambda: x @ x)}
    try:
        import torch

        t = torch.from_numpy(x)
        found["torch"] = rate(lambda: t @ t)
    except ImportError:
        pass
    from jdp.metrics import measure_matmul_flops

    found["xla"] = measure_matmul_flops(n, seconds)  # the rate jdp's mfu divides by, measured as it measures it
    return {"n": n, "flops": found, "best": max(found, key=found.get)}


def host(config: str, overrides: list[str]) -> dict:
    """The machine and the options every measurement runs with: CPU model and ISA, versions, XLA_FLAGS."""
    from jdp.config import load_config
    from jdp.hardware import host_description
    from jdp.job import xla

    env = dict(os.environ)
    xla.set_xla_flags(load_config(config, overrides).parallel.bucket_mb, env)  # what _setup adds in each child
    return {**host_description(), "xla_flags": env.get("XLA_FLAGS", "")}


def describe_host(h: dict) -> str:
    return (
        f"{h['cpu']} ({h['cpu_family_model']}; {', '.join(h['isa']) or 'no AVX2'}), {h['cores']} cores | "
        f"python {h['python']}, jax {h['jax']}, jaxlib {h['jaxlib']} | XLA_FLAGS={h['xla_flags']!r}"
    )


def table(r: dict) -> str:
    rows = []
    if "single_device" in r:
        s = r["single_device"]
        rows += [
            ("jdp_vs_bare", f"{r['jdp_vs_bare']:.3f}", f"jdp {s['jdp_step_s'] * 1e3:.0f} ms/step, bare {s['bare_step_s'] * 1e3:.0f} ms/step"),
            ("loader_vs_step", f"{r['loader_vs_step']:,.0f}", f"loader {s['loader_tokens_per_s']:,.0f} tokens/s, step {s['jdp_tokens_per_s']:,.0f} tokens/s"),
            ("mfu", f"{r['mfu']:.1%}", f"of {s['peak_flops'] / 1e12:.3g} TFLOP/s ({s['peak_source']})"),
        ]  # fmt: skip
    for n, v in r.get("ddp_vs_dp", {}).items():
        d = r["ddp_vs_dp_detail"][n]
        rows.append(
            (
                f"ddp_vs_dp ({n} dev)",
                f"{v:.3f}",
                f"ddp {d['ddp_step_s'] * 1e3:.0f} ms, dp {d['dp_step_s'] * 1e3:.0f} ms",
            )
        )
    for strategy in ("zero1", "fsdp"):
        if f"{strategy}_vs_ddp" not in r:
            continue
        z = r[f"{strategy}_vs_ddp_detail"]
        n = z["devices"]
        held = (
            f"optimizer state per device {z[f'{strategy}_opt_bytes_per_device'] / 1e6:.2f} MB against "
            f"{z['ddp_opt_bytes_per_device'] / 1e6:.2f} MB"
        )
        if strategy == "fsdp":
            held += (
                f", parameters {z['fsdp_param_bytes_per_device'] / 1e6:.2f} MB against "
                f"{z['ddp_param_bytes_per_device'] / 1e6:.2f} MB"
            )
        rows.append(
            (
                f"{strategy}_vs_ddp ({n} dev)",
                f"{r[f'{strategy}_vs_ddp'][f'{n}_devices']:.3f}",
                f"{strategy} {z[f'{strategy}_step_s'] * 1e3:.0f} ms, ddp {z['ddp_step_s'] * 1e3:.0f} ms; {held}",
            )
        )
        t = z["processes_tokens_per_s"]
        rows.append(
            (
                f"{strategy}_vs_ddp (2 proc)",
                f"{r[f'{strategy}_vs_ddp']['2_processes']:.3f}",
                f"{strategy} {statistics.median(t[strategy]):,.0f}, ddp {statistics.median(t['ddp']):,.0f} tokens/s",
            )
        )
    if "powersgd" in r:
        p = r["powersgd"]
        t = p["tokens_per_s"]
        rows.append(
            (
                "powersgd (2 proc)",
                f"{p['speedup_2_processes']:.3f}",
                f"{p['bytes_per_step']:,} bytes all-reduced per step against {p['bytes_per_step_uncompressed']:,}; "
                f"powersgd {statistics.median(t['powersgd']):,.0f}, ddp {statistics.median(t['ddp']):,.0f} tokens/s",
            )
        )
    for policy in ("dots", "full"):
        if policy in r.get("remat", {}):
            q, none = r["remat"][policy], r["remat"]["none"]
            rows.append(
                (
                    f"remat={policy} (1 dev)",
                    f"{q['time_vs_none']:.3f}",
                    f"step time over none's; activations kept {q['temp_bytes'] / 1e6:,.1f} MB against "
                    f"{none['temp_bytes'] / 1e6:,.1f} MB ({q['temp_vs_none']:.2f}x)",
                )
            )
    if "jdp_vs_torch_ddp" in r:
        t = r["torch_ddp"]
        j, p = statistics.median(t["jdp_tokens_per_s"]), statistics.median(t["torch_tokens_per_s"])
        rows.append(
            (
                "jdp_vs_torch_ddp",
                f"{r['jdp_vs_torch_ddp']:.3f}",
                f"{t['processes']} processes: jdp {j:,.0f}, torch {p:,.0f} tokens/s",
            )
        )
    for processes, t in r.get("torch_compile", {}).items():
        ms = t["ms_per_step"]
        rows.append((f"jdp_vs_torch_compile ({processes} proc)", f"{t['jdp_vs_torch_compile']:.3f}",
                     f"ms/step: jdp {ms['jdp']:.0f}, torch.compile {ms['torch_compile']:.0f}, eager "
                     f"{ms['torch_eager']:.0f} (jdp_vs_torch_eager {t['jdp_vs_torch_eager']:.3f})"))  # fmt: skip
    if "maxtext" in r:
        ms = {k: statistics.median(v) for k, v in r["maxtext"]["ms_per_step"].items()}
        rows.append(("jdp_vs_maxtext", f"{r['jdp_vs_maxtext']:.3f}",
                     f"1 process, ms/step: jdp {ms['jdp']:.0f}, MaxText {ms['maxtext']:.0f}"))  # fmt: skip
    if "matmul_peak" in r:
        m = r["matmul_peak"]
        rows.append(("matmul_peak", f"{m['flops'][m['best']] / 1e9:,.0f}",
                     f"GFLOP/s float32 {m['n']}^2, best of " + ", ".join(f"{k} {v / 1e9:,.0f}" for k, v in
                                                                          m["flops"].items())))  # fmt: skip
    width = max(len(k) for k, _, _ in rows)
    lines = [f"{k:<{width}}  {v:>9}  {note}" for k, v, note in rows]
    return "\n".join([f"host: {describe_host(r['host'])}", *lines])


def _has_gpu() -> bool:
    return _gpu_count() > 0


def _gpu_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
        return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
    except (OSError, subprocess.SubprocessError):
        return 0


if __name__ == "__main__":
    sys.exit(main())
