"""Measuring a run: model FLOPs, peak FLOP/s (and so MFU), and the metrics.jsonl writer."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import jax
import jax.numpy as jnp

from jdp.config import Config

# Dense (not sparse) peak FLOP/s per device from the vendors' datasheets, by compute dtype. float32 matmuls
# on these GPUs run on tensor cores as TF32 by XLA's default precision, so the TF32 peak is listed.
GPU_PEAK_FLOPS = {
    "B200": {"bfloat16": 2250e12, "float16": 2250e12, "float32": 1100e12},
    "H200": {"bfloat16": 989e12, "float16": 989e12, "float32": 494e12},
    "H100": {"bfloat16": 989e12, "float16": 989e12, "float32": 494e12},  # SXM; PCIe is lower
    "A100": {"bfloat16": 312e12, "float16": 312e12, "float32": 156e12},
    "L40S": {"bfloat16": 362e12, "float16": 362e12, "float32": 183e12},
    "L4": {"bfloat16": 121e12, "float16": 121e12, "float32": 60e12},
    "A10": {"bfloat16": 125e12, "float16": 125e12, "float32": 62.5e12},
    "V100": {"float16": 125e12, "float32": 15.7e12},
}


def flops_per_token(cfg: Config) -> float:
    """Training FLOPs per token: 6 x (matmul parameters) plus causal attention.

    Matmul parameters per layer are 4 D^2 (qkv, out) + 2 mlp_ratio D^2, plus V D for the tied output
    projection; the embedding lookup and positions do no matmul. Attention scores and values cost
    2 x 2 L D per token per layer forward when every key is attended; causal masking halves that, and
    backward doubles forward: 6 L D per layer. (PaLM's 12 L D counts the masked half too.)
    """
    m, L = cfg.model, cfg.data.seq_len
    matmul_params = m.n_layers * (4 + 2 * m.mlp_ratio) * m.d_model**2 + m.vocab_size * m.d_model
    return 6.0 * matmul_params + 6.0 * m.n_layers * L * m.d_model


def measure_matmul_flops(n: int = 1024, seconds: float = 0.5) -> float:
    """FLOP/s of float32 n x n matmuls running at once on every local device (a CPU's stand-in for a peak).

    Simulated CPU devices share the same cores, so they are measured together, as training uses them.
    """
    xs = [jax.device_put(jnp.ones((n, n), jnp.float32), d) for d in jax.local_devices()]
    f = jax.jit(lambda a: a @ a)
    jax.block_until_ready([f(x) for x in xs])
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        jax.block_until_ready([f(x) for x in xs])
        reps += 1
    return 2.0 * n**3 * reps * len(xs) / (time.perf_counter() - start)


def peak_flops(dtype: str, n_devices: int) -> tuple[float, str]:
    """Total peak FLOP/s of the devices in use, and where the number came from."""
    device = jax.devices()[0]
    if device.platform == "cpu":
        rate = measure_matmul_flops() * jax.process_count()  # assumes every host is like this one
        return rate, "measured float32 matmul rate of this host's CPU devices (CPUs have no datasheet peak)"
    kind = device.device_kind
    for name, table in GPU_PEAK_FLOPS.items():
        if name in kind.upper() and dtype in table:
            return table[dtype] * n_devices, f"datasheet {dtype} peak of {n_devices} x {kind}"
    return float("nan"), f"unknown peak for {kind} ({dtype}): MFU not reported"


class MetricsLog:
    """Appends one JSON object per line to metrics.jsonl, and mirrors every number to the trackers:
    TensorBoard event files in RUN_DIR/tensorboard (tensorboardX's writer) and, when switched on, Weights &
    Biases. Only process 0 writes.

    resume_step: the step a resumed run restarts from; TensorBoard then drops the lost steps after it (the
    same steps `supersede` moves out of metrics.jsonl), so no tracker shows a step twice.
    """

    def __init__(
        self,
        path: str | Path,
        enabled: bool = True,
        tensorboard: bool = False,
        wandb_project: str = "",
        config: dict | None = None,
        resume_step: int | None = None,
    ):
        self.path, self.enabled = Path(path), enabled
        self._tb = self._wandb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = self.path.open("a")
        if tensorboard:
            from tensorboardX import SummaryWriter

            # Events from a step after the resume point are dropped (TensorBoard purges steps >= purge_step).
            purge = None if resume_step is None else resume_step + 1
            self._tb = SummaryWriter(str(self.path.parent / "tensorboard"), purge_step=purge)
        if wandb_project:
            import wandb

            id_file = self.path.parent / "wandb-run-id"  # the same W&B run across restarts of this run
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
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()
        step = record.get("step", 0)
        scalars = {tag: v for tag, v in _tags(record) if isinstance(v, (int, float)) and v is not None}
        if self._tb is not None:
            for tag, value in scalars.items():
                self._tb.add_scalar(tag, value, global_step=step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

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


def read_metrics(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def supersede(path: str | Path, after_step: int) -> int:
    """Move records of steps after `after_step` (work lost since the checkpoint a run resumes from) from
    metrics.jsonl to metrics.superseded.jsonl, so the log never holds a step twice and nothing is deleted."""
    path = Path(path)
    if not path.exists():
        return 0
    keep, moved = [], []
    for line in path.read_text().splitlines():
        if line.strip():
            (moved if json.loads(line)["step"] > after_step else keep).append(line)
    if moved:
        with path.with_name("metrics.superseded.jsonl").open("a") as f:
            f.write("\n".join(moved) + "\n")
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        tmp.replace(path)
    return len(moved)
