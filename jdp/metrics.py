"""Measuring a run: model FLOPs and MFU, per-step records, the goodput account, parameter fingerprints, and the
metrics.jsonl writer (mirrored to TensorBoard and W&B)."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jdp import models
from jdp.config import Config
from jdp.errors import ConfigError
from jdp.hardware import GPU_PEAK_FLOPS
from jdp.log import logger
from jdp.parallel.remat import Remat
from jdp.rundir import RunDir

__all__ = [
    "CPU_PEAK_ENV",
    "GOODPUT_PARTS",
    "MetricsLog",
    "MetricsWriteFailed",
    "StepMeter",
    "cpu_peak_given",
    "describe_goodput",
    "fingerprint",
    "host_leaves",
    "flops_per_token",
    "goodput",
    "lost_steps",
    "measure_matmul_flops",
    "missing_steps",
    "params_sha256",
    "peak_flops",
    "read_metrics",
    "step_ranges",
    "supersede",
]

log = logger("jdp.metrics")


def flops_per_token(cfg: Config) -> float:
    """Training FLOPs per token: 6 x (matmul parameters) plus causal attention, for any model family.

    Matmul parameters: each block's, as its family counts them (jdp/models/: GPT's q, k, v, output and MLP; Llama's
    grouped-query projections and SwiGLU), plus V D for the output projection, tied or not. The embedding lookup
    and positions do no matmul. Attention scores and values cost 2 x 2 L H K per token per layer forward when every
    key is attended; causal masking halves that, and backward doubles forward: 6 L H K per layer. (PaLM's 12 L D
    counts the masked half too.) With LoRA (model.lora_rank) each frozen weight costs 4 (forward, and backward's
    gradient of its input), each adapter weight and each weight trained whole 6.
    """
    m, L = cfg.model, cfg.data.seq_len
    HK = m.n_heads * m.head_width
    matmul_params = m.n_layers * models.get(m.arch).block_matmul_params(m) + m.vocab_size * m.d_model
    if m.lora_rank:  # LoRA: a frozen weight costs its forward and its input's gradient (4), no weight gradient
        from jdp import peft

        lora, whole = peft.matmul_params(m)
        return 4.0 * matmul_params + 2.0 * whole + 6.0 * lora + 6.0 * m.n_layers * L * HK
    return 6.0 * matmul_params + 6.0 * m.n_layers * L * HK


def recompute_flops_per_token(cfg: Config) -> float:
    """FLOPs per token that model.remat adds to a training step (not counted in MFU, which is the model's FLOPs:
    PaLM's convention; hardware FLOPs are flops_per_token + these). full: each recomputed block's forward again, its
    matmuls (2 per weight) and attention (2 L H K); dots: its attention scores and values only (the projections'
    outputs are kept; elementwise work is not counted)."""
    m, L = cfg.model, cfg.data.seq_len
    k = Remat.of(m).blocks(m.n_layers)
    attention = 2.0 * L * m.n_heads * m.head_width
    per_block = attention + (2.0 * models.get(m.arch).block_matmul_params(m) if m.remat == "full" else 0.0)
    return k * per_block


def measure_matmul_flops(n: int = 1024, seconds: float = 0.5, windows: int = 5) -> float:
    """FLOP/s of float32 n x n matmuls running at once on every local device (a CPU's stand-in for a peak): the
    best of `windows` equal windows over `seconds`, so that another process taking the cores for a moment (a shared
    machine) does not read as a lower peak, and MFU above 100%.

    Simulated CPU devices share the same cores, so they are measured together, as training uses them.
    """
    xs = [jax.device_put(jnp.ones((n, n), jnp.float32), d) for d in jax.local_devices()]
    f = jax.jit(lambda a: a @ a)
    jax.block_until_ready([f(x) for x in xs])
    best = 0.0
    for _ in range(windows):
        reps, start = 0, time.perf_counter()
        while reps == 0 or time.perf_counter() - start < seconds / windows:
            jax.block_until_ready([f(x) for x in xs])
            reps += 1
        best = max(best, 2.0 * n**3 * reps * len(xs) / (time.perf_counter() - start))
    return best


CPU_PEAK_ENV = "JDP_CPU_PEAK_FLOPS"  # one host's float32 FLOP/s for MFU on CPUs, instead of measuring it at start


def cpu_peak_given(value: str) -> float:
    """JDP_CPU_PEAK_FLOPS's value: a positive number of FLOP/s (one host's CPU devices together), or an error naming it."""
    try:
        rate = float(value)
    except ValueError:
        rate = float("nan")
    if not (math.isfinite(rate) and rate > 0):
        raise ConfigError(
            f"{CPU_PEAK_ENV}={value!r} is not a positive number of FLOP/s: set it to one host's float32 peak (e.g. "
            f"2e11; `python scripts/bench.py --only peak` measures it), or unset it to measure it at start"
        )
    return rate


def peak_flops(dtype: str, n_devices: int) -> tuple[float, str]:
    """Total peak FLOP/s of the devices in use, and where the number came from."""
    device = jax.devices()[0]
    if device.platform == "cpu":
        if given := os.environ.get(CPU_PEAK_ENV):
            return cpu_peak_given(given) * jax.process_count(), f"{CPU_PEAK_ENV}={given} per host (not measured)"
        rate = measure_matmul_flops() * jax.process_count()  # assumes every host is like this one
        return rate, "measured float32 matmul rate of this host's CPU devices (best 0.1 s of 0.5; CPUs have no datasheet peak)"
    kind = device.device_kind
    for name, table in GPU_PEAK_FLOPS.items():
        if name in kind.upper() and dtype in table:
            return table[dtype] * n_devices, f"datasheet {dtype} peak of {n_devices} x {kind}"
    return float("nan"), f"unknown peak for {kind} ({dtype}): MFU not reported"


class MetricsWriteFailed(RuntimeError):
    """metrics.jsonl could not be written (a full disk): the run stops rather than lose the record."""


class MetricsLog:
    """Appends one JSON object per line to metrics.jsonl, and mirrors every number to the trackers:
    TensorBoard event files in RUN_DIR/tensorboard (tensorboardX's writer) and, when switched on, Weights &
    Biases. Only process 0 writes.

    resume_step: the step a resumed run restarts from; TensorBoard then drops the lost steps after it (the
    same steps `supersede` moves out of metrics.jsonl), so no tracker shows a step twice. missing_steps: the steps
    up to it whose records metrics.jsonl lost (`missing_steps`), for the summary.
    """

    def __init__(
        self,
        path: str | Path,
        enabled: bool = True,
        tensorboard: bool = False,
        wandb_project: str = "",
        config: dict | None = None,
        resume_step: int | None = None,
        missing_steps: Sequence[int] = (),
    ):
        self.path, self.enabled = Path(path), enabled
        self.missing_steps = list(missing_steps)  # logged steps before resume_step whose records are gone
        self._tb = self._wandb = None
        if not enabled:
            return
        run = RunDir(self.path.parent)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = self.path.open("a")
        if tensorboard:
            from tensorboardX import SummaryWriter

            # Events from a step after the resume point are dropped (TensorBoard purges steps >= purge_step).
            purge = None if resume_step is None else resume_step + 1
            self._tb = SummaryWriter(str(run.tensorboard), purge_step=purge)
        if wandb_project:
            import wandb

            id_file = run.wandb_run_id  # the same W&B run across restarts of this run
            run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:8]
            id_file.write_text(run_id)
            self._wandb = wandb.init(
                project=wandb_project,
                id=run_id,
                resume="allow",
                dir=str(self.path.parent),
                name=self.path.parent.name,
                config=config,
            )

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        try:
            self._f.write(json.dumps(record) + "\n")
            self._f.flush()
        except OSError as e:  # a full disk, a quota, a storage error: the run stops, naming the file and the space
            raise self._failed(e, record) from None
        step = record.get("step", 0)
        scalars = {tag: v for tag, v in _tags(record) if isinstance(v, (int, float)) and v is not None}
        if self._tb is not None:
            for tag, value in scalars.items():
                self._tb.add_scalar(tag, value, global_step=step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def _failed(self, e: OSError, record: dict) -> MetricsWriteFailed:
        try:
            self._f.close()  # closes the file even though the flush of what it holds fails again
        except OSError:
            pass
        self._f = open(os.devnull, "w")  # noqa: SIM115  (closed by close())
        try:
            free = f"{shutil.disk_usage(self.path.parent).free:,} bytes free there"
        except OSError:
            free = "free space unknown"
        return MetricsWriteFailed(
            f"{self.path} could not be written: {e.strerror or e} ({free}); the record of step {record.get('step')} "
            f"was not saved. Free some space and run the same command: it resumes from the newest checkpoint and "
            f"logs the steps after it again"
        )

    def close(self) -> None:
        if self.enabled:
            self._f.close()
            if self._tb is not None:
                self._tb.close()
            if self._wandb is not None:
                self._wandb.finish()


def _tags(record: dict, prefix: str = ""):
    """metrics.jsonl keys as tracker tags: train/loss, eval/loss, goodput/compile_s, ..."""
    for key, value in record.items():
        if key == "step" and not prefix:
            continue
        if isinstance(value, dict):
            yield from _tags(value, f"{prefix}{key}/")
        elif prefix:
            yield f"{prefix}{key}", value
        elif key.startswith("eval_"):
            yield f"eval/{key[len('eval_') :]}", value
        else:
            yield f"train/{key}", value


def _parse(line: str) -> dict | None:
    """One metrics.jsonl record, or None for a line that is cut off or damaged."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("step"), int) else None


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a metrics log; lines that do not parse (what a crash or a full disk leaves) are skipped
    with a warning naming the file and the lines."""
    path, records, damaged = Path(path), [], []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if line.strip():
            if (record := _parse(line)) is None:
                damaged.append(number)
            else:
                records.append(record)
    if damaged:
        log.warning(f"{path}: line(s) {damaged} are cut off or damaged; skipped")
    return records


def supersede(path: str | Path, after_step: int) -> int:
    """Move records of steps after `after_step` (work lost since the checkpoint a run resumes from) from
    metrics.jsonl to metrics.superseded.jsonl, so the log never holds a step twice and nothing is deleted.
    Lines that do not parse (a record cut off by a crash or a full disk) move to metrics.damaged.jsonl, with a
    warning, so the log the run appends to is whole again."""
    path = Path(path)
    if not path.exists():
        return 0
    run = RunDir(path.parent)
    text = path.read_text(errors="replace")
    keep, moved, damaged = [], [], []
    for line in text.splitlines():
        if line.strip():
            if (record := _parse(line)) is None:
                damaged.append(line)
            else:
                (moved if record["step"] > after_step else keep).append(line)
    for lines, where in ((moved, run.superseded_metrics), (damaged, run.damaged_metrics)):
        if lines:
            with where.open("a") as f:
                f.write("\n".join(lines) + "\n")
    if damaged:
        log.warning(f"{path}: {len(damaged)} cut-off or damaged line(s) moved to {run.damaged_metrics}")
    if moved or damaged or (text and not text.endswith("\n")):
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        tmp.replace(path)
    return len(moved)


def lost_steps(metrics_path: str | Path, start: int) -> int:
    """Steps the previous attempt logged after the checkpoint this run resumes from: work done twice."""
    if not Path(metrics_path).exists():
        return 0
    steps = [r["step"] for r in read_metrics(metrics_path) if "loss" in r]
    return max(0, max(steps, default=start) - start)


def missing_steps(metrics_path: str | Path, start: int, log_every: int, eval_every: int) -> list[int]:
    """The steps up to `start` (the checkpoint a run resumes from) that were logged (every `log_every` steps,
    evaluated every `eval_every`; 0: never) but whose records metrics.jsonl no longer has: a deleted or cut log."""
    path = Path(metrics_path)
    records = read_metrics(path) if path.exists() else []
    trained = {r["step"] for r in records if "loss" in r}
    evaluated = {r["step"] for r in records if "eval_loss" in r}
    due = {s for s in range(log_every, start + 1, log_every) if s not in trained} if log_every > 0 else set()
    if eval_every > 0:
        due |= {s for s in range(eval_every, start + 1, eval_every) if s not in evaluated}
    return sorted(due)


def step_ranges(missing: list[int], log_every: int, eval_every: int) -> str:
    """Steps as runs of consecutive logged steps: [3, 6, 9, 15] with log_every=3 -> "3-9, 15"."""
    logged = [
        s for s in range(1, max(missing, default=0) + 1) if s % log_every == 0 or (eval_every and s % eval_every == 0)
    ]
    runs: list[list[int]] = []
    gone = set(missing)
    for s in logged:
        if s not in gone:
            runs.append([])
        elif runs and runs[-1]:
            runs[-1].append(s)
        else:
            runs.append([s])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs if r)


STEP_METRICS = ("loss", "grad_norm", "lr", "tokens", "skipped")  # the step's own; any other is the loss's (rewards/...)


class StepMeter:
    """Turns each finished step's metrics into metrics.jsonl records: throughput and MFU since the previous record
    (the interval that includes compilation reports none), data wait, and the non-finite steps skipped."""

    def __init__(self, cfg: Config, tokens_per_step: int, peak: float, epoch_of, flops_per_token: float = 0.0,
                 stats_of=None):  # fmt: skip
        """tokens_per_step: what the model counts per step (tokens, or rows); flops_per_token: training FLOPs per
        one of them (0: unknown, no MFU); stats_of(step): the loader's own numbers (a mixture's per source)."""
        self.cfg, self.tokens_per_step, self.peak, self.epoch_of = cfg, tokens_per_step, peak, epoch_of
        self.stats_of = stats_of or (lambda step: {})
        self.flops_per_token = flops_per_token
        self.t: float | None = None  # when the current throughput interval started
        self.tokens = 0  # tokens trained in it
        self.tps: float | None = None  # the last throughput measured
        self.wait = 0.0  # the loader's total wait at the previous record
        self.skipped = 0  # non-finite steps since the previous record
        self.bad_run = 0  # non-finite steps in a row
        self.bad_total = 0

    def count(self, m: dict[str, float]) -> None:
        """Account for one finished step (before deciding whether the run can go on)."""
        if self.t is not None:
            self.tokens += self.tokens_per_step
        if m["skipped"]:
            self.skipped += 1
            self.bad_total += 1
            self.bad_run += 1
        else:
            self.bad_run = 0

    def record(self, step: int, m: dict[str, float], data_wait_s: float) -> dict | None:
        """The metrics.jsonl record of step `step` if one is due (every train.log_every steps, and the last)."""
        t = self.cfg.train
        now, tps, record = time.perf_counter(), None, None
        outer = {k: v for k, v in m.items() if k.startswith("outer_")}  # a DiLoCo sync's: every one is logged
        if step % t.log_every == 0 or step == t.steps or outer:
            if self.t is not None and now > self.t:
                tps = self.tps = self.tokens / (now - self.t)
            record = {
                "step": step,
                "loss": m["loss"],
                "grad_norm": m["grad_norm"],
                **({"lr": m["lr"]} if "lr" in m else {}),  # known from a schedule or inject_hyperparams; else none
                "tokens_per_sec": tps,
                "mfu": self.mfu(tps),
                "epoch": self.epoch_of(step),
                "tokens": step * self.tokens_per_step,
                # Seconds the loop waited for this process's batches since the previous record.
                "data_wait_s": data_wait_s - self.wait,
                "skipped_steps": self.skipped,  # non-finite updates skipped since the previous record
                "skipped_total": self.bad_total,
                **self.stats_of(step),
                **outer,
                **{k: v for k, v in m.items() if k not in STEP_METRICS and not k.startswith("outer_")},  # the loss's
            }
            self.wait, self.skipped = data_wait_s, 0
        if self.t is None or tps is not None:
            self.restart()
        return record

    def mfu(self, tps: float | None) -> float | None:
        if tps is None or math.isnan(self.peak) or not self.flops_per_token:
            return None
        return self.flops_per_token * tps / self.peak

    def restart(self) -> None:
        """Start a new throughput interval now (after evaluation: its time is not training throughput)."""
        self.t, self.tokens = time.perf_counter(), 0


GOODPUT_PARTS = ("compile_s", "eval_s", "checkpoint_s", "replica_checks_s")  # timed inside the loop


def goodput(startup_s: float, spent: dict, loop_s: float, data_wait_s: float, steps: int, lost: int) -> dict:
    """Where a run's wall-clock time went, in seconds, and the fraction spent on useful training steps.

    Training steps are the loop's time less compilation, data waits, evaluation, checkpoint saves and replica
    checks (GOODPUT_PARTS, in `spent`). Lost work is the steps an earlier attempt ran past its last checkpoint,
    redone by this run, priced at this run's mean step time: it is inside "training steps" but produced nothing new.
    """
    steps_s = max(0.0, loop_s - data_wait_s - sum(spent[k] for k in GOODPUT_PARTS))
    step_s = steps_s / steps if steps else 0.0
    lost_s = min(steps_s, lost * step_s)
    wall_s = startup_s + loop_s
    out = {
        "wall_s": wall_s,
        "startup_s": startup_s,
        "compile_s": spent["compile_s"],
        "data_wait_s": data_wait_s,
        "train_steps_s": steps_s - lost_s,
        "eval_s": spent["eval_s"],
        "checkpoint_s": spent["checkpoint_s"],
        "replica_checks_s": spent["replica_checks_s"],
        "lost_work_s": lost_s,
        "lost_steps": lost,
    }
    out["goodput"] = out["train_steps_s"] / wall_s if wall_s > 0 else 0.0
    return out


def describe_goodput(g: dict) -> list[str]:
    """The goodput account as lines to log, one per kind of work."""
    rows = [(k[: -len("_s")].replace("_", " "), g[k]) for k in g if k.endswith("_s") and k != "wall_s"]
    lines = [f"goodput {g['goodput']:.1%} of {g['wall_s']:.1f} s wall-clock:"]
    for name, sec in rows:
        extra = (
            f" ({g['lost_steps']} steps redone after the restart)" if name == "lost work" and g["lost_steps"] else ""
        )
        lines.append(f"  {name:<15} {sec:8.1f} s  {sec / g['wall_s']:6.1%}{extra}")
    return lines


def host_leaves(params, shapes: tuple | None = None):
    """(path, numpy value) of each parameter, one at a time: any local copy of a replicated one; a split one (fsdp)
    gathered from every process and cut to its own shape (`shapes`: TrainState.shapes). Every process must call it
    (a split leaf's gather is collective)."""
    from jax.experimental import multihost_utils

    for k, (path, leaf) in enumerate(jax.tree_util.tree_leaves_with_path(params)):
        if leaf.sharding.is_fully_replicated:
            x = np.asarray(leaf.addressable_shards[0].data)
        else:
            x = np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
        yield path, (x if shapes is None else x[: shapes[k][0]] if x.ndim else x)


def fingerprint(params, shapes: tuple | None = None) -> dict[str, list[float]]:
    """Per parameter: sum, L2 norm and the dot product with a fixed random vector, to compare runs to rounding."""
    out = {}
    for path, leaf in host_leaves(params, shapes):
        x = np.asarray(leaf, np.float64).ravel()
        probe = np.random.default_rng(x.size).standard_normal(x.size)
        out[jax.tree_util.keystr(path)] = [float(x.sum()), float(np.linalg.norm(x)), float(x @ probe)]
    return out


def params_sha256(params, shapes: tuple | None = None) -> str:
    """The exact bytes of the parameters (whatever the strategy's layout): equal digests mean bit-identical
    parameters."""
    h = hashlib.sha256()
    for _, leaf in host_leaves(params, shapes):
        h.update(np.ascontiguousarray(leaf).tobytes())
    return h.hexdigest()
