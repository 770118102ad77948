"""The optimizer: AdamW (or SGD) with linear warmup, cosine decay and global-norm clipping, from optax."""

from __future__ import annotations

import jax
import optax

from jdp.config import OptimConfig

__all__ = ["NO_DECAY", "decay_mask", "make_optimizer", "make_schedule"]

# Parameter-path fragments that never get weight decay: embeddings (token and position) and norms.
NO_DECAY = ("embed", "norm")


def decay_mask(params) -> object:
    """True where weight decay applies: matrices outside embeddings and norms (so never biases)."""

    def wants_decay(path, leaf) -> bool:
        names = jax.tree_util.keystr(path).lower()
        return leaf.ndim >= 2 and not any(part in names for part in NO_DECAY)

    return jax.tree_util.tree_map_with_path(wants_decay, params)


def make_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to cfg.lr, then cosine decay to cfg.lr * cfg.min_lr_ratio at total_steps."""
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.lr,
        warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1),
        end_value=cfg.lr * cfg.min_lr_ratio,
    )


def make_optimizer(cfg: OptimConfig, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    schedule = make_schedule(cfg, total_steps)
    if cfg.name == "adamw":
        opt = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=decay_mask)
    elif cfg.name == "sgd":
        opt = optax.sgd(schedule, momentum=cfg.momentum or None)
    else:
        raise ValueError(f"optim.name={cfg.name!r} must be adamw or sgd")
    if cfg.grad_clip > 0:
        opt = optax.chain(optax.clip_by_global_norm(cfg.grad_clip), opt)
    return opt, schedule
