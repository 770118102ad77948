"""How a Hugging Face architecture names a model family's parameters and how its config.json reads: the
`Architecture`s each family declares (its module's `HF_ARCHITECTURES`), which jdp/hf.py reads and writes files by.
Imports no JAX."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from jdp.models.config import ModelConfig

__all__ = ["Architecture", "Slot"]


class Slot(NamedTuple):
    """Where one Hugging Face tensor goes in jdp's model, and whether it is stored transposed ([out, in])."""

    path: tuple
    transposed: bool


@dataclass(frozen=True)
class Architecture:
    """One Hugging Face architecture: its names for jdp's parameters, per model and per block, and how its
    config.json reads into jdp's ModelConfig (`fields`) and is written from it (`hf_config`)."""

    model_type: str
    class_name: str
    family: str  # the jdp model family (model.arch, jdp/models/) it reads into
    prefix: str  # before every name in the files but the output layer's ("transformer."); names without it read too
    top: dict[str, tuple]  # HF name -> jdp parameter path
    block: dict[str, tuple]  # HF name after "{blocks}.{i}." -> path after ("blocks", i)
    blocks: str  # the HF name of the block list
    buffers: re.Pattern  # names in old files that are not parameters (causal masks, rotary tables): skipped
    embedding: str  # the token embedding's name: its rows are the vocabulary
    tied_output: str  # the output layer's name: when tied to the embedding, not written, and checked equal if read
    transposed: frozenset[str]  # names (in `top` or `block`) stored [out, in], the transpose of a Flax kernel
    bias_key: str  # the ModelConfig switch of the table's biases: biases into a model without them must be zero
    fields: Callable[[dict], tuple[dict, list[str]]]  # config.json -> (ModelConfig fields, what jdp cannot compute)
    hf_config: Callable[[ModelConfig], dict]  # ModelConfig -> this architecture's keys of config.json

    def table(self, m: ModelConfig) -> dict[str, Slot]:
        """Every HF name (without the prefix) of model `m` -> where it goes in jdp's model."""
        names = {k: Slot(v, k in self.transposed) for k, v in self.top.items()}
        if m.tie_embeddings:
            names.pop(self.tied_output, None)
        for i in range(m.n_layers):
            names.update(
                {f"{self.blocks}.{i}.{k}": Slot(("blocks", i, *v), k in self.transposed) for k, v in self.block.items()}
            )
        return names

    def file_name(self, name: str) -> str:
        """The name in the files: the prefix, except for the output layer, which sits beside the base model."""
        return name if name == self.tied_output else self.prefix + name
