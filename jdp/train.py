"""`jdp.train`: config -> mesh -> data -> state and step -> the loop -> checkpoints, for jdp's GPT."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import jax
import numpy as np
import yaml
from jax.experimental import multihost_utils

from jdp import hf, parallel
from jdp.build import build
from jdp.checkpoint import Checkpoints, check_resumable, config_differences
from jdp.config import Config, ConfigError, Derived, save_config, validate
from jdp.coordination import PeerMonitor, announce_departure, first_departure
from jdp.corpus import cache_root
from jdp.data import load_data
from jdp.faults import Faults
from jdp.loop import Loop, Phases, Result, Setup
from jdp.memory import check_memory
from jdp.metrics import (
    MetricsLog,
    fingerprint,
    flops_per_token,
    lost_steps,
    missing_steps,
    params_sha256,
    peak_flops,
    step_ranges,
    supersede,
)
from jdp.model import lm_loss
from jdp.rundir import RunDir, RunDirEscape, RunDirInUse, RunLock
from jdp.world import World, WorldError, initialize, resolve_world, use_compilation_cache


class RunError(RuntimeError):
    """Training failed; the message names the process and the phase it was in."""


def train(cfg: Config, world: World | None = None, explicit: frozenset[str] = frozenset()) -> dict:
    """Train the configured GPT; returns the last train and eval metrics (and the final state). `explicit`: the
    keys the user set on the command line (`model.d_model`, ...), which an import must agree with."""
    if world is None:
        try:
            world = resolve_world()
        except WorldError as e:
            raise ConfigError(str(e)) from e
    if not jax.distributed.is_initialized():
        initialize(world, cfg.parallel.init_timeout_s, cfg.parallel.heartbeat_timeout_s, cfg.parallel.coordinator_bind)
    phases = Phases()
    run_dir = RunDir(cfg.train.run_dir)
    lock, peers = RunLock(run_dir), PeerMonitor()
    created = run_dir.missing_dirs() if jax.process_index() == 0 else []  # removed again if the run never starts
    try:
        try:
            run_dir.check_contained()
        except RunDirEscape as e:
            raise ConfigError(str(e)) from None
        cfg, adopted = checked_import(cfg, explicit) if cfg.train.init_from else (cfg, [])
        mesh, derived = checked_config(cfg)  # before the run directory is made: a bad config leaves nothing behind
        if (complete := hold(lock, run_dir, cfg)) is not None:
            return already_complete(run_dir, complete)
        s = setup(cfg, world, phases, mesh, derived, adopted)
        result = Loop(s).run()
        with phases("writing the summary"):
            return finish(s, world, result)
    except ConfigError as e:
        announce_departure(f"found bad input: {e}")
        raise
    except KeyboardInterrupt:
        announce_departure("was interrupted")
        raise
    except Exception as e:
        announce_departure(f"failed while {phases.now}: {type(e).__name__}: {e}")
        who = f"process {jax.process_index()} of {jax.process_count()}"
        first = f" (the first to leave the job: {notice})" if (notice := first_departure()) else ""
        raise RunError(f"{who} failed while {phases.now}: {type(e).__name__}: {e}{first}") from e
    finally:
        peers.close()
        lock.release()
        RunDir.remove_if_empty(created)  # e.g. the data or tokenizer was bad: no empty run directory stays


def checked_config(cfg: Config) -> tuple[jax.sharding.Mesh, Derived]:
    """The mesh and the derived numbers of a config that passed every check of the config alone (values, device
    count, memory), made before anything is written."""
    mesh = parallel.make_mesh()
    derived = validate(cfg, mesh.devices.size, jax.process_count())
    check_memory(cfg, derived, mesh)  # before anything is allocated: a run too large is refused here
    return mesh, derived


def hold(lock: RunLock, run_dir: RunDir, cfg: Config) -> int | None:
    """Process 0 takes the run directory's lock for the whole job (refusing a path jdp must not write into) and
    looks whether the run is already complete; every process learns the outcome. Returns the complete run's step."""
    problem, complete = "", -1
    if jax.process_index() == 0:
        try:
            problem = run_dir.unusable() or ""
            if not problem and (dead := lock.acquire()):
                whose = f"process {dead['pid']} on {dead['host']}, started {dead['started']}"
                if dead.get("damaged"):  # cut off by a crash or a full disk while its job created it
                    whose = f"its lock was cut off while written, at {dead['started']}"
                print(
                    f"jdp: warning: took over {lock.path} from a job that is gone ({whose})",
                    file=sys.stderr,
                    flush=True,
                )
            complete = -1 if problem else completed_step(run_dir, cfg)
        except RunDirInUse as e:
            problem = str(e)
        except OSError as e:  # cannot create the directory or the lock: read-only, no permission, a file on the way
            why = e.strerror or type(e).__name__
            problem = (
                f"train.run_dir={run_dir.path} cannot be written: {why} ({e.filename or run_dir.path}); give a "
                f"train.run_dir on a writable file system"
            )
    if jax.process_count() > 1:
        flag, complete = multihost_utils.broadcast_one_to_all(np.array([bool(problem), complete], np.int32))
        if flag and not problem:
            problem = f"{run_dir.path} cannot be used by this job (process 0 names why)"
    if problem:
        raise ConfigError(problem)
    return None if complete < 0 else int(complete)


def completed_step(run_dir: RunDir, cfg: Config) -> int:
    """The step a finished run ended at, if re-running `cfg` has nothing to do (a scheduler's retry, a repeated
    command); else -1. Finished: its summary says it ended (not preempted) at its newest checkpoint, at or past
    train.steps, and its config.yaml differs from `cfg` in nothing that would change the computation (a changed one
    goes on to setup, whose restore names the difference)."""
    steps = run_dir.checkpoint_steps()
    if not cfg.train.resume or not steps or steps[-1] < cfg.train.steps:
        return -1
    try:
        summary = json.loads(run_dir.summary.read_text())
        saved = yaml.safe_load(run_dir.config.read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return -1
    if not isinstance(summary, dict) or summary.get("steps") != steps[-1] or summary.get("preempted"):
        return -1
    if not isinstance(saved, dict) or config_differences(saved, json.loads(json.dumps(cfg.to_dict()))):
        return -1
    return steps[-1]


def already_complete(run_dir: RunDir, step: int) -> dict:
    """What train() returns for a run with nothing left to do: its summary, untouched on disk."""
    if jax.process_index() == 0:
        print(
            f"jdp: run already complete at step {step} ({run_dir.path}); nothing was changed. Raise train.steps to "
            f"train further, or set train.resume=false to start over",
            flush=True,
        )
    try:
        summary = json.loads(run_dir.summary.read_text())
    except (OSError, ValueError):
        summary = {}
    return {"already_complete": step, "loss": summary.get("loss"), "eval_loss": summary.get("eval_loss")}


def setup(
    cfg: Config, world: World, phases: Phases, mesh: jax.sharding.Mesh, derived: Derived, adopted: list[str] = ()
) -> Setup:
    """Everything before the first step: data, state and steps, the run directory, a checkpoint to resume.
    `mesh`, `derived`: checked_config's; `adopted`: what checked_import took from train.init_from's config.json."""
    t = cfg.train
    is_main = jax.process_index() == 0
    run_dir = RunDir(t.run_dir)
    cache = use_compilation_cache(cache_root(cfg.data) / "xla") if t.compile_cache else None
    with phases("loading data"):
        rows = parallel.process_rows(t.batch_size, mesh)
        data = load_data(
            cfg.data, cfg.model.vocab_size, t.batch_size, t.seed, rows, jax.process_index(), jax.process_count()
        )
        if (valid := cfg.model.vocab_valid) and data.tokenizer.vocab_size > valid:
            raise ConfigError(
                f"data.tokenizer={cfg.data.tokenizer} has {data.tokenizer.vocab_size} tokens but the model knows "
                f"{valid} (model.vocab_valid); use the model's own tokenizer"
            )
    imported = None
    if t.init_from:
        with phases(f"reading {t.init_from}"):
            model, imported = hf.load_model(cfg.model, t.init_from)
    with phases("building the model and compiling"):
        graphdef, state, train_step, n_params, optimizer, hook = build(cfg, mesh, model if imported else None)
        eval_step = parallel.make_eval_step(graphdef, lm_loss, mesh)
    with phases("looking for checkpoints"):
        if not t.resume and is_main and (archived := run_dir.archive()):
            print(f"jdp | train.resume=false: the previous run's files are now in {archived}")
        multihost_utils.sync_global_devices("jdp: run directory ready")
        ckpts = Checkpoints(run_dir.path, t.ckpt_keep)
        start, resumed_from = 0, None
        layout = parallel.OptLayout.of(cfg.parallel.strategy, mesh)

        comm = parallel.comm_record(hook, state)

        def target(record):  # the checkpoint's optimizer state may be laid out for another strategy or device count
            like = parallel.restore_target(state, optimizer, mesh, cfg.parallel.strategy, layout.of_record(record))
            # the hook's saved state is read only into the same hook on as many devices; else it starts afresh
            return like if record.get("comm") == comm else dataclasses.replace(like, comm=None)

        if t.resume and (restored := ckpts.restore_latest(state, lambda r: check_resumable(r, cfg), target)):
            start, state, record = restored
            resumed_from = start
            if (saved := layout.of_record(record)) != layout:
                state = parallel.relayout(state, optimizer, mesh, cfg.parallel.strategy)
                if is_main:
                    print(f"jdp | optimizer state moved from {saved.describe()} to {layout.describe()}")
            if record.get("comm") != comm and is_main and (record.get("comm") or comm):
                print(f"jdp | {comm_change(record.get('comm'), comm)}")
            if cfg.data.streaming:
                data.train.load_state_dict(stream_position(run_dir, start))
        lost = lost_steps(run_dir.metrics, start) if resumed_from is not None else 0
        missing = missing_records(run_dir, cfg, start) if is_main and resumed_from is not None else []
        if is_main and (moved := supersede(run_dir.metrics, start)):
            print(
                f"jdp | {moved} metrics records after step {start} (work lost since that checkpoint) moved to "
                f"{run_dir.superseded_metrics.name}"
            )
    peak, peak_source = peak_flops(cfg.model.dtype, derived.n_devices)
    if is_main:
        print(banner(cfg, world, derived, data, n_params, peak, peak_source, run_dir, resumed_from, cache))
        if imported:
            print(f"jdp | {imported.describe() if resumed_from is None else 'train.init_from not used: resuming'}")
        for change in adopted:  # what the import took from config.json
            print(f"jdp | {change}")
        save_config(cfg, run_dir.path)
    log = MetricsLog(
        run_dir.metrics,
        enabled=is_main,
        tensorboard=t.tensorboard,
        wandb_project=t.wandb_project,
        config=cfg.to_dict(),
        resume_step=resumed_from,
        missing_steps=missing,
    )
    return Setup(
        cfg, derived, mesh, data, graphdef, state, train_step, eval_step, parallel.make_replica_digest(mesh), run_dir,
        ckpts, start, resumed_from, lost, log, peak, phases, Faults(), comm,
    )  # fmt: skip


def missing_records(run_dir: RunDir, cfg: Config, start: int) -> list[int]:
    """The logged steps up to `start` whose records metrics.jsonl lost (deleted, cut), with a warning naming
    them. The cadence is the one the earlier run logged with (its config.yaml, not yet overwritten), else `cfg`'s."""
    try:
        saved = yaml.safe_load(run_dir.config.read_text())
        t, evals = saved["train"], int(saved["data"]["val_tokens"]) > 0
        log_every, eval_every = int(t["log_every"]), int(t["eval_every"]) if evals else 0
    except (OSError, ValueError, TypeError, KeyError, yaml.YAMLError):
        log_every, eval_every = cfg.train.log_every, cfg.train.eval_every if cfg.data.val_tokens > 0 else 0
    if missing := missing_steps(run_dir.metrics, start, log_every, eval_every):
        steps = step_ranges(missing, log_every, eval_every)
        print(
            f"jdp: warning: {run_dir.metrics.name} has no records for steps {steps} ({len(missing)} logged steps up "
            f"to the checkpoint at step {start}; deleted or cut off?). The run goes on; their history is gone from "
            f"metrics.jsonl and `jdp plot` (TensorBoard may still hold them), and summary.json counts them as "
            f"missing_metrics_steps",
            file=sys.stderr,
            flush=True,
        )
    return missing


def stream_position(run_dir: RunDir, step: int) -> dict:
    """This process's stream position saved beside the checkpoint at `step`; an unreadable one is named."""
    path = run_dir.data_state(step, jax.process_index())
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"{path}: the stream position saved with the checkpoint at step {step} cannot be read ({e}); a "
            f"streaming run resumes only with it. Move {run_dir.checkpoints / str(step)} aside to resume from the "
            f"checkpoint before it, or set train.resume=false to start over"
        ) from None


def comm_change(saved: dict | None, now: dict | None) -> str:
    """What a resume does with the communication hook's state when the checkpoint's is not today's."""
    if now is None:
        return f"the checkpoint's {saved['hook']} state is not used (parallel.compression=none)"
    if saved is None:
        return f"{now['hook']} starts with fresh state (the checkpoint has none)"
    return (
        f"{now['hook']} starts with fresh state: the checkpoint's was saved for {saved['hook']} on "
        f"{saved['devices']} devices (rank {saved.get('rank')}), this run is {now['hook']} on {now['devices']} "
        f"(rank {now.get('rank')}); PowerSGD's error feedback restarts from zero"
    )


def checked_import(cfg: Config, explicit: frozenset[str] = frozenset()) -> tuple[Config, list[str]]:
    """The config with train.init_from's model: (config, what the import changed, to print at start).

    The model's keys come from the directory's config.json, and data.seq_len is lowered to its positions, except
    where the command line set them (`explicit`): those must agree, and all that do not are one error."""
    path = cfg.train.init_from
    if cfg.data.tokenizer == "byte":
        raise ConfigError(
            f"train.init_from={path} with data.tokenizer=byte: the imported model's ids are its own "
            f"tokenizer's; set data.tokenizer to it (e.g. data.tokenizer={path})"
        )
    adopted = hf.adopt(cfg.model, path, explicit)
    changes, conflicts, data = list(adopted.changes), list(adopted.conflicts), cfg.data
    positions = adopted.read["max_seq_len"]
    if data.seq_len > positions:
        if "data.seq_len" in explicit:
            conflicts.append(f"data.seq_len={data.seq_len} (config.json's model has {positions} positions)")
        else:
            changes.append(f"data.seq_len {data.seq_len} -> {positions} (the model's positions, from config.json)")
            data = dataclasses.replace(data, seq_len=positions)
    if conflicts:
        raise ConfigError(
            f"train.init_from={path}: the command line contradicts its {hf.CONFIG}:\n  " + "\n  ".join(conflicts)
            + f"\nLeave these keys out (the import takes {hf.CONFIG}'s values) or set them to agree"
        )  # fmt: skip
    return dataclasses.replace(cfg, model=adopted.model, data=data), changes


def banner(cfg: Config, world: World, derived, data, n_params, peak, peak_source, run_dir, resumed_from, cache) -> str:
    """The derived numbers, printed once at start."""
    par, t = cfg.parallel, cfg.train
    epochs = "" if cfg.data.streaming else f" | {t.steps} steps = {data.train.epoch(t.steps):.3f} epochs"
    where = "starting at step 0" if resumed_from is None else f"resuming from the checkpoint at step {resumed_from}"
    return "\n".join(
        [
            f"jdp | {world.describe()} | {jax.devices()[0].device_kind} x {derived.n_devices}, "
            f"{jax.local_device_count()} local | jax {jax.__version__}",
            f"jdp | model {n_params:,} parameters | {flops_per_token(cfg) / 1e6:.1f} MFLOPs/token | MFU peak: "
            f"{peak / 1e12:.3g} TFLOP/s, {peak_source}",
            f"jdp | {derived.describe()}",
            f"jdp | parallel.strategy={par.strategy} bucket_mb={par.bucket_mb:g} reduce_dtype={par.reduce_dtype}"
            f"{compression(par)} | "
            f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}",
            f"jdp | data {data.describe()}{epochs}",
            f"jdp | run dir {run_dir.path} | {where} | compile cache {cache or 'off (train.compile_cache=false)'}",
        ]
    )


def compression(par) -> str:
    if par.compression == "none":
        return ""
    feedback = "with" if par.powersgd_error_feedback else "without"
    return (
        f" compression=powersgd (rank {par.powersgd_rank}, {feedback} error feedback, plain all-reduce for the first "
        f"{par.powersgd_warmup} steps)"
    )


def finish(s: Setup, world: World, r: Result) -> dict:
    """summary.json and the closing line; returns the last metrics, with the final state."""
    summary = {
        "steps": r.done,
        "preempted": r.preempted,
        "resumed_from": s.resumed_from,
        "loss": r.last.get("loss"),
        "eval_loss": r.last.get("eval_loss"),
        "skipped_total": r.skipped_total,
        "missing_metrics_steps": len(s.log.missing_steps),  # logged steps whose records metrics.jsonl lost
        "wall_s": time.time() - s.phases.started,
        "world": world.describe(),
        "devices": s.derived.n_devices,
        "platform": jax.devices()[0].platform,  # what `jdp plan --calibrate` checks the run against
        "device_kind": jax.devices()[0].device_kind,
        "goodput": r.goodput,
        "params_sha256": params_sha256(r.state.params),
        "params_fingerprint": fingerprint(r.state.params),
    }
    if jax.process_index() == 0:
        s.run_dir.summary.write_text(json.dumps(summary, indent=1))
        if not r.preempted:
            evaluated = f", eval_loss {r.last['eval_loss']:.4f}" if "eval_loss" in r.last else ""
            print(f"jdp | done: loss {r.last.get('loss', float('nan')):.4f}{evaluated}")
    return {
        **r.last,
        "state": r.state,
        "graphdef": s.graphdef,
        "preempted": r.preempted,
        "skipped_total": r.skipped_total,
    }
