"""The training loop: config -> mesh -> data -> step -> loop, with evaluation, progress and metrics."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from tqdm import tqdm

from jdp import parallel
from jdp.config import Config, ConfigError, save_config, validate
from jdp.data import Prefetcher, eval_batches, load_data
from jdp.metrics import MetricsLog, flops_per_token, peak_flops
from jdp.model import GPT, count_params, lm_loss
from jdp.optim import make_optimizer


def evaluate(eval_step, state, stream: np.ndarray, cfg: Config, mesh, rows: slice) -> tuple[float, float]:
    """Mean loss over every validation token on every device: (sum of losses) / (sum of weights)."""
    loss_sum, weight_sum = 0.0, 0.0
    pending = []
    for local in eval_batches(stream, cfg.data.seq_len, cfg.train.batch_size, rows):
        pending.append(eval_step(state, parallel.shard_batch(local, mesh, cfg.train.batch_size)))
    for loss, weight in jax.device_get(pending):
        loss_sum += float(loss)
        weight_sum += float(weight)
    return loss_sum / max(weight_sum, 1.0), weight_sum


def fingerprint(params) -> dict[str, list[float]]:
    """Per parameter: sum, L2 norm and the dot product with a fixed random vector, to compare runs to rounding."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        x = np.asarray(leaf.addressable_shards[0].data, np.float64).ravel()  # replicated: any local copy
        probe = np.random.default_rng(x.size).standard_normal(x.size)
        out[jax.tree_util.keystr(path)] = [float(x.sum()), float(np.linalg.norm(x)), float(x @ probe)]
    return out


class RunError(RuntimeError):
    """Training failed; the message names the process and the phase it was in."""


def train(cfg: Config, world: parallel.World | None = None) -> dict:
    """Train the configured GPT; returns the last train and eval metrics."""
    if world is None:
        try:
            world = parallel.resolve_world()
        except parallel.WorldError as e:
            raise ConfigError(str(e)) from e
    if not jax.distributed.is_initialized():
        parallel.initialize(world, cfg.parallel.init_timeout_s, cfg.parallel.heartbeat_timeout_s)
    phase = ["setting up"]
    try:
        return _train(cfg, world, phase)
    except (ConfigError, KeyboardInterrupt):
        raise
    except Exception as e:
        who = f"process {jax.process_index()} of {jax.process_count()}"
        raise RunError(f"{who} failed while {phase[0]}: {type(e).__name__}: {e}") from e


def _train(cfg: Config, world: parallel.World, phase: list[str]) -> dict:
    t = cfg.train
    start_time = time.time()
    mesh = parallel.make_mesh()
    derived = validate(cfg, mesh.devices.size, jax.process_count())
    is_main = jax.process_index() == 0
    run_dir = Path(t.run_dir)
    if (run_dir / "metrics.jsonl").exists():
        raise ConfigError(f"train.run_dir={run_dir} already holds a run (metrics.jsonl); choose another train.run_dir")
    rows = parallel.process_rows(t.batch_size, mesh)
    phase[0] = "loading data"
    data = load_data(
        cfg.data, cfg.model.vocab_size, t.batch_size, t.seed, rows, jax.process_index(), jax.process_count()
    )
    say = print if is_main else (lambda *a, **k: None)

    phase[0] = "building the model and compiling"
    model = GPT(cfg.model, nnx.Rngs(t.seed))
    n_params = count_params(model)
    optimizer, schedule = make_optimizer(cfg.optim, t.steps)
    graphdef, state = parallel.init_state(model, optimizer, mesh)
    del model
    train_step = parallel.make_train_step(graphdef, lm_loss, optimizer, mesh, t.grad_accum, schedule)
    eval_step = parallel.make_eval_step(graphdef, lm_loss, mesh)

    fpt = flops_per_token(cfg)
    peak, peak_source = peak_flops(cfg.model.dtype, derived.n_devices)
    say(
        f"jdp | {world.describe()} | {jax.devices()[0].device_kind} x {derived.n_devices}, {jax.local_device_count()} local"
    )
    say(
        f"jdp | model {n_params:,} parameters | {fpt / 1e6:.1f} MFLOPs/token | MFU peak: {peak / 1e12:.3g} TFLOP/s, {peak_source}"
    )
    say(f"jdp | {derived.describe()}")
    say(
        f"jdp | data {data.describe()}"
        + (f" | {t.steps} steps = {data.train.epoch(t.steps):.3f} epochs" if not cfg.data.streaming else "")
    )
    say(f"jdp | run dir {run_dir}")
    if is_main:
        save_config(cfg, run_dir)
    log = MetricsLog(run_dir / "metrics.jsonl", enabled=is_main)
    do_eval = cfg.data.val_tokens > 0

    last: dict = {}
    bar = tqdm(total=t.steps, disable=not (is_main and t.progress), unit="step", dynamic_ncols=True, mininterval=1.0)
    clock = {"t": None, "tokens": 0, "tps": None, "wait": 0.0}  # throughput window, opened after step 1 (compilation)
    loader = Prefetcher(data.local_batch, 0, t.steps, cfg.data.prefetch)

    def finish(step: int, metrics) -> None:
        """Host side of step `step` (1-based): fetch its metrics (it has finished by now) and log them."""
        m = {k: float(v) for k, v in jax.device_get(metrics).items()}
        now = time.perf_counter()
        tps = None
        if clock["t"] is not None:
            clock["tokens"] += derived.tokens_per_step
        if step % t.log_every == 0 or step == t.steps:
            if clock["t"] is not None and now > clock["t"]:
                tps = clock["tps"] = clock["tokens"] / (now - clock["t"])
            record = {
                "step": step,
                "loss": m["loss"],
                "grad_norm": m["grad_norm"],
                "lr": m["lr"],
                "tokens_per_sec": tps,
                "mfu": None if tps is None or math.isnan(peak) else fpt * tps / peak,
                "epoch": data.train.epoch(step),
                "tokens": step * derived.tokens_per_step,
                # Seconds the loop waited for this process's batches since the previous record.
                "data_wait_s": loader.wait_s - clock["wait"],
            }
            clock["wait"] = loader.wait_s
            log.write(record)
            last.update(record)
        if clock["t"] is None or tps is not None:
            clock["t"], clock["tokens"] = time.perf_counter(), 0
        bar.set_postfix(loss=f"{m['loss']:.4f}", tok_s=f"{clock['tps']:,.0f}" if clock["tps"] else "-", refresh=False)
        bar.update(1)

    def run_eval(step: int) -> None:
        phase[0] = f"evaluating at step {step}"
        loss, n_tok = evaluate(eval_step, state, data.tokens.val, cfg, mesh, rows)
        log.write({"step": step, "eval_loss": loss, "eval_tokens": n_tok})
        last.update(eval_loss=loss)
        if is_main:
            bar.write(f"step {step}: eval_loss {loss:.4f} over {n_tok:,.0f} tokens")
        clock["t"], clock["tokens"] = time.perf_counter(), 0  # evaluation time is not training throughput

    pending = None
    for step, local in loader:
        phase[0] = f"running step {step + 1}"
        state, metrics = train_step(state, parallel.shard_batch(local, mesh, t.batch_size))
        # Fetch the previous step's metrics only now that this step is queued: the device never waits on us.
        if pending is not None:
            finish(*pending)
        pending = (step + 1, metrics)
        if do_eval and t.eval_every and (step + 1) % t.eval_every == 0 and step + 1 < t.steps:
            finish(*pending)
            pending = None
            run_eval(step + 1)
    if pending is not None:
        finish(*pending)
    if do_eval:
        run_eval(t.steps)
    loader.close()
    bar.close()
    log.close()
    phase[0] = "writing the summary"
    summary = {
        "steps": t.steps,
        "loss": last.get("loss"),
        "eval_loss": last.get("eval_loss"),
        "wall_s": time.time() - start_time,
        "world": world.describe(),
        "devices": derived.n_devices,
        "params_fingerprint": fingerprint(state.params),
    }
    if is_main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    say(
        f"jdp | done: loss {last.get('loss', float('nan')):.4f}"
        + (f", eval_loss {last['eval_loss']:.4f}" if do_eval else "")
    )
    last["state"] = state
    last["graphdef"] = graphdef
    return last
