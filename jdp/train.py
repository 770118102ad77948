"""`jdp.train`: config -> mesh -> data -> state and step -> the loop -> checkpoints, for jdp's GPT."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

from jdp import hf, parallel
from jdp.build import build
from jdp.checkpoint import Checkpoints, check_resumable
from jdp.config import Config, ConfigError, save_config, validate
from jdp.coordination import PeerMonitor, announce_departure, first_departure
from jdp.corpus import cache_root
from jdp.data import load_data
from jdp.faults import Faults
from jdp.loop import Loop, Phases, Result, Setup
from jdp.metrics import MetricsLog, fingerprint, flops_per_token, lost_steps, params_sha256, peak_flops, supersede
from jdp.model import lm_loss
from jdp.rundir import RunDir, RunDirEscape, RunDirInUse, RunLock
from jdp.world import World, WorldError, initialize, resolve_world, use_compilation_cache


class RunError(RuntimeError):
    """Training failed; the message names the process and the phase it was in."""


def train(cfg: Config, world: World | None = None) -> dict:
    """Train the configured GPT; returns the last train and eval metrics (and the final state)."""
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
    try:
        try:
            run_dir.check_contained()
        except RunDirEscape as e:
            raise ConfigError(str(e)) from None
        hold(lock)
        s = setup(cfg, world, phases)
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


def hold(lock: RunLock) -> None:
    """Process 0 takes the run directory's lock for the whole job; every process learns whether it got it."""
    problem = ""
    if jax.process_index() == 0:
        try:
            if dead := lock.acquire():
                print(
                    f"jdp: warning: took over {lock.path} from a job that is gone (process {dead['pid']} on "
                    f"{dead['host']}, started {dead['started']})",
                    file=sys.stderr,
                    flush=True,
                )
        except RunDirInUse as e:
            problem = str(e)
    if jax.process_count() > 1 and multihost_utils.broadcast_one_to_all(np.int32(bool(problem))) and not problem:
        problem = f"{lock.path.parent} is in use by another job (process 0 names it)"
    if problem:
        raise ConfigError(problem)


def setup(cfg: Config, world: World, phases: Phases) -> Setup:
    """Everything before the first step: mesh, data, state and steps, the run directory, a checkpoint to resume."""
    t = cfg.train
    cfg = checked_import(cfg) if t.init_from else cfg
    mesh = parallel.make_mesh()
    derived = validate(cfg, mesh.devices.size, jax.process_count())
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
                data.train.load_state_dict(json.loads(run_dir.data_state(start, jax.process_index()).read_text()))
        lost = lost_steps(run_dir.metrics, start) if resumed_from is not None else 0
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
        save_config(cfg, run_dir.path)
    log = MetricsLog(
        run_dir.metrics,
        enabled=is_main,
        tensorboard=t.tensorboard,
        wandb_project=t.wandb_project,
        config=cfg.to_dict(),
        resume_step=resumed_from,
    )
    return Setup(
        cfg, derived, mesh, data, graphdef, state, train_step, eval_step, parallel.make_replica_digest(mesh), run_dir,
        ckpts, start, resumed_from, lost, log, peak, phases, Faults(), comm,
    )  # fmt: skip


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


def checked_import(cfg: Config) -> Config:
    """The model must be the one in train.init_from; a padded vocabulary gets model.vocab_valid."""
    if cfg.data.tokenizer == "byte":
        raise ConfigError(
            f"train.init_from={cfg.train.init_from} with data.tokenizer=byte: the imported model's ids are its own "
            f"tokenizer's; set data.tokenizer to it (e.g. data.tokenizer={cfg.train.init_from})"
        )
    return dataclasses.replace(cfg, model=hf.checked_config(cfg.model, cfg.train.init_from))


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
        "wall_s": time.time() - s.phases.started,
        "world": world.describe(),
        "devices": s.derived.n_devices,
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
