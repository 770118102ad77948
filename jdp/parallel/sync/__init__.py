"""How the groups of devices agree on the model: one module per way, one registry (as strategies/ for the step).

`step` is today's data parallelism: every step ends in the strategy's collectives, so every device holds the same
model after every step. `diloco` (diloco.py) splits the devices into groups (`parallel.groups`, by default one per
host) that train apart with the strategy's step inside each group and agree only every `parallel.outer_every` steps:
DiLoCo's outer step over the groups' pseudo-gradients, for groups joined by a slow link (docs/diloco.md).

A way's module has `mesh(par)` (the devices and their groups), `assemble(...)` (the state and steps, as
parallelize.assemble), and `restore_like(...)` and `converted(...)` (a checkpoint of another way read and moved to
it); its entry below holds what the config asks without JAX. Nothing outside this package compares their names.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

__all__ = ["REGISTRY", "Sync", "get", "names"]


@dataclass(frozen=True)
class Sync:
    name: str
    module: str  # its mesh, state, steps ("": the strategy's own step, every step)
    summary: str
    options: tuple[str, ...] = ()  # the `parallel.*` keys it reads
    strategies: tuple[str, ...] = ()  # the strategies it runs inside a group ((): any)

    def steps(self) -> ModuleType | None:
        return importlib.import_module(self.module) if self.module else None

    def describe(self, parallel: Any) -> str:
        """A few words for the banner ("": every step, nothing to say)."""
        if "outer_every" not in self.options:
            return ""
        groups = f"{parallel.groups} groups" if parallel.groups else "a group per host"
        momentum = f", Nesterov {parallel.outer_momentum:g}" if parallel.outer_momentum else ""
        streamed = ""
        if "fragments" in self.options:
            streamed = (
                f"; {parallel.fragments} fragments, each outer step landing {parallel.outer_delay} steps later "
                f"(mix {parallel.outer_mix:g})"
            )
        return (
            f"parallel.sync={self.name}: {groups}, synced every {parallel.outer_every} steps (outer SGD lr "
            f"{parallel.outer_lr:g}{momentum}), pseudo-gradients as {parallel.outer_dtype}{streamed}"
        )

    def notes(self, parallel: Any, groups: int) -> list[str]:
        """What start-up says about running it as `parallel` with `groups` groups: one group runs (an elastic job may
        be left with one) but has no other group to agree with."""
        if "groups" not in self.options or groups != 1:
            return []
        why = "parallel.groups=1" if parallel.groups else "a group per host, and this job has one host"
        return [f"parallel.sync={self.name} with one group ({why}): no other group to agree with; each outer step "
                f"applies the outer optimizer to this group's own progress. For groups of this host's devices set "
                f"parallel.groups=N"]  # fmt: skip

    def extra_bytes(self, parallel: Any, params: int) -> tuple[int, int]:
        """(parameter, optimizer state) bytes one device holds beyond its strategy's, whose are then each group's:
        DiLoCo's round parameters and its outer momentum buffers (float32 parameters: as many bytes again each)."""
        if "outer_every" not in self.options:
            return 0, 0
        return params, params

    def group_devices(self, parallel: Any, n: int) -> int:
        """The devices of one group, out of n, that its strategy splits its state over (zero1's optimizer slices):
        n / parallel.groups; with parallel.groups=0 (a group per host) the memory check sets the hosts' count, and
        `jdp plan`, which does not know it, counts one group of n."""
        if "groups" not in self.options or not parallel.groups or n % parallel.groups:
            return n
        return n // parallel.groups

    def apart(self, parallel: Any) -> tuple[int, int]:
        """(every, lag): the groups meet every `every` steps (1: every step agrees), and a meeting's result is needed
        `lag` steps later (a streamed outer step's delay): a group can run up to every + lag + 2 steps ahead."""
        if "outer_every" not in self.options:
            return 1, 0
        return parallel.outer_every, getattr(parallel, "outer_delay", 0) if "outer_delay" in self.options else 0

    def problems(self, parallel: Any, train: Any, n_devices: int) -> list[str]:
        """What is wrong with running it as `parallel` (the config's section) on `n_devices` devices."""
        out = []
        if dataclasses.is_dataclass(parallel):
            default = type(parallel)()
            for key in dict.fromkeys(k for s in REGISTRY.values() for k in s.options if k not in self.options):
                if getattr(parallel, key) != getattr(default, key):
                    owner = next(s.name for s in REGISTRY.values() if key in s.options)
                    out.append(
                        f"parallel.{key}={getattr(parallel, key)} is an option of parallel.sync={owner}, which "
                        f"parallel.sync={self.name} does not read: leave it out, or set parallel.sync={owner}"
                    )
        if self.strategies and parallel.strategy not in self.strategies:
            out.append(
                f"parallel.sync={self.name} runs each group's inner steps with {' or '.join(self.strategies)} so far; "
                f"parallel.strategy={parallel.strategy} inside a group is not built yet (docs/diloco.md): set "
                f"parallel.strategy={self.strategies[0]}"
            )
        if "groups" in self.options:
            g = parallel.groups
            if g and n_devices and n_devices % g:
                fits = [d for d in range(1, n_devices + 1) if n_devices % d == 0]
                out.append(
                    f"parallel.groups={g} does not split the {n_devices} devices into equal groups: use one of "
                    f"{fits} (0: one group per host)"
                )
            k = getattr(parallel, "shard_size", 0)  # hsdp's (another strategy refuses it as not its option)
            if g and n_devices and n_devices % g == 0 and k and (n_devices // g) % k:
                fits = [d for d in range(1, n_devices // g + 1) if (n_devices // g) % d == 0]
                out.append(
                    f"parallel.shard_size={k} must split each of the {g} groups' {n_devices // g} devices into equal "
                    f"shards (hsdp inside each group): use one of {fits}"
                )
            f, h, d = getattr(parallel, "fragments", 1), parallel.outer_every, getattr(parallel, "outer_delay", 0)
            if h % f:
                out.append(
                    f"parallel.fragments={f} must divide parallel.outer_every={h} (each fragment syncs every {h} "
                    f"steps, the fragments evenly spread over them): use outer_every={h // f * f or f} or a divisor"
                )
            elif d >= h // f:
                out.append(
                    f"parallel.outer_delay={d} must be below parallel.outer_every / parallel.fragments = {h // f}: a "
                    f"fragment's outer step must land before the next fragment's sync"
                )
            if parallel.compression != "none":
                out.append(
                    f"parallel.compression={parallel.compression} compresses every step's gradients; with "
                    f"parallel.sync={self.name} the groups exchange pseudo-gradients only every "
                    f"parallel.outer_every steps (parallel.outer_dtype sets their bytes): set parallel.compression=none"
                )
        return out


DILOCO = ("groups", "outer_every", "outer_lr", "outer_momentum", "outer_dtype")

REGISTRY: dict[str, Sync] = {
    s.name: s
    for s in (
        Sync("step", "", "every step: the strategy's collectives (all-reduce, reduce-scatter) after each backward"),
        Sync(
            "diloco",
            "jdp.parallel.sync.diloco",
            "groups of devices train apart for parallel.outer_every steps, then average their pseudo-gradients and "
            "take one outer Nesterov step (DiLoCo)",
            options=DILOCO,
            strategies=("ddp", "zero1", "fsdp", "hsdp"),
        ),
        Sync(
            "streaming",
            "jdp.parallel.sync.diloco",
            "DiLoCo with the model in parallel.fragments fragments synced at staggered steps, each outer step landing "
            "parallel.outer_delay steps later (Streaming DiLoCo)",
            options=(*DILOCO, "fragments", "outer_delay", "outer_mix"),
            strategies=("ddp", "zero1", "fsdp", "hsdp"),
        ),
    )
}


def names() -> tuple[str, ...]:
    return tuple(REGISTRY)


def get(name: str) -> Sync:
    if name not in REGISTRY:
        raise ValueError(f"parallel.sync={name!r} must be one of {', '.join(REGISTRY)}")
    return REGISTRY[name]
