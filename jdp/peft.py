"""PEFT's adapter format in and out: `adapter_model.safetensors` + `adapter_config.json`, as `peft` writes and
`PeftModel.from_pretrained`, vLLM (`--lora-modules`) and transformers load them; and model.lora_* in PEFT's terms.

A family's names come from its Hugging Face architecture (the tables jdp/hf.py imports and exports by): jdp's
blocks.0.attn.q is Llama's model.layers.0.self_attn.q_proj, whose adapter PEFT stores as
`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` ([r, in]) and `...lora_B.weight` ([out, r]), the
transposes of jdp's A (in x r) and B (r x out); a module trained whole (modules_to_save) as
`base_model.model.<module>.weight`. model.lora_targets and model.lora_modules_to_save take the short names
PEFT's target_modules uses (q_proj, ..., all-linear: models/lora_names.py).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jdp import adapters, hf
from jdp.errors import ConfigError
from jdp.models.config import ModelConfig
from jdp.models.lora_names import names, short, split

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "add_adapters", "adopted", "load_adapter", "read_config", "save_adapter"]

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_PREFIX = "base_model.model."  # PeftModel's, before the transformers model's own names
# adapter_config.json's keys -> model.lora_*
_KEYS = {"r": "lora_rank", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout", "use_rslora": "lora_rslora"}
# What PEFT can store that jdp does not compute: refused by name when set
_UNSUPPORTED = {"use_dora": "DoRA", "lora_bias": "trained LoRA biases", "alpha_pattern": "per-module alphas",
                "rank_pattern": "per-module ranks", "layers_to_transform": "a subset of layers",
                "bias": "trained biases", "use_qalora": "QA-LoRA", "target_parameters": "LoRA on parameters"}  # fmt: skip


def add_adapters(model, m: ModelConfig, seed: int = 0):
    """`model` (jdp's family `m`) with the adapters model.lora_* ask for (adapters.add), in place; A drawn from
    `seed`."""
    layers, targets, whole = names(m), split(m.lora_targets), split(m.lora_modules_to_save)
    if layers.modules:
        chosen = {p for p, n in layers.linear().items() if "all-linear" in targets or short(n) in targets}
        kept = {p for p, n in layers.outside_blocks().items() if short(n) in whole}
        adapt, train = chosen.__contains__, kept.__contains__
    else:  # a family without Hugging Face names: jdp's own, matched at the end of the path
        adapt, train = targets, whole
    dtype = jnp.dtype(m.base_dtype) if m.base_dtype else None
    return adapters.add(model, adapt, m.lora_rank, m.lora_alpha, m.lora_dropout, m.lora_rslora, train, dtype,
                        nnx.Rngs(seed + 1))  # fmt: skip


@functools.cache
def matmul_params(m: ModelConfig) -> tuple[int, int]:
    """(the adapters' weights, the weights of the matrix-multiplying modules trained whole) of model `m` with its
    adapters (shapes only, nothing computed): what the FLOPs count beside the frozen base (metrics.flops_per_token)."""
    from jdp.models import make_model

    model = nnx.eval_shape(lambda: add_adapters(make_model(m, nnx.Rngs(0)), m))
    lora = whole = 0
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if variable.__class__ is nnx.LoRAParam:
            lora += variable.size
        elif path[-1] == "kernel":  # an output head trained whole (an embedding's lookup multiplies nothing)
            whole += variable.size
    return lora, whole


# ---- the files ---------------------------------------------------------------------------------------------------


def save_adapter(model, cfg, out_dir: str | Path) -> list[str]:
    """Write the model's adapters (and the modules trained whole) as PEFT's two files in `out_dir` (new or empty),
    atomically (a temporary directory renamed into place)."""
    from safetensors.numpy import save_file

    m = cfg.model
    layers = names(m)
    modules = layers.modules
    if not modules:
        raise ConfigError(f"model.arch={m.arch} has no Hugging Face names to write PEFT's format with")
    out = hf.new_directory(out_dir)
    vocab = m.vocab_valid or m.vocab_size
    tensors, targets = {}, set()
    for path, layer in adapters.lora_layers(model):
        name = _PREFIX + modules[path]
        targets.add(short(modules[path]))
        tensors[name + ".lora_A.weight"] = np.asarray(layer.lora_a[...], np.float32).T
        tensors[name + ".lora_B.weight"] = np.asarray(layer.lora_b[...], np.float32).T
    saved = []
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if variable.__class__ is nnx.LoRAParam:
            continue
        module = tuple(path[:-1])
        value = np.asarray(variable[...], np.float32)
        value = value if path[-1] == "embedding" else value.T  # a kernel [in, out] -> torch's [out, in]
        tensors[_PREFIX + modules[module] + ".weight"] = np.ascontiguousarray(value[:vocab])
        saved.append(short(modules[module]))
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": cfg.train.init_from or None,
        "revision": None, "r": m.lora_rank, "lora_alpha": m.lora_alpha, "lora_dropout": m.lora_dropout,
        "use_rslora": m.lora_rslora, "target_modules": sorted(targets), "modules_to_save": sorted(saved) or None,
        "bias": "none", "fan_in_fan_out": layers.fan_in_fan_out,  # GPT-2's Conv1D: its weights [in, out]
        "init_lora_weights": True, "inference_mode": True, "use_dora": False,
    }  # fmt: skip
    with hf.written_whole(out) as tmp:
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp / ADAPTER_WEIGHTS),
                  metadata={"format": "pt"})  # fmt: skip
        (tmp / ADAPTER_WEIGHTS).chmod(0o644)
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return sorted(p.name for p in out.iterdir())


def read_config(path: str | Path) -> dict:
    """adapter_config.json of a PEFT adapter directory, checked to be a LoRA jdp computes exactly."""
    p = Path(path).expanduser()
    if not (p / ADAPTER_CONFIG).is_file() or not (p / ADAPTER_WEIGHTS).is_file():
        raise ConfigError(f"train.init_adapter={path}: not a PEFT adapter directory (it needs {ADAPTER_CONFIG} and "
                          f"{ADAPTER_WEIGHTS}, as PeftModel.save_pretrained writes them)")  # fmt: skip
    try:
        config = json.loads((p / ADAPTER_CONFIG).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p / ADAPTER_CONFIG}: not valid JSON ({e})") from e
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise ConfigError(f"{p / ADAPTER_CONFIG}: peft_type {config.get('peft_type')!r}; jdp reads LoRA adapters")
    refused = [f"{k} {config[k]!r} ({what})" for k, what in _UNSUPPORTED.items()
               if config.get(k) not in (None, False, {}, [], "none")]  # fmt: skip
    if refused:
        raise ConfigError(f"{p / ADAPTER_CONFIG}: {'; '.join(refused)}: jdp computes plain LoRA (and rsLoRA) only")
    return config


def adopted(m: ModelConfig, path: str | Path, explicit: frozenset[str]) -> tuple[ModelConfig, list[str], list[str]]:
    """(m with model.lora_* as the adapter at `path` has them, what changed, what the command line contradicts):
    the rank, alpha, dropout, rsLoRA and the modules trained whole from adapter_config.json, the targets from the
    adapters the file holds."""
    from safetensors import safe_open

    config = read_config(path)
    with safe_open(str(Path(path) / ADAPTER_WEIGHTS), "numpy") as f:
        keys = list(f.keys())
    targets = sorted({short(k.removesuffix(".lora_A.weight")) for k in keys if k.endswith(".lora_A.weight")})
    whole = sorted({short(k.removesuffix(".weight")) for k in keys if ".lora_" not in k})
    values = {ours: config[theirs] for theirs, ours in _KEYS.items() if config.get(theirs) is not None}
    values |= {"lora_targets": ",".join(targets), "lora_modules_to_save": ",".join(whole)}
    changes, conflicts, fields = [], [], {}
    for key, value in values.items():
        value = type(getattr(m, key))(value)
        now = getattr(m, key)
        if now == value or (key in ("lora_targets", "lora_modules_to_save") and set(split(now)) == set(split(value))):
            continue
        if f"model.{key}" in explicit:
            conflicts.append(f"model.{key}={now!r} (the adapter's is {value!r})")
        else:
            fields[key] = value
            changes.append(f"model.{key} {now!r} -> {value!r} (from {Path(path) / ADAPTER_CONFIG})")
    return dataclasses.replace(m, **fields), changes, conflicts


def load_adapter(model, cfg, path: str | Path) -> int:
    """Read a PEFT adapter into `model` (which has adapters as the config asks: add_adapters): every LoRA layer's
    A and B and every module trained whole, each checked present, of its shape, and nothing left over (an adapter
    whose keys miss the model would load with B at zero in peft: here it is an error). Returns the tensors read."""
    from safetensors.numpy import load_file

    read_config(path)
    modules = names(cfg.model).modules
    tensors = load_file(str(Path(path) / ADAPTER_WEIGHTS))
    left = dict(tensors)
    problems = []

    def take(name: str, want: tuple):
        """The file's tensor `name`, of shape `want` (the file's layout), or None with the problem noted; an
        embedding's or output's rows below jdp's padded vocabulary (model.vocab_size) are zeros."""
        value = left.pop(name, None)
        if value is None:
            problems.append(f"missing {name}")
        elif value.shape != want and not (value.ndim == 2 and value.shape[1] == want[1] and value.shape[0] < want[0]):
            problems.append(f"{name} has shape {value.shape}; jdp's model needs {want}")
            value = None
        elif value.shape != want:
            value = np.concatenate([value, np.zeros((want[0] - value.shape[0], want[1]), value.dtype)])
        return value

    def put(variable, value, transposed: bool):
        if value is not None:
            variable.set_value(np.asarray(value.T if transposed else value, variable[...].dtype))

    for where, layer in adapters.lora_layers(model):
        name = _PREFIX + modules[where]
        for variable, suffix in ((layer.lora_a, ".lora_A.weight"), (layer.lora_b, ".lora_B.weight")):
            put(variable, take(name + suffix, variable[...].shape[::-1]), True)
    for where, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if variable.__class__ is not nnx.LoRAParam:  # a module trained whole: torch's [out, in] but embeddings
            transposed = where[-1] != "embedding"
            shape = variable[...].shape
            put(variable, take(_PREFIX + modules[tuple(where[:-1])] + ".weight", shape[::-1] if transposed else shape),
                transposed)  # fmt: skip
    if left:
        problems.append(f"not in this model's adapters: {', '.join(sorted(left)[:6])}{' ...' if len(left) > 6 else ''}")
    if problems:
        raise ConfigError(f"train.init_adapter={path}: the adapter does not fit the model (model.arch="
                          f"{cfg.model.arch}, model.lora_targets={cfg.model.lora_targets}):\n  "
                          + "\n  ".join(problems[:12]))  # fmt: skip
    return len(tensors)
