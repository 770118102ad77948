"""LoRA's names in a family's terms: the linear layers model.lora_targets may name and the modules
model.lora_modules_to_save may, as PEFT's target_modules names them (q_proj, ..., all-linear), from the family's
Hugging Face architecture (its name tables, hf_names.py); and what model.lora_* get wrong. Imports no JAX.

jdp's blocks.0.attn.q is Llama's model.layers.0.self_attn.q_proj; a family with no Hugging Face architecture (one a
user registered) takes jdp's own names (attn.q), matched as PEFT matches: against the end of the path.
"""

from __future__ import annotations

from typing import NamedTuple

from jdp import models
from jdp.models.config import LORA_KEYS, ModelConfig

__all__ = ["Names", "names", "problems", "split"]


class Names(NamedTuple):
    """A model's layers by name: {jdp module path: its Hugging Face module name} for the linear layers and the
    embeddings, the output head's path (None: tied to the embedding), and whether its linear weights are stored
    [in, out] (GPT-2's Conv1D: PEFT's fan_in_fan_out)."""

    modules: dict
    output: tuple | None
    fan_in_fan_out: bool

    def linear(self) -> dict:
        """The linear layers LoRA may target (PEFT's all-linear: every one but the output head)."""
        return {p: n for p, n in self.modules.items() if p[-1] != "embed" and p != self.output}

    def outside_blocks(self) -> dict:
        """The modules that may train whole (modules_to_save): the embedding and the output head."""
        return {p: n for p, n in self.modules.items() if len(p) == 1}


def names(m: ModelConfig) -> Names:
    """Model `m`'s layers by the family's first Hugging Face architecture (Llama, Qwen2 and Mistral name theirs
    alike); empty for a family that has none."""
    archs = list(models.hf_architectures(m.arch).values())
    if not archs:
        return Names({}, None, False)
    arch = archs[0]
    table = arch.table(m)
    modules = {slot.path[:-1]: arch.file_name(name).removesuffix(".weight") for name, slot in table.items()
               if name.endswith(".weight") and slot.path[-1] in ("kernel", "embedding")}  # fmt: skip
    output = arch.top.get(arch.tied_output) if arch.tied_output in table else None  # tied: the embedding is it
    conv1d = not any(slot.transposed for slot in table.values() if slot.path[-1] == "kernel")
    return Names(modules, tuple(output[:-1]) if output else None, conv1d)


def short(name: str) -> str:
    """A Hugging Face module's name as target_modules gives it: its last part (q_proj)."""
    return name.rsplit(".", 1)[-1]


def split(spec: str) -> list[str]:
    """A comma-separated list of names."""
    return [n.strip() for n in spec.split(",") if n.strip()]


def problems(m: ModelConfig) -> list[str]:
    """What model.lora_* get wrong (each key's range is the config's): LoRA keys without a rank, target names the
    family does not have, a module to train whole that is not there."""
    default = ModelConfig()
    if not m.lora_rank:
        return [f"model.{k}={getattr(m, k)!r} is read only with model.lora_rank > 0 (LoRA): set model.lora_rank, or "
                f"leave it out" for k in LORA_KEYS if getattr(m, k) != getattr(default, k)]  # fmt: skip
    if m.arch not in models.names() or not (layers := names(m)).modules:
        return []
    out = []
    linear = {short(n) for n in layers.linear().values()}
    targets = split(m.lora_targets)
    if not targets:
        out.append("model.lora_targets is empty: name the layers that get adapters, or all-linear")
    elif "all-linear" not in targets and (unknown := [t for t in targets if t not in linear]):
        out.append(f"model.lora_targets: {', '.join(unknown)} is not a linear layer of model.arch={m.arch}; its "
                   f"names (PEFT's target_modules): {', '.join(sorted(linear))}, or all-linear")  # fmt: skip
    whole = {short(n) for n in layers.outside_blocks().values()}
    if unknown := [t for t in split(m.lora_modules_to_save) if t not in whole]:
        tied = " (the output is tied to the embedding: train embed_tokens)" if layers.output is None else ""
        out.append(f"model.lora_modules_to_save: {', '.join(unknown)} is not a module of this model{tied}; "
                   f"its modules outside the blocks: {', '.join(sorted(whole))}")  # fmt: skip
    return out
