"""jdp: PyTorch's DistributedDataParallel done the JAX way.

Library use: build a Flax NNX model and a loss `loss_fn(model, batch) -> (loss_sum, weight_sum)`, then

    mesh = jdp.make_mesh()
    graphdef, state = jdp.init_state(model, optimizer, mesh)
    step = jdp.make_train_step(graphdef, loss_fn, optimizer, mesh)
    state, metrics = step(state, jdp.shard_batch(local_batch, mesh))
"""

from jdp.config import Config, ConfigError, load_config
from jdp.model import GPT, lm_loss
from jdp.optim import make_optimizer
from jdp.parallel import (
    TrainState,
    init_state,
    make_eval_step,
    make_mesh,
    make_train_step,
    process_rows,
    replica_mismatches,
    shard_batch,
)
from jdp.train import train

__all__ = [
    "GPT",
    "Config",
    "ConfigError",
    "TrainState",
    "init_state",
    "lm_loss",
    "load_config",
    "make_eval_step",
    "make_mesh",
    "make_optimizer",
    "make_train_step",
    "process_rows",
    "replica_mismatches",
    "shard_batch",
    "train",
]
__version__ = "0.1.0"
