"""Live membership (`train.live=true`): a process that dies costs the step it broke, not a restart.

Every process is one torchft replica group (its local devices run the step). Each step torchft's Lighthouse forms
a quorum of the live processes (in the background, while each computes its part as the last quorum split the
step); the gradient sums are all-reduced over that quorum only, and the update is applied
only when every member's all-reduce succeeded (torchft's `Manager.should_commit`): a member lost mid-step makes the
survivors do that step again, in the same processes, without it. A process that starts (or comes back) joins at a
step boundary and copies the live state (parameters, optimizer state, step) from a peer over torchft's HTTP
transport, never from disk; the others go on while it starts.

Checkpoints: after each step on `train.ckpt_every`'s cadence (and the last), the quorum's first member writes one in
the trainer's own format (jdp.checkpoint, the ddp layout), so a whole-job restart, live or not, resumes from it as
from any other; a member that starts with checkpoints in its run directory resumes from the newest (its peers' live
state still wins when they are ahead: torchft heals it from them).

The data: global batch s is rows [s*B, (s+1)*B) of jdp's global order (dataset.GlobalOrder) whatever the
membership; the members split it in quorum order. So no row is skipped or repeated when the job shrinks or grows,
and each step's gradient is the uninterrupted run's (up to the order of float32 sums): fewer members mean more rows
each, not a smaller batch (docs/live.md says why).

Why torchft and not JAX's `multihost_utils.live_devices`: on CPU a gloo collective with a dead peer never returns,
so the survivors cannot reach the agreement (docs/live.md has the commands and the output).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import json
import logging
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlsplit

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.flatten_util import ravel_pytree

from jdp import parallel
from jdp.checkpoint import (
    RESUMABLE_CHANGES,
    Checkpoints,
    check_data,
    check_param_shapes,
    check_resumable,
    make_record,
    saved_groups,
    saved_layout,
)
from jdp.config import Config, ConfigError
from jdp.data.corpus import cache_root
from jdp.data.pipeline import Batches, load_data
from jdp.data.tokens import windows
from jdp.job.coordination import Watchdog
from jdp.job.xla import use_compilation_cache
from jdp.log import logger
from jdp.metrics import MetricsLog, params_sha256, supersede
from jdp.models import make_model
from jdp.models.common import lm_loss
from jdp.optim import make_optimizer
from jdp.parallel import strategies, sync
from jdp.parallel.step import apply_update
from jdp.rundir import RunDir
from jdp.trainer import RunError

__all__ = ["problems", "train"]

log = logger("jdp.live")
TORCHFT = "torchft==0.2.0"  # the version the tests ran (CI's oldest stack: .ci/run); jdp[live] asks for torchft>=0.2


def problems(cfg: Config) -> list[str]:
    """What a live run cannot do yet, each with its fix (empty: it can run)."""
    p, d, t = cfg.parallel, cfg.data, cfg.train
    s = strategies.get(p.strategy)
    out = []
    whole = not (s.split_optimizer or s.master or s.groups or s.gathers_parameters)
    if not whole or sync.get(p.sync).steps() is not None or p.compression != "none":
        out.append(f"train.live=true runs whole replicas synced every step, uncompressed (not parallel.strategy="
                   f"{p.strategy} parallel.sync={p.sync} parallel.compression={p.compression}): set "
                   "parallel.strategy=ddp parallel.sync=step parallel.compression=none")  # fmt: skip
    if d.sources or d.streaming or d.format != "text" or d.within_documents:
        out.append("train.live=true reads map-style text with attention across the window (data.format=text, no "
                   "data.sources, data.streaming=false, data.document_attention=across)")  # fmt: skip
    if t.grad_accum != 1:
        out.append("train.live=true takes one micro-batch per step: set train.grad_accum=1")
    if t.init_from or t.callbacks:
        out.append("train.live=true starts from a fresh model and runs no callbacks yet: unset train.init_from and "
                   "train.callbacks")  # fmt: skip
    if t.live_min < 1:
        out.append(f"train.live_min={t.live_min}: a step needs at least one member")
    if importlib.util.find_spec("torchft") is None:  # its Lighthouse too: the next step's advice cannot be taken yet
        out.append(f"train.live=true needs torchft, which this Python ({sys.executable}) does not have: install it "
                   f"first, `{sys.executable} -m pip install '{TORCHFT}' torch` (jdp's extra: 'jdp[live]'), then start "
                   "its Lighthouse, torchft_lighthouse (docs/live.md), and set train.lighthouse=http://HOST:PORT")  # fmt: skip
    elif not (t.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")):
        out.append("train.live=true needs torchft's Lighthouse: start `torchft_lighthouse --min_replicas 2 "
                   "--join_timeout_ms 1000 --bind [::]:29510` and set train.lighthouse=http://HOST:29510")  # fmt: skip
    return out


# Keys members may set each their own way: what a resume may change, less train.steps (the learning-rate schedule's
# length), and the live keys (where the Lighthouse is, the quorum's size and timeout).
PER_MEMBER = (RESUMABLE_CHANGES - {"train.steps"}) | {"train.lighthouse", "train.live_min", "train.live_timeout_s"}


def config_tag(cfg: Config, fingerprint: dict | None) -> int:
    """24 bits of what every member must share (the config less PER_MEMBER's keys, the data's fingerprint): members
    start from their own copy of the seed's initialisation, and each applies the quorum's summed gradient with its
    own optimizer, so two that differ would go apart without a word. Exact in float32, it rides in the all-reduce."""
    shared = {f"{section}.{k}": v for section, values in cfg.to_dict().items() for k, v in values.items()
              if f"{section}.{k}" not in PER_MEMBER}  # fmt: skip
    text = json.dumps([shared, fingerprint], sort_keys=True, default=str)
    return int(hashlib.sha256(text.encode()).hexdigest()[:6], 16) or 1


def _torchft():
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's servers log every quorum at info
    logging.getLogger("torchft.manager").addFilter(lambda r: "flight recorder" not in r.getMessage())  # NCCL's, no GPU
    try:
        import torch
        from torch.distributed import ReduceOp, TCPStore
        from torchft.checkpointing.http_transport import HTTPTransport
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo
    except ImportError as e:
        raise ConfigError(f"train.live=true needs torchft and torch ({e}); pip install 'jdp[live]'") from None

    class Transport(HTTPTransport):  # torchft's own names this machine by its hostname; peers get the address given
        def __init__(self, host: str, timeout: timedelta):
            super().__init__(timeout, num_chunks=0)
            self.host = host

        def metadata(self) -> str:
            url = urlsplit(super().metadata())
            return url._replace(netloc=f"{self.host}:{url.port}").geturl()

    return SimpleNamespace(torch=torch, ReduceOp=ReduceOp, TCPStore=TCPStore, Manager=Manager, Gloo=ProcessGroupGloo,
                           Transport=Transport)  # fmt: skip


class Member:
    """This process's replica: the model, its state, the compiled gradient sums and update, and torchft's view of
    it (`state_dict` / `load_state_dict`: what a joiner copies from a peer)."""

    def __init__(self, cfg: Config):
        t = cfg.train
        self.cfg, self.steps = cfg, t.steps
        self.data = load_data(cfg.data, cfg.model.vocab_size, t.batch_size, t.seed)
        self.batches: Batches = self.data.train
        self.fingerprint = self.data.fingerprint()  # what the data is: each checkpoint keeps it, a resume compares
        self.tag = config_tag(cfg, self.fingerprint)
        graphdef, params, rest = nnx.split(make_model(cfg.model, nnx.Rngs(t.seed)), nnx.Param, ...)
        optimizer, schedule = make_optimizer(cfg.optim, t.steps)
        # this process's devices: the replica whole on each, the member's rows split over them (ddp within a member)
        self.mesh = parallel.make_mesh(jax.local_devices())
        self.params, self.opt = parallel.replicate((params, optimizer.init(params)), self.mesh)
        self.rest, self.step = rest, 0
        self.layout = parallel.opt_layout(cfg.parallel.strategy, self.mesh)
        self.treedef = jax.tree.structure((self.params, self.opt))
        self.size = sum(x.size for x in jax.tree.leaves(params)) + 2  # the gradient, the loss sum, the weight
        self.healed_at: list[int] = []
        unravel = ravel_pytree(params)[1]

        @jax.jit
        def sums(params, batch, ids):  # this member's gradient sum, loss sum and weight, and the quorum's PID slots
            def loss(p):
                return lm_loss(nnx.merge(graphdef, p, rest), batch)

            (loss_sum, weight), grads = jax.value_and_grad(loss, has_aux=True)(params)
            return jnp.concatenate([ravel_pytree(grads)[0], jnp.stack([loss_sum, weight]), ids])

        @functools.partial(jax.jit, donate_argnums=(1, 2))
        def update(step, params, opt, total):  # total: the members' summed vectors
            weight = total[-1]
            return apply_update(optimizer, schedule, step, params, opt, unravel(total[:-2] / weight),
                                total[-2] / weight, weight)  # fmt: skip

        @jax.jit
        def eval_sums(params, batch):  # the loss sum and weight of validation windows
            return lm_loss(nnx.merge(graphdef, params, rest), batch)

        self.sums, self.update, self.eval_sums = sums, update, eval_sums

    def rows(self, n: int, rank: int) -> np.ndarray:
        """This member's rows of global batch `step`: the rank-th of n near-equal parts, in global order."""
        return np.array_split(self.batches.order.indices(self.step), n)[rank]

    def placed(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """Rows split over the member's devices, padded with zero-weight rows to a multiple of them (the sums are
        weighted: padding adds nothing)."""
        pad = -len(batch["weights"]) % self.mesh.devices.size
        padded = {k: np.concatenate([x, np.zeros((pad, *x.shape[1:]), x.dtype)]) for k, x in batch.items()}
        return parallel.shard_batch(padded, self.mesh)

    def evaluate(self) -> tuple[float, float]:
        """The mean loss over every validation window and the tokens it weighs, on this member's replica (every
        member holds the same parameters): what the trainer's evaluation gives."""
        loss_sum = weight = 0.0
        for _, batches in self.data.eval_sets():
            for batch in batches:
                loss_k, weight_k = jax.device_get(self.eval_sums(self.params, self.placed(batch)))
                loss_sum, weight = loss_sum + float(loss_k), weight + float(weight_k)
        return loss_sum / max(weight, 1.0), weight

    def contribution(self, n: int, rank: int) -> np.ndarray:
        """What this member adds to the step's all-reduce as the rank-th of n: its rows' gradient sum, loss sum and
        weight, then n PID slots and n config-tag slots, its PID and tag in its rank's (a host copy the all-reduce
        may write into)."""
        batch = self.placed(windows(self.batches.stream, self.rows(n, rank), self.batches.seq_len))
        return np.array(self.sums(self.params, batch, self.ids(n, rank)))

    def ids(self, n: int, rank: int | None) -> np.ndarray:
        """n PID slots then n config-tag slots, this member's PID and tag in its rank's (none without a rank)."""
        ids = np.zeros(2 * n, np.float32)
        if rank is not None:
            ids[rank], ids[n + rank] = os.getpid(), self.tag  # exact in float32 (both < 2**24)
        return ids

    def apply(self, total: np.ndarray) -> dict:
        total = parallel.replicate(total[: self.size], self.mesh)
        self.params, self.opt, metrics = self.update(self.step, self.params, self.opt, total)
        self.step += 1
        return metrics

    def state_dict(self) -> dict:  # copies: the update donates the arrays, and a joiner may read these while it runs
        return {"leaves": [np.array(x) for x in jax.tree.leaves((self.params, self.opt))], "step": self.step}

    def load_state_dict(self, saved: dict) -> None:
        self.params, self.opt = parallel.replicate(jax.tree.unflatten(self.treedef, saved["leaves"]), self.mesh)
        self.step = int(saved["step"])
        self.healed_at.append(self.step)
        log.info(f"joined at step {self.step}: the state copied from a live peer")

    def train_state(self) -> parallel.TrainState:
        """The state as the trainer's checkpoints hold it (whole copies, as under ddp)."""
        return parallel.TrainState(jnp.asarray(self.step, jnp.int32), self.params, self.opt, self.rest)

    def save(self) -> None:
        """Checkpoint this step into RUN_DIR/checkpoints, in the trainer's format, and wait until it is written (the
        writer changes with the quorum: no save may still be running when another member writes the next)."""
        cfg = self.cfg
        shapes = [list(x.shape) for x in jax.tree.leaves(self.params)]
        record = make_record(cfg, self.step, optimizer_layout=self.layout.to_record(), param_shapes=shapes,
                             fingerprint=self.fingerprint)  # fmt: skip
        ckpts = Checkpoints(cfg.train.run_dir, cfg.train.ckpt_keep)  # its own view of what is there, each time
        try:
            ckpts.save(self.step, self.train_state(), record)
            ckpts.wait()
        finally:
            ckpts.close()

    def resume(self) -> int | None:
        """Take the newest checkpoint of the run directory that restores (a live run's or any whole-copies one's);
        its step, or None when there is none."""
        cfg = self.cfg
        if not cfg.train.resume or not RunDir(cfg.train.run_dir).checkpoints.is_dir():
            return None

        def check(record):
            check_resumable(record, cfg)
            check_param_shapes(record, self.params)
            saved = parallel.layout_of(saved_layout(record))
            if not saved.reads_into(self.layout) or saved_groups(record):
                raise ConfigError(
                    f"the checkpoint at step {record['step']} holds its state split or in DiLoCo's groups "
                    f"({saved.describe()}); a live member reads whole copies: resume it once "
                    f"with `jdp train` under parallel.strategy=ddp parallel.sync=step (one step), then go live"
                )  # fmt: skip
            check_data(record, self.fingerprint, cfg)

        ckpts = Checkpoints(cfg.train.run_dir, cfg.train.ckpt_keep, read_only=True)  # a peer may be writing
        try:
            if (restored := ckpts.restore_latest(self.train_state(), check)) is None:
                return None
        finally:
            ckpts.close()
        step, state, _ = restored
        self.params, self.opt, self.rest, self.step = state.params, state.opt_state, state.rest, int(step)
        return self.step

    def flat_params(self) -> np.ndarray:
        return np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(self.params)])


def quorum_timeout_s(cfg: Config) -> float:
    """How long a member waits for a quorum before asking again as a new incarnation."""
    return max(30.0, 3 * cfg.train.live_timeout_s)


def _manager(tf, member: Member, cfg: Config, host: str, name: str):
    """A torchft Manager for this process (a replica group of one process), and its store (keep it: the store's
    server lives as long as the object)."""
    t = cfg.train
    store = tf.TCPStore(host, 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=t.live_timeout_s)
    manager = tf.Manager(
        pg=tf.Gloo(timeout=timeout), load_state_dict=member.load_state_dict, state_dict=member.state_dict,
        min_replica_size=t.live_min, use_async_quorum=True, init_sync=False, timeout=timeout,
        quorum_timeout=timedelta(seconds=quorum_timeout_s(cfg)), store_addr=host, store_port=store.port,
        rank=0, world_size=1, lighthouse_addr=t.lighthouse or None, replica_id=name, hostname=host,
        heartbeat_interval=timedelta(milliseconds=100), checkpoint_transport=tf.Transport(host, timeout),
    )  # fmt: skip
    _at_member_step(manager, member)
    return store, manager


def _at_member_step(manager, member: Member) -> None:
    """torchft's step counter set to the member's. torchft counts its own steps from 0; a member resumed from a
    checkpoint (or cut off and asking again) is at its own, and one that copied the last step has counted one more
    commit. The quorum copies the state of the member furthest on to the others."""
    manager.load_state_dict({"step": member.step, "batches_committed": member.step * member.cfg.train.batch_size})


def train(cfg: Config) -> dict:
    """Train as one live member; returns the last step's metrics, the steps this member saw fail and the steps
    it joined at (also in RUN_DIR/live-HOST_PID-end.json). RUN_DIR/live-HOST_PID.jsonl gets a line per step it
    committed: loss, members (their PIDs), this member's rows, seconds since the previous step (a failed attempt's
    included)."""
    if found := problems(cfg):
        raise ConfigError("\n".join(found))
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, run_dir=cfg.train.run_dir or "runs/live"))
    if cfg.train.compile_cache:  # a replacement loads the programs its peers compiled, as a restart does
        use_compilation_cache(cache_root(cfg.data) / "xla")
    tf, member = _torchft(), Member(cfg)
    devices = member.mesh.devices.size
    log.info(f"live member: {devices} {jax.devices()[0].platform} device{'s' if devices > 1 else ''} "
             f"(the member's rows of each step split over them)")  # fmt: skip
    if (resumed := member.resume()) is not None:
        log.info(f"resumed from step {resumed} ({cfg.train.run_dir}/checkpoints/{resumed})")
    host = os.environ.get("JDP_LIVE_ADDR") or socket.gethostname()
    name = f"{host}_{os.getpid()}"
    out = Path(cfg.train.run_dir)
    out.mkdir(parents=True, exist_ok=True)
    (store, manager), last = _manager(tf, member, cfg, host, name), {}  # store: kept while it serves
    run = Run(cfg, resumed)
    committed_at, failures = time.time(), 0  # the last step committed; attempts failed in a row since
    guess: tuple[int, int | None] = (1, None)  # the last quorum's (members, this member's rank)
    seen: dict[int, float] = {}  # each member's PID: when a step this member committed last had it
    # A call into torchft that never returns (none should: each has a timeout) ends the process with each thread's
    # stack, after the loop's own check below had its chance: a replacement then joins as for any lost member.
    watchdog = Watchdog(cfg.train.step_timeout_s + 2 * quorum_timeout_s(cfg))
    watchdog.progress(member.step)
    try:
        with (out / f"live-{name}.jsonl").open("a") as f:
            while member.step < member.steps:
                if time.time() - committed_at > cfg.train.step_timeout_s:
                    raise RunError(f"no step committed for train.step_timeout_s={cfg.train.step_timeout_s} s "
                                   f"({failures} attempts failed): no quorum of train.live_min={cfg.train.live_min}")  # fmt: skip
                try:
                    manager.start_quorum()  # asks for the quorum in the background
                    line, guess = _attempt(tf, manager, member, guess)
                except TimeoutError as e:  # cut off (a partition): ask again as a new incarnation
                    log.warning(f"no quorum in time ({e}); asking again")
                    manager.shutdown(wait=False)
                    store, manager = _manager(tf, member, cfg, host, name)
                    continue
                if line is not None:
                    line = {**line, "s": round(time.time() - committed_at, 4)}  # failed attempts included
                    f.write(json.dumps(line) + "\n")
                    f.flush()
                    seen.update(dict.fromkeys(line["members"], time.time()))
                    with watchdog.paused():  # the writer's evaluation and saves: waits of their own
                        run.committed(member, line)
                    last, committed_at, failures = line, time.time(), 0
                    watchdog.progress(member.step)
                    continue
                if member.step >= member.steps:  # it copied the last step's state: the others ended without it
                    _at_member_step(manager, member)  # so it joins _finish's rounds as one of those at the end
                    break
                failures += 1
                run.failed.append(member.step + 1)
                log.warning(f"step {member.step + 1}: a member was lost; done again by the survivors")
                if failures % 3 == 0:  # this member's view of the quorum may be stale (a dead member's store):
                    manager.shutdown(wait=False)  # a new incarnation asks afresh and copies a peer's state
                    store, manager = _manager(tf, member, cfg, host, name)
            if seen:
                recent = max(seen.values()) - cfg.train.live_timeout_s
                _finish(tf, manager, member, {pid for pid, t in seen.items() if t >= recent}, quorum_timeout_s(cfg))
    finally:
        watchdog.close()
        manager.shutdown(wait=False)
        run.close()
    np.save(out / f"live-{name}-params.npy", member.flat_params())  # what the tests compare
    end = {**last, "step": member.step, "failed": run.failed, "healed_at": member.healed_at, "pid": os.getpid()}
    (out / f"live-{name}-end.json").write_text(json.dumps(end))  # its last step, whether committed or copied
    return end


def _finish(tf, manager, member: Member, expected: set[int], timeout_s: float) -> None:
    """Stay in the quorum after the last step until every member of the last steps has it too. A member that fell
    behind near the end (sitting steps out while it evaluated, or slowed) would otherwise find no quorum once the
    others left, and wait train.step_timeout_s to fail; here it copies the last step's state from a peer (as any
    joiner does) and joins these rounds. Each round adds nothing: the all-reduce carries each finished member's PID
    in its rank's slot (a vector of 2n: the PID and config-tag slots, no gradient), and the round's members end once
    every expected PID has been seen (at most timeout_s)."""
    done, deadline = {os.getpid()}, time.time() + timeout_s
    while not expected <= done and time.time() < deadline:
        try:
            manager.start_quorum()
            n = manager.num_participants()
            ids = member.ids(n, manager.participating_rank() if manager.is_participating() else None)  # no gradient
            if manager.allreduce(tf.torch.from_numpy(ids), reduce_op=tf.ReduceOp.SUM).wait() and not manager.errored():
                done |= {int(x) for x in ids[:n]} - {0}
        except Exception as e:  # no quorum (the others have gone), or torchft's error: the run is done either way
            log.info(f"stopped waiting for the others to end ({type(e).__name__}: {e})")
            break
    if missing := sorted(expected - done):
        log.warning(f"ended without members {missing} having the last step (gone, or too far behind to join)")


def _attempt(tf, manager, member: Member, guess: tuple[int, int | None]) -> tuple[dict | None, tuple]:
    """One try at the next step over the quorum: its metrics line, or None when a member failed (nothing applied),
    and this quorum's (members, rank). torchft forms the quorum in the background (start_quorum returns at once):
    meanwhile this member computes its part as the last quorum split the step (`guess`), and computes it again only
    when the quorum changed. A member behind the others has no rank: it adds nothing, copies a peer's state when it
    votes on the commit, and applies the step's update with the others."""
    early = member.contribution(*guess) if guess[1] is not None else None  # while the quorum forms
    n = manager.num_participants()  # waits for the quorum
    if manager.current_step() >= member.steps:  # the others ended the run: their rounds (_finish) hand over its state
        manager.allreduce(tf.torch.from_numpy(member.ids(n, None)), reduce_op=tf.ReduceOp.SUM).wait()
        manager.should_commit()  # applies the state copied from a peer, when the copy succeeded
        return None, guess
    rank = manager.participating_rank() if manager.is_participating() else None
    rows = [int(i) for i in member.rows(n, rank)] if rank is not None else []
    if rank is None:
        total = np.zeros(member.size + 2 * n, np.float32)
    else:
        total = early if (n, rank) == guess else member.contribution(n, rank)
    vec = tf.torch.from_numpy(total)
    summed = manager.allreduce(vec, reduce_op=tf.ReduceOp.SUM).wait()  # False, or errored(): it failed
    by_rank = [int(x) for x in total[member.size : member.size + n]]  # each participant's PID in its rank's slot
    tags = [int(x) for x in total[member.size + n :]]
    if not summed or manager.errored() is not None:
        pass  # what a failed all-reduce leaves is not a sum: no one commits, the step is done again
    elif 0 in by_rank:  # a rank nobody trained: its rows would be lost, so no one commits
        manager.report_error(RuntimeError(f"step {member.step + 1}: ranks {by_rank} of the quorum, one not trained"))
    elif odd := {pid: tag for pid, tag in zip(by_rank, tags, strict=True) if tag != member.tag}:
        manager.report_error(RuntimeError("members with another config"))
        manager.should_commit()  # the others learn it from the same vector, and stop too
        raise ConfigError(
            f"live members with another config or data than this one (PID {os.getpid()}, config tag {member.tag}) "
            f"in the quorum of step {member.step + 1}, PID: tag {odd}. Every member needs the same config and data: "
            f"every key but those a resume may change (train.run_dir, train.log_every, ...) and the live keys"
        )  # fmt: skip
    if not manager.should_commit():
        return None, (n, rank)
    metrics = {k: float(v) for k, v in member.apply(total).items()}
    line = {"step": member.step, **metrics, "members": sorted(by_rank), "by_rank": by_rank, "rank": rank,
            "rows": rows}
    return line, (n, rank)


class Run:
    """What a committed step leaves besides the members' own lines: the quorum's first member (one per step) writes
    its record to metrics.jsonl and the trackers (TensorBoard, W&B: jdp.metrics.MetricsLog) on train.log_every's
    cadence, evaluates on train.eval_every's (and after the last step), writes a checkpoint on train.ckpt_every's
    and, at the last step, summary.json; every member counts non-finite steps in a row against train.max_bad_steps
    (they all see the same ones). A member that stops being the first closes its trackers: one process holds the
    W&B run at a time."""

    def __init__(self, cfg: Config, resumed_from: int | None):
        self.cfg, self.t, self.dir, self.bad_run, self.metrics = cfg, cfg.train, RunDir(cfg.train.run_dir), 0, None
        self.resumed_from, self.started, self.skipped, self.failed = resumed_from, time.time(), 0, []
        self.eval_every = (self.t.eval_every or self.t.steps) if cfg.data.val_tokens > 0 else 0
        self.eval_loss: float | None = None  # this member's last evaluation (the writer's at the last step)

    def writer(self, step: int) -> MetricsLog:
        """This member's MetricsLog, opened when it first writes: records past the step before are a job's before
        this one (work it lost), moved aside as a restart moves them; TensorBoard drops their steps too."""
        if self.metrics is None:
            if moved := supersede(self.dir.metrics, step - 1):
                log.info(f"{moved} metrics records after step {step - 1} (work lost before this job) moved to "
                         f"{self.dir.superseded_metrics.name}")  # fmt: skip
            t = self.t
            self.metrics = MetricsLog(self.dir.metrics, tensorboard=t.tensorboard, wandb_project=t.wandb_project,
                                      config=self.cfg.to_dict(), resume_step=step - 1)  # fmt: skip
        return self.metrics

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None

    def committed(self, member: Member, line: dict) -> None:
        t, step = self.t, line["step"]
        self.bad_run = self.bad_run + 1 if line["skipped"] else 0
        self.skipped += int(line["skipped"])
        if self.bad_run > t.max_bad_steps:
            raise RunError(f"{self.bad_run} non-finite steps in a row (more than train.max_bad_steps="
                           f"{t.max_bad_steps}), the last at step {step}. Lower optim.lr or check the data")  # fmt: skip
        due = step % max(t.log_every, 1) == 0 or step == t.steps
        if due:
            log.info(f"step {step} loss {line['loss']:.4f} members {line['members']}")
        if line["rank"] != 0:
            self.close()  # another member writes now
            return
        metrics = self.writer(step)
        if due:
            record = {k: line[k] for k in ("step", "loss", "grad_norm", "lr", "skipped") if k in line}
            metrics.write({**record, "tokens": step * t.batch_size * member.batches.seq_len, "members": line["members"]})
        if self.eval_every and (step % self.eval_every == 0 or step == t.steps):
            loss, tokens = member.evaluate()
            metrics.write({"step": step, "eval_loss": loss, "eval_tokens": tokens})
            log.info(f"step {step}: eval_loss {loss:.4f} over {tokens:,.0f} tokens")
            self.eval_loss = loss
        if (t.ckpt_every and step % t.ckpt_every == 0) or step == t.steps:
            member.save()
        if step == t.steps:
            self.dir.summary.write_text(json.dumps(self.summary(member, line), indent=1))

    def summary(self, member: Member, line: dict) -> dict:
        """summary.json of a live run: the trainer's keys that mean the same here, and the live ones."""
        return {
            "steps": line["step"], "preempted": False, "resumed_from": self.resumed_from, "loss": line["loss"],
            "eval_loss": self.eval_loss,
            "skipped_total": self.skipped, "wall_s": time.time() - self.started, "live": True,
            "members": line["members"],  # the last step's quorum (PIDs)
            "failed_steps": self.failed,  # the steps the writer saw fail and did again with the survivors
            "healed_at": member.healed_at,  # the steps at which the writer copied a peer's state
            "platform": jax.devices()[0].platform, "device_kind": jax.devices()[0].device_kind,
            "params_sha256": params_sha256(member.params),
        }  # fmt: skip
