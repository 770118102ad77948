"""The memory check: before anything is allocated, the planner's bytes per device (jdp.plan: parameters,
gradients, optimizer state, activations) against what this process's devices have, and what would fit instead.

Shapes only (jax.eval_shape): a model too large for the machine is refused in seconds, where allocating it would
end in the kernel's OOM killer with no word. GPUs: JAX's pool (memory_stats' bytes_limit, less what is in use).
CPUs: a process's simulated devices all live in the host's memory, so it needs its devices' bytes together,
against the host's available memory (MemAvailable, or less where a cgroup limit leaves less).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from jdp import plan
from jdp.config import Config, ConfigError, Derived
from jdp.parallel import strategies
from jdp.parallel.mesh import GROUP
from jdp.parallel.remat import POLICIES

__all__ = [
    "LARGER_FRACTION",
    "Pool",
    "check_memory",
    "device_available_bytes",
    "host_available_bytes",
    "local_pool",
    "peak_device_bytes",
    "refusal",
    "suggestions",
]

LARGER_FRACTION = 0.95  # what a user may give JAX instead of its default 75% of a GPU, leaving CUDA the rest


def host_available_bytes(proc: Path = Path("/proc"), cgroups: Path = Path("/sys/fs/cgroup")) -> int | None:
    """What this process can still take from the host: MemAvailable, or less where its cgroup (v2 or v1, or a
    parent group) has a limit closer to its usage; None where /proc/meminfo cannot be read (not Linux)."""
    try:
        available = _kilobytes(proc / "meminfo", "MemAvailable:")
    except (OSError, StopIteration, IndexError, ValueError):
        return None
    for group, v2 in _cgroups(proc, cgroups):
        while True:  # the group and every parent: the tightest limit binds
            if (free := _cgroup_free(group, v2)) is not None:
                available = min(available, free)
            if group in (cgroups, cgroups / "memory") or group == group.parent:
                break
            group = group.parent
    return available


def _cgroup_free(group: Path, v2: bool) -> int | None:
    """A cgroup's limit less its usage; None where it has no limit (or none readable)."""
    limit_file, usage_file, cache = ("memory.max", "memory.current", "inactive_file") if v2 else (
        "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")  # fmt: skip
    try:
        limit = (group / limit_file).read_text().strip()
        usage = int((group / usage_file).read_text())
        if limit == "max" or int(limit) >= 2**60:  # v1 writes "no limit" as a huge number
            return None
    except (OSError, ValueError):
        return None
    try:  # usage counts the page cache, whose inactive part is dropped before the OOM killer comes
        stat = dict(line.split()[:2] for line in (group / "memory.stat").read_text().splitlines())
        usage -= int(stat.get(cache, 0))
    except (OSError, ValueError):
        pass
    return max(int(limit) - usage, 0)


def _kilobytes(meminfo: Path, key: str) -> int:
    """One /proc/meminfo field, in bytes."""
    line = next(line for line in meminfo.read_text().splitlines() if line.startswith(key))
    return int(line.split()[1]) * 1024


def _cgroups(proc: Path, cgroups: Path) -> list[tuple[Path, bool]]:
    """This process's memory cgroup directories, v2 ("0::/path": True) and v1 ("N:memory:/path": False)."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            out.append((cgroups / path.lstrip("/"), True))
        elif "memory" in controllers.split(","):
            out.append((cgroups / "memory" / path.lstrip("/"), False))
    return out


def device_available_bytes(devices, scale: float = 1.0) -> int | None:
    """What the fullest of `devices` can still allocate in JAX's pool (were the pool `scale` times its size);
    None where the runtime does not say (CPUs)."""
    free = []
    for d in devices:
        stats = d.memory_stats() if hasattr(d, "memory_stats") else None
        if not stats or "bytes_limit" not in stats:
            return None
        free.append(int(stats["bytes_limit"] * scale) - stats.get("bytes_in_use", 0))
    return min(free) if free else None


def peak_device_bytes(devices) -> int | None:
    """The most any of `devices` has held at once since the process started (memory_stats' peak_bytes_in_use): what
    a run really needed, beside `jdp plan`'s prediction; None where the runtime does not say (CPUs)."""
    peaks = []
    for d in devices:
        stats = d.memory_stats() if hasattr(d, "memory_stats") else None
        if not stats or "peak_bytes_in_use" not in stats:
            return None
        peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None


@dataclass(frozen=True)
class Pool:
    """One memory this process's devices draw from: one GPU's (each has its own), or the host's (CPUs share it)."""

    devices: int  # this process's
    shared: bool  # True on CPUs: every one of them draws from the host's memory
    available: int  # bytes
    source: str  # where `available` came from
    larger: int | None = None  # a GPU's pool with XLA_PYTHON_CLIENT_MEM_FRACTION=.95, where JAX got its default

    def need(self, m: plan.Memory) -> int:
        """What the pool must hold for devices holding `m` each, or, where the others hold less (`m.others`: dp's
        master holds more), one holding `m` and the rest `m.others`."""
        if not self.shared:
            return m.total
        return m.total + (self.devices - 1) * (m.others or m).total

    def amount(self, nbytes: int) -> str:
        return (
            f"{_gb(nbytes)} for this process's {self.devices} devices" if self.shared else f"{_gb(nbytes)} per device"
        )


def local_pool(devices: list) -> Pool | None:
    """The pool of this process's devices, or None where the runtime cannot say what it holds."""
    if devices[0].platform == "cpu":
        available = host_available_bytes()
        source = "available on the host (MemAvailable, within any cgroup limit), which CPU devices share"
        return None if available is None else Pool(len(devices), True, available, source)
    available = device_available_bytes(devices)
    if available is None:
        return None
    source = f"free in JAX's pool on one {devices[0].device_kind} (memory_stats' bytes_limit)"
    default = "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ  # then JAX took 75% of the GPU
    larger = device_available_bytes(devices, LARGER_FRACTION / plan.JAX_MEMORY_FRACTION) if default else None
    return Pool(len(devices), False, available, source, larger)


def check_memory(cfg: Config, derived: Derived, mesh: jax.sharding.Mesh, pool: Pool | None = None) -> None:
    """Raise ConfigError when the plan says this process's devices cannot hold the run (unless
    train.memory_check=false); every process checks its own, and all refuse if one does. `pool`: what the
    devices have (default: measured)."""
    if not cfg.train.memory_check:
        return
    if GROUP in mesh.axis_names and not cfg.parallel.groups:  # DiLoCo's group per host: the mesh knows how many
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, groups=int(mesh.shape[GROUP])))
    mine = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    pool = pool or local_pool(mine)
    problem = refusal(cfg, derived, pool, mine[0].platform) if pool else None
    if jax.process_count() > 1:  # every process learns whether any refuses: none goes on to wait for the others
        refused = np.asarray(multihost_utils.process_allgather(np.int32(problem is not None))).ravel()
        if refused.any() and problem is None:
            others = ", ".join(str(i) for i in np.flatnonzero(refused))
            problem = f"process(es) {others} cannot hold this run in memory (their errors give the numbers)"
    if problem:
        raise ConfigError(problem)


def refusal(cfg: Config, derived: Derived, pool: Pool, platform: str) -> str | None:
    """The message refusing the run on `pool`, with what would fit; None when it fits."""
    strategy, fused = cfg.parallel.strategy, plan.fused_attention(cfg, platform)
    frees = plan.recomputes_activations(platform)
    state = plan.abstract_state(cfg)
    m = plan.device_memory(cfg, derived.n_devices, derived.micro_batch, fused, state=state, frees=frees)
    need = pool.need(m)
    if need <= pool.available:
        return None
    parts = [("parameters", m.params), ("gradients", m.grads), ("gradient accumulator", m.accumulator),
             ("optimizer state", m.opt_state), ("activations", m.activations)]  # fmt: skip
    if m.late_grads:  # made as backward frees the activations: they count against them
        parts[1] = ("gradients", 0)
        if m.end_of_backward > m.activations:
            parts[-1] = ("the gradients and those being reduced (more than the activations)", m.end_of_backward)
    elif m.in_flight > m.activations:  # the end of backward is the step's peak
        parts[-1] = ("a gradient bucket being reduced (more than the activations)", m.in_flight)
    held = ", ".join(f"{name} {_gb(nbytes)}" for name, nbytes in parts if nbytes)
    together = f", {pool.amount(need)}," if pool.shared and pool.devices > 1 else ""
    who = f"{strategy}'s master device" if strategies.get(strategy).master else "each device"
    lines = [
        f"this run does not fit in memory: {who} needs "
        f"{_gb(m.total)} ({held}; the activations are an estimate for a micro-batch of {derived.micro_batch} x "
        f"{cfg.data.seq_len} tokens; `jdp plan` shows the same numbers){together} and {_gb(pool.available)} is "
        f"{pool.source}. Nothing was allocated."
    ]
    if fits := suggestions(cfg, derived, pool, m, fused, state, frees):
        lines += ["What would fit:", *(f"  {s}" for s in fits)]
    else:
        state_only = pool.need(m.with_activations(0))
        lines.append(
            f"No smaller batch, train.grad_accum or parallel.strategy fits: the parameters, gradients and optimizer "
            f"state alone need {pool.amount(state_only)}; train a smaller model (model.d_model, model.n_layers)"
        )
    lines.append("train.memory_check=false starts anyway.")
    return "\n  ".join(lines)


def suggestions(
    cfg: Config, derived: Derived, pool: Pool, m: plan.Memory, fused: bool, state: tuple, frees: bool = True
) -> list[str]:
    """Each change the plan says would fit a run that holds `m` per device, with its bytes: more of JAX's share of
    a GPU, another strategy (zero1's slice of the optimizer state; ddp for dp), the least recomputation, the largest
    global batch, the fewest micro-batches; these with zero1 when none fits alone. frees: whether recomputation
    frees memory here (plan.recomputes_activations): where it does not, none is suggested."""
    n, p = derived.n_devices, cfg.parallel
    out = []
    if pool.larger is not None and pool.need(m) <= pool.larger:
        out.append(
            f"XLA_PYTHON_CLIENT_MEM_FRACTION={LARGER_FRACTION} in the environment (JAX takes "
            f"{plan.JAX_MEMORY_FRACTION:.0%} of a GPU by default): {_gb(pool.larger)} free per device"
        )
    others = strategies.get(p.strategy).instead if n > 1 else ()
    for other in others:
        alt = plan.device_memory(cfg, n, derived.micro_batch, fused, other, state, frees=frees)
        if (need := pool.need(alt)) <= pool.available:
            hooks = strategies.get(other).comm_hooks
            compression = " parallel.compression=none" if not hooks and p.compression != "none" else ""
            why = strategies.get(other).saves.format(n=n, opt=_gb(alt.opt_state))
            out.append(f"parallel.strategy={other}{compression} ({why}): {pool.amount(need)}")
    policies = tuple(POLICIES)  # from the least recomputation to the most
    stronger = policies[policies.index(cfg.model.remat) + 1 :] if frees else ()
    for policy in stronger:  # the least recomputation that fits (model.remat: parallel/remat.py)
        c = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, remat=policy, remat_every=1))
        if (
            need := pool.need(plan.device_memory(c, n, derived.micro_batch, fused, state=state, frees=frees))
        ) <= pool.available:
            out.append(f"model.remat={policy} ({plan.REMAT_NOTES[policy]} in backward): {pool.amount(need)}")
            break
    out += _batch_changes(cfg, derived, pool, fused, state, p.strategy, "", frees)
    if not out:  # none fits alone: a smaller batch with the optimizer state split, and recomputing every block
        full = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, remat="full", remat_every=1))
        for c, remat in ((cfg, ""), *(((full, "model.remat=full "),) if stronger else ())):
            for other in (o for o in others if strategies.get(o).split_optimizer):
                out += _batch_changes(
                    c, derived, pool, fused, state, other, f"{remat}parallel.strategy={other} ", frees
                )
            if out:
                break
    return out


def _batch_changes(
    cfg: Config, derived: Derived, pool: Pool, fused: bool, state: tuple, strategy: str, prefix: str, frees: bool
) -> list[str]:
    """The largest train.batch_size, and the fewest train.grad_accum micro-batches at today's batch, that fit
    under `strategy`."""
    n, t = derived.n_devices, cfg.train
    held: dict[int, plan.Memory] = {}  # per train.grad_accum: the state's bytes, as the strategy counts them

    def need(micro: int, accum: int) -> int:
        if accum not in held:
            held[accum] = plan.held_bytes(cfg, strategy, n, state, accum, frees)
        return pool.need(held[accum].with_activations(plan.activation_bytes(cfg, micro, fused, strategy, frees)))

    out = []
    # Activations grow with the micro-batch: the largest that fits, by bisection (a batch of 10^8 is 27 looks)
    if micro := _largest(lambda k: need(k, t.grad_accum) <= pool.available, derived.micro_batch - 1):
        out.append(
            f"{prefix}train.batch_size={micro * t.grad_accum * n} ({micro} sequence(s) per device per micro-batch "
            f"instead of {derived.micro_batch}): {pool.amount(need(micro, t.grad_accum))}"
        )
    b = derived.per_device_batch
    fewest = (k for k in _divisors(b) if k > t.grad_accum and need(b // k, k) <= pool.available)
    if accum := next(fewest, 0):
        out.append(
            f"{prefix}train.grad_accum={accum} (the same train.batch_size={t.batch_size} in micro-batches of "
            f"{b // accum} sequence(s) per device): {pool.amount(need(b // accum, accum))}"
        )
    return out


def _largest(fits, high: int) -> int:
    """The largest k in 1..high with fits(k), for a `fits` true up to some k and false above it; 0 if none."""
    low = 0  # fits(low) holds, or low is 0
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def _divisors(n: int) -> list[int]:
    """n's divisors, smallest first (up to sqrt(n) tries, not n)."""
    small = [k for k in range(1, math.isqrt(n) + 1) if n % k == 0]
    return small + [n // k for k in reversed(small) if k * k != n]


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"
