"""Layers whose randomness does not depend on how the batch is split: RowDropout, dropout keyed by the global row.

nnx.Dropout draws one mask for the rows a device holds, from a stream jdp's step derives from (seed, step,
device): correct, but 4 devices and 1 device draw different masks for the same example, so they train differently.
RowDropout draws each example's mask from (its key, the step, the example's global row in the global batch): the
same example gets the same mask on any number of devices and any grad_accum, so N devices = 1 device holds with
dropout on. The model never sees a mesh: jdp's step fills in the rows and the step (jdp/parallel/).
"""

from __future__ import annotations

__all__ = ["Frozen", "RowDropout", "RowIds", "RowKey"]

import jax
import jax.numpy as jnp
from flax import nnx


class Frozen(nnx.Variable):
    """A parameter that does not train: no gradient is computed for it, no optimizer state kept, no collective
    carries it, and checkpoints leave it out (a fingerprint of it is kept instead). LoRA's base (jdp/adapters.py)
    is made of these; jdp's step splits them off the other variables before anything is differentiated."""


class RowKey(nnx.Variable):
    """RowDropout's key. jdp's step folds in the step number for each forward and puts the key back afterwards;
    unlike nnx.RngKey it never folds in the device."""


class RowIds(nnx.Variable):
    """The global rows (int32, one per example) of the batch a forward computes: set by jdp's step before each
    (micro-)batch and put back afterwards. Outside jdp's step it holds [-1]: the rows are then numbered 0, 1, ...."""


class RowDropout(nnx.Module):
    """Dropout whose mask for an example depends only on (key, step, global row): inputs (rows, ...).

    Like nnx.Dropout: zeroes each element with probability `rate` and scales the rest by 1 / (1 - rate);
    `deterministic=True` (or model.eval()) turns it off. Each example's mask is drawn over its own shape
    (inputs.shape[1:]). A RowDropout module applied twice in one forward draws the same mask both times: use
    one module per place.
    """

    def __init__(self, rate: float, *, deterministic: bool = False, rng_collection: str = "dropout", rngs: nnx.Rngs):
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"RowDropout(rate={rate!r}): the rate is a probability, from 0 to 1")
        self.rate = rate
        self.deterministic = deterministic
        self.key = RowKey(rngs[rng_collection]())
        self.rows = RowIds(jnp.full((1,), -1, jnp.int32))  # outside jdp's step (not size 0: checkpoints skip those)

    def __call__(self, inputs: jax.Array, *, deterministic: bool | None = None) -> jax.Array:
        deterministic = self.deterministic if deterministic is None else deterministic
        if deterministic or self.rate == 0.0:
            return inputs
        if self.rate == 1.0:
            return jnp.zeros_like(inputs)
        rows = self.rows[...]
        if rows.shape[0] != inputs.shape[0] and rows.shape == (1,):  # outside jdp's step: rows 0, 1, ...
            rows = jnp.arange(inputs.shape[0], dtype=jnp.int32)
        elif rows.shape[0] == 1:  # one row: -1 outside jdp's step
            rows = jnp.maximum(rows, 0)
        elif rows.shape[0] != inputs.shape[0]:
            raise ValueError(
                f"RowDropout got inputs of shape {inputs.shape}, whose first axis is not the batch's "
                f"{rows.shape[0]} rows: apply it to arrays with one row per example (rows first)"
            )
        keep = 1.0 - self.rate
        key = self.key[...]

        def row_mask(row):
            return jax.random.bernoulli(jax.random.fold_in(key, row), keep, inputs.shape[1:])

        mask = jax.vmap(row_mask)(rows)
        return jax.lax.select(mask, inputs / keep, jnp.zeros_like(inputs))

    def set_view(self, deterministic: bool | None = None):
        """nnx.view's hook, as nnx.Dropout's."""
        if deterministic is not None:
            self.deterministic = deterministic
