"""The strategies: how the data-parallel step keeps and updates the state. One module each, one registry.

A strategy's module (`ddp.py`, `zero1.py`, `dp.py`) holds what needs JAX: `layout(mesh)` (how its optimizer state
lies, which checkpoints record), `opt_shardings(shapes, mesh)` (where that state lives), `make_train_step(...)`, and
what it costs, in jdp/parallel/costs.py's terms: `state_bytes(...)` (what one device holds; the memory check and `jdp plan`
add the activations) and `traffic(buckets, n, grad_accum)` (the collectives of one step, which `jdp plan` times on
a link). Its entry below holds what the rest of jdp asks about it without importing JAX (the `jdp` command starts
without it): the config checks, its XLA options, and a few words for the planner's and the memory check's messages.
Nothing outside this package compares strategy names (tests/test_shape.py checks it).

Adding a strategy is one module with those functions and one entry here (and its name in README's module table):
the config accepts its name, `jdp train` and the library run it, the memory check counts its bytes, and `jdp plan`
prints it beside the others (where its entry names the collective its gradients travel by), with no line changed
elsewhere (docs/planning.md).
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from jdp.errors import ConfigError
from jdp.job import xla

__all__ = ["REGISTRY", "Strategy", "get", "names"]


@dataclass(frozen=True)
class Strategy:
    name: str
    module: str  # its layout, placement, step and costs (imported on first use)
    summary: str
    comm_hooks: bool = False  # a communication hook (comm_hooks.py) may replace the mean of its gradient buckets
    one_process: bool = False  # cannot span processes
    split_optimizer: bool = False  # each device keeps 1/N of the optimizer state (the memory check suggests it)
    master: bool = False  # one device receives every gradient and keeps the optimizer state (messages name it)
    gradients: str = "all-reduce"  # the collective gradients travel by ("": gathered onto the master, not planned)
    gathers_parameters: bool = False  # the updated parameters are all-gathered (`jdp allreduce` matches them)
    combine_cpu_all_reduces: bool = False  # XLA:CPU may merge its all-reduces (they are scalars only)
    instead: tuple[str, ...] = ()  # what the memory check suggests when this one does not fit, in order
    saves: str = ""  # why it needs less memory than the others, for that suggestion ({n}: devices, {opt}: bytes)
    options: tuple[str, ...] = ()  # the `parallel.*` keys its make_train_step and costs take as keyword arguments
    groups: bool = False  # runs on a mesh of groups of parallel.shard_size devices (jdp.make_mesh(shard_size=K))

    @property
    def planned(self) -> bool:
        """Whether `jdp plan` and `jdp allreduce` model it (a collective per bucket)."""
        return bool(self.gradients)

    def steps(self) -> ModuleType:
        """Its module: layout(mesh), opt_shardings(shapes, mesh), make_train_step(...)."""
        return importlib.import_module(self.module)

    def costs(self) -> ModuleType:
        """Its module, for what it costs: state_bytes(params, opt_state, optimizer, n, grad_accum) -> costs.Memory,
        and where planned, traffic(buckets, n, grad_accum) -> costs.Traffic."""
        return importlib.import_module(self.module)

    def problems(self, parallel: Any, n_processes: int, n_devices: int = 0) -> list[str]:
        """What is wrong with running it as `parallel` (the config's section) on `n_processes` processes and
        `n_devices` devices."""
        out = self._foreign_options(parallel)
        k = getattr(parallel, "shard_size", 0)
        if self.groups and n_devices and (k < 1 or n_devices % k):
            fits = [d for d in range(1, n_devices + 1) if n_devices % d == 0]
            out.append(
                f"parallel.strategy={self.name} splits the state inside groups of parallel.shard_size devices (a "
                f"node's); shard_size={k} does not divide the {n_devices} devices: use one of {fits}"
            )
        if self.one_process and n_processes > 1:
            out.append(
                f"parallel.strategy={self.name} is PyTorch DataParallel's single-process master pattern and cannot "
                f"span {n_processes} processes; use parallel.strategy=ddp"
            )
        if parallel.compression != "none" and not self.comm_hooks:
            out.append(
                f"parallel.compression={parallel.compression} compresses ddp's gradient all-reduces; "
                f"parallel.strategy={self.name} has none (use parallel.strategy=ddp, or parallel.compression=none)"
            )
        return out

    def _foreign_options(self, parallel: Any) -> list[str]:
        """Another strategy's options set away from their defaults: ignored by this one, so refused (a
        parallel.shard_size meant for hsdp under fsdp would be dropped without a word)."""
        if not dataclasses.is_dataclass(parallel):
            return []
        default, out = type(parallel)(), []
        for key in dict.fromkeys(k for s in REGISTRY.values() for k in s.options if k not in self.options):
            if getattr(parallel, key) != getattr(default, key):
                owners = [s.name for s in REGISTRY.values() if key in s.options]
                out.append(
                    f"parallel.{key}={getattr(parallel, key)} is an option of {' and '.join(owners)}, which "
                    f"parallel.strategy={self.name} does not read: leave it out, or set parallel.strategy={owners[0]}"
                )
        return out

    def options_of(self, parallel: Any) -> dict:
        """Its options' values from the config's `parallel` section."""
        return {k: getattr(parallel, k) for k in self.options}

    def xla_flags(self, bucket_mb: float) -> dict[str, str]:
        return xla.collective_flags(bucket_mb, self.combine_cpu_all_reduces)

    def set_xla_flags(self, bucket_mb: float = 25.0, environ: dict | None = None) -> list[str]:
        """Its XLA options into XLA_FLAGS where the user has not set them (xla.set_xla_flags)."""
        return xla.set_xla_flags(bucket_mb, environ, self.combine_cpu_all_reduces)


REGISTRY: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy(
            "ddp",
            "jdp.parallel.strategies.ddp",
            "every device keeps everything; gradients all-reduced in buckets; every replica updates",
            comm_hooks=True,
            instead=("zero1", "fsdp"),
            saves="no master gathers every device's gradients",
        ),
        Strategy(
            "zero1",
            "jdp.parallel.strategies.zero1",
            "ddp with the optimizer state split over the devices: reduce-scatter, update a slice, all-gather",
            split_optimizer=True,
            gradients="reduce-scatter",
            gathers_parameters=True,
            combine_cpu_all_reduces=True,
            saves="each device keeps 1/{n} of the optimizer state, {opt}",
            instead=("fsdp",),
        ),
        Strategy(
            "fsdp",
            "jdp.parallel.strategies.fsdp",
            "parameters, gradients and optimizer state split over the devices; each block gathered for its forward "
            "and backward, its gradients reduce-scattered (ZeRO-3, PyTorch FSDP2)",
            split_optimizer=True,
            gradients="reduce-scatter",
            gathers_parameters=True,
            combine_cpu_all_reduces=True,
            saves="each device keeps 1/{n} of the parameters, gradients and optimizer state",
            options=("reshard_after_forward", "accumulate_unsharded"),
        ),
        Strategy(
            "hsdp",
            "jdp.parallel.strategies.hsdp",
            "fsdp inside each group of parallel.shard_size devices (a node), the groups replicas of each other: "
            "gathers and reduce-scatters inside a group, the gradient shards all-reduced across groups",
            split_optimizer=True,
            gradients="reduce-scatter",
            gathers_parameters=True,
            combine_cpu_all_reduces=True,
            saves="each device keeps 1/parallel.shard_size of the parameters, gradients and optimizer state",
            options=("reshard_after_forward", "accumulate_unsharded", "shard_size"),
            groups=True,
        ),
        Strategy(
            "dp",
            "jdp.parallel.strategies.dp",
            "PyTorch DataParallel's master: gradients gathered, one device updates, parameters broadcast (a baseline)",
            one_process=True,
            master=True,
            gradients="",
            instead=("ddp", "zero1", "fsdp"),
        ),
    )
}


def names() -> tuple[str, ...]:
    return tuple(REGISTRY)


def get(name: str) -> Strategy:
    if name not in REGISTRY:
        raise ConfigError(f"strategy={name!r} must be one of {', '.join(REGISTRY)}")
    return REGISTRY[name]
