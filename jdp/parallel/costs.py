"""What a strategy costs, in the terms the planner counts: the bytes one device holds during a step (`Memory`), and
the collectives a step issues (`Traffic`: which kind, how many bytes per bucket, over which devices, what compute can
hide them).

Each strategy's module answers for itself (`state_bytes` and `traffic` in strategies/ddp.py, zero1.py, ...); the
planner (plan.py) and the memory check (memory.py) only add up and time what it says, with one ring formula per kind
of collective (`ring_s`) and a link's bandwidth and latency (hardware.py), the same for every strategy.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

__all__ = [
    "BLOCK",
    "KINDS",
    "WINDOWS",
    "Buckets",
    "Collectives",
    "Memory",
    "Traffic",
    "payload_bytes",
    "ring_s",
    "tree_bytes",
]

KINDS = ("all-reduce", "reduce-scatter", "all-gather")
WINDOWS = ("forward", "backward")  # the compute a collective may run behind


def tree_bytes(tree) -> int:
    """The bytes of a pytree of arrays or shapes."""
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def ring_s(kind: str, nbytes: float, n: int, busbw: float) -> float:
    """The bandwidth term of a ring collective over n devices (busbw in nccl-tests' sense, bytes/s): an all-reduce
    sends and receives 2 (n-1)/n of its bytes, a reduce-scatter (of its input) or an all-gather (of its output)
    (n-1)/n, half as much."""
    if kind not in KINDS:
        raise ValueError(f"a collective's kind is one of {', '.join(KINDS)}, not {kind!r}")
    if n <= 1:
        return 0.0
    share = 2 * (n - 1) / n if kind == "all-reduce" else (n - 1) / n
    return share * nbytes / busbw


BLOCK = 256  # numbers that share one scale in DiLoCo's 8- and 4-bit pseudo-gradients (per-block absmax)


def payload_bytes(n_numbers: int, dtype: str) -> int:
    """The bytes a DiLoCo pseudo-gradient of `n_numbers` numbers travels as (parallel.outer_dtype `dtype`)."""
    blocks = -(-n_numbers // BLOCK)
    per_block = {"float32": 4 * BLOCK, "bfloat16": 2 * BLOCK, "int8": BLOCK + 4, "int4": BLOCK // 2 + 4}[dtype]
    return blocks * per_block


@dataclass(frozen=True)
class Memory:
    """What one device holds during a step, in bytes: the fullest device, and in `others` what each other device
    holds where that is less (dp's master holds every gradient and the only optimizer state)."""

    params: int
    grads: int
    accumulator: int  # the running sum of micro-batch gradients (train.grad_accum > 1)
    opt_state: int
    activations: int = 0  # estimate (plan.activation_bytes): the same for every strategy
    others: Memory | None = None
    opt_note: str = ""  # how this device holds the optimizer state, for the printout ("this device's 1/8")
    # At the end of backward, beside every gradient: the bucket being reduced (ddp: its concatenation; zero1: the
    # slices scattered and gathered). The activations are gone by then, so the larger of the two counts.
    in_flight: int = 0
    # The gradients are made as backward frees the activations (fsdp's reduce-scattered shards, none at the start of
    # backward; any strategy's when blocks are recomputed: plan.device_memory), so they count against the
    # activations, at the end of backward, not beside them.
    late_grads: bool = False

    @property
    def end_of_backward(self) -> int:
        """What backward's end holds beyond the parameters, optimizer state and accumulator, where the activations
        are gone; the step holds the larger of this and the activations (with the gradients made early)."""
        return self.in_flight + (self.grads if self.late_grads else 0)

    @property
    def total(self) -> int:
        early = 0 if self.late_grads else self.grads
        return self.params + early + self.accumulator + self.opt_state + max(self.activations, self.end_of_backward)

    def with_activations(self, nbytes: int) -> Memory:
        others = self.others.with_activations(nbytes) if self.others else None
        return dataclasses.replace(self, activations=nbytes, others=others)

    def with_late_grads(self) -> Memory:
        """The same bytes, the gradients made as backward frees the activations (late_grads)."""
        others = self.others.with_late_grads() if self.others else None
        return dataclasses.replace(self, late_grads=True, others=others)

    def to_dict(self) -> dict:
        """The bytes and their total (what `jdp plan --json` prints)."""
        fields = ("params", "grads", "accumulator", "opt_state", "activations", "in_flight")
        return {**{k: getattr(self, k) for k in fields}, "total": self.total}


@dataclass(frozen=True)
class Buckets:
    """A model's gradient buckets (buckets.py), in the order backward finishes them: what a step's collectives
    carry."""

    grads: tuple[int, ...]  # each bucket's gradient bytes, in parallel.reduce_dtype
    params: tuple[int, ...]  # the same buckets' parameter bytes, in their dtype
    reduce_dtype: str
    wire: tuple[int, ...] = ()  # a communication hook's bytes on the wire per bucket instead; () without one
    wire_calls: int = 1  # the hook's collectives per bucket (PowerSGD: P, then Q)
    wire_what: str = ""  # what the hook sends, for the printout


@dataclass(frozen=True)
class Collectives:
    """One collective of one kind per bucket (or `calls` of them), as a strategy's step issues them."""

    kind: str  # one of KINDS
    what: str  # what travels, for the printout: "float32 gradients", "parameters"
    nbytes: tuple[int, ...]  # per bucket, in the order issued: a reduce-scatter's input, an all-gather's output
    overlaps: str = ""  # the compute that can hide them (one of WINDOWS: issued as it finishes each bucket); "": none
    calls: int = 1  # collectives per bucket, each paying the link's latency
    devices: int = 0  # in each ring; 0: all of the job's
    apart: int = 1  # between a ring's neighbours, in devices (a ring over one device of each group of K: K), so
    # that devices x apart > a node's GPUs crosses the network


@dataclass(frozen=True)
class Traffic:
    """Every collective of one step, and what of it shows in the step time, in words."""

    collectives: tuple[Collectives, ...]
    exposed: str
