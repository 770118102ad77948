"""Everything jdp claims about GPUs, measured on one in a single call: correctness of bf16 compute and of the fused
attention, the non-finite guard, speed and MFU beside the planner's prediction, peak memory beside the plan's,
a profiler trace, the goodput account and the KV-cache sampling rate. docs/performance.md#gpu-check says what
each number means.

    scripts/gpu_check.sh [--out DIR] [--budget-s 480]   # on a GPU machine (about 8 minutes on one H200)
    scripts/gpu_check.sh --cpu --out DIR                # the same steps on CPU with tiny configs (CI runs it)

Writes into DIR (default $OUT, else gpu-check-out): summary.md (every number and what it was compared with),
results.json (the same, whole), gpu_check.log (every step's own output), trace.tar.gz (a jax.profiler trace of a
few training steps: `tensorboard --logdir` or https://ui.perfetto.dev on its .trace.json.gz) and runs.tar.gz (each
training run's config, metrics.jsonl and summary.json). Five files, so the device tool brings them all back.

Each step runs in its own process, in order, with its own time limit out of --budget-s: one that fails, hangs or
runs out of time is reported as such in the summary and the rest still run. The parent process never touches an
accelerator (a GPU's memory stays free for the step running).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "datasets", "numpy", "jinja2", "tensorboardX")
TRACE_LIMIT = 15_000_000  # bytes: the device tool returns files of up to 16 MB
PEAK_GPU = "H200"  # the planner's GPU in --cpu mode (a CPU has no datasheet to plan against)


@dataclass(frozen=True)
class Train:
    """One `jdp train` run measured for speed, memory and goodput, and planned for beside it."""

    name: str
    config: str
    overrides: tuple[str, ...]
    steps: int
    log_every: int


@dataclass(frozen=True)
class Profile:
    """What each mode runs: the GPU's real sizes, or tiny ones that run everywhere in about a minute."""

    models: dict  # name -> (config, overrides): correctness (bf16 vs float32) and sampling
    check_batch: tuple[int, int]  # rows, sequence length of the correctness steps
    check_steps: int
    attention: tuple  # (label, B, L, H, G, K)
    trains: tuple[Train, ...]
    new_tokens: int  # sampling: tokens drawn after the prompt
    sample_len: int  # sampling: model.max_seq_len (the window the uncached path re-reads per token)
    trace_steps: int
    remat: tuple = ()  # (config, overrides): model.remat none, dots and full side by side (peak memory, ms/step)
    budgets: dict = field(default_factory=dict)  # step -> seconds it may take at most


GPU = Profile(
    models={
        # the widths of GPT-2 small and of Llama-3.2-1B, 4 layers each: the numerics are the same, the compiles short
        "gpt2-small-4layers": ("gpt2-small", ("model.n_layers=4",)),
        "llama-1b-4layers": ("llama-3.2-1b", ("model.n_layers=4",)),
    },
    check_batch=(8, 1024),
    check_steps=5,
    attention=(("gpt2-small heads", 8, 1024, 12, 12, 64), ("llama-1b heads (GQA)", 8, 1024, 32, 8, 64)),
    trains=(
        Train("gpt2-small", "gpt2-small", ("train.batch_size=64", "train.grad_accum=4"), 40, 10),
        Train(
            "llama-1b",
            "llama-3.2-1b",
            ("data.seq_len=1024", "train.batch_size=16", "train.grad_accum=2", "optim.warmup_steps=10"),
            20,
            5,
        ),
    ),
    new_tokens=256,
    sample_len=512,
    trace_steps=2,
    remat=("llama-3.2-1b", ("data.seq_len=2048", "train.batch_size=8", "model.dtype=bfloat16")),
    budgets={
        "devices": 60,
        "correctness": 150,
        "attention": 120,
        "train": 170,
        "plan": 60,
        "profile": 90,
        "generate": 120,
        "remat": 180,
    },
)

CPU = Profile(
    models={"tiny": ("tiny", ("model.n_layers=2",)), "llama-tiny": ("llama-tiny", ("model.n_layers=2",))},
    check_batch=(4, 128),
    check_steps=3,
    attention=(("tiny heads", 2, 128, 4, 4, 32), ("llama-tiny heads (GQA)", 2, 128, 4, 2, 64)),
    trains=(
        Train("tiny", "tiny", ("model.n_layers=2", "train.batch_size=16", "train.grad_accum=2"), 8, 2),
        Train("llama-tiny", "llama-tiny", ("model.n_layers=2", "train.batch_size=16", "train.grad_accum=2"), 6, 2),
    ),
    new_tokens=24,
    sample_len=128,
    trace_steps=2,
    remat=("llama-tiny", ("model.n_layers=2", "data.seq_len=128", "train.batch_size=8")),
    budgets={
        "devices": 60,
        "correctness": 120,
        "attention": 60,
        "train": 120,
        "plan": 60,
        "profile": 90,
        "generate": 90,
        "remat": 90,
    },
)

# After each run's overrides, so they win: no evaluation (its compile is not what is measured), one checkpoint at
# the end (always written: its time is in the goodput account), no progress bar in the log.
COMMON = ("data.val_tokens=0", "train.ckpt_every=0", "train.progress=false")

# bf16 compute against float32 (at full float32 matmul precision) from the same initial parameters and batches:
# each step's loss may differ by this fraction of the float32 loss at most. bf16 keeps 8 bits of mantissa (a
# relative rounding of 2^-9 ~ 0.2%); a few steps of Adam move the two runs apart by a little more.
LOSS_BOUND = 0.02
# The fused attention against the written-out (einsum) one, both in bf16 with float32 softmax: the largest
# difference of any output or gradient element, over the largest magnitude of that tensor.
ATTENTION_BOUND = 0.02


# ------------------------------------------------------------------------ the steps, each in its own process


def child_devices(p: Profile, work: Path) -> dict:
    import jax

    d = jax.devices()[0]
    stats = d.memory_stats() or {}
    return {
        "platform": d.platform,
        "device_kind": d.device_kind,
        "device_count": jax.device_count(),
        "bytes_limit": stats.get("bytes_limit"),
        "default_backend": jax.default_backend(),
    }


def _text_batches(n: int, rows: int, length: int) -> list:
    """n batches of real text (the Python standard library's own sources, as bytes): the same on every run."""
    import numpy as np

    text = b"".join(p.read_bytes() for p in sorted(Path(os.__file__).parent.glob("*.py")))
    need = n * rows * (length + 1)
    ids = np.frombuffer((text * (need // len(text) + 1))[:need], np.uint8).astype(np.int32)
    windows = ids.reshape(n, rows, length + 1)
    return [{"inputs": w[:, :-1], "targets": w[:, 1:], "weights": np.ones((rows, length), np.float32)} for w in windows]


def child_correctness(p: Profile, work: Path) -> dict:
    """Each model a few steps in bf16 compute (float32 parameters) and in float32 from the same start, and the
    non-finite guard on the bf16 state: a batch whose weights are NaN must leave every parameter as it was."""
    import jax
    import numpy as np

    from jdp import parallel
    from jdp.build import build
    from jdp.config import load_config
    from jdp.metrics import params_sha256

    mesh = parallel.make_mesh()
    rows, length = p.check_batch
    batches = _text_batches(p.check_steps, rows, length)
    out = {}
    for name, (config, overrides) in p.models.items():
        runs = {}
        for label, dtype, precision in (("bf16", "bfloat16", "default"), ("float32", "float32", "highest")):
            cfg = load_config(config, [*overrides, f"model.dtype={dtype}", "model.param_dtype=float32",
                                       "train.run_dir=/dev/null", f"train.batch_size={rows}",
                                       f"data.seq_len={length}", f"train.steps={p.check_steps + 2}"])  # fmt: skip
            with jax.default_matmul_precision(precision):
                built = build(cfg, mesh)
                state, losses, norms = built.state, [], []
                for batch in batches:
                    state, m = built.train_step(state, parallel.shard_batch(batch, mesh, rows))
                    losses.append(float(m["loss"]))
                    norms.append(float(m["grad_norm"]))
                runs[label] = {"loss": losses, "grad_norm": norms}
                if label == "bf16":  # the guard, on the same compiled step
                    before = params_sha256(state.params, state.shapes)
                    bad = {**batches[0], "weights": batches[0]["weights"] * np.float32("nan")}
                    state, m = built.train_step(state, parallel.shard_batch(bad, mesh, rows))
                    skipped, bad_loss = int(m["skipped"]), float(m["loss"])
                    after = params_sha256(state.params, state.shapes)
                    state, m = built.train_step(state, parallel.shard_batch(batches[1], mesh, rows))
                    guard = {
                        "skipped": skipped,
                        "loss_reported": bad_loss,
                        "params_unchanged": before == after,
                        "next_step_finite": bool(np.isfinite(float(m["loss"]))) and int(m["skipped"]) == 0,
                    }
                    guard["ok"] = skipped == 1 and before == after and guard["next_step_finite"]
        rel = [abs(a - b) / abs(b) for a, b in zip(runs["bf16"]["loss"], runs["float32"]["loss"], strict=True)]
        rel = [x if math.isfinite(x) else math.inf for x in rel]  # max() would pass over a NaN
        out[name] = {
            "config": config,
            "overrides": list(overrides),
            "batch": [rows, length],
            **runs,
            "max_rel_loss_diff": max(rel),
            "bound": LOSS_BOUND,
            "ok": max(rel) <= LOSS_BOUND,
            "guard": guard,
        }
    return out


def child_attention(p: Profile, work: Path) -> dict:
    """The fused attention (cuDNN on a GPU; XLA's jax.nn.dot_product_attention on a CPU) against jdp's blocked
    einsum, forward and gradients, in bf16; both against the einsum in float32 at full precision; causal, and
    within two documents per row (a mask); and each one's forward + backward time."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jdp.attention import attention

    fused = "cudnn" if jax.default_backend() == "gpu" else "xla"
    out = {"fused": fused, "cases": []}
    for label, B, L, H, G, K in p.attention:
        keys = jax.random.split(jax.random.key(0), 4)
        q32 = jax.random.normal(keys[0], (B, L, H, K), jnp.float32)
        k32, v32 = (jax.random.normal(k, (B, L, G, K), jnp.float32) for k in keys[1:3])
        dy = jax.random.normal(keys[3], (B, L, H, K), jnp.float32)
        segments = jnp.broadcast_to((jnp.arange(L) >= L // 3).astype(jnp.int32), (B, L))
        for masked in (False, True):
            seg = segments if masked else None

            def run(kind, dtype, q32=q32, k32=k32, v32=v32, dy=dy, seg=seg):
                def loss(q_, k_, v_):
                    y = attention(q_, k_, v_, kind, seg)
                    return (y.astype(jnp.float32) * dy).sum(), y

                f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
                args = [x.astype(dtype) for x in (q32, k32, v32)]
                (_, y), grads = jax.block_until_ready(f(*args))
                times = []
                for _ in range(5):
                    start = time.perf_counter()
                    jax.block_until_ready(f(*args))
                    times.append(time.perf_counter() - start)
                return [np.asarray(t, np.float32) for t in (y, *grads)], statistics.median(times)

            case = {"shape": label, "B": B, "L": L, "H": H, "G": G, "K": K, "within_documents": masked}
            try:
                with jax.default_matmul_precision("highest"):
                    ref, _ = run("einsum", jnp.float32)
                blocked, einsum_s = run("einsum", jnp.bfloat16)
                fast, fused_s = run(fused, jnp.bfloat16)

                def worst(a, b):
                    errors = [
                        float(np.abs(x - y).max() / max(np.abs(y).max(), 1e-30)) for x, y in zip(a, b, strict=True)
                    ]
                    return max(e if math.isfinite(e) else math.inf for e in errors)  # a NaN is the worst, not skipped

                case["fused_vs_einsum"] = worst(fast, blocked)
                case["fused_vs_float32"] = worst(fast, ref)
                case["einsum_vs_float32"] = worst(blocked, ref)
                case["ok"] = case["fused_vs_einsum"] <= ATTENTION_BOUND
                case["einsum_ms"], case["fused_ms"] = einsum_s * 1e3, fused_s * 1e3
            except Exception as e:  # a kernel that refuses a shape or a mask is a result, not the end of the check
                case["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                case["ok"] = False
            out["cases"].append(case)
    out["bound"] = ATTENTION_BOUND
    return out


def child_profile(p: Profile, work: Path) -> dict:
    """The first training config's step outside the loop: the compiled program's memory, the bare step time, the
    device's peak memory after it, and a jax.profiler trace of a few steps."""
    import jax
    import numpy as np

    from jdp import parallel
    from jdp.build import build
    from jdp.config import load_config
    from jdp.job.xla import use_compilation_cache
    from jdp.memory import peak_device_bytes
    from jdp.parallel import strategies

    t = p.trains[0]
    cfg = load_config(t.config, [*t.overrides, "train.run_dir=/dev/null", f"train.steps={t.steps}"])
    strategies.get(cfg.parallel.strategy).set_xla_flags(cfg.parallel.bucket_mb)
    use_compilation_cache(
        Path(os.environ["JDP_CACHE"]) / "xla"
    )  # where the `jdp train` run of the same config left its programs
    mesh = parallel.make_mesh()
    built = build(cfg, mesh)
    rows, length = cfg.train.batch_size, cfg.data.seq_len
    rng = np.random.default_rng(0)
    local = {
        "inputs": rng.integers(0, 256, (rows, length)).astype(np.int32),
        "targets": rng.integers(0, 256, (rows, length)).astype(np.int32),
        "weights": np.ones((rows, length), np.float32),
    }
    batch = parallel.shard_batch(local, mesh, rows)
    out = {"config": t.name}
    try:
        m = built.train_step.lower(built.state, batch).compile().memory_analysis()
        out["compiled_bytes"] = {
            "arguments": m.argument_size_in_bytes,
            "outputs": m.output_size_in_bytes,
            "aliased": m.alias_size_in_bytes,
            "temporaries": m.temp_size_in_bytes,
            "code": m.generated_code_size_in_bytes,
        }
        out["compiled_total"] = (
            m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
        )
    except Exception as e:
        out["compiled_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    out["bare_step_ms"], _, state = _median_step_ms(built.train_step, built.state, batch)
    out["peak_memory_bytes"] = peak_device_bytes(jax.local_devices())
    trace = work / "trace"
    try:  # the profiler (CUPTI on a GPU) failing loses the trace, not the numbers above
        with jax.profiler.trace(str(trace)):
            for _ in range(p.trace_steps):
                with jax.profiler.StepTraceAnnotation("train", step_num=int(state.step)):
                    state, metrics = built.train_step(state, batch)
            jax.block_until_ready(metrics)
    except Exception as e:
        out["trace_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    out["trace_steps"] = p.trace_steps
    out["trace_files"] = sorted(str(f.relative_to(trace)) for f in trace.rglob("*") if f.is_file())
    return out


def _median_step_ms(step, state, batch) -> tuple[float, list[float], object]:
    """The median of 5 timed steps after 3 that compile and warm up, those 3 losses (the run's first), and the state
    after them all (the step donates the one it is given)."""
    import jax

    losses = []
    for _ in range(3):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    times = []
    for _ in range(5):
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3, losses, state


def child_generate(p: Profile, work: Path) -> dict:
    """Tokens/s drawing from each model, with the KV cache and without (scripts/bench_generate.py's measurement)."""
    import jax
    from flax import nnx

    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_generate import PROMPT, tokens_per_sec

    from jdp.config import load_config
    from jdp.models import make_model
    from jdp.models.common import count_params

    out = {}
    for name, (config, overrides) in p.models.items():
        cfg = load_config(config, [*overrides, f"model.max_seq_len={p.sample_len}"])
        model = make_model(cfg.model, nnx.Rngs(0))
        cached, a = tokens_per_sec(model, p.new_tokens, True, 3)
        uncached, b = tokens_per_sec(model, p.new_tokens, False, 2)
        out[name] = {
            "params": count_params(model),
            "dtype": cfg.model.dtype,
            "prompt_tokens": len(PROMPT),
            "new_tokens": p.new_tokens,
            "batch": 1,
            "max_seq_len": p.sample_len,
            "cached_tokens_per_sec": cached,
            "uncached_tokens_per_sec": uncached,
            "cached_vs_uncached": cached / uncached,
            "same_tokens": a == b,
            "device": jax.devices()[0].device_kind,
        }
    return out


def child_remat(p: Profile, work: Path) -> dict:
    """model.remat none, dots and full on one device: the compiled step's bytes (temporaries: the activations kept
    for backward), the planner's activation estimate beside them, and ms/step (median of 5 after 3 warm-up steps);
    the losses of the first steps, which recomputation must not change."""
    import dataclasses

    import jax
    import numpy as np

    from jdp import parallel, plan
    from jdp.build import build
    from jdp.config import load_config

    config, overrides = p.remat
    base = load_config(config, [*overrides, "train.run_dir=/dev/null", "optim.warmup_steps=0"])
    mesh = parallel.make_mesh(jax.devices()[:1])
    rows, length = base.train.batch_size, base.data.seq_len
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 256, (rows, length + 1)).astype(np.int32)
    local = {"inputs": toks[:, :-1], "targets": toks[:, 1:], "weights": np.ones((rows, length), np.float32)}
    batch = parallel.shard_batch(local, mesh, rows)
    out = {"config": config, "overrides": list(overrides), "policies": {}}
    for policy in ("none", "dots", "full"):
        cfg = dataclasses.replace(base, model=dataclasses.replace(base.model, remat=policy))
        built = build(cfg, mesh)
        m = built.train_step.lower(built.state, batch).compile().memory_analysis()
        step_ms, losses, _ = _median_step_ms(built.train_step, built.state, batch)
        fused = plan.fused_attention(cfg, jax.devices()[0].platform)
        out["policies"][policy] = {
            "temp_bytes": m.temp_size_in_bytes,
            "total_bytes": m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
            + m.temp_size_in_bytes,
            "planned_activation_bytes": plan.activation_bytes(cfg, rows, fused),
            "step_ms": step_ms,
            "losses": losses,
        }
        del built
    none = out["policies"]["none"]
    for q in out["policies"].values():
        q["same_losses"] = all(abs(a - b) <= 1e-3 * abs(b) for a, b in zip(q["losses"], none["losses"], strict=True))
    return out


CHILDREN = {
    "devices": child_devices,
    "correctness": child_correctness,
    "attention": child_attention,
    "profile": child_profile,
    "generate": child_generate,
    "remat": child_remat,
}


# ------------------------------------------------------------------------------------------ the parent


class Check:
    """The parent: runs each step in its own process within the budget, keeps the log, writes the results."""

    def __init__(self, mode: str, out: Path, budget_s: float):
        self.mode, self.out, self.profile = mode, out, CPU if mode == "cpu" else GPU
        self.work = Path(tempfile.mkdtemp(prefix="jdp-gpu-check-"))  # runs, checkpoints: never in what comes back
        self.deadline = time.monotonic() + budget_s
        self.results: dict = {"mode": mode, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "steps": {}}
        self.log = open(out / "gpu_check.log", "w")  # noqa: SIM115 (open for the whole check)
        cache = os.environ.get("JDP_CACHE") or str(self.work / "cache")  # the corpus and the compiled programs
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", JDP_CACHE=cache)
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        # A GPU check on no GPU would spend the budget running GPT-2 on a CPU: JAX must find the GPU or fail
        self.env["JAX_PLATFORMS"] = "cpu" if mode == "cpu" else os.environ.get("JAX_PLATFORMS") or "cuda"

    def say(self, text: str) -> None:
        line = f"[gpu_check {time.strftime('%H:%M:%S')}] {text}"
        print(line, flush=True)
        self.log.write(line + "\n")
        self.log.flush()

    def limit(self, step: str) -> float:
        return min(self.profile.budgets[step.split(":")[0]], self.deadline - time.monotonic())

    def run(self, step: str, cmd: list[str], env: dict | None = None) -> tuple[int | None, str, float]:
        """(exit status or None when out of time, its output, seconds): a process of its own, its output logged."""
        limit = self.limit(step)
        if limit < 5:
            self.say(f"{step}: skipped, the budget is spent")
            return None, "skipped: the budget (--budget-s) was spent before this step", 0.0
        self.say(f"{step}: {' '.join(cmd[1:])} (at most {limit:.0f} s)")
        start = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env or self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)  # fmt: skip
        try:
            text, _ = proc.communicate(timeout=limit)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # the step and any process it started
            text, _ = proc.communicate()
            rc, text = None, text + f"\n[gpu_check] {step}: stopped after {limit:.0f} s (its time limit)\n"
        took = time.monotonic() - start
        self.log.write(f"----- {step} ({took:.1f} s, exit {rc})\n{text}\n")
        self.log.flush()
        self.say(f"{step}: {'done' if rc == 0 else 'FAILED' if rc else 'out of time'} in {took:.1f} s")
        return rc, text, took

    def child(self, name: str) -> dict:
        result = self.work / f"{name}.json"
        cmd = [sys.executable, __file__, "--child", name, "--mode", self.mode, "--work", str(self.work)]
        rc, text, took = self.run(name, cmd)
        if rc == 0 and result.is_file():
            out = {**json.loads(result.read_text()), "seconds": took}
        else:
            out = {"error": _last_error(text), "seconds": took}
        self.results["steps"][name] = out
        return out

    def train(self, t: Train) -> dict:
        run_dir = self.work / f"run-{t.name}"
        overrides = [*t.overrides, *COMMON, f"train.steps={t.steps}", f"train.log_every={t.log_every}"]
        cmd = [sys.executable, "-m", "jdp.cli", "train", t.config, *overrides, f"train.run_dir={run_dir}"]
        rc, text, took = self.run(f"train:{t.name}", cmd)
        out = {"command": f"jdp train {t.config} {' '.join(overrides)}", "seconds": took}
        if rc != 0:
            out["error"] = _last_error(text)
        out.update(_measured(run_dir))
        out["plan"] = self.plan(t, run_dir, out.get("mfu"))
        self.results["steps"][f"train:{t.name}"] = out
        return out

    def plan(self, t: Train, run_dir: Path, measured_mfu: float | None) -> dict:
        """`jdp plan` for the same config on this GPU: at the assumed MFU, and calibrated with the run."""
        gpu = self.results.get("gpu") or PEAK_GPU
        args = [t.config, *t.overrides, "--devices", "1", "--gpu", gpu]
        base = [sys.executable, "-m", "jdp.cli", "plan", *args, "--json"]
        env = {**self.env, "JAX_PLATFORMS": "cpu"}  # shapes only: the planner needs no accelerator
        out = {"gpu": gpu}
        calibrate = ["--calibrate", str(run_dir)]
        if self.mode == "cpu" and measured_mfu:
            # --calibrate refuses a CPU run (its MFU is against the CPU's matmul rate, tests/test_plan.py): the same
            # number given as --mfu exercises the same planning. A CPU's "peak" is a short matmul measurement on a
            # shared machine, so the run can measure above it: the planner takes at most 1
            calibrate = ["--mfu", f"{min(measured_mfu, 1.0):.6f}"]
            out["calibrated_as"] = "--mfu (the measured MFU, at most 1): --calibrate refuses a run on CPU devices"
        for label, extra in (("assumed", []), ("calibrated", calibrate)):
            rc, text, _ = self.run(f"plan:{t.name}:{label}", base + extra, env)
            plan = _last_json(text) if rc == 0 else None
            if plan is None:
                out[label] = {"error": _last_error(text)}
                continue
            out[label] = {
                "command": "jdp plan " + " ".join([*args, *extra]),
                "mfu": plan["mfu"],
                "mfu_source": plan["mfu_source"],
                "step_ms": plan["step"]["step_s"] * 1e3,
                "tokens_per_sec": plan["step"]["tokens_per_s"],
                "memory": plan["memory"],
            }
        return out

    def environment(self) -> bool:
        """The versions and the devices; False where a GPU check finds no GPU (then nothing else runs)."""
        env = {
            "python": platform.python_version(),
            "packages": {n: _version(n) for n in PACKAGES},
            "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
            "host": platform.node(),
            "cpu": _cpu_model(),
            "cpu_cores": os.cpu_count(),
        }
        if shutil.which("nvidia-smi"):
            query = "--query-gpu=name,memory.total,driver_version"
            smi = subprocess.run(["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True,
                                 timeout=30)  # fmt: skip
            env["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
        self.results["environment"] = env
        devices = self.child("devices")
        kind = str(devices.get("device_kind", ""))
        match = re.search(r"\b(B200|H200|H100|A100|L40S|L4|A10|V100)\b", kind.upper())
        self.results["gpu"] = match.group(1) if match else None
        if self.mode == "gpu" and devices.get("platform") != "gpu":
            devices.setdefault("error", f"no GPU: JAX's devices are {devices.get('platform')} ({kind})")
            self.say(devices["error"] + "; nothing else runs")
            return False
        return True

    def finish(self) -> None:
        """trace.tar.gz and runs.tar.gz, then results.json and summary.md; the work directory removed (five files
        are what comes back)."""
        self.results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        trace = self.work / "trace"
        if trace.is_dir():
            with tarfile.open(self.out / "trace.tar.gz", "w:gz") as tar:
                tar.add(trace, arcname="trace")
            if (self.out / "trace.tar.gz").stat().st_size > TRACE_LIMIT:  # the device tool brings back 16 MB a file
                with tarfile.open(self.out / "trace.tar.gz", "w:gz") as tar:
                    for f in trace.rglob("*.xplane.pb"):
                        tar.add(f, arcname=f"trace/{f.relative_to(trace)}")
                self.results["trace_note"] = "the Perfetto trace.json.gz left out (too large); the xplane kept"
            if (size := (self.out / "trace.tar.gz").stat().st_size) > TRACE_LIMIT:
                (self.out / "trace.tar.gz").unlink()
                self.results["trace_note"] = f"no trace: {size:,} bytes compressed, over {TRACE_LIMIT:,}"
            else:
                self.results["trace_bytes"] = size
        with tarfile.open(self.out / "runs.tar.gz", "w:gz") as tar:
            for run in sorted(self.work.glob("run-*")):
                for name in ("config.yaml", "metrics.jsonl", "summary.json"):
                    if (run / name).is_file():
                        tar.add(run / name, arcname=f"{run.name}/{name}")
        text = summary(self.results)  # also lists what failed in results["failed"]
        (self.out / "summary.md").write_text(text)
        (self.out / "results.json").write_text(json.dumps(self.results, indent=1, default=str) + "\n")
        shutil.rmtree(self.work, ignore_errors=True)


def _measured(run_dir: Path) -> dict:
    """Speed, MFU, peak memory and goodput of a finished `jdp train` run, from its metrics.jsonl and summary.json."""
    out: dict = {}
    try:
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    except OSError:
        return out
    config = {}
    if (run_dir / "config.yaml").is_file():
        import yaml

        config = yaml.safe_load((run_dir / "config.yaml").read_text())
    timed = [r for r in records if isinstance(r.get("tokens_per_sec"), (int, float))]
    if timed:
        tps = statistics.median(r["tokens_per_sec"] for r in timed)
        tokens = config["train"]["batch_size"] * config["data"]["seq_len"] if config else None
        out.update(tokens_per_sec=tps, step_ms=tokens / tps * 1e3 if tokens else None, intervals=len(timed))
        if mfus := [r["mfu"] for r in timed if isinstance(r.get("mfu"), (int, float))]:
            out["mfu"] = statistics.median(mfus)
    losses = [r["loss"] for r in records if "loss" in r]
    if losses:
        out.update(first_loss=losses[0], last_loss=losses[-1])
    if config:
        out.update(batch=config["train"]["batch_size"], grad_accum=config["train"]["grad_accum"],
                   seq_len=config["data"]["seq_len"], dtype=config["model"]["dtype"])  # fmt: skip
    if (run_dir / "summary.json").is_file():
        s = json.loads((run_dir / "summary.json").read_text())
        out.update(goodput=s.get("goodput"), peak_memory_bytes=s.get("peak_memory_bytes"), device_kind=s.get("device_kind"),
                   skipped_total=s.get("skipped_total"), steps=s.get("steps"))  # fmt: skip
    return out


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _last_json(text: str) -> dict | None:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def _last_error(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return " | ".join(lines[-3:])[-600:] if lines else "no output"


# ------------------------------------------------------------------------------------------ summary.md


def _gb(n) -> str:
    return "-" if n is None else f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _f(x, spec: str = ".3g") -> str:
    return "-" if x is None else format(x, spec)


def summary(r: dict) -> str:
    """The one page: every number, and what it was compared with."""
    env, steps, gpu = r.get("environment", {}), r["steps"], r.get("gpu")
    dev = steps.get("devices", {})
    on = f"{dev.get('device_count', '?')} x {dev.get('device_kind', '?')} ({dev.get('platform', '?')})"
    L = [f"# jdp GPU check ({r['mode']} mode): {r['started']}", ""]
    if r["mode"] == "cpu":
        L += ["CPU mode: tiny configs, to prove the check runs end to end. The numbers are a CPU's; MFU is against",
              "the CPU's measured matmul rate, and the plan is for an H200, so its times do not compare with these.", ""]  # fmt: skip
    L += ["## Environment", "", f"- devices: {on}, {_gb(dev.get('bytes_limit'))} in JAX's pool"]
    if "nvidia_smi" in env:
        L.append(f"- nvidia-smi (name, memory, driver): {env['nvidia_smi']}")
    L.append(f"- host: {env.get('cpu')} ({env.get('cpu_cores')} cores), Python {env.get('python')}")
    L.append("- " + ", ".join(f"{k} {v}" for k, v in env.get("packages", {}).items()))
    L.append(f"- XLA_FLAGS: `{env.get('XLA_FLAGS') or '(unset)'}` (jdp train adds its own; each run's log prints them)")

    L += ["", "## Correctness", ""]
    c = steps.get("correctness", {})
    if "error" in c:
        L.append(f"FAILED: {c['error']}")
    else:
        L += [f"bf16 compute (float32 parameters) against float32 at full matmul precision, same start and batches; "
              f"bound: every step's loss within {LOSS_BOUND:.0%} of float32's.", "",
              "| model | batch | bf16 losses | float32 losses | max rel. diff | ok |", "|---|---|---|---|---|---|"]  # fmt: skip
        for name, m in c.items():
            if not isinstance(m, dict):
                continue
            fmt = ", ".join
            L.append(f"| {name} | {m['batch'][0]} x {m['batch'][1]} | {fmt(f'{x:.4f}' for x in m['bf16']['loss'])} | "
                     f"{fmt(f'{x:.4f}' for x in m['float32']['loss'])} | {m['max_rel_loss_diff']:.2e} | "
                     f"{'yes' if m['ok'] else 'NO'} |")  # fmt: skip
        L += ["", "Non-finite guard (a batch of NaN weights fed to the bf16 step): "]
        for name, m in c.items():
            if isinstance(m, dict):
                g = m["guard"]
                L.append(f"- {name}: skipped {g['skipped']}, loss reported {g['loss_reported']}, parameters unchanged "
                         f"{g['params_unchanged']}, next step finite {g['next_step_finite']}: "
                         f"{'ok' if g['ok'] else 'FAILED'}")  # fmt: skip
    a = steps.get("attention", {})
    L += ["", f"### Attention: fused ({a.get('fused', '?')}) against the blocked einsum path", ""]
    if "error" in a:
        L.append(f"FAILED: {a['error']}")
    else:
        L += [f"bf16 inputs; the largest difference of the output and of each gradient, over that tensor's largest "
              f"magnitude; bound {ATTENTION_BOUND}. float32: the einsum path at full float32 precision.", "",
              "| heads | B x L | H / G / K | within documents | fused vs einsum | fused vs float32 | einsum vs float32 "
              "| fused ms | einsum ms | ok |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for case in a.get("cases", []):
            head = f"| {case['shape']} | {case['B']} x {case['L']} | {case['H']} / {case['G']} / {case['K']} | " \
                   f"{'yes' if case['within_documents'] else 'no'} | "  # fmt: skip
            if "error" in case:
                L.append(head + f"error: {case['error']} | | | | | NO |")
            else:
                L.append(head + f"{case['fused_vs_einsum']:.2e} | {case['fused_vs_float32']:.2e} | "
                         f"{case['einsum_vs_float32']:.2e} | {case['fused_ms']:.2f} | {case['einsum_ms']:.2f} | "
                         f"{'yes' if case['ok'] else 'NO'} |")  # fmt: skip

    trains = {k.split(":", 1)[1]: v for k, v in steps.items() if k.startswith("train:")}
    L += ["", "## Speed: `jdp train`, ddp on one device, train.grad_accum > 1", "",
          f"Median over the logged intervals after the first (which compiles). MFU against "
          f"{'the ' + gpu + ' datasheet bf16 peak' if gpu else 'the peak jdp found (a CPU: its measured matmul rate)'}; "
          f"the plan's predictions for {(steps.get('train:' + next(iter(trains), ''), {}).get('plan') or {}).get('gpu', '?')} "
          f"beside them.", "",
          "| config | batch (accum) x seq | dtype | ms/step | tokens/s | MFU | plan ms/step (assumed MFU) | "
          "plan ms/step (calibrated) | loss first -> last |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, t in trains.items():
        plan = t.get("plan", {})
        assumed, calibrated = plan.get("assumed", {}), plan.get("calibrated", {})
        L.append(f"| {name} | {t.get('batch', '?')} ({t.get('grad_accum', '?')}) x {t.get('seq_len', '?')} | "
                 f"{t.get('dtype', '?')} | {_f(t.get('step_ms'), '.1f')} | {_f(t.get('tokens_per_sec'), ',.0f')} | "
                 f"{_f(t.get('mfu'), '.1%')} | {_f(assumed.get('step_ms'), '.3g')} at {_f(assumed.get('mfu'), '.0%')} | "
                 f"{_f(calibrated.get('step_ms'), '.3g')} at {_f(calibrated.get('mfu'), '.1%')} | "
                 f"{_f(t.get('first_loss'), '.3f')} -> {_f(t.get('last_loss'), '.3f')} |")  # fmt: skip
    for name, t in trains.items():
        if "error" in t:
            L.append(f"- {name}: FAILED: {t['error']}")
        for label in ("assumed", "calibrated"):
            if "error" in t.get("plan", {}).get(label, {}):
                L.append(f"- {name}: plan ({label}) FAILED: {t['plan'][label]['error']}")
        if "calibrated_as" in t.get("plan", {}):
            L.append(f"- {name}: calibrated with {t['plan']['calibrated_as']}")
    p = steps.get("profile", {})
    if "bare_step_ms" in p and p.get("config") in trains and trains[p["config"]].get("step_ms"):
        ratio = p["bare_step_ms"] / trains[p["config"]]["step_ms"]
        L.append(f"- {p['config']}: the bare step (same state and batch shape, random tokens, no loop) takes "
                 f"{p['bare_step_ms']:.1f} ms; `jdp train`'s step is {ratio:.1%} as fast.")  # fmt: skip

    L += ["", "## Memory per device", "",
          "| config | plan: parameters + gradients (+ accumulator) + optimizer + activations = total | compiled step (XLA) | "
          "peak in use (memory_stats) |", "|---|---|---|---|"]  # fmt: skip
    for name, t in trains.items():
        m = t.get("plan", {}).get("assumed", {}).get("memory")
        parts = ("params", "grads", "accumulator", "opt_state", "activations")
        planned = " + ".join(_gb(m[k]) for k in parts if m.get(k)) + f" = {_gb(m['total'])}" if m else "-"
        compiled = _gb(p.get("compiled_total")) if p.get("config") == name else "-"
        peak = t.get("peak_memory_bytes")
        L.append(f"| {name} | {planned} | {compiled} | {_gb(peak) if peak else 'not reported (CPU)'} |")
    if p.get("config") and p.get("peak_memory_bytes"):
        L.append(f"- {p['config']}, the bare step's process: peak {_gb(p['peak_memory_bytes'])}")
    if "compiled_error" in p:
        L.append(f"- compiled memory analysis failed: {p['compiled_error']}")

    L += ["", "## Profile and goodput", ""]
    if "error" in p:
        L.append(f"- profile FAILED: {p['error']}")
    elif "trace_note" in r:
        L.append(f"- trace: {r['trace_note']}")
    if p and "error" not in p and "trace_bytes" in r:
        L.append(f"- trace.tar.gz: {p.get('trace_steps')} steps of {p.get('config')} ({_f(r.get('trace_bytes'), ',')} "
                 f"bytes; {len(p.get('trace_files', []))} files). Open: `tar xzf trace.tar.gz && tensorboard --logdir "
                 f"trace` (the profile plugin), or load the .trace.json.gz in https://ui.perfetto.dev")  # fmt: skip
    for name, t in trains.items():
        g = t.get("goodput")
        if g:
            parts = ", ".join(f"{k[:-2]} {v:.1f} s" for k, v in g.items() if k.endswith("_s") and k != "wall_s")
            L.append(f"- {name}: goodput {g['goodput']:.1%} of {g['wall_s']:.1f} s ({parts})")

    gen = steps.get("generate", {})
    L += ["", "## Sampling with the KV cache", ""]
    if "error" in gen:
        L.append(f"FAILED: {gen['error']}")
    else:
        L += ["One prompt, greedy; tokens/s with the KV cache against re-running the model over the window for every "
              "token (`--no-cache`). In float32 both must draw the same tokens; in bf16 the two paths' roundings differ (einsum "
              "with the cache, cuDNN without), so a near-tie may go the other way and the tokens part there.", "",
              "| model | params | dtype | new tokens | cached tok/s | uncached tok/s | ratio | same tokens |",
              "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for name, g in gen.items():
            if isinstance(g, dict):
                L.append(f"| {name} | {g['params'] / 1e6:.1f}M | {g['dtype']} | {g['new_tokens']} | "
                         f"{g['cached_tokens_per_sec']:,.0f} | {g['uncached_tokens_per_sec']:,.0f} | "
                         f"{g['cached_vs_uncached']:.1f} | {g['same_tokens']} |")  # fmt: skip

    rm = steps.get("remat", {})
    L += ["", "## Activation recomputation (model.remat)", ""]
    if "error" in rm:
        L.append(f"FAILED: {rm['error']}")
    elif rm:
        L += [f"{rm['config']} {' '.join(rm['overrides'])}, one device: the compiled step's temporaries (what backward "
              "keeps) beside the planner's activation estimate, ms/step (median of 5), and whether the first losses "
              "are those without recomputation (to 0.1%).", "",
              "| model.remat | temporaries | planned activations | total compiled | ms/step | same losses |",
              "|---|---|---|---|---|---|"]  # fmt: skip
        for policy, q in rm["policies"].items():
            L.append(f"| {policy} | {_gb(q['temp_bytes'])} | {_gb(q['planned_activation_bytes'])} | "
                     f"{_gb(q['total_bytes'])} | {q['step_ms']:.1f} | {q['same_losses']} |")  # fmt: skip

    failed = [k for k, v in steps.items() if isinstance(v, dict) and "error" in v]
    failed += [f"remat:{k}" for k, q in rm.get("policies", {}).items() if not q.get("same_losses", True)]
    failed += [f"correctness:{k}" for k, v in c.items() if isinstance(v, dict) and not v.get("ok", True)]
    failed += [f"guard:{k}" for k, v in c.items() if isinstance(v, dict) and not v.get("guard", {}).get("ok", True)]
    failed += [f"sampling:{k}" for k, g in gen.items()
               if isinstance(g, dict) and g.get("dtype") == "float32" and not g.get("same_tokens")]  # fmt: skip
    failed += [f"attention:{x['shape']}{' (within documents)' if x['within_documents'] else ''}"
               for x in a.get("cases", []) if not x.get("ok")]  # fmt: skip
    L += ["", "## Verdict", "", f"- failed: {', '.join(failed)}" if failed else "- every check passed",
          "- seconds per step: " + ", ".join(f"{k} {v.get('seconds', 0):.0f}" for k, v in steps.items()), ""]  # fmt: skip
    r["failed"] = failed
    return "\n".join(L)


def needs(wheels: Path, requirements: list[str] | None = None) -> list[str]:
    """The wheels in `wheels` to install here: those of jdp's requirements (pyproject.toml) this interpreter lacks or
    holds out of range, and, wheel by wheel, what they require that is missing here and lies beside them."""
    import tomllib
    import zipfile

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    def unmet(req: Requirement) -> bool:
        try:
            return not req.specifier.contains(metadata.version(req.name), prereleases=True)
        except metadata.PackageNotFoundError:
            return True

    carried = {canonicalize_name(w.name.split("-")[0]): w for w in sorted(wheels.glob("*.whl"))}
    if requirements is None:
        requirements = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    todo = [Requirement(r) for r in reversed(requirements)]
    chosen: dict[str, Path] = {}
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in chosen or not unmet(req):
            continue
        if name not in carried:
            print(
                f"[gpu_check] {req} is not met here and no wheel of it is in {wheels}: the steps that need it will "
                f"fail (carry one: scripts/gpu_check.sh --wheels, then pip download it into {wheels})",
                file=sys.stderr,
            )
            continue
        chosen[name] = wheel = carried[name]
        with zipfile.ZipFile(wheel) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            for line in z.read(meta).decode().splitlines():
                if line.startswith("Requires-Dist:"):
                    dep = Requirement(line.split(":", 1)[1].strip())
                    if dep.marker is None or dep.marker.evaluate({"extra": ""}):
                        todo.append(dep)
    return [str(w) for w in chosen.values()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="tiny configs on the CPU: the check's own test (~1-2 min)")
    ap.add_argument("--out", default=os.environ.get("OUT") or "gpu-check-out", help="where the five files go")
    ap.add_argument("--budget-s", type=float, default=480, help="stop starting steps after this many seconds")
    ap.add_argument("--needs", metavar="WHEELS_DIR", help=argparse.SUPPRESS)  # gpu_check.sh: what to install
    ap.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=("cpu", "gpu"), help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.needs:
        print(" ".join(needs(Path(a.needs))))
        return 0
    if a.child:
        work = Path(a.work)
        result = CHILDREN[a.child](CPU if a.mode == "cpu" else GPU, work)
        (work / f"{a.child}.json").write_text(json.dumps(result, indent=1, default=str))
        return 0
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    check = Check("cpu" if a.cpu else "gpu", out, a.budget_s)
    check.work.mkdir(exist_ok=True)
    try:
        if check.environment():
            check.child("correctness")
            check.child("attention")
            first, *rest = check.profile.trains
            check.train(first)
            check.child("profile")  # the first config again, outside the loop (the compilation cache shared)
            check.child("generate")
            for t in rest:  # the largest, last: where the budget runs out, only it is lost
                check.train(t)
            check.child("remat")  # a ~1B Llama three times: last of all
    except Exception:  # the parent's own fault: still write what was measured
        check.results["steps"]["gpu_check"] = {"error": traceback.format_exc()[-1500:]}
    finally:
        check.finish()
    check.say(f"wrote {out}/summary.md; failed: {', '.join(check.results['failed']) or 'none'}")
    check.log.close()
    return 1 if check.results["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
