"""The training loop: config -> mesh -> data -> step -> loop -> checkpoint, with evaluation and metrics."""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import shutil
import signal
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from tqdm import tqdm

from jdp import parallel
from jdp.buckets import bucket_plan
from jdp.checkpoint import Checkpoints, check_resumable
from jdp.config import Config, ConfigError, save_config, validate
from jdp.coordination import StopAgreement, Watchdog
from jdp.data import Prefetcher, eval_batches, load_data
from jdp.hlo import all_reduces
from jdp.metrics import MetricsLog, flops_per_token, peak_flops, read_metrics, supersede
from jdp.model import GPT, count_params, lm_loss
from jdp.optim import make_optimizer
from jdp.world import World, WorldError, initialize, resolve_world


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


def params_sha256(params) -> str:
    """The exact bytes of the parameters (any local replica): equal digests mean bit-identical parameters."""
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(params):
        h.update(np.asarray(leaf.addressable_shards[0].data).tobytes())
    return h.hexdigest()


class _timed:
    """Adds the seconds spent inside the block to spent[key]."""

    def __init__(self, spent: dict, key: str, enabled: bool = True):
        self.spent, self.key, self.enabled = spent, key, enabled

    def __enter__(self):
        self.t = time.time()

    def __exit__(self, *exc):
        if self.enabled:
            self.spent[self.key] += time.time() - self.t


def _lost_steps(metrics_path: Path, start: int) -> int:
    """Steps the previous attempt logged after the checkpoint this run resumes from: work done twice."""
    if not metrics_path.exists():
        return 0
    steps = [r["step"] for r in read_metrics(metrics_path) if "loss" in r]
    return max(0, max(steps, default=start) - start)


def _goodput(spent: dict, loop_s: float, data_wait_s: float, steps: int, lost_steps: int) -> dict:
    """Where this run's wall-clock time went, in seconds, and the fraction spent on useful training steps.

    Training steps are the loop's time less compilation, data waits, evaluation, checkpoint saves and replica
    checks. Lost work is the steps an earlier attempt ran past its last checkpoint, redone by this run, priced
    at this run's mean step time: it is inside "training steps" but produced nothing new.
    """
    in_loop = ("compile_s", "eval_s", "checkpoint_s", "replica_checks_s")
    steps_s = max(0.0, loop_s - data_wait_s - sum(spent[k] for k in in_loop))
    step_s = steps_s / steps if steps else 0.0
    lost_s = min(steps_s, lost_steps * step_s)
    wall_s = spent["startup_s"] + loop_s
    out = {
        "wall_s": wall_s,
        "startup_s": spent["startup_s"],
        "compile_s": spent["compile_s"],
        "data_wait_s": data_wait_s,
        "train_steps_s": steps_s - lost_s,
        "eval_s": spent["eval_s"],
        "checkpoint_s": spent["checkpoint_s"],
        "replica_checks_s": spent["replica_checks_s"],
        "lost_work_s": lost_s,
        "lost_steps": lost_steps,
    }
    out["goodput"] = out["train_steps_s"] / wall_s if wall_s > 0 else 0.0
    return out


def _describe_goodput(g: dict) -> str:
    rows = [(k[: -len("_s")].replace("_", " "), g[k]) for k in g if k.endswith("_s") and k != "wall_s"]
    lines = [f"jdp | goodput {g['goodput']:.1%} of {g['wall_s']:.1f} s wall-clock:"]
    for name, sec in rows:
        extra = (
            f" ({g['lost_steps']} steps redone after the restart)" if name == "lost work" and g["lost_steps"] else ""
        )
        lines.append(f"jdp |   {name:<15} {sec:8.1f} s  {sec / g['wall_s']:6.1%}{extra}")
    return "\n".join(lines)


class RunError(RuntimeError):
    """Training failed; the message names the process and the phase it was in."""


def test_hooks() -> dict[str, str]:
    """Fault injection for jdp's own tests, off unless JDP_TEST_* variables are set:
    JDP_TEST_NAN_STEPS=3,4 (NaN weights in those steps' batches), JDP_TEST_KILL=STEP or STEP:save (SIGKILL
    process 0 after that step, or just after starting its checkpoint save), JDP_TEST_TERM=STEP:save (SIGTERM
    process 0 just after starting the save at STEP), JDP_TEST_DIVERGE=STEP (perturb
    the last device's replica), JDP_TEST_STALL=STEP:PROCESS (that process stops at that step)."""
    return {k[len("JDP_TEST_") :].lower(): v for k, v in os.environ.items() if k.startswith("JDP_TEST_")}


def _diverge(params):
    """Test hook: add 1e-3 to the first parameter on the mesh's last device only."""
    leaf = jax.tree.leaves(params)[0]
    last = leaf.sharding.mesh.devices.flat[-1]
    shards = [
        jax.device_put(np.asarray(s.data) + (1e-3 if s.device == last else 0.0), s.device)
        for s in leaf.addressable_shards
    ]
    new = jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, shards)
    flat, tree = jax.tree.flatten(params)
    return jax.tree.unflatten(tree, [new, *flat[1:]])


def _archive(run_dir: Path) -> Path | None:
    """Move a previous run's files into run_dir/archived-TIME (train.resume=false): nothing is deleted."""
    old = [
        run_dir / n
        for n in (
            "checkpoints",
            "metrics.jsonl",
            "metrics.superseded.jsonl",
            "summary.json",
            "data_state",
            "tensorboard",
            "wandb-run-id",
            "wandb",
        )
    ]
    old = [p for p in old if p.exists()]
    if not old:
        return None
    dest = run_dir / f"archived-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"
    dest.mkdir(parents=True)
    for p in old:
        shutil.move(str(p), str(dest / p.name))
    return dest


def build(cfg: Config, mesh):
    """The configured model's (graphdef, initial state, jitted train step, parameter count) on `mesh`."""
    model = GPT(cfg.model, nnx.Rngs(cfg.train.seed))
    n_params = count_params(model)
    optimizer, schedule = make_optimizer(cfg.optim, cfg.train.steps)
    graphdef, state = parallel.init_state(model, optimizer, mesh)
    state = parallel.for_strategy(state, cfg.parallel.strategy, mesh)
    p = cfg.parallel
    train_step = parallel.make_train_step(
        graphdef,
        lm_loss,
        optimizer,
        mesh,
        cfg.train.grad_accum,
        schedule,
        strategy=p.strategy,
        bucket_mb=p.bucket_mb,
        reduce_dtype=p.reduce_dtype,
    )
    return graphdef, state, train_step, n_params


def batch_spec(cfg: Config, mesh) -> dict[str, jax.ShapeDtypeStruct]:
    """The shapes, dtypes and sharding of a global training batch (for compiling without data)."""
    shape, sharding = (cfg.train.batch_size, cfg.data.seq_len), parallel.batch_sharding(mesh)
    return {
        "inputs": jax.ShapeDtypeStruct(shape, np.int32, sharding=sharding),
        "targets": jax.ShapeDtypeStruct(shape, np.int32, sharding=sharding),
        "weights": jax.ShapeDtypeStruct(shape, np.float32, sharding=sharding),
    }


def all_reduce_report(cfg: Config) -> tuple[str, dict]:
    """Compile the configured train step on this job's devices and list its all-reduces (no data, no run).

    Returns the printable table and the numbers: gradient all-reduces (count, bytes each, total) and
    the parameter bytes they must add up to.
    """
    if cfg.parallel.strategy != "ddp":
        raise ConfigError("the all-reduce report is for parallel.strategy=ddp (dp gathers to a master instead)")
    mesh = parallel.make_mesh()
    derived = validate(cfg, mesh.devices.size, jax.process_count())
    graphdef, state, train_step, n_params = build(cfg, mesh)
    spec = batch_spec(cfg, mesh)
    micro = {k: jax.ShapeDtypeStruct((derived.micro_batch, *v.shape[1:]), v.dtype) for k, v in spec.items()}
    p = cfg.parallel
    buckets = bucket_plan(graphdef, lm_loss, state.params, state.rest, micro, p.bucket_mb, p.reduce_dtype)
    lowered = train_step.lower(state, spec)
    emitted_found = all_reduces(lowered.as_text(dialect="hlo"))  # the program before XLA's passes
    emitted = _gradient_all_reduces(emitted_found, buckets)
    found = all_reduces(lowered.compile().as_text())
    grads = _gradient_all_reduces(found, buckets)
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.params))
    lines = [
        f"all-reduces of the compiled train step: {mesh.devices.size} x {jax.devices()[0].device_kind}, "
        f"parallel.bucket_mb={p.bucket_mb:g}, parallel.reduce_dtype={p.reduce_dtype}, "
        f"train.grad_accum={cfg.train.grad_accum}",
        f"{'#':>3}  {'bytes':>13}  {'operand':<18} {'in a loop':<9}  contents",
    ]
    for i, a in enumerate(found, 1):
        b = grads.get(id(a))
        more = f" + {len(b.names) - 3} more" if b and len(b.names) > 3 else ""
        what = f"gradients: {', '.join(b.names[:3])}{more}" if b else "loss and token count"
        lines.append(f"{i:>3}  {a.bytes:>13,}  {' '.join(a.shapes):<18} {'yes' if a.in_loop else 'no':<9}  {what}")
    grad_bytes = sum(a.bytes for a in found if id(a) in grads)
    emitted_bytes = sum(a.bytes for a in emitted_found if id(a) in emitted)
    others = [a for a in found if id(a) not in grads]
    lines.append(
        f"gradients: {len(grads)} all-reduce(s), {grad_bytes:,} bytes in all = {grad_bytes / param_bytes:.2f} x the "
        f"parameter bytes ({param_bytes:,} bytes, {n_params:,} parameters); other all-reduces: {len(others)}, "
        f"{sum(a.bytes for a in others):,} bytes"
    )
    if emitted_bytes != grad_bytes:
        lines.append(
            f"as jdp emits them the gradients are {len(emitted)} all-reduce(s) of {emitted_bytes:,} bytes; "
            f"XLA on {jax.devices()[0].platform} changed that (CPUs have no bfloat16 all-reduce, so XLA "
            f"promotes it to float32 there; GPUs keep it)"
        )
    if mesh.devices.size == 1:
        lines.append("one device: XLA removes every all-reduce; add --devices N to see the N-device program")
    numbers = {
        "devices": mesh.devices.size,
        "gradient_all_reduces": len(grads),
        "gradient_bytes": [a.bytes for a in found if id(a) in grads],
        "gradient_bytes_total": grad_bytes,
        "emitted_gradient_all_reduces": len(emitted),
        "emitted_gradient_bytes_total": emitted_bytes,
        "parameter_bytes": param_bytes,
        "planned_bucket_bytes": [b.nbytes for b in buckets],
        "other_all_reduces": len(others),
        "in_loop": sum(a.in_loop for a in found),
    }
    return "\n".join(lines), numbers


def _gradient_all_reduces(found: list, buckets: list) -> dict:
    """Which all-reduces carry gradients: id(all-reduce) -> its planned bucket, matched by element count."""
    unused = list(buckets)
    out = {}
    for a in found:
        if len(a.shapes) != 1:
            continue
        match = next((b for b in unused if b.elements == _elements(a.shapes[0])), None)
        if match is not None:
            unused.remove(match)
            out[id(a)] = match
    return out


def _elements(shape: str) -> int:
    dims = shape[shape.index("[") + 1 : -1]
    return math.prod(int(d) for d in dims.split(",") if d)


def train(cfg: Config, world: World | None = None) -> dict:
    """Train the configured GPT; returns the last train and eval metrics."""
    if world is None:
        try:
            world = resolve_world()
        except WorldError as e:
            raise ConfigError(str(e)) from e
    if not jax.distributed.is_initialized():
        initialize(world, cfg.parallel.init_timeout_s, cfg.parallel.heartbeat_timeout_s)
    phase = ["setting up"]
    try:
        return _train(cfg, world, phase)
    except (ConfigError, KeyboardInterrupt):
        raise
    except Exception as e:
        who = f"process {jax.process_index()} of {jax.process_count()}"
        raise RunError(f"{who} failed while {phase[0]}: {type(e).__name__}: {e}") from e


def _train(cfg: Config, world: World, phase: list[str]) -> dict:
    t = cfg.train
    hooks = test_hooks()
    start_time = time.time()
    mesh = parallel.make_mesh()
    derived = validate(cfg, mesh.devices.size, jax.process_count())
    is_main = jax.process_index() == 0
    say = print if is_main else (lambda *a, **k: None)
    run_dir = Path(t.run_dir)
    rows = parallel.process_rows(t.batch_size, mesh)
    phase[0] = "loading data"
    data = load_data(
        cfg.data, cfg.model.vocab_size, t.batch_size, t.seed, rows, jax.process_index(), jax.process_count()
    )

    phase[0] = "building the model and compiling"
    graphdef, state, train_step, n_params = build(cfg, mesh)
    eval_step = parallel.make_eval_step(graphdef, lm_loss, mesh)
    digest = parallel.make_replica_digest(mesh)

    phase[0] = "looking for checkpoints"
    if not t.resume and is_main and (archived := _archive(run_dir)):
        say(f"jdp | train.resume=false: the previous run's files are now in {archived}")
    multihost_utils.sync_global_devices("jdp: run directory ready")
    ckpts = Checkpoints(run_dir, t.ckpt_keep)
    start, resumed_from = 0, None
    if t.resume and (restored := ckpts.restore_latest(state, lambda record: check_resumable(record, cfg))):
        start, state, record = restored
        resumed_from = start
        if cfg.data.streaming:
            data.train.load_state_dict(
                json.loads((run_dir / "data_state" / str(start) / f"process_{jax.process_index()}.json").read_text())
            )
    lost_steps = _lost_steps(run_dir / "metrics.jsonl", start) if resumed_from is not None else 0
    if is_main and (moved := supersede(run_dir / "metrics.jsonl", start)):
        say(
            f"jdp | {moved} metrics records after step {start} (work lost since that checkpoint) moved to metrics.superseded.jsonl"
        )

    fpt = flops_per_token(cfg)
    peak, peak_source = peak_flops(cfg.model.dtype, derived.n_devices)
    say(
        f"jdp | {world.describe()} | {jax.devices()[0].device_kind} x {derived.n_devices}, {jax.local_device_count()} local"
    )
    say(
        f"jdp | model {n_params:,} parameters | {fpt / 1e6:.1f} MFLOPs/token | MFU peak: {peak / 1e12:.3g} TFLOP/s, {peak_source}"
    )
    say(f"jdp | {derived.describe()}")
    par = cfg.parallel
    say(
        f"jdp | parallel.strategy={par.strategy} bucket_mb={par.bucket_mb:g} reduce_dtype={par.reduce_dtype} | "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}"
    )
    epochs = "" if cfg.data.streaming else f" | {t.steps} steps = {data.train.epoch(t.steps):.3f} epochs"
    say(f"jdp | data {data.describe()}{epochs}")
    say(
        f"jdp | run dir {run_dir} | "
        + (f"resuming from the checkpoint at step {start}" if resumed_from is not None else "starting at step 0")
    )
    if is_main:
        save_config(cfg, run_dir)

    def check_replicas(step: int) -> None:
        phase[0] = f"checking the replicas at step {step}"
        if str(step) == hooks.get("diverge"):
            state.params = _diverge(state.params)
        if bad := parallel.replica_digest_mismatches(digest, state.params, mesh):
            raise RuntimeError(
                f"replicas diverged at step {step}: the parameters on {', '.join(bad)} differ from device 0's"
            )

    check_replicas(start)

    log = MetricsLog(
        run_dir / "metrics.jsonl",
        enabled=is_main,
        tensorboard=t.tensorboard,
        wandb_project=t.wandb_project,
        config=cfg.to_dict(),
        resume_step=start if resumed_from is not None else None,
    )
    # Where the wall-clock time goes (the goodput summary): seconds per kind of work.
    spent = {"startup_s": time.time() - start_time, "compile_s": 0.0, "eval_s": 0.0, "checkpoint_s": 0.0}
    spent["replica_checks_s"] = 0.0
    do_eval = cfg.data.val_tokens > 0
    last: dict = {}
    bar = tqdm(
        total=t.steps,
        initial=start,
        disable=not (is_main and t.progress),
        unit="step",
        dynamic_ncols=True,
        mininterval=1.0,
    )
    clock = {"t": None, "tokens": 0, "tps": None, "wait": 0.0, "skipped": 0, "bad_run": 0, "bad_total": 0}
    positions: dict[int, object] = {}  # streaming: the loader's position after each step's batch
    loader = Prefetcher(lambda s: (data.local_batch(s), data.position()), start, t.steps, cfg.data.prefetch)
    stop = StopAgreement()
    watchdog = Watchdog(t.step_timeout_s)

    def finish(step: int, metrics) -> None:
        """Host side of step `step` (1-based): fetch its metrics (it has finished by now) and log them."""
        m = {k: float(v) for k, v in jax.device_get(metrics).items()}
        watchdog.progress(step)
        now = time.perf_counter()
        tps = None
        if clock["t"] is not None:
            clock["tokens"] += derived.tokens_per_step
        if m["skipped"]:
            clock["skipped"] += 1
            clock["bad_total"] += 1
            clock["bad_run"] += 1
            if is_main:
                bar.write(
                    f"step {step}: non-finite loss or gradient (loss {m['loss']}, grad_norm {m['grad_norm']}): update skipped"
                )
            if clock["bad_run"] > t.max_bad_steps:
                good = [s for s in ckpts.steps() if s < step]
                raise RuntimeError(
                    f"{clock['bad_run']} non-finite steps in a row (more than train.max_bad_steps={t.max_bad_steps}), "
                    f"the last at step {step}; the parameters were never updated with them and the newest "
                    f"checkpoint is step {good[-1] if good else 'none'}. Lower optim.lr or check the data"
                )
        else:
            clock["bad_run"] = 0
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
                "skipped_steps": clock["skipped"],  # non-finite updates skipped since the previous record
                "skipped_total": clock["bad_total"],
            }
            clock["wait"], clock["skipped"] = loader.wait_s, 0
            log.write(record)
            last.update(record)
        if clock["t"] is None or tps is not None:
            clock["t"], clock["tokens"] = time.perf_counter(), 0
        bar.set_postfix(loss=f"{m['loss']:.4f}", tok_s=f"{clock['tps']:,.0f}" if clock["tps"] else "-", refresh=False)
        bar.update(1)

    def run_eval(step: int) -> None:
        with _timed(spent, "eval_s"):
            _run_eval(step)

    def _run_eval(step: int) -> None:
        phase[0] = f"evaluating at step {step}"
        watchdog.pause()
        loss, n_tok = evaluate(eval_step, state, data.tokens.val, cfg, mesh, rows)
        log.write({"step": step, "eval_loss": loss, "eval_tokens": n_tok})
        last.update(eval_loss=loss)
        if is_main:
            bar.write(f"step {step}: eval_loss {loss:.4f} over {n_tok:,.0f} tokens")
        clock["t"], clock["tokens"] = time.perf_counter(), 0  # evaluation time is not training throughput

    def save(step: int) -> None:
        with _timed(spent, "checkpoint_s"):
            _save(step)

    def _save(step: int) -> None:
        phase[0] = f"saving the checkpoint at step {step}"
        if cfg.data.streaming:  # each process's own stream position, beside the checkpoint
            where = run_dir / "data_state" / str(step)
            where.mkdir(parents=True, exist_ok=True)
            (where / f"process_{jax.process_index()}.json").write_text(json.dumps(positions[step]))
        if bad := parallel.nonfinite_leaves(state.params):  # a checkpoint never holds a NaN or an Inf
            good = [s for s in ckpts.steps() if s < step]
            raise RuntimeError(
                f"step {step}: the parameters hold NaN or Inf ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}) "
                f"although every loss and gradient was finite: the optimizer update overflowed. Not saved; the "
                f"newest checkpoint is step {good[-1] if good else 'none'}. Lower optim.lr"
            )
        record = {"step": step, "config": json.loads(json.dumps(cfg.to_dict())), "data": {"seed": t.seed, "step": step}}
        record["rng"] = "none: the train step draws no random numbers; data order derives from (train.seed, step)"
        ckpts.save(step, state, record)
        saved.add(step)
        if jax.process_index() == 0:  # test hooks: a signal while the asynchronous save is being written
            if hooks.get("kill") == f"{step}:save":
                os.kill(os.getpid(), signal.SIGKILL)
            if hooks.get("term") == f"{step}:save":
                os.kill(os.getpid(), signal.SIGTERM)

    pending, done, preempted, saved = None, start, False, set(ckpts.steps())
    periodic = {"replicas": t.check_replicas_every, "eval": t.eval_every if do_eval else 0, "checkpoint": t.ckpt_every}
    loop_start = time.time()
    try:
        for step, (local, position) in loader:
            if stop.should_stop(done):
                preempted = True
                break
            phase[0] = f"running step {step + 1}"
            if hooks.get("stall") == f"{step + 1}:{jax.process_index()}":
                time.sleep(10**6)  # test hook: a process that stops making progress
            if str(step + 1) in hooks.get("nan_steps", "").split(","):
                local = {**local, "weights": local["weights"] * np.float32("nan")}
            positions[step + 1] = position
            with _timed(spent, "compile_s", enabled=step == start):  # the first call traces and compiles
                state, metrics = train_step(state, parallel.shard_batch(local, mesh, t.batch_size))
            done = step + 1
            # Fetch the previous step's metrics only now that this step is queued: the device never waits on us.
            if pending is not None:
                finish(*pending)
            pending = (done, metrics)
            due = {name: every and done % every == 0 and done < t.steps for name, every in periodic.items()}
            if any(due.values()):
                finish(*pending)
                pending = None
                if due["replicas"]:
                    with _timed(spent, "replica_checks_s"):
                        check_replicas(done)
                if due["eval"]:
                    run_eval(done)
                if due["checkpoint"]:
                    save(done)
            if hooks.get("kill") == str(done) and jax.process_index() == 0:
                if pending is not None:
                    finish(*pending)
                    pending = None
                os.kill(os.getpid(), signal.SIGKILL)  # test hook: die after this step
            positions.pop(done - 1, None)
        if pending is not None:
            finish(*pending)
    except BaseException:
        # The watchdog must not outlive a failed run: in a process that goes on (a notebook, the test suite) it
        # would end the whole process step_timeout_s later.
        watchdog.close()
        stop.close()
        # A checkpoint already being written holds good parameters: let it complete. With several processes a
        # dead peer could block that forever, so only a single process waits.
        loader.close()
        if jax.process_count() == 1:
            ckpts.wait()
        raise
    loader.close()
    if preempted:
        if done not in saved:
            save(done)
        phase[0] = f"waiting for the checkpoint at step {done}"
        watchdog.pause()
        with _timed(spent, "checkpoint_s"):
            ckpts.wait()
        say(f"\njdp | stopped by a signal after step {done}; checkpoint saved. Run the same command to resume.")
    else:
        if do_eval:
            run_eval(t.steps)
        if t.steps not in saved:
            save(t.steps)
        phase[0] = "waiting for the last checkpoint"
        watchdog.pause()
        with _timed(spent, "checkpoint_s"):
            ckpts.wait()
    watchdog.close()
    stop.close()
    ckpts.close()
    bar.close()
    goodput = _goodput(spent, time.time() - loop_start, loader.wait_s, done - start, lost_steps)
    log.write({"step": done, "goodput": goodput})
    if is_main:
        print(_describe_goodput(goodput), flush=True)
    log.close()
    phase[0] = "writing the summary"
    summary = {
        "steps": done,
        "preempted": preempted,
        "resumed_from": resumed_from,
        "loss": last.get("loss"),
        "eval_loss": last.get("eval_loss"),
        "skipped_total": clock["bad_total"],
        "wall_s": time.time() - start_time,
        "world": world.describe(),
        "devices": derived.n_devices,
        "goodput": goodput,
        "params_sha256": params_sha256(state.params),
        "params_fingerprint": fingerprint(state.params),
    }
    if is_main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    if not preempted:
        say(
            f"jdp | done: loss {last.get('loss', float('nan')):.4f}"
            + (f", eval_loss {last['eval_loss']:.4f}" if do_eval else "")
        )
    last.update(state=state, graphdef=graphdef, preempted=preempted, skipped_total=clock["bad_total"])
    return last
