"""From a config to what a run of jdp's model (GPT or Llama) needs: the model, the optimizer, the replicated state
and the step.

Shared by training, `jdp generate` (the state's structure to restore into) and `jdp allreduce` (a step to compile).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np
import optax
from flax import nnx

from jdp import hf, parallel, peft
from jdp.config import Config, ParallelConfig
from jdp.models import make_model
from jdp.models.common import count_params, lm_loss
from jdp.optim import make_optimizer
from jdp.parallel.comm_hooks import CommHook, PowerSGD
from jdp.parallel.remat import Remat


class Built(NamedTuple):
    graphdef: nnx.GraphDef
    state: parallel.TrainState
    train_step: object  # jitted (state, batch) -> (state, metrics)
    n_params: int
    optimizer: optax.GradientTransformation
    comm_hook: CommHook | None  # parallel.compression's hook


def build(cfg: Config, mesh: jax.sharding.Mesh, model: nnx.Module | None = None) -> Built:
    """The configured model, its initial state (laid out for parallel.strategy) and jitted train step on `mesh`.

    `model`: the parameters to start from (an import, jdp.hf.load_model); default a fresh model.arch from train.seed.
    """
    if model is None:  # a fresh model (with its adapters): the structure and a step to compile, no import read
        model = make_model(cfg.model, nnx.Rngs(cfg.train.seed))
        if cfg.model.lora_rank:
            peft.add_adapters(model, cfg.model, cfg.train.seed)
    n_params = count_params(model)
    optimizer, schedule = make_optimizer(cfg.optim, cfg.train.steps)
    p = cfg.parallel
    hook = comm_hook(p, cfg.train.seed)
    a = parallel.assemble(model, lm_loss, optimizer, mesh, p, cfg.train.grad_accum, schedule, hook,
                          remat=Remat.of(cfg.model))
    return Built(a.graphdef, a.state, a.train_step, n_params, optimizer, hook)


def run_model(cfg: Config) -> tuple[nnx.Module, hf.Imported | None]:
    """The model a run of `cfg` starts from, and what an import read (None: made from train.seed): train.init_from's
    or a fresh model.arch, with the adapters model.lora_* ask for (adapters.py), train.init_adapter's read in."""
    imported = None
    if cfg.train.init_from:
        model, imported = hf.load_model(cfg.model, cfg.train.init_from)
    else:
        model = make_model(cfg.model, nnx.Rngs(cfg.train.seed))
    if cfg.model.lora_rank:
        peft.add_adapters(model, cfg.model, cfg.train.seed)
        if cfg.train.init_adapter:
            peft.load_adapter(model, cfg, cfg.train.init_adapter)
    return model, imported


def comm_hook(p: ParallelConfig, seed: int = 0) -> CommHook | None:
    """The communication hook parallel.compression asks for (None: the built-in mean in parallel.reduce_dtype)."""
    if p.compression == "powersgd":
        return PowerSGD(
            rank=p.powersgd_rank,
            start_step=p.powersgd_warmup,
            error_feedback=p.powersgd_error_feedback,
            min_ratio=p.powersgd_min_ratio,
            seed=seed,
            dtype=p.reduce_dtype,
            uncompressed=tuple(part.strip() for part in p.powersgd_uncompressed.split(",") if part.strip()),
        )
    return None


def batch_spec(cfg: Config, mesh) -> dict[str, jax.ShapeDtypeStruct]:
    """The shapes, dtypes and sharding of a global training batch (for compiling without data)."""
    shape, sharding = (cfg.train.batch_size, cfg.data.seq_len), parallel.batch_sharding(mesh)
    return {
        "inputs": jax.ShapeDtypeStruct(shape, np.int32, sharding=sharding),
        "targets": jax.ShapeDtypeStruct(shape, np.int32, sharding=sharding),
        "weights": jax.ShapeDtypeStruct(shape, np.float32, sharding=sharding),
        **(
            {k: jax.ShapeDtypeStruct(shape, np.int32, sharding=sharding) for k in ("segments", "positions")}
            if cfg.data.document_attention == "within"
            else {}
        ),  # fmt: skip
    }
