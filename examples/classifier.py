"""A small CNN classifier with BatchNorm and Dropout, trained through jdp.Trainer on a labelled dataset it makes.

    python examples/classifier.py --run-dir runs/classifier --steps 200
    jdp launch --nproc-per-node 2 -- python examples/classifier.py --run-dir runs/classifier

Each image is 8x8 noise with a bright 3x3 square in one of four quadrants; the label is the quadrant. The data is a
Hugging Face `datasets.Dataset` with `image` and `label` columns, read by jdp in its global order (batch s is a pure
function of (seed, s); each process reads only its rows). BatchNorm uses the global batch's statistics
(`axis_name=jdp.AXIS`, SyncBatchNorm's semantics) and dropout masks are keyed by (seed, step, global row)
(`jdp.nn.RowDropout`), so 1 device and N devices train the same model. Run it again on the same --run-dir and it
resumes from the newest checkpoint (after a kill too); it ends by writing RUN_DIR/summary.json like `jdp train`.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jdp


def make_dataset(n: int, seed: int):
    """n labelled 8x8 images as a Hugging Face Dataset (columns `image`: (8, 8, 1) float32, `label`: int)."""
    import datasets

    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 4, n)
    images = rng.normal(0.0, 0.5, (n, 8, 8, 1)).astype(np.float32)
    for i, label in enumerate(labels):
        r, c = divmod(int(label), 2)
        images[i, 4 * r : 4 * r + 3, 4 * c : 4 * c + 3, 0] += 2.0
    return datasets.Dataset.from_dict({"image": images, "label": labels}).with_format("numpy")


class CNN(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, dropout: float = 0.2, batch_stats: str = "global"):
        axis = jdp.AXIS if batch_stats == "global" else None  # global: statistics over every device's rows
        # No bias before BatchNorm: its gradient is exactly zero but for rounding, which Adam would turn into
        # full-size steps that the running mean (and so evaluation) then carries.
        self.conv = nnx.Conv(1, 16, (3, 3), use_bias=False, rngs=rngs)
        self.norm = nnx.BatchNorm(16, axis_name=axis, rngs=rngs)
        self.drop = jdp.nn.RowDropout(dropout, rngs=rngs)  # each row's mask from (seed, step, global row)
        self.out = nnx.Linear(16 * 4 * 4, 4, rngs=rngs)

    def __call__(self, x_BxHxWxC):
        x = nnx.relu(self.norm(self.conv(x_BxHxWxC)))
        x = nnx.max_pool(x, (2, 2), strides=(2, 2))
        return self.out(self.drop(x.reshape(x.shape[0], -1)))


def loss_fn(model: CNN, batch: dict) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(sum of the examples' cross-entropies, number of examples): jdp forms the exact global mean."""
    losses = optax.softmax_cross_entropy_with_integer_labels(model(batch["image"]), batch["label"])
    return losses.sum(), jnp.float32(losses.shape[0])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--batch-stats", choices=("global", "local"), default="global")
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="more config, as jdp train takes it")
    args = p.parse_args(argv)
    config = jdp.load_config(None, [
        f"train.run_dir={args.run_dir}", f"train.steps={args.steps}", f"train.batch_size={args.batch_size}",
        f"train.ckpt_every={args.ckpt_every}", "train.eval_every=100", "train.log_every=10", *args.overrides,
    ])  # fmt: skip
    trainer = jdp.Trainer(
        lambda: CNN(nnx.Rngs(config.train.seed), batch_stats=args.batch_stats),  # built once the job has started
        loss_fn,
        optax.adam(3e-3),
        make_dataset(2048, seed=0),
        config,
        eval_data=make_dataset(256, seed=1),
        handle_signals=True,  # SIGTERM: every process stops at one agreed step and saves
    )
    result = trainer.fit()
    if "state" in result and jax.process_index() == 0:  # the final line once, from process 0
        print(f"classifier: loss {result['loss']:.4f}, eval_loss {result.get('eval_loss', float('nan')):.4f}")
    return result


if __name__ == "__main__":
    main()
