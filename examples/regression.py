"""A regression MLP with a mean-squared-error loss, trained through jdp.Trainer on a dict of numpy arrays.

    python examples/regression.py --run-dir runs/regression --steps 300

The target is y = sin(3 x0) + x1^2 plus noise; the loss is a sum of squared errors with its count, so that jdp forms
the exact global mean. Any indexable data works the same way: a dict of equal-length arrays, a Hugging Face
Dataset, or an object with `len()` and `__getitem__` returning a dict per row.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jdp


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(2, 64, rngs=rngs)
        self.out = nnx.Linear(64, 1, rngs=rngs)

    def __call__(self, x_BxF):
        return self.out(nnx.gelu(self.hidden(x_BxF)))[:, 0]


def loss_fn(model: MLP, batch: dict) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(sum of squared errors, number of examples)."""
    err = model(batch["x"]) - batch["y"]
    return jnp.sum(err * err), jnp.float32(err.shape[0])


def make_data(n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, (n, 2)).astype(np.float32)
    y = (np.sin(3 * x[:, 0]) + x[:, 1] ** 2 + rng.normal(0, 0.05, n)).astype(np.float32)
    return {"x": x, "y": y}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args(argv)
    config = jdp.load_config(None, [f"train.run_dir={args.run_dir}", f"train.steps={args.steps}",
                                    "train.batch_size=64", "train.eval_every=100"])  # fmt: skip
    result = jdp.Trainer(
        lambda: MLP(nnx.Rngs(0)), loss_fn, optax.adam(1e-2), make_data(4096, 0), config, eval_data=make_data(500, 1)
    ).fit()
    if "state" in result and jax.process_index() == 0:  # the final line once, from process 0
        print(f"regression: mean squared error {result['loss']:.4f}, eval {result.get('eval_loss', float('nan')):.4f}")
    return result


if __name__ == "__main__":
    main()
