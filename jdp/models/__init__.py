"""Model families: each is one module that the rest of jdp asks, never branches on (tests/test_shape.py checks it).

A family module (gpt.py, llama.py, or one of a user's, registered with `register`) provides the `Family` protocol
below: its name, the config keys it reads and its refusals, the model it builds, and the numbers the planner, the
memory check and the MFU need (its MLP width, matmul parameters and activation bytes per block). Its model class
also gives the KV-cache decoder its pieces (jdp/decode.py's `Decodable`), and the family declares the Hugging Face
architectures that read into it (their name tables and config.json translation: hf_names.py), which jdp/hf.py
reads and writes files by.

This module imports no JAX (the `jdp` command starts without it): the built-in families are imported on first use.
Adding a family is one module and one `register(module)` call, in jdp/ or outside it (tests/test_families.py
trains, plans, counts and samples one defined in a test file).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Protocol

from jdp.errors import ConfigError
from jdp.models.config import SHARED_KEYS, ModelConfig

__all__ = ["Family", "ff_width", "get", "hf_architectures", "keys", "make_model", "names", "problems", "register"]

_BUILTIN = {"gpt": "jdp.models.gpt", "llama": "jdp.models.llama"}  # imported on first use
_REGISTERED: dict[str, Any] = {}
_REQUIRED = ("NAME", "TITLE", "KEYS", "problems", "build", "ff_width", "block_matmul_params", "block_activation_bytes")


class Family(Protocol):
    """What jdp asks of a model family (a module or any object with these names)."""

    NAME: str  # model.arch's value
    TITLE: str  # how messages name it ("Llama")
    KEYS: tuple[str, ...]  # the ModelConfig keys it reads besides SHARED_KEYS; set, another family's are refused
    # optional: NAMED_REFUSALS, keys of other families that problems() refuses in its own words (the generic
    # refusal skips them); HF_ARCHITECTURES, the Hugging Face architectures (hf_names.Architecture: name tables,
    # config.json in and out) that read into it, the first the one it exports as

    def problems(self, m: ModelConfig) -> list[str]:
        """What its keys get wrong together (each key's own range is the config's), each naming the key and the fix."""

    def build(self, m: ModelConfig, rngs: Any) -> Any:
        """The model (an nnx.Module whose __call__(tokens, segments=None, positions=None) gives float32 logits)."""

    def ff_width(self, m: ModelConfig) -> int:
        """The MLP's hidden width."""

    def block_matmul_params(self, m: ModelConfig) -> int:
        """The weights one block multiplies each token by (the FLOPs: 6 per weight per token in training)."""

    def block_activation_bytes(self, m: ModelConfig, tokens: int, itemsize: int) -> int:
        """The bytes one block keeps for backward from a micro-batch of `tokens` tokens (compute dtype of
        `itemsize` bytes), except the attention's softmax, which jdp/plan.py counts for every family alike."""

    # optional: block_projection_bytes(m, tokens, itemsize), the bytes of the block's input and of its matrix
    # products' outputs (what model.remat=dots keeps: jdp/parallel/remat.py); without it the planner counts
    # block_activation_bytes, as if dots kept everything


def register(family: Any) -> None:
    """Make `family` (a module or object with the `Family` names) what model.arch=family.NAME builds."""
    missing = [k for k in _REQUIRED if not hasattr(family, k)]
    if missing:
        raise ConfigError(f"model family {family!r} lacks {', '.join(sorted(missing))} (jdp.models.Family)")
    if family.NAME in _BUILTIN:
        raise ConfigError(f"model.arch={family.NAME} is jdp's own family; register yours under another name")
    unknown = [k for k in family.KEYS if k not in {f.name for f in dataclasses.fields(ModelConfig)}]
    if unknown:
        raise ConfigError(f"model family {family.NAME}: KEYS {unknown} are not ModelConfig keys")
    _REGISTERED[family.NAME] = family


def names() -> tuple[str, ...]:
    """model.arch's values: jdp's families, then those registered."""
    return (*_BUILTIN, *_REGISTERED)


def get(name: str) -> Family:
    """The family model.arch=`name` builds (a built-in one imported now)."""
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name not in _BUILTIN:
        raise ConfigError(f"model.arch={name!r} must be one of {', '.join(names())}")
    return importlib.import_module(_BUILTIN[name])


def keys(arch: str) -> tuple[str, ...]:
    """The model.* keys family `arch` reads, in ModelConfig's order: the shared ones and its own (every key when
    `arch` names no family: the config check then says so)."""
    own = set(SHARED_KEYS) | set(get(arch).KEYS) if arch in names() else None
    return tuple(f.name for f in dataclasses.fields(ModelConfig) if own is None or f.name in own)


def projection_bytes(m: ModelConfig, tokens: int, itemsize: int) -> int:
    """What one block keeps for backward under model.remat=dots: its input and its projections' outputs (the
    family's block_projection_bytes; a family without it: all it keeps without recomputation)."""
    family = get(m.arch)
    if (count := getattr(family, "block_projection_bytes", None)) is not None:
        return count(m, tokens, itemsize)
    return family.block_activation_bytes(m, tokens, itemsize)


def ff_width(m: ModelConfig) -> int:
    """The MLP's hidden width (F) of the model `m` describes."""
    return get(m.arch).ff_width(m)


def hf_architectures(arch: str | None = None) -> dict[str, Any]:
    """model_type -> the Hugging Face architecture (hf_names.Architecture) of family `arch`, or of every family."""
    return {a.model_type: a for name in ([arch] if arch else names())
            for a in getattr(get(name), "HF_ARCHITECTURES", ())}  # fmt: skip


def problems(m: ModelConfig) -> list[str]:
    """What the model's keys get wrong together (each key's own range is the config's _value_problems), each naming
    the key and the fix: the shared keys, then keys of another family that were set, then the family's own."""
    out = []
    if m.vocab_valid > m.vocab_size:
        out.append(f"model.vocab_valid={m.vocab_valid} is more than model.vocab_size={m.vocab_size}")
    if m.arch not in names() or m.n_heads <= 0:
        return out  # the config's choices and ranges name these; the rest needs the family and divides by n_heads
    family = get(m.arch)
    if not m.head_dim and m.d_model % m.n_heads:
        out.append(
            f"model.d_model={m.d_model} is not divisible by model.n_heads={m.n_heads}"
            + ("; set model.head_dim for heads of another width" if "head_dim" in family.KEYS else "")
        )
    return out + _foreign_keys(m, family) + family.problems(m)


def _foreign_keys(m: ModelConfig, family: Family) -> list[str]:
    """Keys of other families set away from their defaults: each family's keys stay its own."""
    default = ModelConfig()
    own = set(SHARED_KEYS) | set(family.KEYS) | set(getattr(family, "NAMED_REFUSALS", ()))
    changed = [f.name for f in dataclasses.fields(ModelConfig)
               if f.name not in own and getattr(m, f.name) != getattr(default, f.name)]  # fmt: skip
    out = []
    for owner in [get(n) for n in names() if n != family.NAME]:
        theirs = [k for k in changed if k in owner.KEYS]
        changed = [k for k in changed if k not in theirs]
        if theirs:
            keys = ", ".join(f"model.{k}={getattr(m, k)!r}" for k in theirs)
            out.append(f"{keys}: {owner.TITLE}'s key(s), not {family.TITLE}'s; leave them out or set "
                       f"model.arch={owner.NAME}")  # fmt: skip
    if changed:
        keys = ", ".join(f"model.{k}={getattr(m, k)!r}" for k in changed)
        out.append(f"{keys}: no key of {family.TITLE}'s (model.arch={family.NAME}); leave them out")
    return out


def make_model(m: ModelConfig, rngs: Any) -> Any:
    """The model `m` describes (model.arch picks the family), refused in the config's words when its keys do not fit
    together (as validate refuses them for `jdp train`)."""
    family = get(m.arch)
    if found := problems(m):
        raise ConfigError("invalid model config:\n  " + "\n  ".join(found))
    return family.build(m, rngs)
