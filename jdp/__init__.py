"""jdp: PyTorch's DistributedDataParallel done the JAX way.

Library use: build a Flax NNX model and a loss `loss_fn(model, batch) -> (loss_sum, weight_sum)`, then

    jdp.Trainer(lambda: model, loss_fn, optimizer, data, jdp.load_config(None, ["train.run_dir=runs/x"])).fit()

runs jdp train's whole loop for it (docs/library.md); or, for a loop of your own, the bare step:

    mesh = jdp.make_mesh()
    graphdef, state = jdp.init_state(model, optimizer, mesh)
    step = jdp.make_train_step(graphdef, loss_fn, optimizer, mesh)
    state, metrics = step(state, jdp.shard_batch(local_batch, mesh))  # donates `state`: go on with the new one

A state passed to the step is consumed (its memory holds the new state); passing it again, a loss that returns a
mean, or a global batch whose rows do not split into devices x grad_accum raises jdp.ConfigError with the fix.

The names below (and jdp's modules, e.g. `jdp.parallel`) load on first use, so `import jdp` and the `jdp`
command start without importing JAX.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import TYPE_CHECKING

from jdp import moved as _moved

_EXPORTS = {
    "Config": "jdp.config",
    "ConfigError": "jdp.config",
    "load_config": "jdp.config",
    "load": "jdp.checkpoint",
    "GPT": "jdp.models.gpt",
    "Llama": "jdp.models.llama",
    "make_model": "jdp.models",
    "lm_loss": "jdp.models.common",
    "make_optimizer": "jdp.optim",
    "AXIS": "jdp.parallel",
    "TrainState": "jdp.parallel",
    "init_state": "jdp.parallel",
    "make_eval_step": "jdp.parallel",
    "make_mesh": "jdp.parallel",
    "make_train_step": "jdp.parallel",
    "process_rows": "jdp.parallel",
    "replica_mismatches": "jdp.parallel",
    "shard_batch": "jdp.parallel",
    "train": "jdp.lm",
    "Trainer": "jdp.trainer",
    "RunError": "jdp.trainer",
    "every": "jdp.callbacks",
    "Callback": "jdp.callbacks",
    "StepInfo": "jdp.callbacks",
    "Loader": "jdp.data.dataset",
    "RowDropout": "jdp.nn",
}
__all__ = [
    "AXIS",
    "GPT",
    "Callback",
    "Llama",
    "Config",
    "ConfigError",
    "Loader",
    "RowDropout",
    "RunError",
    "StepInfo",
    "Trainer",
    "TrainState",
    "init_state",
    "lm_loss",
    "load",
    "load_config",
    "make_eval_step",
    "make_mesh",
    "make_model",
    "make_optimizer",
    "make_train_step",
    "process_rows",
    "replica_mismatches",
    "shard_batch",
    "every",
    "train",
]
__version__ = "0.1.0"
_moved.install(sys.meta_path)  # the module paths the redesign moved import for one more release, with a warning


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif importlib.util.find_spec(f"{__name__}.{name}") is not None:  # a module: jdp.parallel, jdp.hf, ...
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


if TYPE_CHECKING:
    from jdp.callbacks import Callback, StepInfo, every
    from jdp.checkpoint import load
    from jdp.config import Config, ConfigError, load_config
    from jdp.data.dataset import Loader
    from jdp.lm import train
    from jdp.models import make_model
    from jdp.models.common import lm_loss
    from jdp.models.gpt import GPT
    from jdp.models.llama import Llama
    from jdp.nn import RowDropout
    from jdp.optim import make_optimizer
    from jdp.parallel import (
        AXIS,
        TrainState,
        init_state,
        make_eval_step,
        make_mesh,
        make_train_step,
        process_rows,
        replica_mismatches,
        shard_batch,
    )
    from jdp.trainer import RunError, Trainer
