"""Checkpoints with orbax: asynchronous and atomic saves, the last k kept, resume past damaged ones."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import re
import shutil
import socket
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx
from jax.experimental import multihost_utils

from jdp import adapters
from jdp.config import Config, ConfigError, absolute_paths
from jdp.log import logger
from jdp.preference import REFERENCE
from jdp.rundir import RunDir

__all__ = [
    "RESUMABLE_CHANGES",
    "ChecksumMismatch",
    "Checkpoints",
    "SaveFailed",
    "abstract",
    "base_fingerprint",
    "check_base",
    "check_reference",
    "check_param_shapes",
    "check_data",
    "check_resumable",
    "checksums",
    "config_differences",
    "data_changes",
    "make_record",
    "saved_comm",
    "saved_data_state",
    "saved_groups",
    "saved_parallel",
    "saved_sync",
    "saved_fingerprint",
    "saved_layout",
    "verify",
]

log = logger("jdp.checkpoint")

# Config keys a resumed run may change: they do not alter what the next step computes. (train.steps re-targets
# the learning-rate schedule's cosine decay, which the user asked for by changing it.)
RESUMABLE_CHANGES = {
    "train.steps", "train.log_every", "train.eval_every", "train.progress", "train.run_dir", "train.ckpt_every",
    "train.ckpt_keep", "train.resume", "train.check_replicas_every", "train.step_timeout_s", "train.max_bad_steps",
    "data.prefetch", "data.num_proc", "data.cache_dir", "train.tensorboard", "train.wandb_project", "train.compile_cache",
    "parallel.init_timeout_s", "parallel.heartbeat_timeout_s", "parallel.coordinator_bind", "train.callbacks",
    "train.eval_tasks", "train.eval_tasks_every", "train.eval_tasks_path", "train.eval_tasks_limit",  # what is measured
    # How gradients travel changes rounding, not the state: a run may resume with another strategy or bucketing,
    # or switch gradient compression on or off (the hook's state starts afresh when it is not the saved one's).
    "parallel.strategy", "parallel.reshard_after_forward", "parallel.accumulate_unsharded", "parallel.shard_size",
    "parallel.bucket_mb", "parallel.reduce_dtype",
    # What backward keeps or computes again changes memory and time, not the results (parallel/remat.py).
    "model.remat", "model.remat_every",
    "parallel.compression",
    "parallel.powersgd_rank", "parallel.powersgd_warmup", "parallel.powersgd_error_feedback",
    "parallel.powersgd_min_ratio", "parallel.powersgd_uncompressed",
    # DiLoCo: when the groups sync next and how their pseudo-gradients travel; the round in progress goes on. A
    # checkpoint of every-step sync continues under DiLoCo and the reverse, and one of G groups with another number of
    # groups (a host lost or added: elastic membership); parallel/sync/diloco.py converts it.
    "parallel.outer_every", "parallel.outer_dtype", "parallel.sync", "parallel.groups",
    # A resumed run starts from its own checkpoint: where its first weights came from no longer matters (a frozen
    # base, which checkpoints leave out, is checked by its fingerprint: check_base).
    "train.init_from", "train.init_adapter",
    # Whether a resume may go on over changed data: it is checked against the data, not the saved config.
    "data.accept_changes",
    # A live run's checkpoint is a whole-copies one (live.py): a whole-job restart may go on live or not.
    "train.live", "train.lighthouse", "train.live_min", "train.live_timeout_s",
}  # fmt: skip


def config_differences(saved: dict, current: dict) -> list[str]:
    """`section.key: saved -> current` for every value that differs and may not change on resume. Local paths are
    compared absolute (config.yaml keeps them so, a checkpoint's record as given: `tok` and `/here/tok` agree)."""
    out, defaults = [], dataclasses.asdict(Config())  # every key's default (to_dict keeps one family's model keys)
    saved, current = absolute_paths(saved), absolute_paths(current)
    for section, values in current.items():
        for key, value in values.items():
            name = f"{section}.{key}"
            # a key added to jdp after the checkpoint was written had its default then
            old = saved.get(section, {}).get(key, defaults.get(section, {}).get(key, "<absent>"))
            if name == "data.sources":  # a mixture's weights may change on resume (mixture.py), not its sources
                old, value = _unweighted(old), _unweighted(value)
            if old != value and name not in RESUMABLE_CHANGES:
                out.append(f"{name}: {old!r} -> {value!r}")
    return out


def _unweighted(sources) -> list:
    return (
        [{k: v for k, v in e.items() if k != "weight"} for e in sources or []]
        if isinstance(sources, (list, tuple))
        else sources
    )


def abstract(tree):
    """Shapes, dtypes and shardings of a pytree of arrays: what orbax restores into (on today's mesh)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


@jax.jit
def _leaf_checksums(tree) -> list[jax.Array]:
    def checksum(x):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):  # a random key (dropout's): its words
            x = jax.random.key_data(x)
        if x.dtype.itemsize >= 4:
            words = jax.lax.bitcast_convert_type(x, jnp.uint32)  # a 64-bit value becomes two words
        elif x.dtype.itemsize == 2:
            words = jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
        else:
            words = x.astype(jnp.uint32)
        words = words.ravel()
        # Each word times an odd weight of its position, modulo 2^32: odd weights are invertible, so changing
        # any one word always changes the sum, and moving a word changes it too.
        weights = jnp.arange(words.size, dtype=jnp.uint32) * jnp.uint32(2) + jnp.uint32(1)
        return jnp.sum(words * weights, dtype=jnp.uint32)

    return [checksum(x) for x in jax.tree.leaves(tree)]


def checksums(tree) -> dict[str, int]:
    """Per leaf, a 32-bit checksum of its exact bytes, computed where the arrays live (only the sums are fetched)."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    groups: dict[frozenset, list[int]] = {}  # one computation per set of devices: dp keeps its optimizer state on
    for i, (_, x) in enumerate(leaves):  # one device and the rest on all (one jit call cannot take both)
        sharding = getattr(x, "sharding", None)
        groups.setdefault(frozenset(sharding.device_set) if sharding is not None else frozenset(), []).append(i)
    sums = [0] * len(leaves)
    for members in groups.values():
        for i, s in zip(members, jax.device_get(_leaf_checksums([leaves[i][1] for i in members])), strict=True):
            sums[i] = s
    return {jax.tree_util.keystr(path): int(s) for (path, _), s in zip(leaves, sums, strict=True)}


class ChecksumMismatch(ValueError):
    """A checkpoint whose arrays are not the ones saved with its record: changed after it was written."""


def verify(state, record: dict) -> None:
    """Raise ChecksumMismatch unless `state` has the checksums saved in `record` (older records have none)."""
    if "checksums" not in record:
        return
    found = checksums(state)
    differ = [path for path, value in record["checksums"].items() if found.get(path) != value]
    if differ or found.keys() != record["checksums"].keys():
        raise ChecksumMismatch(
            f"its arrays changed after it was written: {len(differ)} of {len(found)} leaves differ from the "
            f"checksums saved with it ({', '.join(differ[:3])}{', ...' if len(differ) > 3 else ''})"
        )


class _Refused(Exception):
    """check(record) refused a checkpoint: the search ends with its error."""

    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


def _core(state) -> dict:
    """A TrainState's step, parameters, optimizer and other model state: a checkpoint's "state" item (the
    communication hook's per-device states, when there are any, are its "comm" item). A frozen base (adapters.py)
    is not saved: the run makes it again as it started (train.init_from), and the record's `base` fingerprint says
    which base the adapters belong to."""
    return {k: getattr(state, k) for k in ("step", "params", "opt_state")} | {"rest": _unfrozen(state.rest)}


def _checksummed(state):
    """The state as the record's checksums cover it: without its separately saved parts, the hook's per-device
    states ("comm") and DiLoCo's groups' states ("inner"), each an item of its own with its own checksums, and
    without the frozen base, which is not saved."""
    parts = {k: None for k in ("comm", "inner") if getattr(state, k, None) is not None}
    if adapters.frozen(state.rest):
        parts["rest"] = _unfrozen(state.rest)
    return dataclasses.replace(state, **parts) if parts else state


def _unfrozen(rest):
    """A model's other variables without the frozen base (unchanged when there is none)."""
    return adapters.split_frozen(rest)[1] if adapters.frozen(rest) else rest


def _inner(inner: dict) -> dict:
    """DiLoCo's groups' states as saved: without the frozen base."""
    return {**inner, "rest": _unfrozen(inner["rest"])}


def base_fingerprint(rest, reference: bool = False) -> dict | None:
    """What a frozen base is (adapters.py), for the record of every checkpoint of its adapters (None: nothing is
    frozen): its leaves, elements and a checksum of their bits (each leaf's `checksums`, folded in order).
    reference=True: the same of a preference objective's frozen reference copy (preference.py) instead, which the
    model alone (`load`: generate, export) never holds."""
    flat = [(k, v) for k, v in nnx.to_flat_state(adapters.frozen(rest)) if (k[0] == REFERENCE) == reference]
    if not flat:
        return None
    base = nnx.from_flat_state(flat)
    leaves, total = jax.tree.leaves(base), 0
    for _, value in sorted(checksums(base).items()):
        total = (total * 1_000_003 + value) % (1 << 61)
    return {"leaves": len(leaves), "elements": int(sum(x.size for x in leaves)), "checksum": f"{total:016x}"}


def check_reference(record: dict, reference: dict | None, cfg: Config) -> None:
    """Refuse to go on against another reference model than the one the run trained against (a preference
    objective's frozen copy of the starting weights, made again on resume from train.init_from or the seed)."""
    if record.get("reference") != reference:
        where = f"train.init_from={cfg.train.init_from}" if cfg.train.init_from else f"train.seed={cfg.train.seed}"
        raise ConfigError(
            f"the checkpoint at step {record['step']} trained against another reference model than this run's "
            f"frozen copy of its starting weights ({where}): saved {record.get('reference')}, now {reference}. Start "
            f"from the model the run started from (or a new train.run_dir)"
        )


def check_base(record: dict, base: dict | None, cfg: Config) -> None:
    """Refuse adapters saved for another base than this run's (its fingerprint differs), or a checkpoint whose
    frozen base was or was not there as today's."""
    saved = record.get("base")
    if saved == base:
        return
    where = f"train.init_from={cfg.train.init_from}" if cfg.train.init_from else f"made from train.seed={cfg.train.seed}"
    raise ConfigError(
        f"the adapters in the checkpoint at step {record['step']} were trained on another base model than this "
        f"run's ({where}): saved {saved}, now {base}. Give the base they were trained on (or, to train, a new "
        f"train.run_dir or train.resume=false to start over)"
    )


def _refrozen(restored, like):
    """A restored model's other variables with the frozen base of `like` (the state the run made) put back."""
    return adapters.with_frozen(like, restored) if adapters.frozen(like) else restored


class _ReadOnlyNotice(logging.Filter):
    """Drops orbax's warnings that a manager is read-only (`CheckpointManagerOptions.read_only=True, setting
    ...`, `Given directory is read only=...`): jdp asked for it. Every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(
            ("CheckpointManagerOptions.read_only=True", "Given directory is read only")
        )


@contextlib.contextmanager
def _quiet_read_only_warnings(read_only: bool):
    """Around a read-only manager's construction: only orbax's read-only notices are silenced, nothing else."""
    if not read_only:
        yield
        return
    absl_log, notice = logging.getLogger("absl"), _ReadOnlyNotice()
    absl_log.addFilter(notice)
    try:
        yield
    finally:
        absl_log.removeFilter(notice)


class _RaisedToTheCaller(logging.Filter):
    """Drops ERROR records whose traceback runs through orbax: a failed background save is logged by orbax from
    each thread it passes through (absl), and its sibling writes' errors by asyncio when their tasks are collected,
    but orbax raises it to the next `save` or `wait`, where jdp reports it once (SaveFailed). Every other record
    passes: warnings, notices, and errors without a traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or not record.exc_info:
            return True
        tb = record.exc_info[2]
        while tb is not None:
            if tb.tb_frame.f_code.co_filename.startswith(_ORBAX):
                return False
            tb = tb.tb_next
        return True


_ORBAX = str(Path(ocp.__file__).parent)
_RAISED_TO_THE_CALLER = _RaisedToTheCaller()


class _ClosedLoopCallbacks:
    """sys.unraisablehook that drops "Event loop is closed": when one write of a save fails, orbax ends that save's
    event loop, and tensorstore's callbacks for its other writes, finishing later, find it closed. The save's
    error reaches jdp (SaveFailed); these say nothing more. Every other unraisable error goes to the previous hook."""

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, unraisable) -> None:
        if isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed":
            return
        self.previous(unraisable)


def _quiet_failed_saves() -> None:
    """Leave a failed save to SaveFailed: orbax, asyncio and tensorstore would each print its traceback too."""
    for name in ("absl", "asyncio"):
        logging.getLogger(name).addFilter(_RAISED_TO_THE_CALLER)  # adding the same filter again is a no-op
    if not isinstance(sys.unraisablehook, _ClosedLoopCallbacks):
        sys.unraisablehook = _ClosedLoopCallbacks(sys.unraisablehook)


class SaveFailed(RuntimeError):
    """A checkpoint could not be written: the message names its step, its directory and the space left there."""


def _fix_for(code: int | None, where: Path) -> str:
    """What to do about a write that failed with OS error `code` in `where`."""
    if code in (errno.ENOSPC, errno.EDQUOT):
        return "free some space"
    if code in (errno.EROFS, errno.EACCES, errno.EPERM):
        return f"make {where} writable (or point train.run_dir at a writable directory)"
    return "fix the cause named above"


def check_writable(where: Path, tidy: bool = True) -> None:
    """A file can be made and removed in `where` (each process its own name), or a ConfigError before any compute:
    a read-only or full checkpoints directory would otherwise fail the first save, after the first steps."""
    probe = where / f".jdp-write-check-{socket.gethostname()}-{os.getpid()}"
    # tidy: the directories made for the check removed again (only where no other process may be using them)
    made = [p for p in (where, *where.parents) if not p.exists()] if tidy else []
    try:
        where.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"jdp")
        probe.unlink()
        for p in made:
            p.rmdir()
    except OSError as e:
        raise ConfigError(f"{where}: cannot write there ({e.strerror or e}); checkpoints go there: "
                          f"{_fix_for(e.errno, where)}") from None  # fmt: skip


REPLICA_PARALLEL_MIN_BYTES = 1 << 20


def _small_arrays_from_one_replica() -> None:
    """Orbax saves a replicated array "replica-parallel" by default on CPU and TPU: each replica writes a slice,
    cut by a compiled slice op per array. For an array under REPLICA_PARALLEL_MIN_BYTES a slice costs more than it
    saves: one replica writes it whole (the same bytes on disk; a 123k-parameter model's save took half as long,
    0.6 s instead of 1.2 s, on a 2-core CPU). Larger arrays keep orbax's default. Orbax's handler registry is global:
    this sets its jax.Array handler for the whole process (saves only: restores read the same files either way)."""
    import inspect

    handler = ocp.type_handlers.ArrayHandler
    if getattr(ocp.type_handlers.get_type_handler(jax.Array), "_min_slice_bytes_for_replica_parallel", None):
        return  # set already (the registry logs a warning at every override)
    if "min_slice_bytes_for_replica_parallel" not in inspect.signature(handler.__init__).parameters:
        return  # an orbax without the setting
    absl, notice = logging.getLogger("absl"), _OverrideNotice()  # only that notice: other threads' records pass
    absl.addFilter(notice)
    try:
        ocp.type_handlers.register_type_handler(
            jax.Array, handler(min_slice_bytes_for_replica_parallel=REPLICA_PARALLEL_MIN_BYTES), override=True
        )
    finally:
        absl.removeFilter(notice)


class _OverrideNotice(logging.Filter):
    """Drops orbax's `Type handler registry type ... overriding ...`: jdp's override is the point."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Type handler registry type")


class Checkpoints:
    """The run's checkpoints under RUN_DIR/checkpoints/STEP: train state + a JSON record (step, data, config).

    Saves are asynchronous (training continues while they are written) and atomic (orbax writes into a
    temporary directory and renames it when complete, so a partial save is never seen as a checkpoint).
    An error in a background save is raised, as SaveFailed naming that save's step, by `wait` (at once when
    `ended`: the loop asks after every step) or the next `save`, never swallowed; its partial directory is removed.
    """

    def __init__(self, run_dir: str | Path, keep: int, read_only: bool = False):
        """read_only: only restore (jdp generate): create, clean up and move nothing, since a training run may
        be writing its next checkpoint into this directory right now; damaged ones are skipped, left in place."""
        self.run_dir = RunDir(Path(run_dir).expanduser().absolute())
        self.dir = self.run_dir.checkpoints
        self.read_only = read_only
        self.writing: int | None = None  # the step whose asynchronous save may still be running, or may have failed
        if not read_only:
            _quiet_failed_saves()
            _small_arrays_from_one_replica()
            check_writable(self.dir, tidy=False)  # (orbax makes it anyway; other processes may be probing it)
        with _quiet_read_only_warnings(read_only):  # orbax warns while building the options, not the manager
            if read_only:
                options = ocp.CheckpointManagerOptions(
                    read_only=True, create=False, cleanup_tmp_directories=False, enable_async_checkpointing=False
                )
            else:
                options = ocp.CheckpointManagerOptions(
                    max_to_keep=keep, create=True, cleanup_tmp_directories=True, enable_async_checkpointing=True
                )
            self.manager = ocp.CheckpointManager(self.dir, options=options)

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state, record: dict, position: dict | None = None) -> None:
        """Start writing `state` and `record` (which gains the state's checksums) as checkpoint `step`, and this
        process's stream `position` beside it (data_state/STEP/process_N.json; every process writes its own)."""
        if position is not None:
            where = self.run_dir.data_state(step, jax.process_index())
            where.parent.mkdir(parents=True, exist_ok=True)
            where.write_text(json.dumps(position))
        record = {**record, "checksums": checksums(_checksummed(state))}
        items = {"state": ocp.args.StandardSave(_core(state))}
        if (comm := getattr(state, "comm", None)) is not None:
            record["comm_checksums"] = checksums(comm)
            items["comm"] = ocp.args.StandardSave(comm)
        if (inner := getattr(state, "inner", None)) is not None:
            record["inner_checksums"] = checksums(_inner(inner))
            items["inner"] = ocp.args.StandardSave(_inner(inner))
        self.wait()  # orbax's save waits for the previous one anyway; this names that one's step if it failed
        self.writing = step
        try:
            self.manager.save(step, args=ocp.args.Composite(**items, record=ocp.args.JsonSave(record)), force=True)
        except Exception as e:
            raise self._failed(e) from e

    def position(self, step: int) -> dict:
        """This process's stream position saved beside the checkpoint at `step`; an unreadable one is named."""
        path = self.run_dir.data_state(step, jax.process_index())
        saved = sorted(path.parent.glob("process_*.json"))
        if not path.exists() and saved:  # written by a job of fewer processes (more is refused by load_position)
            raise ConfigError(
                f"the checkpoint at step {step} was saved by a streaming run of {len(saved)} process(es); a stream "
                f"resumes only on as many (this job has {jax.process_count()}), or set train.resume=false to start over"
            )
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"{path}: the stream position saved with the checkpoint at step {step} cannot be read ({e}); a "
                f"streaming run resumes only with it. Move {self.dir / str(step)} aside to resume from the "
                f"checkpoint before it, or set train.resume=false to start over"
            ) from None

    def wait(self) -> None:
        """Block until the save in flight is written; SaveFailed if it could not be (raised once)."""
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            if self.writing is None:  # a save started on the manager itself
                raise
            raise self._failed(e) from e
        self.writing = None

    def ended(self) -> bool:
        """Whether the save in flight is over (or there is none): then `wait` returns at once, or raises its error."""
        # is_saving_in_progress: orbax-checkpoint >= 0.11; without it a failure surfaces at the next save or wait
        in_progress = getattr(self.manager, "is_saving_in_progress", None)
        return self.writing is None or (in_progress is not None and not in_progress())

    def _failed(self, e: Exception) -> SaveFailed:
        """The error of the save of `self.writing`, which is over: its partial directory removed, the space left."""
        step, self.writing = self.writing, None
        for partial in self.dir.glob(f"{step}.orbax-checkpoint-tmp*"):  # each process: its disk may be its own
            shutil.rmtree(partial, ignore_errors=True)
        code = re.search(r"os_error_code='(\d+)'", str(e))  # tensorstore reports the OS error in its message
        errno_ = int(code[1]) if code else getattr(e, "errno", None)
        if code:
            reason = os.strerror(int(code[1]))
        elif isinstance(e, OSError) and e.strerror:
            reason = e.strerror
        else:
            reason = f"{type(e).__name__}: {str(e)[:300]}"
        try:
            free = f"{shutil.disk_usage(self.dir).free:,} bytes free there"
        except OSError:
            free = "free space unknown"
        newest = max((s for s in self.steps() if s < step), default=None)
        before = "no checkpoint was saved before it" if newest is None else f"the newest checkpoint is step {newest}"
        return SaveFailed(
            f"the checkpoint at step {step} could not be written to {self.dir / str(step)}: {reason} ({free}). "
            f"The partial checkpoint was removed and {before}: {_fix_for(errno_, self.dir)} and run the same command "
            f"to resume"
        )

    def restore_latest(self, state_like, check=lambda record: None, target=None) -> tuple[int, object, dict] | None:
        """The newest checkpoint that restores, warning about (and setting aside) newer ones that do not.

        `check(record)` sees each checkpoint's JSON record before its arrays are read; what it raises (a
        refused config change) ends the search. `target(record)`, if given, says what to restore that checkpoint
        into (its optimizer state may be laid out for another strategy); else `state_like`. None when there are
        no checkpoints at all. The communication hook's states are read when the target has them (target.comm) and
        the checkpoint does; otherwise the state keeps `state_like.comm`.
        """
        steps, damaged = self.steps(), []
        for step in reversed(steps):
            try:
                state, record = self._restore(step, state_like, check, target)
            except _Refused as e:
                raise e.error from None
            except Exception as e:  # a truncated, corrupt or altered checkpoint: report it and try the one before
                self._damaged(step, e)
                damaged.append(step)
                continue
            self._set_aside(damaged)
            return step, state, record
        if steps:
            raise ConfigError(
                f"none of the checkpoints in {self.dir} ({steps}) can be restored; refusing to start from scratch "
                f"over them. Move them away (or set train.resume=false) to start a new run"
            )
        return None

    def restore_model(self, step: int | None, params_like, rest_like, base: dict | None = None,
                      cfg: Config | None = None) -> tuple[int, object, object]:  # fmt: skip
        """(step, params, rest): the model alone from the checkpoint at `step` (None: the newest that restores,
        warning past damaged ones), verified against the checksums saved with it. No optimizer state is read, so a
        checkpoint of any strategy or device count loads into `params_like`/`rest_like`'s shapes and placement:
        what `jdp generate` and `jdp export` need."""
        steps = self.steps()
        if step is not None and step not in steps:
            raise ConfigError(f"{self.dir} has no checkpoint at step {step} (it has {steps or 'none'})")
        for s in [step] if step is not None else reversed(steps):
            try:
                model = self._restore_model(s, {"params": params_like, "rest": rest_like}, base, cfg)
            except ConfigError:
                raise
            except Exception as e:
                if step is not None:
                    raise ConfigError(
                        f"checkpoint {self.dir / str(s)} cannot be restored: {type(e).__name__}: {e}"
                    ) from e
                self._damaged(s, e)
                continue
            return s, model["params"], model["rest"]
        raise ConfigError(f"none of the checkpoints {steps} in {self.dir} can be restored (see the warnings)")

    def _restore_model(self, step: int, like: dict, base: dict | None = None, cfg: Config | None = None) -> dict:
        like = abstract(like)
        saved = self.manager.restore(step, args=ocp.args.Composite(record=ocp.args.JsonRestore()))["record"]
        if cfg is not None:  # adapters are read onto the base they were trained on only
            check_base(dict(saved), base, cfg)
        restore_args = ocp.checkpoint_utils.construct_restore_args(like)
        if _pads_rows(dict(saved)):  # fsdp's padded rows: cut to the parameters' own shapes
            check_param_shapes(dict(saved), like["params"])
            restore_args = jax.tree.map(
                lambda a: dataclasses.replace(a, strict=False) if hasattr(a, "strict") else a, restore_args
            )
        part = ocp.args.PyTreeRestore(  # the "state" item's model only, placed as `like` is
            item=like, restore_args=restore_args, partial_restore=True
        )
        restored = self.manager.restore(step, args=ocp.args.Composite(state=part, record=ocp.args.JsonRestore()))
        model, record = restored["state"], dict(restored["record"])
        if "checksums" in record:  # the model's leaves are the state's `.params...` and `.rest...` ones
            found = {"." + k.removeprefix("['").replace("']", "", 1): v for k, v in checksums(model).items()}
            saved = {k: v for k, v in record["checksums"].items() if k.startswith((".params", ".rest"))}
            if differ := sorted(k for k in saved.keys() | found.keys() if saved.get(k) != found.get(k)):
                raise ChecksumMismatch(
                    f"its arrays changed after it was written: {len(differ)} of {len(saved)} model leaves differ "
                    f"from the checksums saved with it ({', '.join(differ[:3])}{', ...' if len(differ) > 3 else ''})"
                )
        return model

    def restore(self, step: int, state_like, target=None) -> tuple[object, dict]:
        """(state, record) of the checkpoint at `step`, verified against its checksums like restore_latest's."""
        if step not in (steps := self.steps()):
            raise ConfigError(f"{self.dir} has no checkpoint at step {step} (it has {steps or 'none'})")
        try:
            return self._restore(step, state_like, target=target)
        except Exception as e:
            raise ConfigError(f"checkpoint {self.dir / str(step)} cannot be restored: {type(e).__name__}: {e}") from e

    def _restore(self, step: int, state_like, check=lambda record: None, target=None) -> tuple[object, dict]:
        record = dict(self.manager.restore(step, args=ocp.args.Composite(record=ocp.args.JsonRestore()))["record"])
        try:
            check(record)
        except Exception as e:
            raise _Refused(e) from e
        like = target(record) if target else state_like
        # A layout that pads the parameters (fsdp) restores from and into any other: the checkpoint's padding rows
        # are cut, or zero rows added, each device reading its own rows. The checksums do not change with that
        # padding (zeros at the end), and the parameters' own shapes were checked against the record (check).
        padded = _pads_rows(record) or getattr(like, "shapes", None) is not None
        items = {"state": ocp.args.StandardRestore(abstract(_core(like)), strict=not padded)}
        read_comm = getattr(like, "comm", None) is not None and "comm_checksums" in record
        if read_comm:
            items["comm"] = ocp.args.StandardRestore(abstract(like.comm))
        if (inner := getattr(like, "inner", None)) is not None:
            if "inner_checksums" not in record:  # the config check refuses a changed parallel.sync before this
                raise ValueError("it holds no groups' states (parallel.sync=diloco's); it was saved with another sync")
            items["inner"] = ocp.args.StandardRestore(abstract(_inner(inner)))
        restored = self.manager.restore(step, args=ocp.args.Composite(**items, record=ocp.args.JsonRestore()))
        state = dataclasses.replace(state_like, **restored["state"])
        if inner is None and getattr(state_like, "inner", None) is not None:  # an every-step checkpoint for DiLoCo:
            state = dataclasses.replace(state, inner=None)  # not today's fresh groups (diloco.converted makes them)
        verify(_checksummed(state), record)
        state = dataclasses.replace(state, rest=_refrozen(state.rest, state_like.rest))
        if read_comm:
            verify(restored["comm"], {"checksums": record["comm_checksums"]})
            state = dataclasses.replace(state, comm=restored["comm"])
        if inner is not None:
            verify(restored["inner"], {"checksums": record["inner_checksums"]})
            groups = restored["inner"]
            if state_like.inner is not None:  # the base each group holds, as the run made it
                groups = {**groups, "rest": _refrozen(groups["rest"], state_like.inner["rest"])}
            state = dataclasses.replace(state, inner=groups)
        return state, record

    def _damaged(self, step: int, e: Exception) -> None:
        log.warning(
            f"checkpoint {self.dir / str(step)} cannot be restored ({type(e).__name__}: {str(e)[:300]}); falling "
            f"back to the previous one"
        )

    def _set_aside(self, steps: list[int]) -> None:
        """Move damaged checkpoints to RUN_DIR/damaged-checkpoints (kept for inspection, out of the way)."""
        if self.read_only:
            return
        if steps and jax.process_index() == 0:
            aside = self.run_dir.damaged_checkpoints
            aside.mkdir(exist_ok=True)
            for step in steps:
                shutil.move(str(self.dir / str(step)), str(aside / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"))
                log.warning(f"moved the damaged checkpoint {step} to {aside}")
        if steps:
            multihost_utils.sync_global_devices("jdp: damaged checkpoints set aside")
            self.manager.reload()

    def close(self) -> None:
        self.manager.close()


def check_param_shapes(record: dict, param_shapes) -> None:
    """Refuse a checkpoint whose parameters' own shapes (recorded since fsdp, whose arrays are padded) are not
    those of the model it is restored into."""
    if "param_shapes" not in record:
        return
    today = [list(x.shape) for x in jax.tree.leaves(param_shapes)]
    if record["param_shapes"] != today:
        differ = [i for i, (a, b) in enumerate(zip(record["param_shapes"], today, strict=False)) if a != b]
        raise ConfigError(
            f"the checkpoint's parameters have other shapes than this model's ({len(record['param_shapes'])} "
            f"leaves saved, {len(today)} here; first difference at leaf {differ[0] if differ else len(today)}): "
            f"it was written by another model. Point train.run_dir elsewhere, or build the model it was trained with"
        )


def _pads_rows(record: dict) -> bool:
    """Whether the checkpoint's parameters are padded along their first axis (its record's optimizer_layout: fsdp's
    and hsdp's rows), so that restoring cuts or adds rows."""
    return bool(saved_layout(record).get("rows", False))


def saved_layout(record: dict) -> dict:
    """What the record keeps of the optimizer state's layout (the strategy's to_record; older records: none)."""
    return record.get("optimizer_layout", {})


def saved_comm(record: dict) -> dict | None:
    """What the record keeps of the communication hook (step.comm_record), or None."""
    return record.get("comm")


def saved_parallel(record: dict) -> dict:
    """The parallel section of the config a checkpoint was saved with (how its groups synced, the outer step)."""
    return record.get("config", {}).get("parallel", {})


def saved_sync(record: dict) -> str:
    """How a checkpoint's groups synced (parallel.sync; older records: every step)."""
    return saved_parallel(record).get("sync", "step")


def saved_groups(record: dict) -> int | None:
    """How many groups' states a DiLoCo checkpoint holds (parallel.sync=diloco); None for any other."""
    return record.get("groups")


def saved_data_state(record: dict) -> dict | None:
    """What the record keeps of the data besides the step (a mixture's schedule: Source.state), or None."""
    return record.get("data", {}).get("state")


def saved_fingerprint(record: dict) -> dict | None:
    """What the record keeps of what the data was (Source.fingerprint), or None (an earlier jdp wrote it)."""
    return record.get("data", {}).get("fingerprint")


def make_record(
    cfg: Config,
    step: int,
    *,
    optimizer_layout: dict,
    comm: dict | None = None,
    param_shapes: list | None = None,
    data_state: dict | None = None,
    fingerprint: dict | None = None,
    groups: int | None = None,
    base: dict | None = None,
    reference: dict | None = None,
) -> dict:
    """A checkpoint's JSON record beside its arrays: what resuming checks and needs besides the train state (the
    config it was trained with, where the data stood, how the optimizer state is laid out, the hook's state)."""
    record = {
        "step": step,
        "config": json.loads(json.dumps(cfg.to_dict())),
        # global batch s is a pure function of (seed, s) and, for a mixture, of its schedule (mixture.py)
        "data": {"seed": cfg.train.seed, "step": step, **({"state": data_state} if data_state is not None else {}),
                 **({"fingerprint": fingerprint} if fingerprint is not None else {})},
        "rng": "model random streams (dropout) derive from the keys in the state, the step and the device or row; "
        "data order from (train.seed, step)",
        "optimizer_layout": optimizer_layout,
        **({"param_shapes": param_shapes} if param_shapes is not None else {}),
    }
    if comm is not None:
        record["comm"] = comm
    if groups is not None:  # parallel.sync=diloco: how many groups' states the checkpoint holds
        record["groups"] = groups
    if base is not None:  # adapters: the frozen base they belong to (not saved: base_fingerprint)
        record["base"] = base
    if reference is not None:  # a preference objective's frozen reference copy (not saved either)
        record["reference"] = reference
    return record


def check_resumable(record: dict, cfg: Config) -> None:
    differences = config_differences(record["config"], json.loads(json.dumps(cfg.to_dict())))
    if differences:
        raise ConfigError(
            "refusing to resume: the config changes what training computes:\n  "
            + "\n  ".join(differences)
            + "\nUse the saved values, or a new train.run_dir (or train.resume=false) to start a new run"
        )


def data_changes(record: dict, fingerprint: dict | None) -> list[str]:
    """What differs between the data a checkpoint was trained on (its record's fingerprint) and today's, one
    line per source that changed; [] when nothing did or either side is not known (an older record, a loader jdp
    cannot digest)."""
    saved = saved_fingerprint(record)
    if saved is None or fingerprint is None:
        return []
    out = []
    for label in [*saved, *(k for k in fingerprint if k not in saved)]:
        old, new = saved.get(label), fingerprint.get(label)
        if old == new:
            continue
        name = f"source {label!r}" if label else "the data"
        if old is None or new is None:
            out.append(f"{name}: {'not in the checkpoint' if old is None else 'gone'}")
            continue
        keys = [*old, *(k for k in new if k not in old)]
        out.append(f"{name}: " + ", ".join(f"{k} {_shown(old.get(k))} -> {_shown(new.get(k))}"
                                         for k in keys if old.get(k) != new.get(k)))  # fmt: skip
    return out


def _shown(value) -> str:
    return f"{value:,}" if isinstance(value, int) else "none" if value is None else str(value)


def check_data(record: dict, fingerprint: dict | None, cfg: Config) -> None:
    """Refuse to resume over data that changed since the checkpoint (data.accept_changes=true goes on)."""
    if cfg.data.accept_changes or not (changes := data_changes(record, fingerprint)):
        return
    what = "data.sources" if cfg.data.sources else f"data.source={cfg.data.source}"
    raise ConfigError(
        f"refusing to resume: the training data ({what}) changed since the checkpoint at step {record['step']}:\n  "
        + "\n  ".join(changes)
        + "\nThe documents held out for validation and the order of windows follow from the data, so going on would "
        f"train on some windows twice and skip others in this epoch, and could validate on documents already "
        f"trained on. Put the data back as it was, start a new run (a new train.run_dir, or train.resume=false), or "
        f"set data.accept_changes=true to go on from step {record['step']} with the new data "
        f"(docs/data.md#changed-data)"
    )


def load(run_dir: str | Path, model, step: int | None = None, *, with_step: bool = False, cfg: Config | None = None):
    """A run's trained model, for inference or a loop of your own (`jdp.load`): `model` (a module of the run's
    architecture, or a function that makes one: only its structure and shapes are used, nothing is computed) with
    the parameters and other variables (BatchNorm's statistics, ...) of the checkpoint at `step` (None: the newest
    that restores, past damaged ones), on one device. Any strategy and any number of devices or processes may have
    written it: only the model is read, no optimizer state, checked against the checksums saved with it.
    `with_step=True` returns (step, model). A run of adapters (adapters.py) saved no base: `model` holds it (or
    makes it, called), and with the run's `cfg` it is checked to be the base the adapters were trained on."""
    run = RunDir(run_dir)
    run.check_contained()
    if not run.checkpoints.is_dir():
        raise ConfigError(f"{run_dir} has no checkpoint yet (no {run.checkpoints}); train it first")
    if callable(model) and not isinstance(model, nnx.Module):
        shapes = nnx.eval_shape(model)
        # A frozen base is not in checkpoints (adapters.py): the model that holds it is made for real
        model = model() if adapters.frozen(nnx.state(shapes)) else shapes
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    base = adapters.frozen(rest)
    if base and any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(base)):
        raise ConfigError("the model's frozen base has shapes, not values: checkpoints of adapters hold no base; give "
                          "the model with its base weights (or a function that makes it)")  # fmt: skip
    one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])  # each process its own (jdp eval under launch)
    params, others = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one),
                                  (params, _unfrozen(rest)))  # fmt: skip
    ckpts = Checkpoints(run.path, keep=1, read_only=True)  # a training run may be writing next to us
    try:
        if not ckpts.steps():
            raise ConfigError(f"{run_dir} has no checkpoint yet ({ckpts.dir} is empty); train it first")
        step, params, others = ckpts.restore_model(step, params, others, base_fingerprint(rest), cfg)
    finally:
        ckpts.close()
    loaded = nnx.merge(graphdef, params, _refrozen(others, jax.device_put(rest, one)))
    return (step, loaded) if with_step else loaded
