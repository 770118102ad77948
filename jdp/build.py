"""From a config to what a run of jdp's GPT needs: the model, the optimizer, the replicated state and the step.

Shared by training, `jdp generate` (the state's structure to restore into) and `jdp allreduce` (a step to compile).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np
import optax
from flax import nnx

from jdp import parallel
from jdp.config import Config
from jdp.model import GPT, count_params, lm_loss
from jdp.optim import make_optimizer


class Built(NamedTuple):
    graphdef: nnx.GraphDef
    state: parallel.TrainState
    train_step: object  # jitted (state, batch) -> (state, metrics)
    n_params: int
    optimizer: optax.GradientTransformation


def build(cfg: Config, mesh: jax.sharding.Mesh, model: GPT | None = None) -> Built:
    """The configured model, its initial state (laid out for parallel.strategy) and jitted train step on `mesh`.

    `model`: the parameters to start from (an import, jdp.hf.load_model); default a fresh GPT from train.seed.
    """
    model = model if model is not None else GPT(cfg.model, nnx.Rngs(cfg.train.seed))
    n_params = count_params(model)
    optimizer, schedule = make_optimizer(cfg.optim, cfg.train.steps)
    graphdef, state = parallel.init_state(model, optimizer, mesh, cfg.parallel.strategy)
    p = cfg.parallel
    train_step = parallel.make_train_step(
        graphdef,
        lm_loss,
        optimizer,
        mesh,
        cfg.train.grad_accum,
        schedule,
        strategy=p.strategy,
        bucket_mb=p.bucket_mb,
        reduce_dtype=p.reduce_dtype,
    )
    return Built(graphdef, state, train_step, n_params, optimizer)


def batch_spec(cfg: Config, mesh) -> dict[str, jax.ShapeDtypeStruct]:
    """The shapes, dtypes and sharding of a global training batch (for compiling without data)."""
    shape, sharding = (cfg.train.batch_size, cfg.data.seq_len), parallel.batch_sharding(mesh)
    return {
        "inputs": jax.ShapeDtypeStruct(shape, np.int32, sharding=sharding),
        "targets": jax.ShapeDtypeStruct(shape, np.int32, sharding=sharding),
        "weights": jax.ShapeDtypeStruct(shape, np.float32, sharding=sharding),
    }
