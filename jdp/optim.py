"""The optimizer: AdamW, SGD or Muon (jdp/muon.py) with linear warmup, cosine decay and global-norm clipping, from
optax. One builder per `optim.name` below."""

from __future__ import annotations

import dataclasses

import jax
import optax

from jdp import muon
from jdp.config import ConfigError, OptimConfig, ns_coeffs

__all__ = ["BUILDERS", "NO_DECAY", "adamw_only", "decay_mask", "make_optimizer", "make_schedule", "whole_matrices"]

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


def _adamw(cfg: OptimConfig, schedule: optax.Schedule, total_steps: int) -> optax.GradientTransformation:
    return optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=decay_mask)


def _sgd(cfg: OptimConfig, schedule: optax.Schedule, total_steps: int) -> optax.GradientTransformation:
    return optax.sgd(schedule, momentum=cfg.momentum or None)


def _muon(cfg: OptimConfig, schedule: optax.Schedule, total_steps: int) -> optax.GradientTransformation:
    """Muon for the hidden matrices at optim.muon_lr (0: optim.lr) on the same warmup and decay, AdamW for the
    embeddings, norms, output head and every parameter that is not a matrix (optim.muon_adamw)."""
    rate = make_schedule(dataclasses.replace(cfg, lr=cfg.muon_lr), total_steps) if cfg.muon_lr else schedule
    return muon.muon(
        rate, schedule, beta=cfg.muon_momentum, nesterov=cfg.muon_nesterov, steps=cfg.muon_ns_steps,
        coeffs=ns_coeffs(cfg.muon_ns_coeffs), scale=cfg.muon_scale, weight_decay=cfg.weight_decay,
        adamw_only=adamw_only(cfg), decay_mask=decay_mask, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
    )  # fmt: skip


def adamw_only(cfg: OptimConfig) -> tuple[str, ...]:
    """optim.muon_adamw's name fragments: the matrices Muon leaves to AdamW."""
    return tuple(part.strip().lower() for part in cfg.muon_adamw.split(",") if part.strip())


BUILDERS = {"adamw": _adamw, "sgd": _sgd, "muon": _muon}  # optim.name -> its optax transformation


def whole_matrices(cfg: OptimConfig, params) -> list[bool]:
    """Per parameter (in leaf order), whether the optimizer needs it whole at each update: Muon's matrices, which
    a split layout (zero1, fsdp, hsdp) all-gathers onto every device for Newton-Schulz; no other optimizer's."""
    if cfg.name != "muon":
        return [False] * len(jax.tree.leaves(params))
    only = adamw_only(cfg)
    return [muon.is_matrix(path, x, only) for path, x in jax.tree_util.tree_leaves_with_path(params)]


def make_optimizer(cfg: OptimConfig, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    schedule = make_schedule(cfg, total_steps)
    if cfg.name not in BUILDERS:
        raise ConfigError(f"optim.name={cfg.name!r} must be one of {', '.join(BUILDERS)}")
    opt = BUILDERS[cfg.name](cfg, schedule, total_steps)
    if cfg.grad_clip > 0:
        opt = optax.chain(optax.clip_by_global_norm(cfg.grad_clip), opt)
    return opt, schedule
