"""Preference objectives (train.objective=dpo|ipo|simpo|orpo) on pairs of a chosen and a rejected answer
(data.format=preference), each as TRL defines it, and the reference model they compare with.

Each answer's log-probability is the sum of its tokens' log-probabilities (`answer_logps`), or their mean for
SimPO, IPO's scores and ORPO, as TRL takes them. With c, r the policy's and c0, r0 the reference's, per pair:

  dpo    (DPOTrainer, loss_type=sigmoid)  d = (c - c0) - (r - r0); loss = -(1-e) log s(b d) - e log s(-b d)
                                          (e: train.label_smoothing, cDPO; TRL 1.x's sigmoid is e = 0)
  ipo    (DPOTrainer, loss_type=ipo)      d = (c - c0)/|c| - (r - r0)/|r|; loss = (d - 1/(2b))^2
  simpo  (CPOTrainer, loss_type=simpo, cpo_alpha=0)  d = c/|c| - r/|r| - g/b; loss = -(1-e) log s(b d) - e log s(-b d)
  orpo   (ORPOTrainer)                    a = c/|c|, a' = r/|r|; o = (a - a') - (log(1-exp a) - log(1-exp a'));
                                          loss = -a - l log s(o)   (-a: the chosen answer's mean NLL)

b: train.beta, g: train.simpo_gamma, l: train.orpo_lambda, s: the sigmoid, |c|: the answer's tokens. The loss is
the mean over the batch's pairs (jdp's loss contract: the sum and the number of pairs, so N devices = 1). Metrics,
under TRL's names, are means over pairs: rewards/chosen = b (c - c0) (SimPO: b c/|c|; ORPO: l c/|c|),
rewards/rejected, rewards/accuracies (chosen > rejected), rewards/margins, logps/chosen, logps/rejected (the
log-probabilities the loss reads); ORPO adds nll_loss, log_odds_ratio and log_odds_chosen.

The reference (dpo and ipo): with LoRA, the same model with its adapters off (`adapters.disabled`; no second copy,
as TRL does for a new PEFT adapter); otherwise a frozen copy of the starting weights (`with_reference`), every one
of its variables a jdp.nn.Frozen: no gradient, optimizer state or collective touches it, checkpoints leave it out
(the starting model is made again on resume), and fsdp holds it in rows like LoRA's base. Or, with
train.precompute_reference=true, neither: every pair's reference log-probabilities are computed once by the
starting model before the first step (`reference_logps`), kept with the run and read from each batch (`ref_logps`).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jdp import adapters
from jdp.nn import Frozen

__all__ = ["REFERENCE", "answer_logps", "holds_copy", "log1mexp", "losses", "make_loss", "needs_reference",
           "reference_logps", "sequences_per_row", "with_reference"]  # fmt: skip

REFERENCE = "preference_reference"  # the model's attribute that holds the frozen reference copy


def needs_reference(objective: str) -> bool:
    return objective in ("dpo", "ipo")


def holds_copy(cfg) -> bool:
    """Whether a run of the config `cfg` holds its reference as a frozen copy in the model: dpo and ipo, without
    LoRA (whose base is the reference) and without a precomputed reference (train.precompute_reference)."""
    t = cfg.train
    return needs_reference(t.objective) and not cfg.model.lora_rank and not t.precompute_reference


def sequences_per_row(objective: str) -> int:
    """Sequences one row of the batch holds: a pair's two answers under a preference objective."""
    return 1 if objective == "lm" else 2


def answer_logps(model, batch) -> tuple[jax.Array, jax.Array]:
    """Each answer's summed log-probability and its number of tokens, (pairs, 2) each: chosen, rejected. The two
    answers of every pair go through the model as one batch of 2 x pairs sequences (TRL's concatenated forward)."""
    pairs, two, length = batch["inputs"].shape
    logits = model(batch["inputs"].reshape(pairs * two, length))
    targets = batch["targets"].reshape(pairs * two, length)
    logp = -optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    weights = batch["weights"].reshape(pairs * two, length).astype(jnp.float32)
    return jnp.sum(logp * weights, axis=-1).reshape(pairs, two), jnp.sum(weights, axis=-1).reshape(pairs, two)


def log1mexp(x: jax.Array) -> jax.Array:
    """log(1 - exp(x)) for x < 0, accurate near 0 and far below it."""
    return jnp.where(x > -jnp.log(2.0), jnp.log(-jnp.expm1(x)), jnp.log1p(-jnp.exp(x)))


def _smoothed(z: jax.Array, eps: float) -> jax.Array:
    return -(1 - eps) * jax.nn.log_sigmoid(z) - eps * jax.nn.log_sigmoid(-z)


def losses(objective: str, logps, counts, ref=None, *, beta=0.1, label_smoothing=0.0, simpo_gamma=0.5,
           orpo_lambda=0.1) -> tuple[jax.Array, dict[str, jax.Array]]:  # fmt: skip
    """Per pair: (loss, {metric: value}) from the policy's (pairs, 2) answer log-prob sums, their token counts and
    the reference's sums (dpo, ipo). The module's docstring has the formulas."""
    n = jnp.maximum(counts, 1.0)
    mean = logps / n
    extra = {}
    if objective in ("dpo", "ipo"):
        ratios = logps - ref
        rewards, shown = beta * ratios, logps
        if objective == "dpo":
            loss = _smoothed(beta * (ratios[:, 0] - ratios[:, 1]), label_smoothing)
        else:
            loss = ((ratios[:, 0] / n[:, 0] - ratios[:, 1] / n[:, 1]) - 1 / (2 * beta)) ** 2
    elif objective == "simpo":
        rewards, shown = beta * mean, mean
        loss = _smoothed(beta * ((mean[:, 0] - mean[:, 1]) - simpo_gamma / beta), label_smoothing)
    elif objective == "orpo":
        rewards, shown = orpo_lambda * mean, mean
        log_odds = (mean[:, 0] - mean[:, 1]) - (log1mexp(mean[:, 0]) - log1mexp(mean[:, 1]))
        ratio = jax.nn.log_sigmoid(log_odds)
        nll = -mean[:, 0]
        loss = nll - orpo_lambda * ratio
        extra = {"nll_loss": nll, "log_odds_ratio": ratio, "log_odds_chosen": log_odds}
    else:
        raise ValueError(f"train.objective={objective!r} is not a preference objective")
    metrics = {
        "rewards/chosen": rewards[:, 0],
        "rewards/rejected": rewards[:, 1],
        "rewards/accuracies": (rewards[:, 0] > rewards[:, 1]).astype(jnp.float32),
        "rewards/margins": rewards[:, 0] - rewards[:, 1],
        "logps/chosen": shown[:, 0],
        "logps/rejected": shown[:, 1],
        **extra,
    }
    return loss, metrics


def make_loss(objective: str, beta=0.1, label_smoothing=0.0, simpo_gamma=0.5, orpo_lambda=0.1):
    """loss_fn(model, batch of pairs) -> (sum of the pairs' losses, number of pairs, each metric summed over them),
    jdp's loss contract. A pair with an answer of no tokens (a padding pair) weighs 0."""
    options = dict(beta=beta, label_smoothing=label_smoothing, simpo_gamma=simpo_gamma, orpo_lambda=orpo_lambda)

    def loss_fn(model, batch):
        logps, counts = answer_logps(model, batch)
        ref = None
        if needs_reference(objective):
            if "ref_logps" in batch:  # computed once before training (train.precompute_reference)
                ref = batch["ref_logps"]
            elif (reference := getattr(model, REFERENCE, None)) is not None:
                ref, _ = answer_logps(reference, batch)
            elif adapters.has_adapters(model):
                with adapters.disabled(model):
                    ref, _ = answer_logps(model, batch)
            else:
                raise ValueError(f"train.objective={objective} needs a reference model: give the model LoRA adapters "
                                 f"(model.lora_rank) or a frozen copy (jdp.preference.with_reference(model))")  # fmt: skip
            ref = jax.lax.stop_gradient(ref)
        valid = jnp.all(counts > 0, axis=-1)
        # A padding pair's answers have no tokens: give it harmless numbers (ORPO's log(1 - exp(0)) is -inf, and a
        # where's unused branch still sends its NaN gradient back)
        safe = lambda x, fill: jnp.where(valid[:, None], x, fill)  # noqa: E731
        ref = None if ref is None else safe(ref, -1.0)
        per_pair, metrics = losses(objective, safe(logps, -1.0), safe(counts, 1.0), ref, **options)
        kept = lambda x: jnp.sum(jnp.where(valid, x, 0.0))  # noqa: E731  (a padding pair's, even NaN, never counts)
        return kept(per_pair), jnp.sum(valid.astype(jnp.float32)), {k: kept(v) for k, v in metrics.items()}

    loss_fn.__name__ = f"{objective}_loss"
    return loss_fn


def reference_logps(graphdef, state, mesh, strategy: str, sets: dict, batch_size: int) -> dict[str, np.ndarray]:
    """Each set's pairs' log-probabilities under the model `state` holds (with LoRA: its adapters off), in order:
    {name: (pairs, 2)}, on every process. `sets`: {name: (number of pairs, their global batches, this process's
    rows of each)} (data.preference.PairBatches.every_pair). Run at step 0, the model is the reference itself."""
    from jax.experimental import multihost_utils

    from jdp import parallel

    def row_logps(model, batch):
        with adapters.disabled(model) if adapters.has_adapters(model) else contextlib.nullcontext():
            return answer_logps(model, batch)[0]

    step = parallel.make_strategy_eval_step(graphdef, row_logps, mesh, strategy, per_row=True)
    out = {}
    for name, (n, batches) in sets.items():
        parts = [multihost_utils.process_allgather(step(state, parallel.shard_batch(b, mesh, batch_size)), tiled=True)
                 for b in batches]  # fmt: skip
        out[name] = np.concatenate([np.asarray(p) for p in parts])[:n] if parts else np.zeros((0, 2), np.float32)
    return out


def _copied(value):
    """An array of its own (the step donates the state: two leaves on one buffer would be donated twice)."""
    if isinstance(value, jax.Array):
        return jnp.array(value, copy=True)
    return np.array(value, copy=True) if isinstance(value, np.ndarray) else value


def with_reference(model: nnx.Module) -> nnx.Module:
    """`model` holding a frozen copy of itself as it is now (its REFERENCE attribute): the reference of dpo and ipo
    without LoRA. Returned (the same model)."""
    copy = nnx.clone(model)
    for path, node in list(nnx.iter_graph(copy)):
        if isinstance(node, nnx.Variable) and not isinstance(node, Frozen):
            adapters.put_at(copy, tuple(path), Frozen(_copied(node.get_value())))
    setattr(model, REFERENCE, copy)
    return model
