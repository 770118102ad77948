"""All of jdp's parallelism: the `data` mesh, global batches, and the shard_map train and eval steps.

Nothing outside this module mentions devices, meshes, axis names or collectives.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

AXIS = "data"

# loss_fn(model, batch) -> (sum of per-token losses, sum of token weights) on one device's slice.
LossFn = Callable[[nnx.Module, dict[str, jax.Array]], tuple[jax.Array, jax.Array]]
Batch = dict[str, Any]


@dataclass(frozen=True)
class World:
    """How this process joins a job: which coordinator, how many processes, which one it is."""

    coordinator: str | None  # HOST:PORT; None for one process, or when JAX's cluster detection finds it
    num_processes: int
    process_id: int
    source: str  # where the description came from, printed at start
    local_device_ids: tuple[int, ...] | None = None  # this process's GPUs; None: every visible one
    auto_detect: bool = False  # let jax.distributed find the job itself (SLURM, Open MPI)

    def describe(self) -> str:
        if self.num_processes == 1:
            return f"single process ({self.source})"
        where = self.coordinator or "auto-detected by JAX"
        return f"process {self.process_id} of {self.num_processes}, coordinator {where} (from {self.source})"


class WorldError(ValueError):
    """A job description that is incomplete or contradicts itself."""


def _int(source: str, name: str, value) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise WorldError(f"{source}: {name}={value!r} is not an integer") from None


def _checked(source: str, coordinator, n, pid, local_ids=None) -> World:
    missing = [
        k for k, v in (("coordinator", coordinator), ("number of processes", n), ("process id", pid)) if v in (None, "")
    ]
    if missing:
        raise WorldError(f"incomplete multi-process job description from {source}: missing {', '.join(missing)}")
    n, pid = _int(source, "number of processes", n), _int(source, "process id", pid)
    if n < 1 or not 0 <= pid < n:
        raise WorldError(f"{source}: process id {pid} is not in [0, {n}) for {n} processes")
    host, _, port = str(coordinator).rpartition(":")
    if n > 1 and (not host or not port.isdigit()):
        raise WorldError(f"{source}: coordinator {coordinator!r} must be HOST:PORT")
    return World(str(coordinator) if n > 1 else None, n, pid, source, local_ids)


def _slurm_coordinator(env: Mapping[str, str]) -> str:
    """The first host of the step's node list and JAX's port for this job id (as jax's SlurmCluster does)."""
    nodes = env["SLURM_STEP_NODELIST"]
    cut = next((i for i, ch in enumerate(nodes) if ch in ",["), len(nodes))
    host = nodes[:cut]
    if cut < len(nodes) and nodes[cut] == "[":
        rest = nodes[cut + 1 :]
        host += rest[: next((i for i, ch in enumerate(rest) if ch in ",-]"), len(rest))]
    return f"{host}:{int(env['SLURM_JOB_ID']) % 2**12 + (65535 - 2**12 + 1)}"


def resolve_world(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: tuple[int, ...] | None = None,
    env: Mapping[str, str] | None = None,
) -> World:
    """The job this process belongs to, from the first of: explicit options, JAX's variables, torchrun's
    variables, SLURM's, Open MPI's; one process alone when none is there.

    The first three must agree where more than one is given; SLURM and Open MPI are only consulted when none
    is (a launcher running inside a SLURM allocation describes its own workers with JAX's variables).
    """
    env = os.environ if env is None else env
    found: list[World] = []
    if any(v is not None for v in (coordinator, num_processes, process_id)):
        found.append(_checked("explicit options", coordinator, num_processes, process_id, local_device_ids))
    if any(env.get(k) for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")):
        ids = env.get("JDP_LOCAL_DEVICE_IDS")
        local = tuple(_int("JDP_LOCAL_DEVICE_IDS", "id", i) for i in ids.split(",")) if ids else None
        found.append(
            _checked(
                "JAX_* variables",
                env.get("JAX_COORDINATOR_ADDRESS"),
                env.get("JAX_NUM_PROCESSES"),
                env.get("JAX_PROCESS_ID"),
                local,
            )
        )
    if any(env.get(k) for k in ("WORLD_SIZE", "RANK")):
        addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
        n = env.get("WORLD_SIZE")
        coord = f"{addr}:{port}" if addr and port else ("localhost:0" if n == "1" else None)
        # torchrun starts one process per GPU: LOCAL_RANK picks this process's GPU.
        per_node = _int("torchrun", "LOCAL_WORLD_SIZE", env.get("LOCAL_WORLD_SIZE", "1"))
        local = (_int("torchrun", "LOCAL_RANK", env["LOCAL_RANK"]),) if per_node > 1 and env.get("LOCAL_RANK") else None
        found.append(
            _checked(
                "torchrun variables (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK)", coord, n, env.get("RANK"), local
            )
        )
    if found:
        first = found[0]
        for other in found[1:]:
            if (other.num_processes, other.process_id) != (first.num_processes, first.process_id) or (
                other.num_processes > 1 and other.coordinator != first.coordinator
            ):
                raise WorldError(
                    f"contradictory job description: {first.source} say process {first.process_id} of "
                    f"{first.num_processes} at {first.coordinator}, {other.source} say process {other.process_id} "
                    f"of {other.num_processes} at {other.coordinator}; remove one of them"
                )
        return first
    if all(k in env for k in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")):
        n = _int("SLURM", "SLURM_NTASKS", env["SLURM_NTASKS"])
        world = _checked("SLURM variables", _slurm_coordinator(env), n, env["SLURM_PROCID"])
        return dataclasses.replace(world, auto_detect=n > 1)
    if "OMPI_COMM_WORLD_SIZE" in env:
        n, pid = env["OMPI_COMM_WORLD_SIZE"], env.get("OMPI_COMM_WORLD_RANK")
        world = _checked("Open MPI variables", "auto:0", n, pid)
        return dataclasses.replace(world, coordinator=None, auto_detect=world.num_processes > 1)
    return World(None, 1, 0, "no job description found")


def initialize(world: World, init_timeout_s: int = 300, heartbeat_timeout_s: int = 100) -> None:
    """Join the job `world` describes (nothing to do for one process). Call before anything touches devices.

    If the other processes have not all arrived within init_timeout_s, this process exits with a message
    naming the phase and what it waited for, instead of JAX's abort from deep inside its runtime.
    """
    if world.num_processes == 1:
        return
    # CPU collectives across processes need gloo; GPU collectives use NCCL regardless of this setting.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    joined = threading.Event()

    def watchdog() -> None:
        if not joined.wait(init_timeout_s):
            waited_for = (
                f"all {world.num_processes} processes to register with this coordinator"
                if world.process_id == 0
                else f"the coordinator (process 0) at {world.coordinator or 'the auto-detected address'}"
            )
            print(
                f"jdp: error: process {world.process_id} of {world.num_processes} gave up after {init_timeout_s} s "
                f"waiting for {waited_for} (phase: initialization). A process never started, died before "
                f"joining, or cannot reach the coordinator; check the other processes' logs and the address, "
                f"or raise parallel.init_timeout_s.",
                file=sys.stderr,
                flush=True,
            )
            os._exit(3)

    threading.Thread(target=watchdog, daemon=True, name="jdp-init-watchdog").start()
    kwargs = {}
    if not world.auto_detect:
        kwargs = dict(
            coordinator_address=world.coordinator, num_processes=world.num_processes, process_id=world.process_id
        )
    jax.distributed.initialize(
        **kwargs,
        local_device_ids=list(world.local_device_ids) if world.local_device_ids else None,
        initialization_timeout=init_timeout_s + 30,  # our watchdog speaks first
        heartbeat_timeout_seconds=heartbeat_timeout_s,
    )
    joined.set()


def collective_flags(bucket_mb: float) -> dict[str, str]:
    """The XLA options jdp wants for its gradient all-reduces (see set_xla_flags)."""
    threshold = int(bucket_mb * 2**20) if bucket_mb > 0 else 2**40
    return {
        # GPUs: collectives already run asynchronously by default in this XLA; the latency-hiding scheduler
        # moves each bucket's all-reduce-start as early as its gradients exist, so it overlaps the rest of
        # backward, and a dedicated high-priority stream keeps it from queueing behind compute kernels.
        "xla_gpu_enable_latency_hiding_scheduler": "true",
        "xla_gpu_enable_highest_priority_async_stream": "true",
        # XLA merges neighbouring all-reduces up to this size: the bucket size, so it keeps jdp's buckets.
        "xla_gpu_all_reduce_combine_threshold_bytes": str(threshold),
        # CPU: XLA would merge every all-reduce of the step into one; keep the buckets as planned.
        "xla_disable_hlo_passes": "cpu-all-reduce-combiner",
    }


def cpu_speed_flags() -> dict[str, str]:
    """XLA:CPU options measured faster for jdp's steps (README, Performance); only for the versions measured.

    An XLA_FLAGS entry this XLA does not know aborts the process, so experimental flags are version-gated.
    """
    import jaxlib

    if not jaxlib.__version__.startswith("0.10."):
        return {}
    # jaxlib 0.10 hands matrix multiplies to YNNPACK, which ran jdp's tiny step about 8% slower than XLA's own
    # Eigen dots (and materialises the broadcasts it cannot fuse): keep XLA's.
    return {"xla_cpu_experimental_ynn_fusion_type": ""}


def set_xla_flags(bucket_mb: float = 25.0, environ: dict | None = None) -> list[str]:
    """Add jdp's collective (and CPU speed) options to XLA_FLAGS where the user has not set them; returns the ones added.

    XLA reads XLA_FLAGS once, when JAX first touches a device: call this before that (`jdp train` does).
    A flag already in XLA_FLAGS is left exactly as the user set it.
    """
    environ = os.environ if environ is None else environ
    current = environ.get("XLA_FLAGS", "")
    present = set(re.findall(r"--([\w]+)", current))
    wanted = {**collective_flags(bucket_mb), **cpu_speed_flags()}
    added = [f"--{k}={v}" for k, v in wanted.items() if k not in present]
    if added:
        environ["XLA_FLAGS"] = " ".join([current, *added]).strip()
    return added


_GPU_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin")


def keep_scratch_memory(environ: dict | None = None) -> bool:
    """Keep XLA:CPU's per-step scratch memory mapped from one step to the next; True if this changed malloc.

    XLA:CPU allocates a step's temporaries as one block (125 MB for the tiny config at batch 16), from a worker
    thread. glibc serves a block that large from a thread's arena with a fresh mmap and unmaps it when freed,
    so every step page-faults all of it in again: 30,641 faults per step, a fifth of the step time on a 2-core
    VM. One arena (the main heap, which has no size cap), no mmap and no trimming keep the block between steps,
    as PyTorch's caching allocators keep theirs; the price is that freed host memory goes back to the OS only
    at exit. Call it before JAX first touches a device (`jdp train` does). It does nothing where the C library
    is not glibc, where a GPU plugin is installed and JAX_PLATFORMS does not say cpu (temporaries live on the
    GPU there), or where the user set malloc options of their own (MALLOC_*, GLIBC_TUNABLES).
    """
    import ctypes
    import importlib.util
    import platform

    environ = os.environ if environ is None else environ
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    if any(k.startswith("MALLOC_") for k in environ) or "glibc.malloc" in environ.get("GLIBC_TUNABLES", ""):
        return False
    cpu_only = environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu"
    if not cpu_only and any(importlib.util.find_spec(name) for name in _GPU_PLUGINS):
        return False
    mallopt = ctypes.CDLL(None).mallopt
    M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8  # <malloc.h>
    return bool(mallopt(M_ARENA_MAX, 1) & mallopt(M_MMAP_MAX, 0) & mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def make_mesh(devices: list | None = None) -> jax.sharding.Mesh:
    """A 1-D mesh with axis `data` over every device of every process (or the devices given)."""
    devices = jax.devices() if devices is None else list(devices)
    return jax.sharding.Mesh(np.asarray(devices), (AXIS,))


def replicated(mesh: jax.sharding.Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(AXIS))


def process_rows(global_batch: int, mesh: jax.sharding.Mesh) -> slice:
    """The rows of every global batch that this process materialises (its devices' rows, in mesh order)."""
    devices = list(mesh.devices.flat)
    per_device = global_batch // len(devices)
    mine = [i for i, d in enumerate(devices) if d.process_index == jax.process_index()]
    if mine != list(range(mine[0], mine[-1] + 1)):
        raise ValueError("this process's devices are not contiguous in the mesh; build it with make_mesh()")
    return slice(mine[0] * per_device, (mine[-1] + 1) * per_device)


def shard_batch(local: Batch, mesh: jax.sharding.Mesh, global_batch: int | None = None) -> Batch:
    """This process's rows (numpy, leading axis = rows) -> global jax.Arrays sharded along `data`."""
    sharding = batch_sharding(mesh)

    def put(x):
        x = np.asarray(x)
        rows = global_batch if global_batch is not None else x.shape[0] * jax.process_count()
        return jax.make_array_from_process_local_data(sharding, x, (rows, *x.shape[1:]))

    return jax.tree.map(put, local)


@jax.tree_util.register_dataclass
@dataclass
class TrainState:
    """Everything the step updates. Every leaf is replicated: one identical copy per device."""

    step: jax.Array
    params: nnx.State  # the model's nnx.Param variables
    opt_state: optax.OptState
    rest: nnx.State  # any other model variables, carried unchanged


def init_state(model: nnx.Module, optimizer: optax.GradientTransformation, mesh: jax.sharding.Mesh):
    """Split the model once; place parameters and optimizer state, replicated, on every device of the mesh."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params, rest = jax.device_put((params, rest), replicated(mesh))
    opt_state = jax.jit(optimizer.init, out_shardings=replicated(mesh))(params)
    step = jax.device_put(jnp.zeros((), jnp.int32), replicated(mesh))
    return graphdef, TrainState(step, params, opt_state, rest)


def _varying(tree):
    # jax >= 0.10 names it pcast(to="varying"); older releases called it pvary.
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(tree, AXIS, to="varying")
    return jax.lax.pvary(tree, AXIS)


def _local_sums(graphdef, loss_fn: LossFn, grad_accum: int):
    """This device's (grad of loss sum, loss sum, weight sum) over its rows, in grad_accum micro-batches."""

    def loss_of(params, rest, micro):
        return loss_fn(nnx.merge(graphdef, params, rest), micro)

    grad_fn = jax.value_and_grad(loss_of, has_aux=True)

    def sums(params, rest, batch):
        # Differentiate with respect to a per-device ("varying") view of the replicated parameters.
        # Differentiating the replicated value itself would make shard_map's autodiff insert a psum,
        # silently giving the *sum* over devices: the classic N-times-too-large gradient.
        params = _varying(params)
        if grad_accum == 1:
            # No loop: the gradients leave backward one layer at a time, so each bucket's all-reduce can start
            # while earlier layers are still being differentiated.
            (loss, weight), grads = grad_fn(params, rest, batch)
            return grads, loss, weight
        micro = jax.tree.map(lambda x: x.reshape(grad_accum, x.shape[0] // grad_accum, *x.shape[1:]), batch)

        def one(carry, mb):
            (loss, weight), grads = grad_fn(params, rest, mb)
            g_acc, l_acc, w_acc = carry
            return (jax.tree.map(jnp.add, g_acc, grads), l_acc + loss, w_acc + weight), None

        zero = (
            jax.tree.map(jnp.zeros_like, params),
            _varying(jnp.zeros((), jnp.float32)),
            _varying(jnp.zeros((), jnp.float32)),
        )
        # Micro-batches accumulate locally: no collective inside the loop (DDP's no_sync).
        (grads, loss, weight), _ = jax.lax.scan(one, zero, micro)
        return grads, loss, weight

    return sums


# ---- Gradient buckets: DDP's bucket_cap_mb, in the order backward finishes the gradients ----


def gradient_order(loss_of: Callable, params, *args) -> list[int]:
    """Indices of `params`' leaves in the order backward finishes their gradients.

    A parameter's gradient is complete once backward has passed its *first* use in the forward pass, so the
    order is the reverse of first use, read off the traced forward program (for a transformer: the last
    layer first; a tied embedding, used first and last, comes last). Works for any model and loss.
    """
    leaves = jax.tree.leaves(params)
    closed = jax.make_jaxpr(loss_of)(params, *args)
    first: dict[int, tuple] = {}

    def walk(jaxpr, env: dict, where: tuple) -> None:
        for i, eqn in enumerate(jaxpr.eqns):
            for v in eqn.invars:
                try:
                    leaf = env.get(v)
                except TypeError:  # an unhashable literal
                    continue
                if leaf is not None:
                    first.setdefault(leaf, (*where, i))
            for sub in eqn.params.values():  # calls into nested programs (jit, custom_vjp, remat, ...)
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns") and len(inner.invars) == len(eqn.invars):
                    inner_env = {}
                    for outer_v, inner_v in zip(eqn.invars, inner.invars, strict=True):
                        try:
                            if outer_v in env:
                                inner_env[inner_v] = env[outer_v]
                        except TypeError:
                            continue
                    walk(inner, inner_env, (*where, i))

    walk(closed.jaxpr, {v: k for k, v in enumerate(closed.jaxpr.invars[: len(leaves)])}, ())
    # Unused parameters have a zero gradient at once: they go first.
    return sorted(range(len(leaves)), key=lambda k: first.get(k, (math.inf,)), reverse=True)


@dataclass(frozen=True)
class Bucket:
    leaves: tuple[int, ...]  # indices into jax.tree.leaves(params), in backward-completion order
    names: tuple[str, ...]
    elements: int
    nbytes: int  # as communicated, in the reduce dtype


def plan_buckets(params, order: list[int], bucket_mb: float, reduce_dtype: str = "float32") -> list[Bucket]:
    """Group the gradients, in `order`, into buckets of at most bucket_mb MiB (DDP's rule: a gradient
    larger than the cap gets a bucket of its own; bucket_mb=0 puts them all in one)."""
    flat = jax.tree_util.tree_leaves_with_path(params)
    item = jnp.dtype(reduce_dtype).itemsize
    cap = bucket_mb * 2**20 if bucket_mb > 0 else math.inf
    buckets, current = [], []

    def close():
        if current:
            n = sum(math.prod(flat[k][1].shape) for k in current)
            names = tuple(
                jax.tree_util.keystr(flat[k][0], simple=True, separator=".").removesuffix(".value") for k in current
            )
            buckets.append(Bucket(tuple(current), names, n, n * item))
            current.clear()

    size = 0
    for k in order:
        nbytes = math.prod(flat[k][1].shape) * item
        if current and size + nbytes > cap:
            close()
            size = 0
        current.append(k)
        size += nbytes
    close()
    return buckets


def _reduce_buckets(grads, buckets: list[Bucket], reduce_dtype: str):
    """pmean of the gradients over `data`: one all-reduce per bucket, each bucket one flat buffer (as DDP)."""
    leaves, tree = jax.tree.flatten(grads)
    out = list(leaves)
    for bucket in buckets:
        flat = jnp.concatenate([leaves[k].astype(reduce_dtype).ravel() for k in bucket.leaves])
        flat = jax.lax.pmean(flat, AXIS)
        offset = 0
        for k in bucket.leaves:
            size = leaves[k].size
            out[k] = flat[offset : offset + size].reshape(leaves[k].shape).astype(leaves[k].dtype)
            offset += size
    return jax.tree.unflatten(tree, out)


def _spec(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def bucket_plan(
    graphdef, loss_fn: LossFn, params, rest, micro_batch, bucket_mb: float, reduce_dtype: str
) -> list[Bucket]:
    """The gradient buckets of a step: `micro_batch` is one device's micro-batch (arrays or shapes)."""

    def loss_of(params, rest, micro):
        return loss_fn(nnx.merge(graphdef, params, rest), micro)

    order = gradient_order(loss_of, _spec(params), _spec(rest), _spec(micro_batch))
    return plan_buckets(params, order, bucket_mb, reduce_dtype)


def _global_grads(graphdef, loss_fn: LossFn, n_devices: int, grad_accum: int, bucket_mb: float, reduce_dtype: str):
    """Per-device function: (params, rest, local rows) -> (gradient of the global mean loss, loss, weight)."""
    local_sums = _local_sums(graphdef, loss_fn, grad_accum)

    def grads_of(params, rest, batch):
        grads_sum, loss_sum, weight_sum = local_sums(params, rest, batch)
        micro = {k: jax.ShapeDtypeStruct((v.shape[0] // grad_accum, *v.shape[1:]), v.dtype) for k, v in batch.items()}
        buckets = bucket_plan(graphdef, loss_fn, params, rest, micro, bucket_mb, reduce_dtype)
        # Loss and token count travel together in one small all-reduce.
        loss_total, weight = jax.lax.psum(jnp.stack([loss_sum, weight_sum]), AXIS)
        loss = loss_total / weight
        # The gradient all-reduces of the step, one per bucket. Each device holds the gradient of the *sum*
        # of the losses on its own rows; pmean gives sum_over_devices / n, so multiplying by n / (global
        # token weight) yields exactly the gradient of the global token-weighted mean loss, the same as one
        # device computing the whole batch, whatever the device count or the spread of padding.
        scale = jnp.where(weight > 0, n_devices / weight, 0.0)
        grads = jax.tree.map(lambda g: g * scale, _reduce_buckets(grads_sum, buckets, reduce_dtype))
        return grads, loss, weight

    return grads_of


def _update(optimizer, schedule, state: TrainState, grads, loss, weight):
    """The optimizer step on (globally averaged) gradients: new state and metrics. Shared by ddp and dp."""
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    # A non-finite loss or gradient skips the update (as PyTorch's GradScaler does). These values come after
    # the all-reduce, so every replica takes the same decision; the batch still counts as consumed (state.step
    # advances). Known before the update, the choice fuses into it. The new parameters are not checked here:
    # that would cost one more pass over parameters and optimizer state every step (2% of the tiny CPU step);
    # the loop checks them before every checkpoint instead (nonfinite_leaves).
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    params, opt_state = jax.tree.map(
        lambda new, old: jnp.where(ok, new, old), (params, opt_state), (state.params, state.opt_state)
    )
    metrics = {"loss": loss, "grad_norm": grad_norm, "tokens": weight, "skipped": 1 - ok.astype(jnp.int32)}
    if schedule is not None:
        metrics["lr"] = jnp.asarray(schedule(state.step), jnp.float32)
    return TrainState(state.step + 1, params, opt_state, state.rest), metrics


def make_train_step(
    graphdef,
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    mesh: jax.sharding.Mesh,
    grad_accum: int = 1,
    schedule: optax.Schedule | None = None,
    *,
    strategy: str = "ddp",
    bucket_mb: float = 25.0,
    reduce_dtype: str = "float32",
) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]]:
    """The data-parallel step: (state, global batch) -> (new state, metrics), state donated.

    strategy="ddp" (jdp's design): every device computes its gradients, they are averaged by all-reduces
    of about bucket_mb MiB, and every replica applies the identical update. strategy="dp" is PyTorch
    DataParallel's master pattern, kept as the baseline to measure against (see make_dp_train_step).
    """
    if strategy == "dp":
        return make_dp_train_step(graphdef, loss_fn, optimizer, mesh, grad_accum, schedule)
    if strategy != "ddp":
        raise ValueError(f"strategy={strategy!r} must be ddp or dp")
    grads_of = _global_grads(graphdef, loss_fn, mesh.devices.size, grad_accum, bucket_mb, reduce_dtype)

    def step(state: TrainState, batch: Batch):
        grads, loss, weight = grads_of(state.params, state.rest, batch)
        # Every replica applies the identical update to identical parameters: they stay bit-identical.
        return _update(optimizer, schedule, state, grads, loss, weight)

    sharded = jax.shard_map(step, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=(P(), P()))
    return jax.jit(sharded, donate_argnums=0)


def master_device(mesh: jax.sharding.Mesh):
    return mesh.devices.flat[0]


def make_dp_train_step(
    graphdef,
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    mesh: jax.sharding.Mesh,
    grad_accum: int = 1,
    schedule: optax.Schedule | None = None,
):
    """PyTorch DataParallel's design, which jdp exists to avoid, as a measurable baseline.

    Each device computes the gradient of its rows; all of them are gathered onto the master (the mesh's
    first device), which sums them and computes the update alone; the new parameters are then broadcast
    to every device. The optimizer state lives on the master only (place it with for_strategy). One
    process only: DataParallel is single-process.
    """
    local_sums = _local_sums(graphdef, loss_fn, grad_accum)
    master = jax.sharding.SingleDeviceSharding(master_device(mesh))

    def per_device(params, rest, batch):
        grads, loss, weight = local_sums(params, rest, batch)
        return jax.tree.map(lambda x: x[None], (grads, loss, weight))  # stacked along `data`, not reduced

    local = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P(), P(AXIS)), out_specs=P(AXIS)))

    def update(state: TrainState, stacked):
        grads, loss, weight = jax.tree.map(lambda x: jnp.sum(x, axis=0), stacked)  # the master sums them
        scale = jnp.where(weight > 0, 1.0 / weight, 0.0)
        return _update(optimizer, schedule, state, jax.tree.map(lambda g: g * scale, grads), loss / weight, weight)

    update = jax.jit(update, donate_argnums=0)

    def step(state: TrainState, batch: Batch):
        stacked = local(state.params, state.rest, batch)
        gathered = jax.device_put(stacked, master)  # every device's gradients copied to the master
        step_, params, rest = jax.device_put((state.step, state.params, state.rest), master)  # its own replica
        new, metrics = update(TrainState(step_, params, state.opt_state, rest), gathered)
        # Broadcast: the new parameters (and step) go from the master to every device.
        params, step_, rest = jax.device_put((new.params, new.step, new.rest), replicated(mesh))
        return TrainState(step_, params, new.opt_state, rest), metrics

    return step


def for_strategy(state: TrainState, strategy: str, mesh: jax.sharding.Mesh) -> TrainState:
    """dp keeps the optimizer state on the master device only; ddp keeps a replica of everything."""
    if strategy != "dp":
        return state
    return dataclasses.replace(
        state, opt_state=jax.device_put(state.opt_state, jax.sharding.SingleDeviceSharding(master_device(mesh)))
    )


def make_grad_fn(
    graphdef, loss_fn: LossFn, mesh: jax.sharding.Mesh, grad_accum: int = 1, bucket_mb: float = 25.0,
    reduce_dtype: str = "float32",
):  # fmt: skip
    """(state, global batch) -> (averaged gradients, loss, token weight): the train step without the update."""
    grads_of = _global_grads(graphdef, loss_fn, mesh.devices.size, grad_accum, bucket_mb, reduce_dtype)
    sharded = jax.shard_map(
        lambda state, batch: grads_of(state.params, state.rest, batch),
        mesh=mesh,
        in_specs=(P(), P(AXIS)),
        out_specs=(P(), P(), P()),
    )
    return jax.jit(sharded)


def make_eval_step(graphdef, loss_fn: LossFn, mesh: jax.sharding.Mesh):
    """(state, global batch) -> (loss sum, weight sum) over the whole global batch; no update."""

    def step(params, rest, batch: Batch):
        loss, weight = loss_fn(nnx.merge(graphdef, params, rest), batch)
        return jax.lax.psum(loss, AXIS), jax.lax.psum(weight, AXIS)

    jitted = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P(AXIS)), out_specs=(P(), P())))
    return lambda state, batch: jitted(state.params, state.rest, batch)  # the optimizer state is not needed


def make_replica_digest(mesh: jax.sharding.Mesh):
    """state -> one uint32 digest per device of its own copy of the parameters (exact, bit-level)."""

    def digest(params):
        total = jnp.zeros((), jnp.uint32)
        for leaf in jax.tree.leaves(params):
            bits = jax.lax.bitcast_convert_type(leaf.astype(jnp.float32), jnp.uint32).ravel()
            weights = jnp.arange(1, bits.size + 1, dtype=jnp.uint32)  # position matters, not just the multiset
            total = total * jnp.uint32(31) + jnp.sum(bits * weights, dtype=jnp.uint32)
        return total[None]

    # check_vma=False: each device digests its own copy, which is exactly what must be compared.
    return jax.jit(jax.shard_map(digest, mesh=mesh, in_specs=P(), out_specs=P(AXIS), check_vma=False))


def replica_digest_mismatches(digest_fn, params, mesh: jax.sharding.Mesh) -> list[str]:
    """Devices (of every process) whose parameter digest differs from the first device's."""
    from jax.experimental import multihost_utils

    digests = np.asarray(multihost_utils.process_allgather(digest_fn(params), tiled=True))
    devices = list(mesh.devices.flat)
    return [f"{devices[i]} (process {devices[i].process_index})" for i in np.flatnonzero(digests != digests[0])]


@jax.jit
def _finite_leaves(tree) -> list[jax.Array]:
    return [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]


def nonfinite_leaves(tree) -> list[str]:
    """Paths of the leaves that hold a NaN or an Inf, checked on device (only the answers are fetched)."""
    flags = jax.device_get(_finite_leaves(tree))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]
    return [path for path, finite in zip(paths, flags, strict=True) if not finite]


def replica_mismatches(tree) -> list[str]:
    """Leaves whose copies on this process's devices are not bit-identical, named with the device."""
    problems = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        shards = [(s.device, np.asarray(s.data)) for s in leaf.addressable_shards]
        first_dev, first = shards[0]
        for dev, data in shards[1:]:
            if data.tobytes() != first.tobytes():
                problems.append(f"{jax.tree_util.keystr(path)}: {dev} differs from {first_dev}")
    return problems


def compiled_text(step_fn, *args) -> str:
    """The optimized HLO text of a jitted step for these arguments (for inspecting collectives)."""
    return step_fn.lower(*args).compile().as_text()


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4}
_DTYPE_BYTES.update({"f64": 8, "s64": 8, "u64": 8})


@dataclass
class AllReduce:
    name: str
    computation: str  # the HLO computation it sits in
    in_loop: bool  # inside a while-loop body or condition: it would run once per iteration
    shapes: list[str]
    bytes: int


def all_reduces(hlo_text: str) -> list[AllReduce]:
    """Every all-reduce in optimized HLO text, with its bytes and whether it sits inside a loop."""
    loop_comps = set(re.findall(r"(?:body|condition)=%?([\w.\-]+)", hlo_text))
    found, computation = [], ""
    for line in hlo_text.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if header and not line.startswith(" "):
            computation = header.group(1)
            continue
        m = re.match(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) all-reduce(?:-start)?\(", line)
        if m:
            shapes = re.findall(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\]", m.group(2))
            nbytes = sum(_DTYPE_BYTES[t] * math.prod(int(d) for d in dims.split(",") if d) for t, dims in shapes)
            found.append(
                AllReduce(m.group(1), computation, computation in loop_comps, [f"{t}[{d}]" for t, d in shapes], nbytes)
            )
    return found


def _kv():
    """jax.distributed's key-value store (on the coordinator), or None in a single-process run."""
    from jax._src import distributed

    return distributed.global_state.client if jax.process_count() > 1 else None


class StopAgreement:
    """SIGTERM or SIGINT to any process makes every process stop after the same step (then save and exit 0).

    The process that gets the signal proposes "stop after step s + margin" in jax.distributed's key-value
    store; every process reads it before each step. Processes of a data-parallel job are never more than a
    step or two apart (each step's metrics fetch waits for everyone's previous step), so the margin of 3
    leaves every process room to reach the agreed step. A second signal exits at once.
    """

    MARGIN = 3
    KEY = "jdp/stop_after_step"

    def __init__(self):
        self.stop_at: int | None = None
        self.signals = 0
        self._pending: int | None = None
        self._previous = {sig: signal.signal(sig, self._handler) for sig in (signal.SIGTERM, signal.SIGINT)}

    def _handler(self, sig, frame) -> None:
        self.signals += 1
        if self.signals > 1:
            print(f"jdp: second {signal.Signals(sig).name}: exiting now, without saving", file=sys.stderr, flush=True)
            os._exit(128 + sig)
        self._pending = sig

    def should_stop(self, done: int) -> bool:
        """Called before each step with the number of steps done: True once the agreed step is reached."""
        kv = _kv()
        if self._pending is not None and self.stop_at is None:
            proposal = done + (self.MARGIN if kv else 0)
            name = signal.Signals(self._pending).name
            if kv:
                try:
                    kv.key_value_set(self.KEY, str(proposal))
                except Exception:
                    pass  # another process proposed first; its step is the one everybody reads
            print(
                f"jdp: process {jax.process_index()} got {name}: every process will stop at an agreed step and "
                f"save (send it again to exit at once)",
                file=sys.stderr,
                flush=True,
            )
            if not kv:
                self.stop_at = proposal
        if kv and self.stop_at is None:
            try:
                self.stop_at = int(kv.key_value_try_get(self.KEY))
            except Exception:
                pass  # no proposal yet
        return self.stop_at is not None and done >= self.stop_at

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class Watchdog:
    """Exits this process, with a message, when no step finishes for `timeout_s` (a stalled or dead peer).

    Each process records its last finished step in the key-value store, so the message names the
    processes that are behind.
    """

    def __init__(self, timeout_s: float):
        self.timeout_s, self.step, self.last = timeout_s, 0, time.monotonic()
        self.armed = False
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True, name="jdp-watchdog").start()

    def progress(self, step: int) -> None:
        self.step, self.last, self.armed = step, time.monotonic(), True
        kv = _kv()
        if kv:
            kv.key_value_set(f"jdp/progress/{jax.process_index()}", str(step), allow_overwrite=True)

    def pause(self) -> None:
        """Stop watching (long, legitimate waits: evaluation, a checkpoint save); progress() re-arms."""
        self.armed = False

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            if self.armed and time.monotonic() - self.last > self.timeout_s:
                behind = ""
                try:
                    kv = _kv()
                    if kv:
                        steps = {int(k.rsplit("/", 1)[1]): int(v) for k, v in kv.key_value_dir_get("jdp/progress/")}
                        lagging = sorted(
                            p for p in range(jax.process_count()) if steps.get(p, -1) < max(steps.values())
                        )
                        behind = f"; processes behind the others: {lagging or 'none'} (last steps: {steps})"
                except Exception as e:
                    behind = f"; could not reach the coordinator to ask the others ({type(e).__name__})"
                print(
                    f"jdp: error: process {jax.process_index()} of {jax.process_count()}: no step finished for "
                    f"{self.timeout_s:g} s after step {self.step} (train.step_timeout_s){behind}. A peer is "
                    f"stalled or dead; exiting instead of waiting forever.",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(4)

    def close(self) -> None:
        self._stop.set()
