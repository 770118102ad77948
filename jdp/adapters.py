"""Adapters: LoRA on a model's linear layers over a frozen base, computed as PEFT computes it.

`add` swaps each targeted `nnx.Linear` for a `LoRALinear` (the same kernel and bias, plus A and B) and turns every
other parameter into `jdp.nn.Frozen`, except the modules named to train whole (PEFT's `modules_to_save`). What
trains is then simply what is still an `nnx.Param`: the step differentiates, all-reduces, shards and checkpoints
those alone under every strategy, and the frozen base is a variable the step splits off before differentiating
(parallel/step.py), so no gradient, optimizer state or collective ever touches it. A frozen part is a filter,
not a copy: the same holds for any model a library user freezes this way.

y = x W + b + scale * dropout(x) A B, with A (in x r) drawn as PEFT's default (Kaiming-uniform: U(-1/sqrt(in),
1/sqrt(in))), B (r x out) zero, and scale = alpha / r (rsLoRA: alpha / sqrt(r)). PEFT stores A and B as torch
Linear weights, [r, in] and [out, r]: jdp/peft.py transposes them in and out. `merged` folds the adapters into
the kernels (W + scale A B) for a plain model (`jdp export` without --adapter).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jdp.nn import Frozen, RowDropout

__all__ = ["LoRALinear", "add", "disabled", "frozen", "has_adapters", "linear_paths", "lora_layers", "merged", "put_at",
           "scale_of", "split_frozen", "with_frozen"]

Path = tuple  # a module's attribute path from the model: ("blocks", 0, "attn", "q")


def scale_of(rank: int, alpha: float, rslora: bool = False) -> float:
    """What B A is multiplied by: alpha / r (PEFT's default), or alpha / sqrt(r) (rsLoRA, use_rslora)."""
    return alpha / math.sqrt(rank) if rslora else alpha / rank


class LoRALinear(nnx.Linear):
    """An `nnx.Linear` whose kernel and bias are frozen and which adds scale * dropout(x) A B (PEFT's lora.Linear,
    in its order: A first, then B, then the scale). It computes the base exactly as the layer it replaces did."""

    def __init__(self, base: nnx.Linear, rank: int, scale: float, dropout: float, base_dtype, rngs: nnx.Rngs):
        for name, value in vars(base).items():  # the layer's own settings and variables (nnx.Linear's attributes)
            if not name.startswith("_"):
                setattr(self, name, value)
        self.kernel = _frozen(base.kernel, base_dtype)
        if base.bias is not None:
            self.bias = _frozen(base.bias, base_dtype)
        bound = 1.0 / math.sqrt(base.in_features)  # kaiming_uniform_(a=sqrt(5)) on a [r, in] weight
        self.lora_a = nnx.LoRAParam(
            jax.random.uniform(rngs.params(), (base.in_features, rank), base.param_dtype, -bound, bound)
        )
        self.lora_b = nnx.LoRAParam(jnp.zeros((rank, base.out_features), base.param_dtype))
        self.lora_scale = float(scale)
        self.lora_dropout = RowDropout(dropout, rngs=rngs) if dropout > 0 else None
        self.lora_off = False  # `disabled`: the base layer alone (read when the forward is traced)

    def __call__(self, inputs: jax.Array, *args, **kwargs) -> jax.Array:
        y = super().__call__(inputs, *args, **kwargs)
        if self.lora_off:
            return y
        x = inputs if self.lora_dropout is None else _row_dropout(self.lora_dropout, inputs)
        x, a, b = self.promote_dtype((x, self.lora_a[...], self.lora_b[...]), dtype=self.dtype)
        return y + ((x @ a) @ b) * jnp.asarray(self.lora_scale, y.dtype)

    def delta(self) -> jax.Array:
        """scale A B, in float32: what the adapter adds to the kernel."""
        a, b = (jnp.asarray(v[...], jnp.float32) for v in (self.lora_a, self.lora_b))
        return (a @ b) * self.lora_scale


def _row_dropout(dropout: RowDropout, x: jax.Array) -> jax.Array:
    """RowDropout on the tokens of each example: jdp's families hand their projections the tokens flat (N = B x L
    rows), so the rows the step set (one per example) are spread over them; each example's tokens keep the mask
    of that example's row, and N devices draw what one device draws."""
    rows = dropout.rows[...].shape[0]  # 1 for a micro-batch of one example, or outside jdp's step
    if x.shape[0] != rows and x.shape[0] % rows == 0:
        return dropout(x.reshape(rows, -1, *x.shape[1:])).reshape(x.shape)
    return dropout(x)


def _frozen(variable: nnx.Variable, dtype) -> Frozen:
    value = variable[...]
    return Frozen(value if dtype is None else value.astype(dtype))


def _at(model, path: Path):
    for part in path:
        model = model[part] if isinstance(part, int) else getattr(model, part)
    return model


def put_at(model, path: Path, value) -> None:
    parent = _at(model, path[:-1])
    if isinstance(path[-1], int):
        parent[path[-1]] = value
    else:
        setattr(parent, path[-1], value)


def linear_paths(model: nnx.Module) -> list[Path]:
    """Every nnx.Linear of the model (LoRALinear too), by attribute path, in the model's order."""
    return [tuple(p) for p, node in nnx.iter_graph(model) if isinstance(node, nnx.Linear)]


def add(
    model: nnx.Module,
    targets: Callable[[Path], bool] | Iterable[str],
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    rslora: bool = False,
    train: Callable[[Path], bool] | Iterable[str] = (),
    base_dtype=None,
    rngs: nnx.Rngs | None = None,
) -> nnx.Module:
    """`model` with LoRA on its targeted nnx.Linear layers and every other parameter frozen (in place; returned).

    targets: which layers get adapters, a predicate on a layer's path or names matched as PEFT matches
    `target_modules`, against the end of the path ("q" or "attn.q" matches blocks.0.attn.q); "all-linear" every
    linear layer. train: modules whose parameters train whole (PEFT's modules_to_save), likewise. base_dtype: the
    frozen base's dtype (None: as it is). rngs: A's draws (default nnx.Rngs(0))."""
    if rank < 1:
        raise ValueError(f"LoRA rank {rank!r} must be 1 or more")
    adapt, keep = _matcher(targets), _matcher(train)
    rngs = rngs if rngs is not None else nnx.Rngs(0)
    scale = scale_of(rank, alpha, rslora)
    chosen = [p for p in linear_paths(model) if adapt(p) and not keep(p)]
    if not chosen:
        raise ValueError(f"LoRA targets {_shown(targets)} match none of the model's linear layers "
                         f"({', '.join('.'.join(map(str, p)) for p in linear_paths(model)[:8])} ...)")  # fmt: skip
    for path in chosen:
        layer = _at(model, path)
        if isinstance(layer, LoRALinear):
            raise ValueError(f"{'.'.join(map(str, path))} already has an adapter")
        put_at(model, path, LoRALinear(layer, rank, scale, dropout, base_dtype, rngs))
    for path, node in list(nnx.iter_graph(model)):
        path = tuple(path)
        if isinstance(node, nnx.Param) and not isinstance(node, nnx.LoRAParam) and not keep(path[:-1]):
            put_at(model, path, _frozen(node, base_dtype))
    return model


def _matcher(spec) -> Callable[[Path], bool]:
    if callable(spec):
        return spec
    if isinstance(spec, str):
        spec = [spec]
    names = [tuple(s.split(".")) for s in spec]
    if ("all-linear",) in names:
        return lambda path: True
    return lambda path: any(tuple(map(str, path[-len(n) :])) == n for n in names)


def _shown(spec) -> str:
    return "(a predicate)" if callable(spec) else repr(spec if isinstance(spec, str) else list(spec))


def lora_layers(model: nnx.Module) -> list[tuple[Path, LoRALinear]]:
    """(path, layer) of every adapted layer, in the model's order."""
    return [(p, layer) for p in linear_paths(model) if isinstance(layer := _at(model, p), LoRALinear)]


def has_adapters(model: nnx.Module) -> bool:
    return bool(lora_layers(model))


@contextlib.contextmanager
def disabled(model: nnx.Module):
    """Every adapter of `model` off inside the block: the frozen base model alone (PEFT's disable_adapter; the
    preference objectives' reference, jdp/preference.py). A switch of the traced program, not a value: a forward
    traced inside the block has no adapter in it. Use it on a model made inside the trace (jdp's step does)."""
    layers = [layer for _, layer in lora_layers(model)]
    for layer in layers:
        layer.lora_off = True
    try:
        yield model
    finally:
        for layer in layers:
            layer.lora_off = False


def split_frozen(rest: nnx.State) -> tuple[nnx.State, nnx.State]:
    """(the frozen base, every other variable) of a model's non-parameter variables."""
    return nnx.split_state(rest, Frozen, ...)


def frozen(rest: nnx.State) -> nnx.State:
    return split_frozen(rest)[0]


def with_frozen(like: nnx.State, values: nnx.State) -> nnx.State:
    """`like` (a model's variables, the frozen base among them) with every variable of `values` (the same paths,
    without the base) put in: the tree keeps `like`'s structure and order."""
    flat = dict(nnx.to_flat_state(like))
    flat.update(dict(nnx.to_flat_state(values)))
    return nnx.from_flat_state([(k, flat[k]) for k, _ in nnx.to_flat_state(like)])


def merged(model: nnx.Module) -> nnx.Module:
    """A copy of `model` with each adapter folded into its kernel (W + scale A B, in the kernel's dtype made
    float32) and every variable a plain parameter again: the model a plain export writes."""
    model = nnx.clone(model)
    for path, layer in lora_layers(model):
        plain = nnx.eval_shape(lambda: nnx.Linear(1, 1, rngs=nnx.Rngs(0)))
        for name, value in vars(layer).items():
            if not name.startswith("_") and not name.startswith("lora_"):
                setattr(plain, name, value)
        kernel = np.asarray(jnp.asarray(layer.kernel[...], jnp.float32) + layer.delta())
        plain.kernel = nnx.Param(jnp.asarray(kernel, layer.param_dtype))
        if layer.bias is not None:
            plain.bias = nnx.Param(jnp.asarray(layer.bias[...], layer.param_dtype))
        put_at(model, path, plain)
    for path, node in list(nnx.iter_graph(model)):
        if isinstance(node, Frozen):
            put_at(model, tuple(path), nnx.Param(jnp.asarray(node[...], jnp.float32)))
    return model
