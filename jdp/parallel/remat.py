"""Activation recomputation (`model.remat`, PyTorch's activation checkpointing, MaxText's `remat_policy`): which of
a block's activations backward keeps, and which it computes again from the block's input.

The unit is a block of the model's repeated blocks: each module of an `nnx.List` of modules the model holds
(`blocks.<i>` in GPT and Llama; a library model marks its blocks the same way, by holding them in an `nnx.List`),
the unit fsdp gathers too. Each recomputed block runs under `jax.checkpoint` with the policy's rule for what it
saves:

- `none`: everything backward needs is kept (no recomputation; fsdp's resharded blocks still recompute their
  elementwise work, as they always have: `dots` below, with matrix products of batch dimensions saved too);
- `dots`: the outputs of the matrix products without batch dimensions are kept (the q/k/v, output and MLP
  projections: MaxText's `minimal`); attention's scores and probabilities, the norms and the activation functions
  are computed again;
- `full`: only the block's input is kept; its whole forward runs again in backward.

`model.remat_every=N` recomputes blocks 0, N, 2N, ... and keeps every other block's activations (torchtitan's
layer-selective checkpointing): between `none` and the policy in memory and time.

The rule is one mechanism for every strategy: the loss function the strategies differentiate runs the model with
its blocks wrapped (`recomputing`); a block that already runs under `jax.checkpoint` (fsdp's gathered blocks, which
gather their parameters again in backward) takes the policy instead of being wrapped twice. Recomputation changes
what is stored, never what is computed: the losses and gradients are the same to float32 rounding
(tests/test_remat.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
from flax import nnx

from jdp.errors import ConfigError

__all__ = ["POLICIES", "Remat", "blocks_of", "recomputing"]

POLICIES = {
    "none": None,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
}
RESHARD = jax.checkpoint_policies.dots_saveable  # fsdp's resharded blocks under model.remat=none


@dataclass(frozen=True)
class Remat:
    """model.remat and model.remat_every."""

    policy: str = "none"
    every: int = 1

    @staticmethod
    def of(model_cfg) -> Remat:
        return Remat(getattr(model_cfg, "remat", "none"), getattr(model_cfg, "remat_every", 1))

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"model.remat={self.policy!r} must be one of {', '.join(POLICIES)}")
        if not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"model.remat_every={self.every!r} must be a whole number >= 1")

    def recomputes(self, i: int) -> bool:
        """Whether block i (of the model's repeated blocks, counted from 0) is recomputed."""
        return self.policy != "none" and i % self.every == 0

    def check(self, model: nnx.Module) -> list[tuple[object, int]]:
        """The model's blocks (blocks_of); a model with none is refused when anything is to be recomputed."""
        blocks = blocks_of(model)
        if self.policy != "none" and not blocks:
            raise ConfigError(
                f"model.remat={self.policy}: {type(model).__name__} holds no nnx.List of modules, the repeated blocks "
                f"jdp recomputes; hold its blocks in an nnx.List (self.blocks = nnx.List([...])), or set "
                f"model.remat=none"
            )
        return blocks

    def blocks(self, n_blocks: int) -> int:
        """How many of n_blocks blocks are recomputed."""
        return sum(self.recomputes(i) for i in range(n_blocks))


def blocks_of(model: nnx.Module) -> list[tuple[object, int]]:
    """The model's repeated blocks, as (their nnx.List, index): every item of an nnx.List of modules the model
    holds outside any such list, in the order nnx walks the model (a model with an encoder's and a decoder's list
    has both)."""
    out = []
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.List) and len(node) and not any(isinstance(p, int) for p in path):
            if all(isinstance(item, nnx.Module) for item in node):
                out += [(node, i) for i in range(len(node))]
    return out


class Recomputed(nnx.Module):
    """A block run under jax.checkpoint with a policy: its variables (parameters and the rest) and its array
    arguments are the checkpointed function's inputs; its other variables' new values (rng counts, statistics)
    come back out."""

    def __init__(self, module: nnx.Module, policy):
        self.module, self.policy = module, policy

    def __call__(self, *args, **kwargs):
        graphdef, state = nnx.split(self.module)
        arrays = {i: a for i, a in enumerate(args) if isinstance(a, jax.Array)}
        named = {k: a for k, a in kwargs.items() if isinstance(a, jax.Array)}

        def run(state, arrays, named):
            module = nnx.merge(graphdef, state)
            out = module(*[arrays.get(i, a) for i, a in enumerate(args)], **{**kwargs, **named})
            return out, nnx.state(module)

        out, state = jax.checkpoint(run, policy=self.policy)(state, arrays, named)
        nnx.update(self.module, state)
        return out


def recomputing(loss_fn: Callable, remat: Remat) -> Callable:
    """loss_fn(model, batch), with the model's blocks that `remat` names recomputed in backward (unchanged for
    model.remat=none). A block with a `recompute(policy)` method (fsdp's gathered block) is told the policy."""
    if remat.policy == "none":
        return loss_fn
    policy = POLICIES[remat.policy]

    def loss(model, batch):
        swapped = []
        for i, (container, k) in enumerate(remat.check(model)):
            if not remat.recomputes(i):
                continue
            block = container[k]
            if callable(getattr(block, "recompute", None)):
                swapped.append((container, k, block, block.recompute(policy)))
            else:
                container[k] = Recomputed(block, policy)
                swapped.append((container, k, block, None))
        try:
            return loss_fn(model, batch)
        finally:
            for container, k, block, before in reversed(swapped):
                if before is None:
                    container[k] = block
                else:
                    block.recompute(before)

    loss.__name__ = getattr(loss_fn, "__name__", "loss")
    loss.__wrapped__ = loss_fn
    return loss
