"""The trainer: one loop for every model. config -> mesh -> data -> state and step -> loop -> checkpoint.

`jdp.Trainer(model, loss_fn, optimizer, data, config).fit()` runs for any Flax NNX model what `jdp train` runs for
jdp's GPT (lm.py is a Trainer too): the world-size-invariant, exactly-once data order, exact resume after a kill,
preemption at an agreed step, checksummed checkpoints, the non-finite skip, replica digests, the watchdogs,
metrics and trackers, goodput and the progress bar. docs/library.md shows it beside the same in PyTorch DDP.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax
import yaml
from flax import nnx
from jax.experimental import multihost_utils

from jdp import jax_private, parallel
from jdp.callbacks import Callback, Checkpoint, Evaluate, ReplicaCheck, imported
from jdp.checkpoint import (
    Checkpoints,
    base_fingerprint,
    check_base,
    check_data,
    check_param_shapes,
    check_reference,
    check_resumable,
    check_writable,
    config_differences,
    data_changes,
    load,
    make_record,
    saved_comm,
    saved_data_state,
    saved_fingerprint,
    saved_groups,
    saved_layout,
    saved_sync,
)
from jdp.config import Config, ConfigError, Derived, save_config, validate
from jdp.data.corpus import cache_root
from jdp.data.dataset import Source, source_for
from jdp.job.coordination import (
    PeerMonitor,
    announce_departure,
    describe_hosts,
    first_departure,
    publish_host,
    published_by_every_process,
)
from jdp.job.join import initialize
from jdp.job.process import Interrupted, StartupInterrupts, startup_interrupts, watch_launcher
from jdp.job.world import World, WorldError, resolve_world
from jdp.job.xla import CACHE_OFF_ACROSS_PROCESSES, keep_scratch_memory, use_compilation_cache
from jdp.log import PLAIN, logger, set_rank
from jdp.loop import Loop, Phases, Result, Run
from jdp.memory import peak_device_bytes
from jdp.metrics import (
    CPU_PEAK_ENV,
    MetricsLog,
    StepMeter,
    cpu_peak_given,
    fingerprint,
    lost_steps,
    missing_steps,
    params_sha256,
    peak_flops,
    step_ranges,
    supersede,
)
from jdp.parallel import strategies, sync
from jdp.parallel.comm_hooks import CommHook
from jdp.parallel.remat import Remat
from jdp.rundir import RunDir, RunDirInUse, RunLock

__all__ = ["FitResult", "RunError", "Trainer"]

LossFn = parallel.LossFn
log = logger("jdp.trainer")


class RunError(RuntimeError):
    """Training failed; the message names the process and the phase it was in."""


class FitResult(dict):
    """What fit() returns: the last metrics and eval_loss, params_sha256, ..., and `result["model"]`, the trained
    module, made on first use: merged from the final state where every device holds the whole model, else (a state
    split over the devices, or a run that had already finished) read from the run's newest checkpoint onto one
    device (jdp.load)."""

    def __init__(self, values: dict, make_model: Callable[[], nnx.Module]):
        super().__init__(values)
        self._make_model = make_model

    def __missing__(self, key):
        if key != "model":
            raise KeyError(key)
        self["model"] = model = self._make_model()
        return model


class Trainer:
    """Trains `model` with `loss_fn(model, batch) -> (loss_sum, weight_sum)` and an optax optimizer on `data`.

    model: an `nnx.Module`, or a function returning one (built once the job has started: pass a function when
    the script runs on several processes, since `jax.distributed` must start before anything touches a device).
    data: a `jdp.Loader` (any Hugging Face `datasets.Dataset` or `IterableDataset`, dict of arrays or indexable),
    or anything with `local_batch(step)`; or a function `rows -> such a loader` given this process's rows.
    eval_data: the same for evaluation (its `eval_batches()` covers every row once), or None. collate: rows (a list
    of dicts) -> a dict of numpy arrays, for the data jdp's Loader reads (default: each column stacked).
    config: a `jdp.Config`; the trainer reads `train`, `parallel` and `data.prefetch` (`jdp.load_config(None,
    ["train.steps=100", ...])` builds one from `key=value` strings). callbacks: `jdp.every(n, fn)` and the like,
    run after jdp's replica checks and evaluation and before its checkpoints. handle_signals: SIGTERM/SIGINT stop
    every process at one agreed step and save there (the `jdp` command does; a library caller asks for it).
    mesh: the devices to train on (default every device of every process). flops_per_row: training FLOPs per row,
    for MFU in the metrics (0: no MFU).
    """

    unit = "examples"  # what the loss weight counts, in metrics and messages
    model_phase = "building the model"

    def __init__(
        self,
        model: nnx.Module | Callable[[], nnx.Module],
        loss_fn: LossFn,
        optimizer: optax.GradientTransformation,
        data: Any,
        config: Config | None = None,
        *,
        eval_data: Any = None,
        collate: Callable[[list[dict]], dict] | None = None,
        schedule: optax.Schedule | None = None,
        comm_hook: CommHook | None = None,
        callbacks: Sequence[Callback] = (),
        handle_signals: bool = False,
        world: World | None = None,
        mesh: jax.sharding.Mesh | None = None,
        flops_per_row: float = 0.0,
    ):
        self.cfg = config if config is not None else Config()
        if not self.cfg.train.run_dir:
            raise ConfigError("train.run_dir is empty: give the trainer a run directory (config.train.run_dir)")
        self.model, self.loss_fn, self.optimizer, self.schedule = model, loss_fn, optimizer, schedule
        self.data, self.eval_data, self.comm_hook = data, eval_data, comm_hook
        self.callbacks = [*callbacks, *imported(self.cfg.train.callbacks)]  # a named one that fails to load: now
        self.handle_signals, self.world, self.flops_per_row = handle_signals, world, flops_per_row
        self.collate = collate
        self.mesh = mesh  # default: every device of every process (jdp.make_mesh())
        apply_xla_options(self.cfg)

    # -- what a task (lm.py: the GPT on text) specialises ---------------------------------------------------------

    def check(self, mesh: jax.sharding.Mesh) -> Derived:
        """Everything about the config alone that can be wrong, checked before anything is written."""
        derived = validate(self.cfg, mesh.devices.size, jax.process_count())
        for note in sync.get(self.cfg.parallel.sync).notes(self.cfg.parallel, dict(mesh.shape).get("group", 1)):
            log.warning(note)  # (DiLoCo with one group: said, not silently run)
        if given := os.environ.get(CPU_PEAK_ENV):
            cpu_peak_given(given)  # a bad value is refused here, before anything is written
        return dataclasses.replace(derived, tokens_per_step=self.cfg.train.batch_size, unit=self.unit)

    def load_data(self, rows: slice) -> tuple[Source, Source | None]:
        """(training loader, evaluation loader or None) for this process's `rows` of every global batch."""
        t = self.cfg.train
        return (source_for(self.data, rows, t.batch_size, t.seed, self.collate, train=True),
                source_for(self.eval_data, rows, t.batch_size, t.seed, self.collate, train=False))  # fmt: skip

    def make_model(self) -> nnx.Module:
        return self.model() if callable(self.model) and not isinstance(self.model, nnx.Module) else self.model

    def model_factory(self) -> Callable[[], nnx.Module] | None:
        """What makes the model from nothing, when it can be made inside a compiled function (a strategy that
        splits the parameters places each device's rows as they are made); None for a model given made."""
        return self.model if callable(self.model) and not isinstance(self.model, nnx.Module) else None

    def saved_model(self) -> nnx.Module:
        """The model of the run's newest checkpoint, on one device."""
        return load(self.cfg.train.run_dir, self.model_factory() or self.make_model(), cfg=self.cfg)

    def describe_model(self, n_params: int, peak: float, peak_source: str) -> str:
        return f"model {n_params:,} parameters | MFU peak: {peak / 1e12:.3g} TFLOP/s, {peak_source}"

    def flops_per_unit(self) -> float:
        return self.flops_per_row

    def announce(self, resumed_from: int | None) -> None:
        """Lines a task logs after the banner (every process calls it; process 0's are shown)."""

    def prepare(self, run_dir: RunDir, steps: Steps, state, resumed_from: int | None, data) -> None:
        """What a task does with the state it starts from before the first step (every process calls it): the
        preference objectives' reference log-probabilities, computed once (lm.py)."""

    # -- the run ---------------------------------------------------------------------------------------------------

    def fit(self) -> dict:
        """Train to train.steps (or resume there); returns the last metrics and eval_loss, the final state and
        graphdef, and `["model"]`, the trained module, on every path (FitResult). Errors: ConfigError for bad input
        (before any compute), RunError naming the phase otherwise."""
        cfg = self.cfg
        world = self.world
        if world is None:
            try:
                world = resolve_world()
            except WorldError as e:
                raise ConfigError(str(e)) from e
        watch_launcher()  # a worker of `jdp launch` never outlives it
        if not jax.distributed.is_initialized():
            p = cfg.parallel
            publish_host(initialize(world, p.init_timeout_s, p.heartbeat_timeout_s, p.coordinator_bind))
        set_rank(jax.process_index())  # process 0 speaks for the job (jdp.log's RankFilter)
        self.cfg = cfg = same_config(cfg)
        phases, run_dir = Phases(), RunDir(cfg.train.run_dir)
        lock, peers = RunLock(run_dir), PeerMonitor()
        created = run_dir.missing_dirs() if jax.process_index() == 0 else []  # removed again if the run never starts
        # what a Ctrl-C before the loop leaves behind: the lock, the directories it made, and its peers told at once
        # (the command's watch thread ends the process itself, past the `except KeyboardInterrupt` below)
        interrupts = self.startup_interrupts(phases, lambda: (lock.release(), RunDir.remove_if_empty(created),
                                                              announce_departure("was interrupted")))  # fmt: skip
        try:
            with interrupts:
                run_dir.check_contained()
                mesh = self.mesh if self.mesh is not None else parallel.mesh_for(self.cfg.parallel)
                derived = self.check(mesh)  # before the run directory is made: a bad config leaves nothing behind
                if (complete := hold(lock, run_dir, cfg)) is not None:
                    return FitResult(already_complete(run_dir, complete), self.saved_model)
                run = self.setup(world, phases, mesh, derived)
            result = Loop(run).go()
            with phases("writing the summary"):
                values = finish(run, world, derived, result)
            whole = not parallel.opt_layout(cfg.parallel.strategy, mesh).splits_parameters
            state = result.state
            return FitResult(values, lambda: nnx.merge(run.graphdef, state.params, state.rest) if whole
                             else self.saved_model())  # fmt: skip
        except ConfigError as e:
            announce_departure(f"found bad input: {e}")
            raise
        except KeyboardInterrupt as e:
            if (guard := startup_interrupts()) is not None:
                guard.answer()  # this thread unwinds and says it: the watch thread need not
            announce_departure("was interrupted")
            raise e if isinstance(e, Interrupted) else Interrupted(phases.now) from None
        except Exception as e:
            announce_departure(f"failed while {phases.now}: {type(e).__name__}: {e}")
            who = f"process {jax.process_index()} of {jax.process_count()}"
            first = f" (the first to leave the job: {notice})" if (notice := first_departure()) else ""
            raise RunError(f"{who} failed while {phases.now}: {type(e).__name__}: {e}{first}") from e
        finally:
            peers.close()
            lock.release()
            RunDir.remove_if_empty(created)  # e.g. the data or tokenizer was bad: no empty run directory stays

    def startup_interrupts(self, phases: Phases, cleanup: Callable[[], object]):
        """Ctrl-C before the loop (which then takes the signals over): never dropped, answered within seconds even
        while compiling (job/process.py). The `jdp` command installs it at its first line (imports, joining the
        job); here it learns the phases and what to clean up. A library user's signals are left alone unless
        handle_signals asks."""
        if (guard := startup_interrupts()) is not None:
            guard.phase, guard.cleanup = (lambda: phases.now), cleanup
            phases.check = guard.check
            return guard.until_the_loop()
        if not self.handle_signals or threading.current_thread() is not threading.main_thread():
            return contextlib.nullcontext()
        interrupts = StartupInterrupts(lambda: phases.now, cleanup)
        phases.check = interrupts.check
        return interrupts

    def setup(self, world: World, phases: Phases, mesh: jax.sharding.Mesh, derived: Derived) -> Run:
        """Everything before the first step: data, state and steps, the run directory, a checkpoint to resume."""
        cfg, t, is_main = self.cfg, self.cfg.train, jax.process_index() == 0
        cache = "off (train.compile_cache=false)"
        if t.compile_cache:
            cache = use_compilation_cache(cache_root(cfg.data) / "xla") or CACHE_OFF_ACROSS_PROCESSES
        with phases("loading data"):
            data, eval_data = self.load_data(parallel.process_rows(t.batch_size, mesh))
            data_print = data.fingerprint()  # what the data is: each checkpoint keeps it, a resume compares
        factory = self.model_factory() if parallel.opt_layout(cfg.parallel.strategy, mesh).splits_parameters else None
        with phases(self.model_phase):
            model = nnx.eval_shape(factory) if factory is not None else self.make_model()
        with phases("building the model and compiling"):
            steps = build_steps(model, self.loss_fn, self.optimizer, mesh, cfg, self.schedule, self.comm_hook,
                                factory)  # fmt: skip
            n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(steps.state.param_shapes()))
        with phases("looking for checkpoints"):
            run_dir = RunDir(t.run_dir)
            ckpts, resumed_from, state = self.restore(run_dir, steps, data, data_print)
            start = resumed_from or 0
            lost = lost_steps(run_dir.metrics, start) if resumed_from is not None else 0
            missing = missing_records(run_dir, cfg, start) if is_main and resumed_from is not None else []
            if is_main and (moved := supersede(run_dir.metrics, start)):
                log.info(
                    f"{moved} metrics records after step {start} (work lost since that checkpoint) moved to "
                    f"{run_dir.superseded_metrics.name}"
                )
        peak, peak_source = peak_flops(cfg.model.dtype, derived.n_devices)
        for line in banner(cfg, world, derived, self.describe_model(n_params, peak, peak_source), data, run_dir,
                           resumed_from, cache):  # fmt: skip
            log.info(line)
        self.announce(resumed_from)
        self.prepare(run_dir, steps, state, resumed_from, data)
        if is_main:
            save_config(cfg, run_dir.path)
        with phases("opening the metrics log"):  # tensorboardX (and torch, which it imports) take seconds here
            metrics = MetricsLog(run_dir.metrics, enabled=is_main, tensorboard=t.tensorboard,
                                 wandb_project=t.wandb_project, config=cfg.to_dict(), resume_step=resumed_from,
                                 missing_steps=missing)  # fmt: skip
        meter = StepMeter(cfg, derived.tokens_per_step, peak, data.epoch, self.flops_per_unit(), data.stats)
        record = steps.recorder(cfg, data.state, data_print)
        callbacks = [ReplicaCheck(t.check_replicas_every)]
        if eval_data is not None:
            callbacks.append(Evaluate(t.eval_every or t.steps))
        callbacks += [*self.callbacks, Checkpoint(t.ckpt_every)]
        return Run(
            cfg=cfg, mesh=mesh, data=data, eval_data=eval_data, graphdef=steps.graphdef, state=state,
            train_step=steps.train_step, eval_step=steps.eval_step, digest=parallel.make_replica_digest(mesh),
            run_dir=run_dir, ckpts=ckpts, record=record, start=start, resumed_from=resumed_from, lost_steps=lost,
            log=metrics, meter=meter, phases=phases, callbacks=callbacks, unit=self.unit,
            handle_signals=self.handle_signals,
        )  # fmt: skip

    def restore(self, run_dir: RunDir, steps: Steps, data, data_print=None) -> tuple[Checkpoints, int | None, Any]:
        """The run's checkpoints, the step resumed from and the state to start from: the newest checkpoint that
        restores (laid out for today's strategy and devices), or None and the fresh state. `data_print`: what
        the data is (Source.fingerprint); a checkpoint of other data is refused unless data.accept_changes."""
        cfg, t, is_main = self.cfg, self.cfg.train, jax.process_index() == 0
        if not t.resume and is_main and (archived := run_dir.archive()):
            log.info(f"train.resume=false: the previous run's files are now in {archived}")
        multihost_utils.sync_global_devices("jdp: run directory ready")
        ckpts = Checkpoints(run_dir.path, t.ckpt_keep)

        def check(record):
            check_resumable(record, cfg)
            check_base(record, steps.base, cfg)
            check_reference(record, base_fingerprint(steps.state.rest, reference=True), cfg)
            check_param_shapes(record, steps.state.param_shapes())
            moving = steps.conversion(record) is not None
            if moving and parallel.layout_of(saved_layout(record)).flat:
                raise ConfigError(
                    f"the checkpoint at step {record['step']} was saved with parallel.sync="
                    f"{saved_sync(record)} and its optimizer state split flat "
                    f"({parallel.layout_of(saved_layout(record)).describe()}); continue it under parallel.strategy=ddp "
                    f"first (one step), then switch parallel.sync"
                )
            if moving and steps.layout.splits_parameters:
                raise ConfigError(
                    f"the checkpoint at step {record['step']} was saved with parallel.sync="
                    f"{saved_sync(record)}; it continues under parallel.strategy=ddp, "
                    f"zero1 or dp (not yet {cfg.parallel.strategy}, which splits the parameters): resume with one of "
                    f"them, save, then switch"
                )
            check_data(record, data_print, cfg)

        if not t.resume or not (restored := ckpts.restore_latest(steps.state, check, steps.target)):
            return ckpts, None, steps.state
        start, state, record = restored
        if cfg.data.accept_changes and (changes := data_changes(record, data_print)):
            log.warning(
                f"data.accept_changes=true: the data changed since the checkpoint at step {start} ("
                f"{'; '.join(changes)}); training goes on from step {start} in the new data's order, which within "
                f"this epoch may repeat windows trained on or skip others (docs/data.md#changed-data)"
            )
        elif data_print is not None and saved_fingerprint(record) is None:
            log.info(f"the checkpoint at step {start} does not record what its data was (an earlier jdp wrote it): "
                     f"the data is not checked against it")  # fmt: skip
        state = steps.after_restore(state, record)
        if data.position() is not None:  # a loader with a position of its own (streaming) takes it back
            data.load_position(ckpts.position(start))
        if (saved := saved_data_state(record)) is not None:
            if change := data.restore(saved, start):  # a mixture's schedule, reweighted if the weights changed
                log.info(change)
        return ckpts, start, state


@dataclasses.dataclass
class Steps:
    """A model's state laid out for the strategy, its compiled steps, and what its checkpoints hold of them."""

    graphdef: Any
    state: parallel.TrainState
    train_step: Callable
    eval_step: Callable
    optimizer: optax.GradientTransformation
    mesh: jax.sharding.Mesh
    strategy: str
    comm_hook: CommHook | None
    par: Any = None  # the config's parallel section (how the groups sync)

    @property
    def groups(self) -> int | None:
        """How many DiLoCo groups' states the state holds (None: every step agrees)."""
        return self.state.groups()

    @functools.cached_property
    def base(self) -> dict | None:
        """The frozen base's fingerprint (adapters.py), which checkpoints keep in its stead; None: none is frozen."""
        return base_fingerprint(self.state.rest)

    def conversion(self, record: dict):
        """The sync module that moves this checkpoint's state to today's way of syncing; None when it is today's."""
        saved = saved_sync(record)
        today = self.par.sync if self.par is not None else "step"
        if saved_groups(record) == self.groups:
            return None
        return next(m for m in (sync.get(saved).steps(), sync.get(today).steps()) if m is not None)

    @property
    def layout(self) -> parallel.OptLayout:
        return parallel.opt_layout(self.strategy, self.mesh)

    @property
    def comm(self) -> dict | None:
        return parallel.comm_record(self.comm_hook, self.state)

    def target(self, record: dict):
        """What to restore a checkpoint into: its optimizer state may be laid out for another strategy or device
        count; the hook's saved state is read only into the same hook on as many devices (else it starts afresh); a
        checkpoint of another way of syncing (DiLoCo's, or every step's for DiLoCo) as it was saved."""
        if (ways := self.conversion(record)) is not None:
            return ways.restore_like(self.state, self.optimizer, self.mesh, saved_groups(record))
        like = parallel.restore_target(self.state, self.optimizer, self.mesh, self.strategy,
                                       parallel.layout_of(saved_layout(record)))  # fmt: skip
        return like if saved_comm(record) == self.comm else dataclasses.replace(like, comm=None)

    def after_restore(self, state, record: dict):
        """A restored state laid out for today's strategy and way of syncing, saying what moved."""
        if (ways := self.conversion(record)) is not None:
            state, what = ways.converted(state, self.mesh, self.groups is not None, self.par)
            log.info(f"the checkpoint at step {record['step']} was saved with parallel.sync={saved_sync(record)}"
                     f"{f' and {g} groups' if (g := saved_groups(record)) else ''}: {what}")  # fmt: skip
        if (saved := parallel.layout_of(saved_layout(record))) != self.layout:
            if not saved.reads_into(self.layout):  # else it was read straight into today's layout
                state = parallel.relayout(state, self.optimizer, self.mesh, self.strategy)
            log.info(f"optimizer state moved from {saved.describe()} to {self.layout.describe()}")
        if (saved_hook := saved_comm(record)) != self.comm and (saved_hook or self.comm):
            log.info(comm_change(saved_hook, self.comm))
        return state

    def recorder(self, cfg: Config, data_state=None, data_print: dict | None = None) -> Callable[[int], dict]:
        """step -> the checkpoint record; `data_state()`: what the loader keeps besides the step (a mixture's
        schedule, the same on every process), read when the record is made; `data_print`: what the data is."""
        layout, comm = self.layout.to_record(), self.comm
        shapes = [list(x.shape) for x in jax.tree.leaves(self.state.param_shapes())]
        groups, base, reference = self.groups, self.base, base_fingerprint(self.state.rest, reference=True)
        return lambda step: make_record(cfg, step, optimizer_layout=layout, comm=comm, param_shapes=shapes,
                                        data_state=data_state() if data_state else None, fingerprint=data_print,
                                        groups=groups, base=base, reference=reference)  # fmt: skip


def apply_xla_options(cfg: Config) -> None:
    """jdp's XLA options (the gradient buckets' collective flags) and host allocator settings, as `jdp train` sets
    them, if JAX has not started yet; if it has, a warning names the options that could not be applied."""
    p, strategy = cfg.parallel, strategies.get(cfg.parallel.strategy)
    if not jax_private.backends_are_initialized():
        strategy.set_xla_flags(p.bucket_mb)
        keep_scratch_memory()
    elif missing := strategy.set_xla_flags(p.bucket_mb, environ=dict(os.environ)):
        log.warning(
            f"JAX started before the trainer was made, so jdp's XLA options ({' '.join(missing)}) are "
            f"not applied: make the Trainer (or call jdp.job.xla.set_xla_flags()) before anything touches a device"
        )


def build_steps(model, loss_fn, optimizer, mesh, cfg: Config, schedule=None, comm_hook=None, factory=None) -> Steps:
    """parallel.assemble's state and steps, with what the trainer's checkpoints need of them."""
    a = parallel.assemble(model, loss_fn, optimizer, mesh, cfg.parallel, cfg.train.grad_accum, schedule, comm_hook,
                          factory, Remat.of(cfg.model))  # fmt: skip
    return Steps(a.graphdef, a.state, a.train_step, a.eval_step, optimizer, mesh, cfg.parallel.strategy, comm_hook,
                 cfg.parallel)  # fmt: skip


_STAMPED = re.compile(r"runs/.+-\d{8}-\d{6}")  # a run directory load_config named by the time (no train.run_dir)
# What each process may set for itself: how it shows progress, where node 0 listens, its own data workers and cache.
PER_PROCESS = ("train.progress", "parallel.coordinator_bind", "data.num_proc", "data.prefetch", "train.compile_cache",
               "data.cache_dir", "parallel.init_timeout_s", "parallel.heartbeat_timeout_s")


def same_config(cfg: Config) -> Config:
    """The config every process of the job resolved, compared at start-up: processes started by a wrapper that
    gives one of them another value would train apart until the first replica check, unnamed. A ConfigError names
    the keys that differ. train.run_dir named by each process's clock (none given) becomes process 0's."""
    mine = {f"{section}.{key}": value for section, keys in cfg.to_dict().items() for key, value in keys.items()}
    texts = published_by_every_process("config", json.dumps(mine, sort_keys=True, default=str))
    if len(texts) == 1:
        return cfg
    first, differ = json.loads(texts[0] or "{}"), []
    for rank, text in enumerate(texts[1:], 1):
        theirs = json.loads(text or "{}")
        for key in sorted(set(first) | set(theirs)):
            a, b = first.get(key), theirs.get(key)
            stamped = key == "train.run_dir" and all(_STAMPED.fullmatch(str(x)) for x in (a, b))
            if a != b and not stamped and key not in PER_PROCESS:
                differ.append(f"process {rank} has {key}={b}, process 0 {key}={a}")
    if differ:
        more = f" (and {len(differ) - 5} more)" if len(differ) > 5 else ""
        raise ConfigError(f"the processes of this job resolved different configs: {'; '.join(differ[:5])}{more}. "
                          f"Every process must be given the same config file and overrides (look at the command or "
                          f"wrapper that starts each)")  # fmt: skip
    run_dir = first["train.run_dir"]
    return cfg if run_dir == cfg.train.run_dir else dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, run_dir=run_dir))  # fmt: skip


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
                log.warning(f"took over {lock.path} from a job that is gone ({whose})")
            complete = -1 if problem else completed_step(run_dir, cfg)
            if not problem and complete < 0:
                problem = past_the_end(run_dir, cfg)
            if not problem and complete < 0:
                check_writable(run_dir.checkpoints)  # before the data and the compile: the first save would fail
        except (RunDirInUse, ConfigError) as e:
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
    current = json.loads(json.dumps(cfg.to_dict()))  # (local paths compared absolute: config_differences)
    if not isinstance(saved, dict) or config_differences(saved, current):
        return -1
    return steps[-1]


def past_the_end(run_dir: RunDir, cfg: Config) -> str:
    """Why an unfinished run cannot go on with a train.steps below its newest checkpoint ("" when it can): it would
    restore that checkpoint, run no step, and call the run done."""
    steps = run_dir.checkpoint_steps() if cfg.train.resume else []
    if not steps or steps[-1] <= cfg.train.steps:
        return ""
    return (f"the run in {run_dir.path} is already at step {steps[-1]} >= train.steps={cfg.train.steps} (its newest "
            f"checkpoint): raise train.steps above {steps[-1]} to continue it, or set train.resume=false (or another "
            f"train.run_dir) to start over")  # fmt: skip


def already_complete(run_dir: RunDir, step: int) -> dict:
    """What fit() returns for a run with nothing left to do: its summary, untouched on disk."""
    log.info(
        f"run already complete at step {step} ({run_dir.path}); nothing was changed. Raise train.steps to "
        f"train further, or set train.resume=false to start over",
        extra=PLAIN,
    )
    try:
        summary = json.loads(run_dir.summary.read_text())
    except (OSError, ValueError):
        summary = {}
    return {"already_complete": step, "loss": summary.get("loss"), "eval_loss": summary.get("eval_loss"),
            "params_sha256": summary.get("params_sha256")}  # fmt: skip


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
        log.warning(
            f"{run_dir.metrics.name} has no records for steps {steps} ({len(missing)} logged steps up "
            f"to the checkpoint at step {start}; deleted or cut off?). The run goes on; their history is gone from "
            f"metrics.jsonl and `jdp plot` (TensorBoard may still hold them), and summary.json counts them as "
            f"missing_metrics_steps"
        )
    return missing


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


def banner(cfg: Config, world: World, derived, model_line: str, data, run_dir, resumed_from, cache) -> list[str]:
    """The derived numbers, logged once at start: one record per line."""
    par, t = cfg.parallel, cfg.train
    epochs = "" if data.position() is not None else f" | {t.steps} steps = {data.epoch(t.steps):.3f} epochs"
    where = "starting at step 0" if resumed_from is None else f"resuming from the checkpoint at step {resumed_from}"
    hosts = describe_hosts()
    return [
        f"{world.describe()} | {jax.devices()[0].device_kind} x {derived.n_devices}, "
        f"{jax.local_device_count()} local | jax {jax.__version__}" + (f" | {hosts}" if hosts else ""),
        model_line,
        derived.describe(),
        f"parallel.strategy={par.strategy} bucket_mb={par.bucket_mb:g} reduce_dtype={par.reduce_dtype}"
        f"{compression(par)} | "
        f"XLA_FLAGS={shown_xla_flags(jax.devices()[0].platform)!r}",
        *([synced] if (synced := sync.get(par.sync).describe(par)) else []),
        f"data {data.describe()}{epochs}",
        *(f"data | {line}" for line in data.describe_sources()),
        f"run dir {run_dir.path} | {where} | compile cache {cache}",
    ]


def shown_xla_flags(platform: str) -> str:
    """XLA_FLAGS for the banner: on CPUs without the GPU options jdp sets everywhere (unused there), counted."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    if platform != "cpu":
        return " ".join(flags)
    gpu = [f for f in flags if f.startswith("--xla_gpu_")]
    kept = " ".join(f for f in flags if not f.startswith("--xla_gpu_"))
    return kept + (f" (and {len(gpu)} --xla_gpu_* options, unused on CPUs)" if gpu else "")


def compression(par) -> str:
    if par.compression == "none":
        return ""
    feedback = "with" if par.powersgd_error_feedback else "without"
    return (
        f" compression=powersgd (rank {par.powersgd_rank}, {feedback} error feedback, plain all-reduce for the first "
        f"{par.powersgd_warmup} steps)"
    )


def finish(run: Run, world: World, derived: Derived, r: Result) -> dict:
    """summary.json and the closing line; returns the last metrics, with the final state."""
    summary = {
        "steps": r.done,
        "preempted": r.preempted,
        "resumed_from": run.resumed_from,
        "loss": r.last.get("loss"),
        "eval_loss": r.last.get("eval_loss"),
        "skipped_total": r.skipped_total,
        "missing_metrics_steps": len(run.log.missing_steps),  # logged steps whose records metrics.jsonl lost
        "wall_s": time.time() - run.phases.started,
        "world": world.describe(),
        "devices": derived.n_devices,
        "platform": jax.devices()[0].platform,  # what `jdp plan --calibrate` checks the run against
        "device_kind": jax.devices()[0].device_kind,
        "goodput": r.goodput,
        # this process's devices' high-water mark (bytes; null on CPUs), beside `jdp plan`'s per-device prediction
        "peak_memory_bytes": peak_device_bytes(jax.local_devices()),
        "params_sha256": params_sha256(r.state.params, r.state.shapes),
        "params_fingerprint": fingerprint(r.state.params, r.state.shapes),
    }
    if sources := run.data.summary(r.done):  # a mixture: each source's account
        summary["sources"] = sources
    if jax.process_index() == 0:
        run.run_dir.summary.write_text(json.dumps(summary, indent=1))
        if not r.preempted:
            evaluated = f", eval_loss {r.last['eval_loss']:.4f}" if "eval_loss" in r.last else ""
            peak = summary["peak_memory_bytes"]
            held = f", peak device memory {peak / 1e9:.2f} GB" if peak is not None else ""
            log.info(f"done: loss {r.last.get('loss', float('nan')):.4f}{evaluated}{held}")
            for label, n in summary.get("sources", {}).items():
                log.info(
                    f"source {label}: {n['tokens_trained']:,} tokens trained ({n['share_trained']:.1%} of them, "
                    f"weight {n['share']:.1%}), {n['epochs']:.3f} epochs"
                    + (f" of its {n['documents']:,} documents" if "documents" in n else " (this process's)")
                )
    return {
        **r.last,
        "state": r.state,
        "graphdef": run.graphdef,
        "preempted": r.preempted,
        "skipped_total": r.skipped_total,
        "params_sha256": summary["params_sha256"],
    }
