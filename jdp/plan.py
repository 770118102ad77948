"""`jdp plan`: memory per device, step time (compute + communication) and tokens/s from 1 to 1024 GPUs.

Nothing is run or allocated: the parameter, gradient and optimizer-state bytes are exact, from the shapes
`nnx.eval_shape` and `jax.eval_shape(optimizer.init)` give; the activations are an estimate, checked against
the compiled step's `memory_analysis` in tests/test_plan.py; time comes from FLOPs, a peak and bandwidths.

What a strategy costs is its module's to say (jdp/parallel/costs.py's terms): `state_bytes`, what one device holds, and
`traffic`, the collectives of one step (their kind and bytes per bucket, which compute can hide them). The model of
a step, the same for every strategy (weak scaling: every device keeps the config's per-device batch, so the global
batch grows with N):

    compute   = FLOPs per token x tokens per device / (peak FLOP/s x MFU)       (MFU assumed, or measured)
    collectives = sum over them of  ring share x bytes / bus bandwidth  +  a fixed latency per collective
                (ring share: 2 (N-1)/N for an all-reduce, (N-1)/N for a reduce-scatter or an all-gather)
    exposed   = what backward (2/3 of compute) or forward (1/3) cannot hide of the collectives the strategy
                issues behind it (see exposed_comm_s), plus all of the others
    step      = compute + exposed;   efficiency(N) = tokens/s(N) / (N x tokens/s(1)) = compute / step

parallel.compression=powersgd sends each bucket as its compressed size (r(m + n) float32 numbers per compressed
m x n gradient, the rest whole) in two all-reduces (two latencies per bucket), and adds its matrix products to the
compute: M Q, M^T P and P Q^T are 2mnr FLOPs each, the QR about 4mr^2.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import operator
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from jdp import adapters, models, peft, preference
from jdp.attention import attention_scores
from jdp.build import comm_hook
from jdp.config import (
    Config,
    ConfigError,
    explicit_keys,
    load_config,
    read_yaml,
    resolve_config_path,
    split_config_args,
    validate,
)
from jdp.hardware import DEFAULT_MFU, INTERCONNECTS, gpu_spec, link_for
from jdp.metrics import flops_per_token, read_metrics, recompute_flops_per_token
from jdp.models import make_model
from jdp.models.common import lm_loss
from jdp.models.config import ModelConfig
from jdp.optim import make_optimizer, whole_matrices
from jdp.parallel import strategies, sync
from jdp.parallel.buckets import bucket_plan
from jdp.parallel.costs import WINDOWS, Buckets, Collectives, Memory, Traffic, payload_bytes, ring_s, tree_bytes
from jdp.parallel.remat import POLICIES, Remat
from jdp.parallel.step import param_names
from jdp.rundir import RunDir

__all__ = [
    "COMPUTE_BOUND",
    "JAX_MEMORY_FRACTION",
    "SCALING_NS",
    "Choice",
    "Memory",
    "Plan",
    "Planner",
    "Ring",
    "Step",
    "abstract_state",
    "activation_bytes",
    "calibrated_mfu",
    "device_memory",
    "exposed_comm_s",
    "fit_note",
    "format_plan",
    "fused_attention",
    "held_bytes",
    "make_plan",
    "make_planner",
    "markdown_table",
    "opt_bytes_per_device",
    "planned_strategies",
    "run",
]

COMPUTE_BOUND = 0.05  # "compute-bound": the exposed all-reduce is at most 5% of the step
JAX_MEMORY_FRACTION = 0.75  # JAX preallocates this much of a GPU's memory by default (XLA_PYTHON_CLIENT_MEM_FRACTION)
SCALING_NS = tuple(2**k for k in range(11))  # 1, 2, 4, ..., 1024


# ---- Memory ----


def abstract_model(m: ModelConfig) -> nnx.Module:
    """The model `m` describes, with the adapters model.lora_* ask for, as shapes only: nothing is allocated."""
    return nnx.eval_shape(lambda: peft.add_adapters(make_model(m, nnx.Rngs(0)), m) if m.lora_rank
                          else make_model(m, nnx.Rngs(0)))  # fmt: skip


def abstract_state(cfg: Config):
    """(graphdef, params, rest, optimizer state) as shapes only: nothing is allocated. A preference objective's
    frozen reference copy (jdp/preference.py; none with LoRA or a precomputed reference) is among the rest."""
    model = abstract_model(cfg.model)
    if preference.holds_copy(cfg):
        model = preference.with_reference(model)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # with adapters: what trains
    optimizer, _ = make_optimizer(cfg.optim, cfg.train.steps)
    return graphdef, params, rest, jax.eval_shape(optimizer.init, params)


def planned_strategies() -> list[str]:
    """The strategies the planner models: those whose gradients travel by a collective per bucket."""
    return [name for name, s in strategies.REGISTRY.items() if s.planned]


def held_bytes(
    cfg: Config, strategy: str, n: int, state: tuple | None = None, grad_accum: int | None = None, frees: bool = True
) -> Memory:
    """The parameters, gradients, accumulator and optimizer state one device holds under `strategy` on n devices
    (no activations), as the strategy's module counts them (its state_bytes). `state`: an abstract_state(cfg)
    already traced; `grad_accum`: default the config's; frees=False (recomputes_activations): a block's gathered
    parameters stay until its backward, resharding or not."""
    _, params, rest, opt_state = state or abstract_state(cfg)
    optimizer, _ = make_optimizer(cfg.optim, cfg.train.steps)
    accum = cfg.train.grad_accum if grad_accum is None else grad_accum
    s = strategies.get(strategy)
    options = s.options_of(cfg.parallel)
    if not frees and "reshard_after_forward" in options:
        options["reshard_after_forward"] = False
    ways = sync.get(cfg.parallel.sync)
    inside = ways.group_devices(cfg.parallel, n)  # DiLoCo: the strategy's state is split inside a group only
    m = s.costs().state_bytes(params, opt_state, optimizer, inside, accum, bucket=largest_bucket(cfg, params),
                              **options)  # fmt: skip
    more_params, more_opt = ways.extra_bytes(cfg.parallel, m.params)  # DiLoCo's round
    shards = cfg.parallel.shard_size if s.groups else inside if s.split_optimizer else 1
    update = update_bytes(cfg, params, shards)
    # LoRA's frozen base: as the strategy holds it (fsdp's and hsdp's base_bytes: in rows), else whole on every
    # device. Held in another dtype than the compute dtype (model.base_dtype=bfloat16, float32 compute), the step
    # converts it, and XLA keeps the converted copies (measured in tests/test_plan.py)
    base = getattr(s.costs(), "base_bytes", whole_base_bytes)(adapters.frozen(rest), inside, cfg.model.dtype, **options)
    return dataclasses.replace(m, params=m.params + more_params + base, opt_state=m.opt_state + more_opt,
                               in_flight=m.in_flight + update)  # fmt: skip


def whole_base_bytes(base, n: int, compute, **_) -> int:
    """A frozen base whole on every device (ddp, zero1, dp), and each leaf's copy converted to the compute dtype
    where it is held in another (XLA keeps them all: measured under ddp and zero1)."""
    compute = jnp.dtype(compute)
    return sum(x.size * (x.dtype.itemsize + (compute.itemsize if x.dtype != compute else 0))
               for x in jax.tree.leaves(base))  # fmt: skip


def update_bytes(cfg: Config, params, shards: int) -> int:
    """What the optimizer's update holds beyond its state, after backward: for Muon, each device's part of its
    matrices' momentum stacked by shape (jdp/muon.py's lax.map) and Newton-Schulz's temporaries for the largest
    matrix whole (about 5x it: the matrix, its Gram matrix's products, the result; measured on XLA:CPU). Counted
    beside the buckets in flight, not instead: within 5% of the compiled step under ddp, fsdp and hsdp, 19% over
    under zero1, whose update reuses the whole gradients' buffers (tests/test_muon.py). Other optimizers update in
    place: 0."""
    wanted = whole_matrices(cfg.optim, params)
    matrices = [x for x, w in zip(jax.tree.leaves(params), wanted, strict=True) if w]
    if not matrices:
        return 0
    sizes = [math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in matrices]
    return sum(sizes) // max(shards, 1) + 5 * max(sizes)


def largest_bucket(cfg: Config, params) -> int:
    """The bytes of the largest gradient bucket (parallel.bucket_mb, in parallel.reduce_dtype), without tracing the
    model as bucket_plan does: a bucket holds up to bucket_mb, or one leaf larger than that, and never more than
    every gradient."""
    size = jnp.dtype(cfg.parallel.reduce_dtype).itemsize
    leaves = [math.prod(x.shape) * size for x in jax.tree.leaves(params)]
    limit = cfg.parallel.bucket_mb * 2**20 if cfg.parallel.bucket_mb > 0 else sum(leaves)
    return int(min(sum(leaves), max(limit, max(leaves, default=0))))


def opt_bytes_per_device(cfg: Config, strategy: str, n: int, state: tuple | None = None) -> int:
    """The optimizer state one device holds (dp: its master)."""
    return held_bytes(cfg, strategy, n, state).opt_state


def activation_bytes(
    cfg: Config, micro_batch: int, fused_attention: bool, strategy: str | None = None, frees: bool = True
) -> int:
    """Estimated bytes alive at the start of backward for one micro-batch: what backward needs from forward (in
    the style of Korthikanti et al. 2022, "Reducing Activation Recomputation", counted for this model as XLA
    keeps it; tests/test_plan.py compares it with XLA:CPU's compiled float32 programs).

    Per block: what its family counts (jdp/models/: GPT's and Llama's each in its module) and the softmax, in
    float32: its exponentials and its probabilities (2 B H S, with S = attention.attention_scores(L), about
    L^2 (n + 1) / 2n for n query blocks), or only the B H L row statistics when the attention is fused (cuDNN).
    Outside the blocks: the embedding output and the final norm (3 ND), and the float32 logits and their
    exponentials for the loss (2 N V). No dropout.

    Recomputation (model.remat, jdp/parallel/remat.py, or the policy `strategy`'s blocks run under: block_policy):
    a recomputed block keeps its input only (full), its input and projections' outputs (dots: the family's
    projection_bytes), or those and attention's two products as well (saved_dots: fsdp's resharded blocks; a fused
    attention is no matrix product, so it is recomputed); the peak is then the start of backward or the
    recomputation of a block (its whole activations, beside what the blocks below it keep), whichever is more.
    frees=False: the compiled step keeps every block's activations anyway (recomputes_activations: XLA:CPU of JAX
    0.10).
    """
    m, L = cfg.model, cfg.data.seq_len
    N, D = micro_batch * L, m.d_model
    s = jnp.dtype(m.dtype).itemsize
    f32 = 4
    scores = micro_batch * m.n_heads * (0 if fused_attention else attention_scores(L)) * f32
    softmax = micro_batch * m.n_heads * L * f32 if fused_attention else 2 * scores
    block = models.get(m.arch).block_activation_bytes(m, N, s) + softmax
    outside = 3 * N * D * s + 2 * N * m.vocab_size * f32

    remat = Remat.of(m)
    policy = block_policy(cfg, strategy) if frees else "none"
    if policy == "none":
        return m.n_layers * block + outside
    if policy == "full":
        kept = N * D * s
    elif policy == "dots":
        kept = models.projection_bytes(m, N, s) + adapter_dots(cfg, N, s)
    else:  # saved_dots, every block whatever model.remat_every says: attention's q k^T and its product with v too
        kept = models.projection_bytes(m, N, s) + adapter_dots(cfg, N, s) + (0 if fused_attention else scores + N * D * s)
        remat = Remat("full")
    held = [kept if remat.recomputes(i) else block for i in range(m.n_layers)]
    # the start of backward (every block's part), or a recomputed block j whole, the blocks below it as kept
    return max([sum(held), *(sum(held[:j]) + block for j in range(m.n_layers) if remat.recomputes(j))]) + outside


def adapter_dots(cfg: Config, tokens: int, itemsize: int) -> int:
    """What a block's LoRA adapters add to the matrix products a dots policy keeps: each adapter's x A (r wide) and
    (x A) B (its layer's output wide) beside the layer's own x W, per block (the model's adapters over its blocks)."""
    return _adapter_widths(cfg.model) * tokens * itemsize // cfg.model.n_layers if cfg.model.lora_rank else 0


@functools.lru_cache(maxsize=8)
def _adapter_widths(m: ModelConfig) -> int:
    """r + out summed over the model's adapters (each lora_b is r x out): traced once per model, not per estimate
    (`jdp plan` asks for every strategy and batch size; an 8B model takes a second to trace)."""
    params = nnx.state(abstract_model(m), nnx.Param)
    return sum(sum(x.shape) for name, x in zip(param_names(params), jax.tree.leaves(params), strict=True)
               if name.endswith("lora_b"))  # fmt: skip


def block_policy(cfg: Config, strategy: str | None = None) -> str:
    """The recomputation policy the model's blocks run under with `strategy` (default: the config's): model.remat,
    unless the strategy's module says otherwise (its block_policy: fsdp's resharded blocks keep every matrix
    product's output under model.remat=none, "saved_dots")."""
    s = strategies.get(strategy or cfg.parallel.strategy)
    own = getattr(s.costs(), "block_policy", None) if s.planned else None
    return own(cfg.model.remat, **s.options_of(cfg.parallel)) if own else cfg.model.remat


def recomputes_activations(platform: str) -> bool:
    """Whether a recomputed block's activations are freed in the compiled step: not by XLA:CPU of JAX 0.10
    (measured: the same temporaries with model.remat=full as without; docs/performance.md), by every other."""
    return platform != "cpu" or jax.__version_info__ >= (0, 11)


def cpu_note(cfg: Config, devices: int, micro_batch: int, state: tuple | None = None) -> str:
    """What a CPU run of this JAX holds beyond the plan's figure ("" where nothing): XLA:CPU of JAX 0.10 frees
    neither a recomputed block's activations nor fsdp's and hsdp's gathered blocks before backward
    (recomputes_activations), so the plan, made for GPUs, is under such a run (fsdp: 46% under the compiled step of
    tests/test_plan.py's activations case on JAX 0.10.2, 8% under with what is kept counted: the figure named)."""
    if recomputes_activations("cpu"):
        return ""
    freed, kept = (device_memory(cfg, devices, micro_batch, False, state=state, frees=f).total for f in (True, False))
    if kept <= 1.05 * freed:
        return ""
    return (f"note: on CPU devices, JAX {jax.__version__} keeps what this plan counts as freed (every block's "
            f"activations, and a gathered block until its backward): a CPU run holds about {_size(kept)} per device "
            f"(as the memory check counts it); GPUs and JAX 0.11 or newer free them")  # fmt: skip


def fused_attention(cfg: Config, platform: str = "gpu") -> bool:
    """Whether the step runs cuDNN's fused attention: on GPUs "auto" is cuDNN's kernel, which jax uses for 16-bit
    compute dtypes only; CPUs run the written-out one."""
    return platform == "gpu" and cfg.model.attention in ("auto", "cudnn") and cfg.model.dtype != "float32"


def device_memory(
    cfg: Config,
    devices: int,
    micro_batch: int,
    fused: bool,
    strategy: str | None = None,
    state: tuple | None = None,
    grad_accum: int | None = None,
    frees: bool = True,
) -> Memory:
    """What one device holds during a step of `strategy` (default: the config's) on `devices` devices, the
    fullest one (dp: the master; `others` then says what the rest hold). `state`: an abstract_state(cfg) already
    traced; `grad_accum`: default the config's; frees: whether recomputation frees memory
    (recomputes_activations). With blocks recomputed the activations peak inside backward, at a block's
    recomputation, as the gradients are being made: they count against each other (Memory.late_grads), the larger
    of the two, as fsdp's always do (measured: docs/planning.md#against-the-compiled-step)."""
    strategy = strategy or cfg.parallel.strategy
    held = held_bytes(cfg, strategy, devices, state, grad_accum, frees)
    sequences = micro_batch * preference.sequences_per_row(cfg.train.objective)  # a pair: two
    memory = held.with_activations(activation_bytes(cfg, sequences, fused, strategy, frees))
    return memory.with_late_grads() if frees and cfg.model.remat != "none" else memory


def fit_note(total: int, gpu_name: str) -> str:
    capacity = gpu_spec(gpu_name).memory_gb * 1e9
    if total <= JAX_MEMORY_FRACTION * capacity:
        return f"fits ({total / capacity:.1%} of {capacity / 1e9:g} GB; JAX's default pool is 75%)"
    if total <= 0.95 * capacity:
        return f"{total / capacity:.1%} of {capacity / 1e9:g} GB: fits with XLA_PYTHON_CLIENT_MEM_FRACTION=.95"
    return f"does NOT fit: {total / capacity:.1%} of {capacity / 1e9:g} GB"


# ---- Time ----


def exposed_comm_s(bucket_s: list[float], window_s: float) -> float:
    """The time of collectives issued behind compute (backward, or forward) that the compute cannot hide.

    Buckets are sent one at a time, in the order the compute finishes them. Every bucket but the last can run
    while the compute continues (XLA's latency-hiding scheduler), so what shows is the last bucket, or whatever of
    the whole does not fit inside the compute: max(last bucket, all buckets - compute). This is the best case.
    """
    total = sum(bucket_s)
    if not bucket_s:
        return total
    return max(bucket_s[-1], total - window_s)


@dataclass(frozen=True)
class Ring:
    """A strategy's collectives of one kind at N devices, on the link their rings cross."""

    collectives: Collectives
    devices: int  # in each ring
    link: str
    busbw: float  # bytes/s
    latency: float  # s per collective

    def bucket_s(self) -> list[float]:
        """Each bucket's time, latencies included, in the order issued; none on one device."""
        c = self.collectives
        if self.devices <= 1:
            return []
        return [ring_s(c.kind, b, self.devices, self.busbw) + c.calls * self.latency for b in c.nbytes]

    def bandwidth_s(self) -> float:
        """The bandwidth term of all of them."""
        return ring_s(self.collectives.kind, sum(self.collectives.nbytes), self.devices, self.busbw)

    def calls(self) -> int:
        return self.collectives.calls * len(self.collectives.nbytes) if self.devices > 1 else 0


@dataclass(frozen=True)
class Step:
    devices: int
    link: str
    busbw_gbs: float
    per_device_batch: int  # sequences
    compute_s: float
    allreduce_s: float  # the rings' bandwidth term: 2 (N-1)/N x bytes all-reduced / bus bandwidth, or (N-1)/N x ...
    latency_s: float  # collectives x the link's latency
    exposed_s: float
    step_s: float
    tokens_per_s: float
    efficiency: float
    compute_bound_batch: int | None = None  # smallest per-device batch with exposed <= 5% of the step

    @property
    def comm_s(self) -> float:
        return self.allreduce_s + self.latency_s


@dataclass(frozen=True)
class Planner:
    """Everything that does not depend on the device count: the model's FLOPs, its gradient buckets, the GPU."""

    cfg: Config
    gpu: str
    peak: float  # FLOP/s of one GPU at the compute dtype
    mfu: float
    n_params: int
    param_bytes: int
    opt_bytes: int
    bucket_bytes: tuple[int, ...]  # in the reduce dtype, in the order backward finishes them
    interconnect: str | None = None
    bandwidth_gbs: float | None = None
    strategy: str = "ddp"  # any planned one (strategies.REGISTRY)
    param_bucket_bytes: tuple[int, ...] = ()  # the same buckets of parameters, in their dtype
    compressed_bytes: tuple[int, ...] = ()  # parallel.compression: each bucket's bytes on the wire; () if none
    compression_flops: float = 0.0  # per device per step: the compression's matrix products
    whole_bytes: tuple[int, ...] = ()  # the matrices the optimizer needs whole (Muon's), each one's bytes

    @property
    def buckets(self) -> Buckets:
        """What the step's collectives carry: the gradient buckets, their parameters, a hook's wire bytes."""
        return Buckets(
            self.bucket_bytes,
            self.param_bucket_bytes,
            self.cfg.parallel.reduce_dtype,
            self.compressed_bytes,
            wire_calls=2,  # PowerSGD: P, then Q
            wire_what="PowerSGD factors and uncompressed gradients",
        )

    def traffic(self, n: int) -> tuple[Traffic, list[Ring]]:
        """The strategy's collectives at n devices (its module's traffic), each on the link its rings cross."""
        s = strategies.get(self.strategy)
        traffic = s.costs().traffic(self.buckets, n, self.cfg.train.grad_accum, **s.options_of(self.cfg.parallel))
        if self.whole_bytes and s.split_optimizer:  # Muon under a split layout: each matrix all-gathered whole
            group = self.cfg.parallel.shard_size if s.groups else 0
            whole = Collectives("all-gather", "Muon's whole matrices", self.whole_bytes, devices=group)
            traffic = Traffic((*traffic.collectives, whole), f"{traffic.exposed}, and Muon's all-gathers (the update)")
        rings = []
        for c in traffic.collectives:
            if c.overlaps and c.overlaps not in WINDOWS:
                raise ValueError(f"{self.strategy}'s {c.kind}s overlap {c.overlaps!r}: one of {', '.join(WINDOWS)}")
            size = c.devices or n
            link, busbw, latency = link_for(gpu_spec(self.gpu), size * c.apart, self.interconnect, self.bandwidth_gbs)
            rings.append(Ring(c, size, link, busbw, latency if size > 1 else 0.0))
        return traffic, rings

    def step(self, n: int, per_device_batch: int) -> Step:
        cfg = self.cfg
        tokens = per_device_batch * cfg.data.seq_len * preference.sequences_per_row(cfg.train.objective)
        flops = (flops_per_token(cfg) + recompute_flops_per_token(cfg)) * tokens  # model.remat's too: time, not MFU
        compute_s = (flops + self.compression_flops) / (self.peak * self.mfu)
        window_s = {"forward": compute_s / 3, "backward": compute_s * 2 / 3}  # backward does twice forward's FLOPs
        link, busbw, _ = link_for(gpu_spec(self.gpu), n, self.interconnect, self.bandwidth_gbs)
        _, rings = self.traffic(n)
        behind = {w: [t for r in rings if r.collectives.overlaps == w for t in r.bucket_s()] for w in WINDOWS}
        shows = [sum(r.bucket_s()) for r in rings if not r.collectives.overlaps]
        exposed = sum(exposed_comm_s(behind[w], window_s[w]) for w in WINDOWS) + sum(shows)
        step_s = compute_s + exposed
        return Step(
            devices=n,
            link=link if n > 1 else "-",
            busbw_gbs=busbw / 1e9 if n > 1 else 0.0,
            per_device_batch=per_device_batch,
            compute_s=compute_s,
            allreduce_s=sum(r.bandwidth_s() for r in rings),
            latency_s=sum(r.latency * r.calls() for r in rings),
            exposed_s=exposed,
            step_s=step_s,
            tokens_per_s=n * tokens / step_s,
            efficiency=compute_s / step_s,  # tokens/s(N) / (N x tokens/s(1)): one device has no all-reduce
        )

    def compute_bound_batch(self, n: int) -> int | None:
        """The smallest per-device batch, a multiple of train.grad_accum, whose exposed all-reduce is at most
        5% of the step (exposed time never grows with the batch, compute does: a bisection finds it)."""
        ga = self.cfg.train.grad_accum

        def bound(k: int) -> bool:
            s = self.step(n, k * ga)
            return s.exposed_s <= COMPUTE_BOUND * s.step_s

        hi = 1
        while not bound(hi):
            hi *= 2
            if hi > 2**30:
                return None
        lo = hi // 2  # not bound (or 0)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if bound(mid) else (mid, hi)
        return hi * ga


@dataclass(frozen=True)
class Choice:
    """One strategy at the requested N: what a device holds and how long a step takes."""

    strategy: str
    opt_state: int  # bytes per device
    memory_total: int  # bytes per device
    exposed_s: float
    step_s: float
    tokens_per_s: float


@dataclass(frozen=True)
class Fit:
    """A change that makes the run fit JAX's default pool, re-checked: its bytes per device and predicted step."""

    change: str  # the key=value settings that differ from the config
    memory_total: int
    step_s: float
    tokens_per_s: float
    devices: int


@dataclass(frozen=True)
class Across:
    """The devices split into groups joined by a slow link (--slow-link): ddp's step across it against DiLoCo's
    (parallel.sync), each (what, step s, bytes across the link per step)."""

    groups: int
    gbs: float
    latency_s: float
    rows: tuple[tuple[str, float, float], ...]


def across_slow_link(planner: Planner, n: int, per_device_batch: int, gbs: float, latency_ms: float) -> Across:
    """ddp across the slow link: every bucket's ring all-reduce runs at the slow link's bandwidth (a ring is as
    fast as its slowest link) and pays its one-way latency at each of its 2 (n - 1) steps, behind backward as ever.
    DiLoCo: the inner step inside a group of n / G on the fast links, plus each sync's all-gather over the groups
    (a group's pseudo-gradient payload, G - 1 of them, at the slow link's bandwidth, G - 1 latencies) once per H
    steps; streamed, each of F fragments' exchanges hides behind parallel.outer_delay inner steps. A clean link: loss
    and retransmits (docs/diloco.md measures a lossy one) come on top."""
    p = planner.cfg.parallel
    g = p.groups or 2
    bw, lat = gbs * 1e9, latency_ms / 1e3
    compute = planner.step(n, per_device_batch).compute_s
    per_bucket = [ring_s("all-reduce", x, n, bw) + 2 * (n - 1) * lat for x in planner.bucket_bytes]
    rows = [("ddp across the link", compute + exposed_comm_s(per_bucket, compute * 2 / 3),
             2 * (n - 1) / n * sum(planner.bucket_bytes))]  # fmt: skip
    inner = planner.step(max(n // g, 1), per_device_batch).step_s
    f, d = getattr(p, "fragments", 1), getattr(p, "outer_delay", 0)
    payload = payload_bytes(planner.n_params, p.outer_dtype)
    for h in sorted({10, 50, 100, 500, p.outer_every}):
        if h % f or d >= h // f:
            continue
        exchange = payload * (g - 1) / bw / f + (g - 1) * lat  # one fragment's
        step = inner + f * max(0.0, exchange - d * inner) / h
        what = f"DiLoCo H={h}" + (f", {f} fragments, delay {d}" if f > 1 or d else "") + f", {p.outer_dtype}"
        rows.append((what, step, payload * (g - 1) / h))
    return Across(g, gbs, lat, tuple(rows))


@dataclass(frozen=True)
class Plan:
    config: str
    gpu: str
    devices: int
    n_params: int
    memory: Memory
    mfu: float
    mfu_source: str
    fused_attention: bool
    bucket_bytes: tuple[int, ...]
    step: Step  # at the requested device count
    scaling: tuple[Step, ...]  # N = 1, 2, 4, ..., 1024 at the same per-device batch
    interconnect_note: str
    strategy: str = "ddp"
    strategies: tuple[Choice, ...] = ()  # every planned strategy side by side at the requested N
    compression: tuple[tuple[str, float, float], ...] = ()  # per interconnect: (name, step s plain, compressed)
    wire_bytes: int = 0  # with compression: the bytes all-reduced per step
    compression_note: str = ""
    traffic: Traffic | None = None  # the strategy's collectives at the requested N (for the printout)
    rings: tuple[Ring, ...] = ()  # the same, on their links
    assumed: tuple[str, ...] = ()  # what the plan took that the config did not say (planning_assumptions)
    fits: tuple[Fit, ...] = ()  # when no strategy fits at the requested N: what would, fastest first
    across: Across | None = None  # --slow-link: ddp across it against DiLoCo
    cpu_note: str = ""  # what a CPU run of this JAX holds beyond the plan (cpu_note)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["memory"] = self.memory.to_dict()
        del out["traffic"], out["rings"]
        return out


def calibrated_mfu(run_dir: str | Path, gpu: str = "H100") -> tuple[float, str]:
    """The median MFU over a run's metrics.jsonl records, and a sentence saying where it came from; refused when
    the run trained on CPUs, noted when on another GPU than `gpu`."""
    run = RunDir(run_dir)
    path = run.metrics
    if not path.is_file():
        raise ConfigError(f"--calibrate {run_dir}: no metrics.jsonl there (a `jdp train` run directory has one)")
    values = [r["mfu"] for r in read_metrics(path) if isinstance(r.get("mfu"), (int, float)) and r["mfu"] > 0]
    if not values:
        raise ConfigError(f"--calibrate {run_dir}: no record in metrics.jsonl has an mfu (the run was too short?)")
    mfu = statistics.median(values)
    try:
        summary = json.loads(run.summary.read_text()) if run.summary.is_file() else {}
    except (OSError, ValueError):  # cut off or damaged: the device is then unchecked, and the note says so
        summary = {}
    summary = summary if isinstance(summary, dict) else {}
    devices = summary.get("devices")
    where = f" on {devices} device(s)" if devices else ""
    note = f"calibrated: median MFU of {len(values)} records of {path}{where}"
    if devices and devices > 1:
        note += " (its MFU includes that run's exposed all-reduce, so the compute term is conservative)"
    return mfu, note + _device_note(run, summary, gpu)


def _device_note(run: RunDir, summary: dict, gpu: str) -> str:
    """Whether a run's MFU carries over to `gpu`, judged by the device its summary.json names."""
    kind, platform = summary.get("device_kind"), summary.get("platform")
    if platform == "cpu" or (platform is None and str(kind).lower() == "cpu"):
        raise ConfigError(
            f"--calibrate {run.path}: that run trained on CPU devices ({run.summary.name}: platform "
            f"{platform or 'cpu'}, device_kind {kind!r}); a CPU run's MFU is against the CPU's measured matmul rate, "
            f"not a GPU's datasheet peak, so it says nothing about {gpu}. Calibrate with a run on {gpu}, or give "
            f"--mfu"
        )
    if not isinstance(kind, str):
        return (
            f"; note: {run.summary} does not name the device the run trained on (an unfinished run, or an older "
            f"jdp), so its MFU is applied to {gpu} unchecked"
        )
    if not re.search(rf"\b{re.escape(gpu)}\b", kind.upper()):  # "NVIDIA H100 80GB HBM3" is an H100; "L40S" no L4
        return (
            f"; note: that run trained on {kind}, not {gpu}: MFU differs between GPUs, so this one may not carry over"
        )
    return ""


def make_planner(
    cfg: Config,
    gpu: str = "H100",
    interconnect: str | None = None,
    bandwidth_gbs: float | None = None,
    mfu: float = DEFAULT_MFU,
    state: tuple | None = None,
) -> Planner:
    """The planner for a config on a GPU; traces the model once (shapes only) for the gradient buckets. `state`:
    abstract_state(cfg), when the caller has it already (it costs seconds for a large model)."""
    if not (s := strategies.get(cfg.parallel.strategy)).planned:
        raise ConfigError(
            f"jdp plan models parallel.strategy={' and '.join(planned_strategies())}, whose gradients travel by "
            f"collectives; {s.name} is {s.summary}"
        )
    peak = gpu_spec(gpu).peak_flops(cfg.model.dtype)
    link_for(gpu_spec(gpu), 2, interconnect, bandwidth_gbs)  # an unknown interconnect fails here, up front
    if bandwidth_gbs is not None and not bandwidth_gbs > 0:
        raise ConfigError(f"--bandwidth {bandwidth_gbs} must be positive (GB/s)")
    if not 0 < mfu <= 1:
        raise ConfigError(f"MFU {mfu} must be in (0, 1]")
    graphdef, params, rest, opt_state = state if state is not None else abstract_state(cfg)
    micro = {
        k: jax.ShapeDtypeStruct((1, cfg.data.seq_len), dtype)
        for k, dtype in (("inputs", jnp.int32), ("targets", jnp.int32), ("weights", jnp.float32))
    }
    p = cfg.parallel
    buckets = bucket_plan(graphdef, lm_loss, params, rest, micro, p.bucket_mb, p.reduce_dtype)
    compressed, flops = (), 0.0
    if hook := comm_hook(p):
        named = [(n, tuple(x.shape)) for n, x in zip(param_names(params), jax.tree.leaves(params), strict=True)]
        item = jnp.dtype(p.reduce_dtype).itemsize
        compressed = tuple(
            sum(4 * hook.wire_elements([named[k]]) if hook.compresses(*named[k]) else item * math.prod(named[k][1])
                for k in b.leaves)
            for b in buckets
        )  # fmt: skip
        r = p.powersgd_rank
        packed = [hook.matrix(s) for n, s in named if hook.compresses(n, s)]
        flops = sum(6 * m * n * r + 4 * m * r * r for m, n in packed)
    return Planner(
        cfg=cfg,
        gpu=gpu,
        peak=peak,
        mfu=mfu,
        n_params=sum(math.prod(x.shape) for x in jax.tree.leaves(params)),
        param_bytes=tree_bytes(params),
        opt_bytes=tree_bytes(opt_state),
        bucket_bytes=tuple(b.nbytes for b in buckets),
        interconnect=interconnect,
        bandwidth_gbs=bandwidth_gbs,
        strategy=cfg.parallel.strategy,
        param_bucket_bytes=tuple(b.elements * jnp.dtype(cfg.model.param_dtype).itemsize for b in buckets),
        compressed_bytes=compressed,
        compression_flops=flops,
        whole_bytes=tuple(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x, w in
                          zip(jax.tree.leaves(params), whole_matrices(cfg.optim, params), strict=True) if w),
    )  # fmt: skip


def make_plan(
    cfg: Config,
    devices: int,
    gpu: str = "H100",
    interconnect: str | None = None,
    bandwidth_gbs: float | None = None,
    mfu: float | None = None,
    calibrate: str | Path | None = None,
    config_name: str = "",
    ns: tuple[int, ...] = SCALING_NS,
    assumed: tuple[str, ...] = (),
    slow_link: tuple[float, float] | None = None,
) -> Plan:
    """The whole plan for `devices` GPUs: memory per device, the step at that N, and the scaling table."""
    if devices < 1:
        raise ConfigError(f"--devices {devices} must be at least 1")
    derived = validate(cfg, devices)  # the per-device batch, exactly as `jdp train` would derive it
    if calibrate is not None:
        mfu, mfu_source = calibrated_mfu(calibrate, gpu)
        run_config = RunDir(calibrate).config
        if run_config.is_file() and load_config(run_config).model != cfg.model:
            mfu_source += "; note: that run trained a different model (its config.yaml), so its MFU may not carry over"
    elif mfu is not None:
        mfu_source = "given with --mfu"
    else:
        mfu, mfu_source = DEFAULT_MFU, "assumed (--mfu or --calibrate RUN_DIR to change)"
    state = abstract_state(cfg)
    planner = make_planner(cfg, gpu, interconnect, bandwidth_gbs, mfu, state)
    fused = fused_attention(cfg)
    memory = device_memory(cfg, devices, derived.micro_batch, fused, state=state)
    b = derived.per_device_batch
    choices = []
    for strategy in planned_strategies():
        held = device_memory(cfg, devices, derived.micro_batch, fused, strategy, state)
        s = dataclasses.replace(planner, strategy=strategy).step(devices, b)
        choices.append(Choice(strategy, held.opt_state, held.total, s.exposed_s, s.step_s, s.tokens_per_s))
    traffic, rings = planner.traffic(devices)
    capacity = JAX_MEMORY_FRACTION * gpu_spec(gpu).memory_gb * 1e9
    fits = () if any(c.memory_total <= capacity for c in choices) else what_fits(planner, state, devices, b, capacity)

    compression, compression_note = _compression(planner, devices, b)

    def with_bound(n: int) -> Step:
        return dataclasses.replace(planner.step(n, b), compute_bound_batch=planner.compute_bound_batch(n))

    if interconnect or bandwidth_gbs:
        note = f"all-reduce over {interconnect or f'{bandwidth_gbs:g} GB/s'} for every N"
    else:
        g = gpu_spec(gpu)
        note = f"all-reduce over {g.intra} up to {g.per_node} GPUs (one node), the slower of {g.intra} and {g.inter} beyond"
    return Plan(
        config=config_name,
        gpu=gpu,
        devices=devices,
        n_params=planner.n_params,
        memory=memory,
        mfu=mfu,
        mfu_source=mfu_source,
        fused_attention=fused,
        bucket_bytes=planner.bucket_bytes,
        step=with_bound(devices),
        scaling=tuple(with_bound(n) for n in ns),
        interconnect_note=note,
        strategy=cfg.parallel.strategy,
        strategies=tuple(choices),
        compression=compression,
        compression_note=compression_note,
        wire_bytes=sum(planner.compressed_bytes),
        traffic=traffic,
        rings=tuple(rings),
        assumed=tuple(assumed),
        fits=fits,
        across=across_slow_link(planner, devices, b, *slow_link) if slow_link else None,
        cpu_note=cpu_note(cfg, devices, derived.micro_batch, state),
    )


REMAT_NOTES = {"dots": "recompute attention, norms and activations", "full": "recompute each block's forward"}


def what_fits(planner: Planner, state: tuple, devices: int, per_device_batch: int, capacity: float,
              limit: int = 8) -> tuple[Fit, ...]:  # fmt: skip
    """The changes that fit `capacity` bytes per device, each re-checked by the planner (memory and step time),
    fastest first: for every planned strategy and recomputation policy, the fewest train.grad_accum micro-batches
    of today's per-device batch that fit; the parameters, gradients and optimizer state in bfloat16 (which changes
    the numerics); and the fewest devices (doubling) at which a strategy fits at today's per-device batch. A change
    another beats on memory, step time and devices at once is left out (recomputing where nothing needs it)."""
    cfg, b, fused = planner.cfg, per_device_batch, fused_attention(planner.cfg)
    found: list[Fit] = []

    def consider(c: Config, n: int, st: tuple, note: str = "") -> bool:
        accum = c.train.grad_accum
        held = device_memory(c, n, b // accum, fused, c.parallel.strategy, st, accum)
        if held.total > capacity:
            return False
        step = dataclasses.replace(planner, cfg=c, strategy=c.parallel.strategy).step(n, b)
        change = [f"{k}={v}" for k, v in _changed(cfg, c).items()] + ([f"--devices {n}"] if n != devices else [])
        found.append(Fit(" ".join(change) + note, held.total, step.step_s, step.tokens_per_s, n))
        return True

    for strategy in planned_strategies():
        for policy in POLICIES:  # the least recomputation first
            for accum in (k for k in range(cfg.train.grad_accum, b + 1) if b % k == 0):
                c = _with(cfg, strategy, policy, accum)
                if consider(c, devices, state, f" ({REMAT_NOTES[policy]})" if policy in REMAT_NOTES else ""):
                    break
        n = devices * 2
        while n <= 1024 and not consider(_with(cfg, strategy, cfg.model.remat, cfg.train.grad_accum), n, state):
            n *= 2
    if cfg.model.param_dtype != "bfloat16":
        half = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, param_dtype="bfloat16"))
        half_state = abstract_state(half)
        for strategy in planned_strategies():
            consider(_with(half, strategy, half.model.remat, half.train.grad_accum), devices, half_state,
                     " (bfloat16 parameters, gradients and optimizer state: other numerics)")  # fmt: skip

    def costs(f: Fit) -> tuple:
        return f.memory_total, f.step_s, f.devices

    def beaten(f: Fit) -> bool:
        return any(costs(g) != costs(f) and all(map(operator.le, costs(g), costs(f))) for g in found)

    return tuple(sorted((f for f in found if not beaten(f)), key=lambda f: (f.step_s, f.devices))[:limit])


def _with(cfg: Config, strategy: str, remat: str, grad_accum: int) -> Config:
    return dataclasses.replace(
        cfg,
        parallel=dataclasses.replace(cfg.parallel, strategy=strategy),
        model=dataclasses.replace(cfg.model, remat=remat),
        train=dataclasses.replace(cfg.train, grad_accum=grad_accum),
    )


def _changed(before: Config, after: Config) -> dict[str, object]:
    """section.key: value for what `after` sets otherwise than `before`."""
    out = {}
    for section in ("parallel", "model", "train"):
        a, b = getattr(before, section), getattr(after, section)
        for f in dataclasses.fields(a):
            if getattr(a, f.name) != getattr(b, f.name):
                out[f"{section}.{f.name}"] = getattr(b, f.name)
    return out


def _compression(planner: Planner, n: int, batch: int) -> tuple[tuple, str]:
    """With compression on: the step without and with it at N devices over every known interconnect, and what
    it sends. Where the exposed all-reduce is larger than the compression's compute, it pays."""
    if not planner.compressed_bytes:
        return (), ""
    p = planner.cfg.parallel
    plain = dataclasses.replace(planner, compressed_bytes=(), compression_flops=0.0)
    rows = []
    for name in INTERCONNECTS:
        over = {"interconnect": name, "bandwidth_gbs": None}
        rows.append(
            (name, dataclasses.replace(plain, **over).step(n, batch).step_s,
             dataclasses.replace(planner, **over).step(n, batch).step_s)
        )  # fmt: skip
    sent, whole = sum(planner.compressed_bytes), sum(planner.bucket_bytes)
    extra = planner.compression_flops / (planner.peak * planner.mfu)
    note = (
        f"parallel.compression=powersgd (rank {p.powersgd_rank}): {_size(sent)} on the wire per step instead of "
        f"{_size(whole)} ({whole / sent:.1f} x fewer), + {_ms(extra)} ms of compression compute "
        f"({planner.compression_flops / 1e9:.2f} GFLOP) per step after the first {p.powersgd_warmup} steps"
    )
    return tuple(rows), note


# ---- Output ----


def _size(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def format_plan(plan: Plan, cfg: Config) -> str:
    """The printout of `jdp plan`: memory, the step at the requested N, the compute-bound batch, the table."""
    m, t, s, gpu = plan.memory, cfg.train, plan.step, gpu_spec(plan.gpu)
    L, ga = cfg.data.seq_len, t.grad_accum
    micro = s.per_device_batch // ga
    split = f"in {ga} micro-batches of {micro}" if ga > 1 else "in one micro-batch"
    attention = "fused (cuDNN) attention" if plan.fused_attention else f"attention probabilities {micro}x{L}x{L}"
    mc = cfg.model
    pdtype = mc.param_dtype if not mc.lora_rank else f"{mc.base_dtype or mc.param_dtype} + {mc.param_dtype}"
    what = f"{plan.n_params:,} parameters" + (f" train: LoRA rank {mc.lora_rank}, the base frozen" if mc.lora_rank else "")
    lines = [
        f"jdp plan: {plan.config or 'config'} ({what}) on {plan.devices} x {plan.gpu}",
        f"weak scaling: every device keeps {s.per_device_batch} sequences x {L} tokens per step "
        f"(train.batch_size={t.batch_size} on {plan.devices} devices), {split}",
        *(f"assumed: {a}" for a in plan.assumed),
        "",
        f"memory per device ({plan.gpu}: {gpu.memory_gb:g} GB)",
        f"  parameters        {pdtype:<9} {_size(m.params):>10}   exact, from the model's shapes"
        + (" (the frozen base, as held and converted to model.dtype, and the adapters)" if mc.lora_rank else ""),
        f"  gradients         {mc.param_dtype:<9} {_size(m.grads):>10}   exact"
        + (
            ", made as backward frees the activations: with the bucket below they count against them"
            if m.late_grads
            else ""
        ),
    ]
    if m.accumulator:
        lines.append(
            f"  grad accumulator  {pdtype:<9} {_size(m.accumulator):>10}   train.grad_accum={ga}: the running sum"
        )
    split = f"; {plan.strategy}: {m.opt_note}" if m.opt_note else ""
    lines += [
        f"  optimizer state   {cfg.optim.name:<9} {_size(m.opt_state):>10}   exact, from optimizer.init's shapes{split}",
        f"  activations       {cfg.model.dtype:<9} {_size(m.activations):>10}   estimate for one micro-batch of "
        f"{micro} x {L} tokens, {attention}",
        *(
            [
                f"  bucket in flight  {cfg.parallel.reduce_dtype:<9} {_size(m.in_flight):>10}   at the end of backward, "
                f"when the activations are gone: the larger of the two counts"
            ]
            if m.in_flight
            else []
        ),  # fmt: skip
        f"  total                       {_size(m.total):>10}   {fit_note(m.total, plan.gpu)}",
        *([f"  {plan.cpu_note}"] if plan.cpu_note else []),
        "",
        f"step on {plan.devices} x {plan.gpu}: MFU {plan.mfu:.1%} {plan.mfu_source}",
        f"  compute     {_ms(s.compute_s):>9} ms   {flops_per_token(cfg) / 1e6:,.1f} MFLOP/token{_recomputed(cfg)} x "
        f"{s.per_device_batch * L:,} tokens at {plan.mfu:.1%} of {gpu.peak_flops(cfg.model.dtype) / 1e12:g} "
        f"TFLOP/s ({cfg.model.dtype})",
    ]
    lines += _communication_lines(plan, cfg)
    lines += [
        f"  step        {_ms(s.step_s):>9} ms   {s.tokens_per_s:,.0f} tokens/s, scaling efficiency {s.efficiency:.1%}",
        "",
    ]
    lines += _strategy_lines(plan)
    lines += _across_lines(plan)
    lines += _compression_lines(plan)
    if s.compute_bound_batch is not None:
        b = s.compute_bound_batch
        act = activation_bytes(cfg, b // ga, plan.fused_attention)
        lines.append(
            f"smallest per-device batch that keeps {plan.devices} x {plan.gpu} compute-bound (exposed all-reduce "
            f"<= {COMPUTE_BOUND:.0%} of the step; multiples of train.grad_accum={ga}): {b} sequences; memory "
            f"{fit_note(m.with_activations(act).total, plan.gpu)}"
        )
    lines += [
        "",
        f"scaling at {s.per_device_batch} sequences per device ({plan.interconnect_note}):",
        _table(plan.scaling, plan.devices),
    ]
    return "\n".join(lines)


def _recomputed(cfg: Config) -> str:
    """What model.remat adds to each token's FLOPs, for the compute line ('' without recomputation)."""
    if not (extra := recompute_flops_per_token(cfg)):
        return ""
    every = f", every {cfg.model.remat_every} blocks" if cfg.model.remat_every > 1 else ""
    return f" + {extra / 1e6:,.1f} recomputed (model.remat={cfg.model.remat}{every})"


_SHARE = {"all-reduce": "2({n}-1)/{n}", "reduce-scatter": "({n}-1)/{n}", "all-gather": "({n}-1)/{n}"}
_DONE = {"all-reduce": "all-reduced", "reduce-scatter": "reduce-scattered", "all-gather": "all-gathered"}


def _communication_lines(plan: Plan, cfg: Config) -> list[str]:
    """The step's communication, from the strategy's collectives: what travels, its ring time, what of it shows."""
    s, n, rings = plan.step, plan.devices, plan.rings
    if n == 1 or not rings:
        return [f"  all-reduce  {_ms(0):>9} ms   one device: nothing to reduce"]
    kinds = [r.collectives.kind for r in rings]
    reduces = set(kinds) == {"all-reduce"}
    label = "all-reduce" if reduces else "collectives"
    terms = [
        f"{_size(sum(r.collectives.nbytes))} of {r.collectives.what}" + ("" if reduces else f" {_DONE[kind]}")
        for r, kind in zip(rings, kinds, strict=True)
    ]
    shares = [_SHARE[kind].format(n=r.devices) for r, kind in zip(rings, kinds, strict=True)]
    links = [f"{r.busbw / 1e9:g} GB/s ({r.link})" for r in rings]
    if len(set(shares)) == 1 and len(set(links)) == 1:  # one ring share and one link: factor them out
        ring = f"{shares[0]} x {terms[0] if len(terms) == 1 else '(' + ' + '.join(terms) + ')'} / {links[0]}"
    else:
        ring = " + ".join(f"{a} x {t} / {link}" for a, t, link in zip(shares, terms, links, strict=True))
    per, k = sum(r.collectives.calls for r in rings), len(plan.bucket_bytes)
    calls = f"{per} x {k} {'all-reduces' if reduces else 'bucket(s)'}" if per > 1 else f"{k} bucket(s)"
    if reduces:
        calls += f" (parallel.bucket_mb={cfg.parallel.bucket_mb:g})"
    return [
        f"  {label:<11} {_ms(s.comm_s):>9} ms   ring: {ring} = {_ms(s.allreduce_s)} ms, + {_ms(s.latency_s)} ms "
        f"latency of {calls}",
        f"  exposed     {_ms(s.exposed_s):>9} ms   {plan.traffic.exposed}",
    ]


def _strategy_lines(plan: Plan) -> list[str]:
    """Every planned strategy side by side at the requested N (nothing for one device)."""
    if plan.devices == 1:
        return []
    out = [f"parallel.strategy side by side on {plan.devices} x {plan.gpu} (memory per device):"]
    width = max([7] + [len(c.strategy) + 1 for c in plan.strategies])
    for c in plan.strategies:
        mark = "*" if c.strategy == plan.strategy else " "
        out.append(
            f"  {c.strategy + mark:<{width}} optimizer state {_size(c.opt_state):>10}  total {_size(c.memory_total):>10}  "
            f"exposed {_ms(c.exposed_s):>8} ms  step {_ms(c.step_s):>9} ms  {c.tokens_per_s:>14,.0f} tokens/s  "
            f"{fit_note(c.memory_total, plan.gpu)}"
        )
    capacity = gpu_spec(plan.gpu).memory_gb * 1e9
    fitting = [c for c in plan.strategies if c.memory_total <= JAX_MEMORY_FRACTION * capacity]
    if fitting:
        best = min(fitting, key=lambda c: c.step_s)
        out.append(f"  fastest that fits JAX's default pool: parallel.strategy={best.strategy}")
    elif plan.fits:
        out.append("  none fits JAX's default pool at this batch; what would, each re-checked (fastest step first):")
        for f in plan.fits:
            out.append(f"    {f.change}: {_size(f.memory_total)} per device, step {_ms(f.step_s)} ms, "
                       f"{f.tokens_per_s / f.devices:,.0f} tokens/s per GPU")  # fmt: skip
    else:
        out.append("  none fits JAX's default pool at this batch, and no change jdp plans makes it fit: train a smaller "
                   "model (model.d_model, model.n_layers)")  # fmt: skip
    return [*out, ""]


def _across_lines(plan: Plan) -> list[str]:
    if (a := plan.across) is None:
        return []
    ddp_s, ddp_bytes = a.rows[0][1], a.rows[0][2]
    lines = [
        f"across a slow link between {a.groups} groups of {plan.devices // a.groups} (--slow-link: {a.gbs:g} GB/s, "
        f"{a.latency_s * 1e3:g} ms one way, no loss), per step (parallel.sync, docs/diloco.md):"
    ]
    for what, step_s, nbytes in a.rows:
        vs = f"  {ddp_s / step_s:5.1f}x faster, {ddp_bytes / nbytes:,.0f}x fewer bytes" if step_s != ddp_s else ""
        lines.append(f"  {what:<44} {_ms(step_s):>9} ms   {_size(nbytes):>10} across the link{vs}")
    return [*lines, ""]


def _compression_lines(plan: Plan) -> list[str]:
    """Where compression pays: the step at the requested N over each interconnect, without and with it."""
    if not plan.compression:
        return []
    out = [plan.compression_note, f"step on {plan.devices} x {plan.gpu} by interconnect, without and with it:"]
    for name, plain, compressed in plan.compression:
        verdict = f"{plain / compressed:.2f} x faster" if compressed < plain else f"{compressed / plain:.2f} x slower"
        out.append(f"  {name:<14} {_ms(plain):>9} ms -> {_ms(compressed):>9} ms   {verdict}")
    return [*out, ""]


def _table(steps, mark: int | None = None) -> str:
    head = (
        f"{'N':>6}  {'link':<14} {'bus GB/s':>8}  {'compute ms':>10}  {'all-reduce ms':>13}  {'exposed ms':>10}  "
        f"{'tokens/s':>14}  {'efficiency':>10}  {'compute-bound from':>18}"
    )
    rows = [head]
    for s in steps:
        n = f"{s.devices}{'*' if s.devices == mark else ' '}"
        bound = f"{s.compute_bound_batch} seq" if s.compute_bound_batch else "-"
        bw = f"{s.busbw_gbs:g}" if s.devices > 1 else "-"
        rows.append(
            f"{n:>6}  {s.link:<14} {bw:>8}  {_ms(s.compute_s):>10}  {_ms(s.comm_s):>13}  {_ms(s.exposed_s):>10}  "
            f"{s.tokens_per_s:>14,.0f}  {s.efficiency:>10.1%}  {bound:>18}"
        )
    if mark in [s.devices for s in steps]:
        rows.append("(* the requested N)")
    return "\n".join(rows)


def markdown_table(cfg: Config, gpu: str = "H100", ns=(8, 64, 512), devices: int | None = None, **kw) -> str:
    """The scaling rows for `ns` as a Markdown table (for the README), at the per-device batch the config has
    on `devices` GPUs (default: the first of ns)."""
    plan = make_plan(cfg, devices or ns[0], gpu, ns=tuple(ns), **kw)
    rows = [
        "| GPUs | all-reduce over | per-device batch | compute ms | all-reduce ms | exposed ms | step ms | "
        "tokens/s | efficiency | compute-bound from (sequences per device) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in plan.scaling:
        link = f"{s.link} ({s.busbw_gbs:g} GB/s)" if s.devices > 1 else "-"
        rows.append(
            f"| {s.devices} x {gpu} | {link} | {s.per_device_batch} | {_ms(s.compute_s)} | {_ms(s.comm_s)} | "
            f"{_ms(s.exposed_s)} | {_ms(s.step_s)} | {s.tokens_per_s:,.0f} | {s.efficiency:.1%} | "
            f"{s.compute_bound_batch or '-'} |"
        )
    return "\n".join(rows)


# ---- Command line ----


def planning_assumptions(cfg: Config, config: str | None, overrides, devices: int) -> tuple[Config, list[str]]:
    """The config as planned and what the plan assumed that the config did not say: the sequence length and
    batch when neither the file nor the command line sets them (a shape config, such as llama-3.1-8b, holds model
    keys only), and a batch that splits over `devices` when the config's does not (the nearest above)."""
    given = set(explicit_keys(overrides))
    if config is not None:
        raw = read_yaml(resolve_config_path(config))
        given |= {f"{s}.{k}" for s, keys in raw.items() if isinstance(keys, dict) for k in keys}
    name, assumed = config or "the config", []
    if "data.seq_len" not in given:
        m, L = cfg.model, cfg.data.seq_len
        longest = f"; the model takes up to {m.max_seq_len:,}" if m.max_seq_len > L else ""
        assumed.append(f"data.seq_len={L} (jdp's default: {name} does not set it{longest}; give yours)")
    t, unit = cfg.train, max(devices, 1) * cfg.train.grad_accum
    whose = "the config's" if "train.batch_size" in given else f"jdp's default, which {name} does not set,"
    if t.batch_size % unit:
        batch = -(-t.batch_size // unit) * unit
        assumed.append(f"train.batch_size={batch} ({whose} {t.batch_size} does not split over {devices} devices x "
                       f"train.grad_accum={t.grad_accum}: the nearest batch above that does)")  # fmt: skip
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(t, batch_size=batch))
    elif "train.batch_size" not in given:
        assumed.append(f"train.batch_size={t.batch_size} (jdp's default: {name} does not set it; give yours)")
    return cfg, assumed


def run(args: argparse.Namespace) -> int:
    config, overrides = split_config_args(args.args)
    cfg, assumed = planning_assumptions(load_config(config, overrides), config, overrides, args.devices)
    plan = make_plan(
        cfg,
        args.devices,
        args.gpu,
        args.interconnect,
        args.bandwidth,
        args.mfu,
        args.calibrate,
        config_name=config,
        ns=tuple(sorted({*SCALING_NS, args.devices})),
        assumed=tuple(assumed),
        slow_link=args.slow_link,
    )
    print(format_plan(plan, cfg))
    if args.json:
        print(json.dumps(plan.to_dict()))
    return 0
