"""Live membership (`train.live=true`): a process that dies costs the step it broke, not a restart.

Every process is one torchft replica group (its local devices run the step). Each step torchft's Lighthouse forms
a quorum of the live processes; the gradient sums are all-reduced over that quorum only, and the update is applied
only when every member's all-reduce succeeded (torchft's `Manager.should_commit`): a member lost mid-step makes the
survivors do that step again, in the same processes, without it. A process that starts (or comes back) joins at a
step boundary and copies the live state (parameters, optimizer state, step) from a peer over torchft's HTTP
transport, never from disk; the others go on while it starts.

The data: global batch s is rows [s*B, (s+1)*B) of jdp's global order (dataset.GlobalOrder) whatever the
membership; the members split it in quorum order. So no row is skipped or repeated when the job shrinks or grows,
and each step's gradient is the uninterrupted run's (up to the order of float32 sums): fewer members mean more rows
each, not a smaller batch (docs/live.md says why).

Why torchft and not JAX's `multihost_utils.live_devices`: on CPU a gloo collective with a dead peer never returns,
so the survivors cannot reach the agreement (docs/live.md has the commands and the output).
"""

from __future__ import annotations

import json
import logging
import os
import socket
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

from jdp.config import Config, ConfigError
from jdp.data.pipeline import Batches, load_data
from jdp.data.tokens import windows
from jdp.log import logger
from jdp.models import make_model
from jdp.models.common import lm_loss
from jdp.optim import make_optimizer
from jdp.parallel import strategies, sync
from jdp.parallel.step import apply_update
from jdp.trainer import RunError

__all__ = ["problems", "train"]

log = logger("jdp.live")


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
    if not (t.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")):
        out.append("train.live=true needs torchft's Lighthouse: start `torchft_lighthouse --min_replicas 2 "
                   "--join_timeout_ms 1000 --bind [::]:29510` and set train.lighthouse=http://HOST:29510")  # fmt: skip
    return out


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
        self.batches: Batches = load_data(cfg.data, cfg.model.vocab_size, t.batch_size, t.seed).train
        graphdef, params, rest = nnx.split(make_model(cfg.model, nnx.Rngs(t.seed)), nnx.Param, ...)
        optimizer, schedule = make_optimizer(cfg.optim, t.steps)
        self.params, self.opt, self.step = params, optimizer.init(params), 0
        self.treedef = jax.tree.structure((self.params, self.opt))
        self.size = sum(x.size for x in jax.tree.leaves(params)) + 2  # the gradient, the loss sum, the weight
        self.healed_at: list[int] = []
        unravel = ravel_pytree(params)[1]

        @jax.jit
        def sums(params, batch):  # this member's gradient sum, loss sum and weight, as one flat vector
            def loss(p):
                return lm_loss(nnx.merge(graphdef, p, rest), batch)

            (loss_sum, weight), grads = jax.value_and_grad(loss, has_aux=True)(params)
            return jnp.concatenate([ravel_pytree(grads)[0], jnp.stack([loss_sum, weight])])

        @jax.jit
        def update(step, params, opt, total):  # total: the members' summed vectors
            weight = total[-1]
            return apply_update(optimizer, schedule, step, params, opt, unravel(total[:-2] / weight),
                                total[-2] / weight, weight)  # fmt: skip

        self.sums, self.update = sums, update

    def rows(self, n: int, rank: int) -> np.ndarray:
        """This member's rows of global batch `step`: the rank-th of n near-equal parts, in global order."""
        return np.array_split(self.batches.order.indices(self.step), n)[rank]

    def contribution(self, idx: np.ndarray) -> np.ndarray:
        return np.asarray(self.sums(self.params, windows(self.batches.stream, idx, self.batches.seq_len)))

    def apply(self, total: np.ndarray) -> dict:
        self.params, self.opt, metrics = self.update(self.step, self.params, self.opt, jnp.asarray(total))
        self.step += 1
        return metrics

    def state_dict(self) -> dict:
        return {"leaves": [np.asarray(x) for x in jax.tree.leaves((self.params, self.opt))], "step": self.step}

    def load_state_dict(self, saved: dict) -> None:
        self.params, self.opt = jax.tree.unflatten(self.treedef, [jnp.asarray(x) for x in saved["leaves"]])
        self.step = int(saved["step"])
        self.healed_at.append(self.step)
        log.info(f"joined at step {self.step}: the state copied from a live peer")

    def flat_params(self) -> np.ndarray:
        return np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(self.params)])


def _manager(tf, member: Member, cfg: Config, host: str, name: str):
    """A torchft Manager for this process (a replica group of one process), and its store (keep it: the store's
    server lives as long as the object)."""
    t = cfg.train
    store = tf.TCPStore(host, 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=t.live_timeout_s)
    return store, tf.Manager(
        pg=tf.Gloo(timeout=timeout), load_state_dict=member.load_state_dict, state_dict=member.state_dict,
        min_replica_size=t.live_min, use_async_quorum=False, timeout=timeout,
        quorum_timeout=timedelta(seconds=max(30.0, 3 * t.live_timeout_s)), store_addr=host, store_port=store.port,
        rank=0, world_size=1, lighthouse_addr=t.lighthouse or None, replica_id=name, hostname=host,
        heartbeat_interval=timedelta(milliseconds=100), checkpoint_transport=tf.Transport(host, timeout),
    )  # fmt: skip


def train(cfg: Config) -> dict:
    """Train as one live member; returns the last step's metrics, the steps this member saw fail and the steps
    it joined at. RUN_DIR/live-HOST_PID.jsonl gets a line per step: loss, members (their PIDs), this member's rows,
    seconds since the previous step (a failed attempt's included)."""
    if found := problems(cfg):
        raise ConfigError("\n".join(found))
    tf, member = _torchft(), Member(cfg)
    host = os.environ.get("JDP_LIVE_ADDR") or socket.gethostname()
    name = f"{host}_{os.getpid()}"
    out = Path(cfg.train.run_dir or "runs/live")
    out.mkdir(parents=True, exist_ok=True)
    (store, manager), last, failed = _manager(tf, member, cfg, host, name), {}, []  # store: kept while it serves
    alone_since = time.time()
    try:
        with (out / f"live-{name}.jsonl").open("a") as f:
            start = time.time()  # of this step's first attempt
            while member.step < member.steps:
                try:
                    manager.start_quorum()  # waits for the quorum; a joiner loads a peer's state here
                except TimeoutError as e:  # cut off (a partition): ask again as a new incarnation, for a while
                    if time.time() - alone_since > cfg.train.step_timeout_s:
                        raise RunError(f"no quorum for train.step_timeout_s={cfg.train.step_timeout_s} s: {e}") from e
                    log.warning(f"no quorum in time ({e}); asking again")
                    manager.shutdown(wait=False)
                    store, manager = _manager(tf, member, cfg, host, name)
                    continue
                alone_since = time.time()
                if (line := _attempt(tf, manager, member)) is None:
                    failed.append(member.step + 1)
                    log.warning(f"step {member.step + 1}: a member was lost; done again by the survivors")
                    continue
                last = {**line, "s": round(time.time() - start, 4)}
                start = time.time()
                f.write(json.dumps(last) + "\n")
                f.flush()
                if member.step % max(cfg.train.log_every, 1) == 0:
                    log.info(f"step {member.step} loss {last['loss']:.4f} members {last['members']}")
    finally:
        manager.shutdown(wait=False)
    np.save(out / f"live-{name}-params.npy", member.flat_params())  # what the tests compare
    return {**last, "failed": failed, "healed_at": member.healed_at, "pid": os.getpid()}


def _attempt(tf, manager, member: Member) -> dict | None:
    """One try at the next step over the quorum: its metrics line, or None when a member failed (nothing applied)."""
    n, rank = manager.num_participants(), manager.participating_rank()
    idx, ids = (member.rows(n, rank) if rank is not None else np.zeros(0, int)), np.zeros(n, np.float32)
    if rank is not None:
        total = member.contribution(idx)
        ids[rank] = os.getpid()  # the members' PIDs ride along in the same all-reduce (exact in float32)
    else:
        total = np.zeros(member.size, np.float32)
    vec = tf.torch.from_numpy(np.concatenate([total, ids]).astype(np.float32))
    manager.allreduce(vec, reduce_op=tf.ReduceOp.SUM).wait()
    if not manager.should_commit():
        return None
    summed = vec.numpy()
    metrics = member.apply(summed[: member.size])
    members = sorted(int(x) for x in summed[member.size :])
    return {"step": member.step, "loss": float(metrics["loss"]), "members": members, "rank": rank,
            "rows": [int(i) for i in idx]}  # fmt: skip
