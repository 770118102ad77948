"""Hugging Face models in and out: GPT-2 and the Llama family (Llama, Qwen2, Mistral, SmolLM) directories
(config.json + safetensors) <-> jdp's GPT and Llama, one name table per architecture.

GPT-2 is jdp's GPT with biases (model.bias=true): the same pre-norm blocks, LayerNorm, tanh GELU, learned positions
and an output tied to the embedding, and HF's `Conv1D` stores its weights [in, out] like a Flax kernel, so every
tensor maps one to one. LlamaForCausalLM, Qwen2ForCausalLM (q/k/v biases) and MistralForCausalLM (without a sliding
window) are jdp's Llama (model.arch=llama, jdp/models/llama.py): their `nn.Linear` weights are [out, in], the transpose of
a Flax kernel, and their rotary embedding is the rotate-half one jdp computes, so q and k need no permutation.
Another architecture is one more `Architecture`: its names, which of them are transposed, its config.json reader
and writer.

Import reads the tensors with safetensors' numpy API (no torch), from one `model.safetensors` or the shards of a
`model.safetensors.index.json`, one tensor at a time, memory-mapped, into the model's dtype (no random init runs, no
second copy is made); `parallel.init_state` then places them, replicated, on every device of every process (each
process reads the files itself). The model's shape comes from config.json (`adopt`): only keys the user set on the
command line must agree with it. A config.json jdp does not compute exactly (another activation, an o_proj or MLP
bias, a rope scaling other than llama3, a sliding window) is refused, naming the key, before any tensor is read.

Export writes the architecture's names and shapes, loadable with `transformers.AutoModelForCausalLM.from_pretrained`
unchanged: the imported model's own vocabulary rows, or, for a model jdp made, only the ids the tokenizer has
(transformers would give the padding probability).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import resource
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jdp import models
from jdp.errors import ConfigError
from jdp.models.config import ModelConfig

__all__ = [
    "ARCHITECTURES",
    "CONFIG",
    "GENERATION_CONFIG",
    "GPT2",
    "INDEX",
    "LLAMA",
    "MISTRAL",
    "QWEN2",
    "TOKENIZER_FILES",
    "VOCAB_MULTIPLE",
    "WEIGHTS",
    "Adopted",
    "Architecture",
    "Imported",
    "Slot",
    "Tensor",
    "Weights",
    "adopt",
    "architecture",
    "export",
    "is_hf_dir",
    "load_model",
    "model_config",
    "model_fields",
    "read_config",
]

CONFIG, WEIGHTS, INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
GENERATION_CONFIG = "generation_config.json"  # sampling defaults (eos ids, temperature): kept from the import
# The files a tokenizer saved by `transformers` may consist of; export copies those the run's tokenizer has.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
    "added_tokens.json", "tokenizer.model", "chat_template.jinja", "chat_template.json",
)  # fmt: skip
# ModelConfig's fields that are how a run computes, not what the model is: config.json never sets them.
_RUN_SETTINGS = ("dtype", "param_dtype", "attention", "vocab_valid")


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


# ---- GPT-2 -----------------------------------------------------------------------------------------------------

_GELU_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")  # jax.nn.gelu(approximate=True), one formula


def _gpt2_fields(hf: dict) -> tuple[dict, list[str]]:
    d = hf.get("n_embd", 768)
    problems = []
    if hf.get("activation_function", "gelu_new") not in _GELU_TANH:
        problems.append(f"activation_function {hf['activation_function']!r} (jdp's MLP uses tanh GELU, gelu_new)")
    if (n_inner := hf.get("n_inner")) is not None and n_inner % d:
        problems.append(f"n_inner {n_inner} is not a multiple of n_embd {d}")
    if not hf.get("scale_attn_weights", True) or hf.get("scale_attn_by_inverse_layer_idx", False):
        problems.append("attention scaled other than by 1/sqrt(head width)")
    if not hf.get("tie_word_embeddings", True):
        problems.append("tie_word_embeddings false (jdp's output layer is the embedding)")
    fields = {
        "vocab_size": hf.get("vocab_size", 50257),
        "max_seq_len": hf.get("n_positions", 1024),
        "d_model": d,
        "n_layers": hf.get("n_layer", 12),
        "n_heads": hf.get("n_head", 12),
        "mlp_ratio": (hf.get("n_inner") or 4 * d) // d,
        "bias": True,
        "arch": "gpt",
        "norm_eps": hf.get("layer_norm_epsilon", 1e-5),
    }
    return fields, problems


def _gpt2_config(m: ModelConfig) -> dict:
    return {
        "n_positions": m.max_seq_len,
        "n_embd": m.d_model,
        "n_layer": m.n_layers,
        "n_head": m.n_heads,
        "n_inner": m.mlp_ratio * m.d_model,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": m.norm_eps,
        "resid_pdrop": 0.0,  # jdp trains without dropout
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "tie_word_embeddings": True,
    }


GPT2 = Architecture(
    model_type="gpt2",
    class_name="GPT2LMHeadModel",
    family="gpt",
    prefix="transformer.",
    top={
        "wte.weight": ("embed", "embedding"),
        "wpe.weight": ("pos_embed",),
        "ln_f.weight": ("norm", "scale"),
        "ln_f.bias": ("norm", "bias"),
    },
    block={
        "ln_1.weight": ("norm1", "scale"),
        "ln_1.bias": ("norm1", "bias"),
        "attn.c_attn.weight": ("attn", "qkv", "kernel"),
        "attn.c_attn.bias": ("attn", "qkv", "bias"),
        "attn.c_proj.weight": ("attn", "out", "kernel"),
        "attn.c_proj.bias": ("attn", "out", "bias"),
        "ln_2.weight": ("norm2", "scale"),
        "ln_2.bias": ("norm2", "bias"),
        "mlp.c_fc.weight": ("mlp", "up", "kernel"),
        "mlp.c_fc.bias": ("mlp", "up", "bias"),
        "mlp.c_proj.weight": ("mlp", "down", "kernel"),
        "mlp.c_proj.bias": ("mlp", "down", "bias"),
    },
    blocks="h",
    buffers=re.compile(r"h\.\d+\.attn\.(bias|masked_bias)$"),
    embedding="wte.weight",
    tied_output="lm_head.weight",
    transposed=frozenset(),  # Conv1D stores [in, out], as Flax does
    bias_key="bias",
    fields=_gpt2_fields,
    hf_config=_gpt2_config,
)

# ---- the Llama family ------------------------------------------------------------------------------------------

# config.json's defaults where a key is missing: the transformers classes' (LlamaConfig, Qwen2Config, MistralConfig)
_LLAMA_DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
                   "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False}  # fmt: skip
_DEFAULTS = {
    "llama": _LLAMA_DEFAULTS,
    "qwen2": {**_LLAMA_DEFAULTS, "vocab_size": 151936, "intermediate_size": 22016, "max_position_embeddings": 32768},
    "mistral": {**_LLAMA_DEFAULTS, "intermediate_size": 14336, "num_key_value_heads": 8,
                "max_position_embeddings": 131072, "sliding_window": 4096},
}  # fmt: skip
# llama3 RoPE scaling's keys in config.json -> jdp's
_LLAMA3_KEYS = {"factor": "rope_factor", "low_freq_factor": "rope_low_freq_factor",
                "high_freq_factor": "rope_high_freq_factor", "original_max_position_embeddings": "rope_original_max_len"}  # fmt: skip


def _rope_fields(hf: dict, default_theta: float) -> tuple[dict, list[str]]:
    """RoPE's fields from transformers v4's `rope_theta` + `rope_scaling` or v5's `rope_parameters` (or both, agreeing)."""
    legacy, params, theta = hf.get("rope_scaling"), hf.get("rope_parameters"), hf.get("rope_theta")
    problems = []
    for key, value in (("rope_scaling", legacy), ("rope_parameters", params)):
        if value is not None and not isinstance(value, dict):
            return {}, [f"{key} {value!r} (expected a mapping, e.g. {{'rope_type': 'llama3', ...}})"]
    if params and params.get("rope_theta") is not None:
        if theta is not None and theta != params["rope_theta"]:
            problems.append(f"rope_theta {theta} and rope_parameters.rope_theta {params['rope_theta']} disagree")
        theta = params["rope_theta"]
    fields = {"rope_theta": float(default_theta if theta is None else theta), "rope_scaling": ""}
    kinds = {}
    for key, value in (("rope_scaling", legacy), ("rope_parameters", params)):
        if value:
            kinds[key] = value.get("rope_type", value.get("type", "default"))
    if len(set(kinds.values())) > 1:
        problems.append(f"rope_scaling type {kinds['rope_scaling']!r} and rope_parameters type "
                        f"{kinds['rope_parameters']!r} disagree")  # fmt: skip
        return fields, problems
    key, kind = next(iter(kinds.items()), ("rope_scaling", "default"))
    scaling = legacy or params
    if kind == "llama3":
        fields["rope_scaling"] = "llama3"
        for theirs, ours in _LLAMA3_KEYS.items():
            if scaling.get(theirs) is None:
                problems.append(f"{key}.{theirs} missing (llama3 RoPE scaling needs it)")
            else:
                fields[ours] = type(getattr(ModelConfig(), ours))(scaling[theirs])
    elif kind != "default":
        problems.append(f"{key} type {kind!r} (jdp computes plain RoPE and llama3 scaling; not linear, dynamic, "
                        f"yarn, longrope or others)")  # fmt: skip
    if (partial := (scaling or {}).get("partial_rotary_factor", 1.0)) != 1.0:
        problems.append(f"{key}.partial_rotary_factor {partial} (jdp rotates every dimension of a head)")
    return fields, problems


def _sliding_window_problems(hf: dict, model_type: str, positions: int) -> list[str]:
    """Sliding-window attention is refused: jdp attends to every earlier position (a window at least as long as
    the model's positions is no window)."""
    problems = []
    if model_type == "qwen2" and hf.get("use_sliding_window"):
        problems.append("use_sliding_window true (sliding-window attention; jdp attends to every earlier position)")
    if model_type == "mistral":
        window = hf.get("sliding_window", _DEFAULTS["mistral"]["sliding_window"])
        if window is not None and window < positions:
            problems.append(
                f"sliding_window {window} (shorter than max_position_embeddings {positions}: sliding-window "
                f"attention, which jdp does not compute; Mistral v0.2 and later have none)"
            )
    if any(kind != "full_attention" for kind in hf.get("layer_types") or []):
        problems.append(f"layer_types {sorted(set(hf['layer_types']))} (jdp computes full_attention only)")
    return problems


def _llama_fields(hf: dict) -> tuple[dict, list[str]]:
    model_type = hf["model_type"]
    defaults = _DEFAULTS[model_type]
    get = lambda key: hf[key] if hf.get(key) is not None else defaults.get(key)  # noqa: E731  (null: the default)
    D, H = get("hidden_size"), get("num_attention_heads")
    G, K = get("num_key_value_heads") or H, get("head_dim") or (D // H if H else 0)
    problems = []
    if (act := get("hidden_act")) not in ("silu", "swish"):
        problems.append(f"hidden_act {act!r} (jdp's SwiGLU MLP uses silu)")
    if model_type != "qwen2" and hf.get("attention_bias"):
        problems.append("attention_bias true (biases on q, k, v and o_proj; jdp has q/k/v biases only, as Qwen2)")
    if hf.get("mlp_bias"):
        problems.append("mlp_bias true (jdp's MLP has no biases)")
    if hf.get("quantization_config"):
        problems.append("quantization_config (a quantized checkpoint; jdp reads float weights: give the original)")
    if H and G and H % G:
        problems.append(f"num_key_value_heads {G} does not divide num_attention_heads {H}")
    positions = get("max_position_embeddings")
    problems += _sliding_window_problems(hf, model_type, positions)
    rope, rope_problems = _rope_fields(hf, defaults["rope_theta"])
    fields = {
        "arch": "llama",
        "vocab_size": get("vocab_size"),
        "max_seq_len": positions,
        "d_model": D,
        "n_layers": get("num_hidden_layers"),
        "n_heads": H,
        "n_kv_heads": 0 if G == H else G,  # 0: as many as the query heads
        "head_dim": 0 if H and K * H == D else K,  # 0: d_model / n_heads
        "d_ff": get("intermediate_size"),
        "norm_eps": float(get("rms_norm_eps")),
        "qkv_bias": model_type == "qwen2",  # Qwen2's q/k/v projections always have biases, its o_proj never
        "tie_embeddings": bool(get("tie_word_embeddings")),
        "bias": False,
        **rope,
    }
    return fields, problems + rope_problems


def _llama_config(m: ModelConfig) -> dict:
    """The keys transformers v4 and v5 both read: RoPE as v4's rope_theta + rope_scaling and as v5's
    rope_parameters, the same values."""
    scaling = None
    if m.rope_scaling == "llama3":
        scaling = {"rope_type": "llama3", **{theirs: getattr(m, ours) for theirs, ours in _LLAMA3_KEYS.items()}}
    return {
        "hidden_size": m.d_model,
        "intermediate_size": models.ff_width(m),
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.kv_heads,
        "head_dim": m.head_width,
        "max_position_embeddings": m.max_seq_len,
        "rms_norm_eps": m.norm_eps,
        "hidden_act": "silu",
        "tie_word_embeddings": m.tie_embeddings,
        "rope_theta": m.rope_theta,
        "rope_scaling": scaling,
        "rope_parameters": {**(scaling or {"rope_type": "default"}), "rope_theta": m.rope_theta},
        "attention_dropout": 0.0,  # jdp trains without dropout
        "mlp_bias": False,
    }


def _llama(model_type: str, class_name: str, biases: bool, config: Callable[[ModelConfig], dict]) -> Architecture:
    attn = {f"self_attn.{x}_proj.weight": ("attn", x, "kernel") for x in "qkvo"}
    if biases:
        attn |= {f"self_attn.{x}_proj.bias": ("attn", x, "bias") for x in "qkv"}
    mlp = {f"mlp.{x}_proj.weight": ("mlp", x, "kernel") for x in ("gate", "up", "down")}
    block = {"input_layernorm.weight": ("attn_norm", "scale"), **attn,
             "post_attention_layernorm.weight": ("mlp_norm", "scale"), **mlp}  # fmt: skip
    return Architecture(
        model_type=model_type,
        class_name=class_name,
        family="llama",
        prefix="model.",
        top={
            "embed_tokens.weight": ("embed", "embedding"),
            "norm.weight": ("norm", "scale"),
            "lm_head.weight": ("lm_head", "kernel"),
        },
        block=block,
        blocks="layers",
        buffers=re.compile(r"layers\.\d+\.self_attn\.rotary_emb\.inv_freq$"),
        embedding="embed_tokens.weight",
        tied_output="lm_head.weight",
        transposed=frozenset([*(k for k in block if k.endswith("_proj.weight")), "lm_head.weight"]),  # nn.Linear
        bias_key="qkv_bias" if biases else "",
        fields=_llama_fields,
        hf_config=config,
    )


LLAMA = _llama("llama", "LlamaForCausalLM", False, lambda m: {**_llama_config(m), "attention_bias": False})
# Qwen2: no layer has a window (max_window_layers: the layers from this one on would, with use_sliding_window)
QWEN2 = _llama("qwen2", "Qwen2ForCausalLM", True,
               lambda m: {**_llama_config(m), "use_sliding_window": False, "sliding_window": None,
                          "max_window_layers": m.n_layers, "layer_types": ["full_attention"] * m.n_layers})  # fmt: skip
MISTRAL = _llama("mistral", "MistralForCausalLM", False, lambda m: {**_llama_config(m), "sliding_window": None})
ARCHITECTURES = {a.model_type: a for a in (GPT2, LLAMA, QWEN2, MISTRAL)}


def is_hf_dir(path: str | Path) -> bool:
    p = Path(path)
    return (p / CONFIG).is_file() and ((p / WEIGHTS).is_file() or (p / INDEX).is_file())


def read_config(path: str | Path) -> dict:
    """config.json of a Hugging Face model directory, checked to be a model jdp can represent exactly."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ConfigError(f"{path}: no such directory; give a local Hugging Face model directory (config.json + "
                          f"model.safetensors), e.g. one saved by save_pretrained or downloaded with `hf download`")  # fmt: skip
    if not (p / CONFIG).is_file():
        raise ConfigError(f"{path}: has no {CONFIG}; give a Hugging Face model directory")
    if not ((p / WEIGHTS).is_file() or (p / INDEX).is_file()):
        found = ", ".join(sorted(q.name for q in p.iterdir())) or "nothing"
        raise ConfigError(
            f"{path}: has neither {WEIGHTS} nor {INDEX} (found: {found}); jdp reads safetensors only (convert a "
            f"pytorch_model.bin with transformers: from_pretrained(...).save_pretrained(DIR))"
        )
    try:
        hf = json.loads((p / CONFIG).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p / CONFIG}: not valid JSON ({e})") from e
    where = p / CONFIG
    if not isinstance(hf, dict) or hf.get("model_type") not in ARCHITECTURES:
        model_type = hf.get("model_type") if isinstance(hf, dict) else None
        known = ", ".join(f"{a.model_type} ({a.class_name})" for a in ARCHITECTURES.values())
        raise ConfigError(f"{where}: model_type {model_type!r}; jdp imports {known}")
    _, problems = ARCHITECTURES[hf["model_type"]].fields(hf)
    if problems:
        raise ConfigError(
            f"{where}: this {hf['model_type']} model differs from what jdp computes: " + "; ".join(problems)
        )
    return hf


def architecture(hf: dict) -> Architecture:
    """The architecture of a config.json that read_config accepted."""
    return ARCHITECTURES[hf["model_type"]]


def model_fields(hf: dict) -> dict:
    """jdp's ModelConfig fields that config.json determines: every field but how a run computes (dtypes, the
    attention kernel), those the architecture does not use at their defaults."""
    fields, _ = architecture(hf).fields(hf)
    default = ModelConfig()
    names = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in _RUN_SETTINGS]
    return {k: fields[k] if k in fields else getattr(default, k) for k in names}  # in ModelConfig's order


def model_config(path: str | Path, base: ModelConfig | None = None) -> ModelConfig:
    """The model a directory holds, as jdp's config (dtypes and attention kept from `base`)."""
    return dataclasses.replace(base or ModelConfig(), **model_fields(read_config(path)), vocab_valid=0)


VOCAB_MULTIPLE = 64  # an imported vocabulary is padded to a multiple of this: faster embedding and output matmuls
# keys whose 0 means "derived": an explicit value agrees with config.json's when the widths they give are equal
_DERIVED = {"n_kv_heads": lambda m: m.kv_heads, "head_dim": lambda m: m.head_width, "d_ff": models.ff_width}


@dataclass(frozen=True)
class Adopted:
    """A model config made to be the one in a directory: what it took from config.json, and what it could not."""

    model: ModelConfig
    read: dict  # config.json's values, as jdp's ModelConfig fields
    changes: list[str]  # "model.d_model 128 -> 64 (from config.json)"
    conflicts: list[str]  # keys set on the command line that config.json contradicts: "model.d_model=128 (...)"


def adopt(m: ModelConfig, path: str | Path, explicit: frozenset[str] = frozenset()) -> Adopted:
    """`m` with every field config.json determines taken from it, except those in `explicit` (the keys the user
    set, `model.d_model`), which are kept and must agree. The vocabulary is padded to a multiple of 64 unless
    model.vocab_size is explicit (then it must hold config.json's ids); model.vocab_valid marks the padding.
    An explicit false bias switch (model.bias, model.qkv_bias) is left to load_model: the file's biases must be 0."""
    hf = read_config(path)
    read, bias_key = model_fields(hf), architecture(hf).bias_key
    vocab = read["vocab_size"]
    padded = -(-vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    theirs_model = dataclasses.replace(m, **read)
    values, changes, conflicts = {}, [], []
    for key, theirs in read.items():
        name, ours, why = f"model.{key}", getattr(m, key), "from config.json"
        if key == "vocab_size":
            if name in explicit:
                if ours < vocab:
                    conflicts.append(
                        f"{name}={ours} (config.json has {vocab} ids: give {vocab} or more, e.g. {padded})"
                    )
                continue
            theirs = padded
            why = f"config.json's {vocab} ids, padded to a multiple of {VOCAB_MULTIPLE}" if padded > vocab else why
        elif key == "bias" and theirs:
            why = "GPT-2 has biases"
        if name in explicit:
            same = _DERIVED[key](m) == _DERIVED[key](theirs_model) if key in _DERIVED else ours == theirs
            if not same and not (key == bias_key and not ours):
                conflicts.append(f"{name}={ours} (config.json: {_shown(theirs)})")
        elif ours != theirs:
            values[key] = theirs
            changes.append(f"{name} {_shown(ours)} -> {_shown(theirs)} ({why})")
    size = values.get("vocab_size", m.vocab_size)
    valid = vocab if size > vocab else 0
    if m.vocab_valid != valid:
        if "model.vocab_valid" in explicit:
            conflicts.append(f"model.vocab_valid={m.vocab_valid} (the import sets it: leave it out)")
        else:
            values["vocab_valid"] = valid
            padding = f"ids {vocab}-{size - 1} are padding and never get probability" if valid else "no padding"
            changes.append(f"model.vocab_valid {m.vocab_valid} -> {valid} ({padding})")
    return Adopted(dataclasses.replace(m, **values), read, changes, conflicts)


def _shown(value) -> str:
    """A value as a message shows it: strings quoted, so an empty one is seen ("model.rope_scaling '' -> 'llama3'")."""
    return repr(value) if isinstance(value, str) else str(value)


class Tensor(NamedTuple):
    """Where one tensor lies in a safetensors file: its dtype, shape and byte offset from the file's start."""

    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int


# safetensors' dtype names -> numpy's (bfloat16 from ml_dtypes, which JAX uses too)
_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "bfloat16", "I64": "<i8", "I32": "<i4", "I16": "<i2",
           "I8": "i1", "U8": "u1", "BOOL": "?"}  # fmt: skip


def _tensors(path: Path) -> dict[str, Tensor]:
    """The header of a safetensors file (8 bytes of its length, then JSON: name -> dtype, shape, data_offsets),
    checked against the file's size, so a damaged or truncated file is an error naming it before any tensor is
    read."""
    import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)

    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if size < 8 or not 2 <= n <= size - 8:
                raise ValueError(f"a header of {n} bytes in a file of {size}")
            header = json.loads(f.read(n))
        start, tensors = 8 + n, {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            if entry["dtype"] not in _DTYPES:
                raise ValueError(f"{name} has dtype {entry['dtype']}; jdp reads {', '.join(_DTYPES)}")
            dtype, shape, (begin, end) = np.dtype(_DTYPES[entry["dtype"]]), tuple(entry["shape"]), entry["data_offsets"]
            if end - begin != math.prod(shape) * dtype.itemsize or not 0 <= begin <= end <= size - start:
                raise ValueError(f"{name}'s data_offsets {[begin, end]} do not hold {entry['dtype']} {list(shape)}")
            tensors[name] = Tensor(dtype, shape, start + begin)
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # JSONDecodeError and UnicodeDecodeError too
        raise ConfigError(f"{path}: not a readable safetensors file ({e})") from e
    return tensors


class Weights:
    """The tensors of a Hugging Face directory, by name (prefix removed), from one file or a sharded index.

    Each `get` reads one tensor straight from the file into a fresh array, the one copy the host holds (safetensors'
    own reader memory-maps the file and copies out of the mapping, so a process's resident memory counts the
    weights twice: the mapped pages and the copy). bfloat16, the dtype of most published checkpoints, is read as
    ml_dtypes' bfloat16, which numpy lacks."""

    def __init__(self, path: str | Path, prefix: str = GPT2.prefix):
        p = Path(path)
        if (p / INDEX).is_file():
            try:
                weight_map = json.loads((p / INDEX).read_text())["weight_map"]
                files = sorted(set(weight_map.values()))
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ConfigError(f"{p / INDEX}: not a safetensors index (no weight_map): {e}") from e
        else:
            files = [WEIGHTS]
        self.path, self.names, self._tensors = p, {}, {}
        for name in files:
            if not (p / name).is_file():
                raise ConfigError(f"{p / INDEX} names {name}, which is not in {p}")
            for key, tensor in _tensors(p / name).items():
                self.names[key.removeprefix(prefix)] = (name, key)
                self._tensors[key] = tensor

    def get(self, name: str) -> np.ndarray:
        file, key = self.names[name]
        tensor = self._tensors[key]
        out = np.empty(tensor.shape, tensor.dtype)
        with open(self.path / file, "rb") as f:
            f.seek(tensor.offset)
            f.readinto(memoryview(out.reshape(-1).view(np.uint8)))
        return out


@dataclass
class Imported:
    """What an import read, for the banner: where from, how many parameters, how long, the peak host memory."""

    path: str
    n_params: int
    seconds: float
    peak_rss_mb: float

    def describe(self) -> str:
        return (
            f"initialised from {self.path} ({self.n_params:,} parameters read in {self.seconds:.1f} s; "
            f"peak host memory of this process {self.peak_rss_mb:,.0f} MB)"
        )


def load_model(m: ModelConfig, path: str | Path):
    """jdp's model for config `m` (GPT or Llama, by model.arch) with every parameter read from the directory (no
    random init is run).

    The values are host numpy arrays, read one tensor at a time and converted to model.param_dtype as read (the
    file's bfloat16 to float32, say), so the host holds one copy of the weights and one tensor in flight:
    `parallel.init_state` places them. The vocabulary rows beyond the file's (a padded model.vocab_size) are zero
    and, with model.vocab_valid set, never get probability.
    """
    from jdp.models import make_model

    start = time.perf_counter()
    arch = architecture(read_config(path))  # refused here, before any tensor is read, if jdp cannot compute it
    if arch.family != m.arch:
        raise ConfigError(f"{path} holds a {arch.class_name}, but model.arch={m.arch}; leave model.arch out")
    weights = Weights(path, arch.prefix)
    model = nnx.eval_shape(lambda: make_model(m, nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    wanted = dict(nnx.to_flat_state(params))
    table = arch.table(m)
    _check_names(arch, table, weights, m, path)
    loaded, n_read = {}, 0
    for name, slot in table.items():
        value = weights.get(name)
        n_read += value.size
        if slot.path not in wanted:  # a bias the model does not have (model.bias=false): only zeros can be dropped
            if np.any(value):
                raise ConfigError(f"{path}: {name} is not zero, but model.{arch.bias_key}=false; "
                                  f"set model.{arch.bias_key}=true")  # fmt: skip
            continue
        loaded[slot.path] = _placed_value(value, slot, wanted[slot.path].get_value().shape, m, name, path, arch)
    if arch.tied_output in weights.names and arch.tied_output not in table:
        embedding = loaded[arch.top[arch.embedding]][: weights.get(arch.embedding).shape[0]]
        if not np.array_equal(weights.get(arch.tied_output).astype(embedding.dtype), embedding):
            raise ConfigError(
                f"{path}: {arch.tied_output} differs from {arch.embedding}, but the model ties its output to the "
                f"embedding (tie_word_embeddings)"
            )
    for where, variable in wanted.items():
        variable.set_value(loaded[where])
    model = nnx.merge(graphdef, nnx.from_flat_state(wanted), rest)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return model, Imported(str(path), n_read, time.perf_counter() - start, peak_mb)


def _check_names(arch: Architecture, table: dict, weights: Weights, m: ModelConfig, path) -> None:
    """Every tensor the model needs is in the files, and every tensor in the files is one of them."""
    unknown = sorted(n for n in weights.names if n not in table and not arch.buffers.match(n) and n != arch.tied_output)
    missing = sorted(n for n in table if n not in weights.names)
    if unknown or missing:
        raise ConfigError(
            f"{path}: its tensors are not a {arch.class_name} of {m.n_layers} blocks:"
            + (f" missing {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''};" if missing else "")
            + (f" unknown {', '.join(unknown[:8])}{' ...' if len(unknown) > 8 else ''}" if unknown else "")
        )


def _placed_value(value: np.ndarray, slot: Slot, shape: tuple, m: ModelConfig, name: str, path, arch) -> np.ndarray:
    """One file tensor as jdp's parameter: transposed (a view), in model.param_dtype (a copy only when the dtype
    differs), the vocabulary's rows beyond the file's zero (the one copy, converted as it is made)."""
    dtype = jnp.dtype(m.param_dtype)
    expected = shape[::-1] if slot.transposed else shape  # in the file's layout
    vocab_rows = name in (arch.embedding, arch.tied_output) and value.ndim == 2 and value.shape[1:] == expected[1:]
    if vocab_rows and value.shape[0] < expected[0]:  # a vocabulary padded for speed
        padded = np.zeros(expected, dtype)
        padded[: value.shape[0]] = value
        value = padded
    if value.shape != expected:
        where = ".".join(map(str, slot.path))
        needs = f", which is {expected} transposed" if slot.transposed else ""
        raise ConfigError(f"{path}: {name} has shape {value.shape}; jdp's {where} is {shape}{needs}")
    return (value.T if slot.transposed else value).astype(dtype, copy=False)


def _export_architecture(cfg) -> Architecture:
    """The architecture of the model's family: the one its bias switch asks for (Qwen2 when a Llama's q/k/v have
    biases), else the one the run was imported from, else the family's first (GPT-2, Llama)."""
    m = cfg.model
    ours = [a for a in ARCHITECTURES.values() if a.family == m.arch]
    if not ours:
        raise ConfigError(
            f"model.arch={m.arch}: no Hugging Face architecture reads into this family (jdp writes "
            f"{', '.join(sorted({a.family for a in ARCHITECTURES.values()}))})"
        )
    if biased := [a for a in ours if a.bias_key and getattr(m, a.bias_key)]:
        return biased[0]
    source = cfg.train.init_from
    original = json.loads((Path(source) / CONFIG).read_text()) if source and is_hf_dir(source) else {}
    return next((a for a in ours if a.model_type == original.get("model_type")), ours[0])


def export(model, cfg, out_dir: str | Path, tokenizer_path: str = "byte") -> list[str]:
    """Write `model` (jdp's GPT or Llama, config `cfg`) as a Hugging Face directory: config.json,
    model.safetensors, the tokenizer's files (for the byte tokenizer, a tokenizer.json that encodes like it) and,
    when the run was imported, the original's generation_config.json. Refuses a directory that is not empty;
    writes to a temporary directory beside it and renames it into place, so OUT_DIR is either complete or absent.

    An imported model keeps its own vocabulary rows (config.json's vocab_size, jdp's padding cut off); a model jdp
    made writes only the output rows of ids the tokenizer has: the padding rows, which jdp never samples
    (model.vocab_valid, or a byte model's 320 rows for 257 ids), would otherwise get probability in transformers."""
    from safetensors.numpy import save_file

    from jdp.data.tokens import load_tokenizer

    m, source = cfg.model, cfg.train.init_from
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} exists and is not an empty directory; give a new directory (nothing was written)")
    tokenizer = load_tokenizer(tokenizer_path)
    tokenizer_files = _tokenizer_files(tokenizer_path)
    arch = _export_architecture(cfg)
    imported = bool(source) and is_hf_dir(source)
    vocab = m.vocab_valid or m.vocab_size  # an import's own rows: its config.json's vocab_size
    if not source:  # a model jdp made: only the ids its tokenizer has
        vocab = min(vocab, tokenizer.vocab_size)
    tensors = _export_tensors(model, m, arch, vocab)
    ids = {"bos_token_id": tokenizer.eod_id, "eos_token_id": tokenizer.eod_id}
    if imported:  # the original's special ids (Llama's bos differs from its eos), as its tokenizer has them
        original = json.loads((Path(source) / CONFIG).read_text())
        ids = {k: original[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in original} or ids
    hf_config = {"architectures": [arch.class_name], "model_type": arch.model_type, "vocab_size": vocab,
                 **arch.hf_config(m), **ids, "torch_dtype": "float32", "dtype": "float32"}  # fmt: skip
    tmp = out.with_name(out.name + ".tmp-export")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})  # transformers requires the format key
    (tmp / WEIGHTS).chmod(0o644)  # safetensors writes it owner-only, unlike every other file here
    (tmp / CONFIG).write_text(json.dumps(hf_config, indent=2) + "\n")
    for file, name in tokenizer_files:
        shutil.copy2(file, tmp / name)
    if imported and (Path(source) / GENERATION_CONFIG).is_file():
        shutil.copy2(Path(source) / GENERATION_CONFIG, tmp / GENERATION_CONFIG)
    if tokenizer_path == "byte":
        _write_byte_tokenizer(tmp)
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    return sorted(p.name for p in out.iterdir())


def _export_tensors(model, m: ModelConfig, arch: Architecture, vocab: int) -> dict[str, np.ndarray]:
    """The model's parameters under the architecture's names, float32, [out, in] where it stores them so, with
    `vocab` rows; biases the model does not have are written as zeros (which compute the same)."""
    params = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    tensors = {}
    for name, slot in arch.table(m).items():
        if slot.path in params:
            value = np.asarray(params[slot.path].get_value(), np.float32)
        else:  # no biases in this model: the architecture's are zeros
            width = params[slot.path[:-1] + ("kernel",)].get_value().shape[-1]
            value = np.zeros((width,), np.float32)
        if slot.transposed:
            value = value.T
        if name in (arch.embedding, arch.tied_output):
            value = value[:vocab]
        tensors[arch.file_name(name)] = np.ascontiguousarray(value)
    return tensors


def _tokenizer_files(spec: str) -> list[tuple[Path, str]]:
    """The files of the run's tokenizer to ship with the model: none for the byte tokenizer."""
    if spec == "byte":
        return []
    p = Path(spec).expanduser()
    if p.is_file():
        return [(p, "tokenizer.json")]  # the `tokenizers` format, whatever the file was called
    return [(p / name, name) for name in TOKENIZER_FILES if (p / name).is_file()]


def _write_byte_tokenizer(out: Path) -> None:
    """tokenizer.json (+ tokenizer_config.json) for jdp's byte tokenizer, so the export is self-contained: a BPE
    without merges over GPT-2's byte alphabet, id b for byte b, and <|endoftext|> as id 256, the next one."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.BPE(vocab={_BYTE_CHARS[b]: b for b in range(256)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(_EOD, special=True)])
    tokenizer.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": _EOD, "eos_token": _EOD}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet of `tokenizers`' ByteLevel pre-tokenizer."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]  # "!".."~", "¡".."¬", "®".."ÿ"
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


_BYTE_CHARS, _EOD = _byte_chars(), "<|endoftext|>"
