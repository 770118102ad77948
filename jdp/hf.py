"""Hugging Face models in and out: GPT-2 and the Llama family (Llama, Qwen2, Mistral, SmolLM) directories
(config.json + safetensors) <-> jdp's GPT and Llama, by the name table each family declares per architecture.

GPT-2 is jdp's GPT with biases (model.bias=true): the same pre-norm blocks, LayerNorm, tanh GELU, learned positions
and an output tied to the embedding, and HF's `Conv1D` stores its weights [in, out] like a Flax kernel, so every
tensor maps one to one. LlamaForCausalLM, Qwen2ForCausalLM (q/k/v biases) and MistralForCausalLM (without a sliding
window) are jdp's Llama (model.arch=llama, jdp/models/llama.py): their `nn.Linear` weights are [out, in], the transpose of
a Flax kernel, and their rotary embedding is the rotate-half one jdp computes, so q and k need no permutation.
Another architecture is one more `Architecture` (jdp/models/hf_names.py) in its family's `HF_ARCHITECTURES`: its
names, which of them are transposed, its config.json reader and writer; nothing here changes.

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

import contextlib
import dataclasses
import json
import math
import re
import resource
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jdp import models
from jdp.errors import ConfigError
from jdp.models.config import ModelConfig
from jdp.models.hf_names import Architecture, Slot
from jdp.rundir import RunDir

__all__ = [
    "CONFIG",
    "GENERATION_CONFIG",
    "INDEX",
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
    "architectures",
    "export",
    "is_hf_dir",
    "load_model",
    "model_config",
    "model_fields",
    "new_directory",
    "output_rows",
    "read_config",
    "written_whole",
]

CONFIG, WEIGHTS, INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
GENERATION_CONFIG = "generation_config.json"  # sampling defaults (eos ids, temperature): kept from the import
# The files a tokenizer saved by `transformers` may consist of; export copies those the run's tokenizer has.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
    "added_tokens.json", "tokenizer.model", "chat_template.jinja", "chat_template.json",
)  # fmt: skip
# ModelConfig's fields that are how a run computes, not what the model is: config.json never sets them.
_RUN_SETTINGS = ("dtype", "param_dtype", "attention", "vocab_valid", "remat", "remat_every", "lora_rank", "lora_alpha",
                 "lora_dropout", "lora_targets", "lora_rslora", "lora_modules_to_save", "base_dtype")  # fmt: skip


def architectures() -> dict:
    """model_type -> Architecture, of every model family (jdp/models/: each declares its own)."""
    return models.hf_architectures()


def is_hf_dir(path: str | Path) -> bool:
    p = Path(path)
    return (p / CONFIG).is_file() and ((p / WEIGHTS).is_file() or (p / INDEX).is_file())


def read_config(path: str | Path, key: str = "") -> dict:
    """config.json of a Hugging Face model directory, checked to be a model jdp can represent exactly. `key`: the
    setting that named the directory (train.init_from), named in the errors."""
    p, named = Path(path).expanduser(), f"{key}={path}" if key else str(path)
    if not p.is_dir():
        raise ConfigError(f"{named}: no such directory; give a local Hugging Face model directory (config.json + "
                          f"model.safetensors), e.g. one saved by save_pretrained or downloaded with `hf download`")  # fmt: skip
    if not (p / CONFIG).is_file():
        run = RunDir(p)
        if run.config.is_file() or run.checkpoints.is_dir():
            raise ConfigError(
                f"{named} is a jdp run directory (its config.yaml and checkpoints/), not a Hugging Face model "
                f"directory: to continue that run give train.run_dir={path} (it resumes from its newest checkpoint); "
                f"to start a new run from its weights, convert them first with `jdp export {path} OUT` and give "
                f"train.init_from=OUT data.tokenizer=OUT (the export holds the run's tokenizer)"
            )
        raise ConfigError(f"{named}: has no {CONFIG}; give a Hugging Face model directory")
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
    known = architectures()
    if not isinstance(hf, dict) or hf.get("model_type") not in known:
        model_type = hf.get("model_type") if isinstance(hf, dict) else None
        kinds = ", ".join(f"{a.model_type} ({a.class_name})" for a in known.values())
        raise ConfigError(f"{where}: model_type {model_type!r}; jdp imports {kinds}")
    _check_types(hf, where)
    try:
        fields, problems = known[hf["model_type"]].fields(hf)
    except (TypeError, ValueError, ArithmeticError) as e:  # a value of the wrong kind that _check_types let by
        raise ConfigError(f"{where}: its values do not make a model: {type(e).__name__}: {e}") from None
    problems += _wrong_kinds(fields)
    if problems:
        raise ConfigError(
            f"{where}: this {hf['model_type']} model differs from what jdp computes: " + "; ".join(problems)
        )
    return hf


_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _check_types(hf: dict, where) -> None:
    """A number written in quotes ("hidden_size": "32") is refused by name: Python would fail on it later, or
    compare it as text."""
    quoted = [k for k, v in hf.items()
              if isinstance(v, str) and _NUMBER.fullmatch(v.strip()) and k != "transformers_version"]  # fmt: skip
    if quoted:
        listed = ", ".join(f'"{k}": {json.dumps(hf[k])}' for k in quoted)
        raise ConfigError(f"{where}: {listed}: a number in quotes is a string; write it without the quotes")


def _wrong_kinds(fields: dict) -> list[str]:
    """Fields whose value is not the kind jdp's ModelConfig holds (a list for a size, true for a count)."""
    default, out = ModelConfig(), []
    for name, value in fields.items():
        want = type(getattr(default, name, None))
        ok = (isinstance(value, want) and not (want is int and isinstance(value, bool))) or (
            want is float and isinstance(value, int) and not isinstance(value, bool))  # fmt: skip
        if want in (int, float, bool, str) and not ok:
            out.append(f"model.{name} would be {value!r}, not {'an' if want is int else 'a'} {want.__name__}")
    return out


def architecture(hf: dict) -> Architecture:
    """The architecture of a config.json that read_config accepted."""
    return architectures()[hf["model_type"]]


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
        start, tensors, spans = 8 + n, {}, []
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            if entry["dtype"] not in _DTYPES:
                raise ValueError(f"{name} has dtype {entry['dtype']}; jdp reads {', '.join(_DTYPES)}")
            dtype, shape, (begin, end) = np.dtype(_DTYPES[entry["dtype"]]), tuple(entry["shape"]), entry["data_offsets"]
            if end - begin != math.prod(shape) * dtype.itemsize or not 0 <= begin <= end <= size - start:
                raise ValueError(f"{name}'s data_offsets {[begin, end]} do not hold {entry['dtype']} {list(shape)}")
            tensors[name] = Tensor(dtype, shape, start + begin)
            spans.append((begin, end, name))
        _check_spans(spans, size - start)
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # JSONDecodeError and UnicodeDecodeError too
        raise ConfigError(f"{path}: not a readable safetensors file ({e})") from e
    return tensors


def _check_spans(spans: list, data_bytes: int) -> None:
    """The tensors' bytes tile the data exactly, as the safetensors library requires ("invalid offset"): no two
    share bytes (an embedding pointing at the output layer's), none is left over."""
    spans = sorted(spans)
    for (_, end, before), (begin, stop, name) in zip(spans, spans[1:], strict=False):
        if begin < end:
            raise ValueError(f"{name}'s data_offsets {[begin, stop]} overlap {before}'s (invalid offset)")
    at = 0
    for begin, end, name in spans:
        if begin != at:
            raise ValueError(f"{name}'s data_offsets {[begin, end]} leave bytes {at}-{begin} to no tensor (invalid "
                             f"offset)")  # fmt: skip
        at = end
    if at != data_bytes:
        raise ValueError(f"the tensors end at byte {at} of the {data_bytes} data bytes (invalid offset)")


class Weights:
    """The tensors of a Hugging Face directory, by name (prefix removed), from one file or a sharded index.

    Each `get` reads one tensor straight from the file into a fresh array, the one copy the host holds (safetensors'
    own reader memory-maps the file and copies out of the mapping, so a process's resident memory counts the
    weights twice: the mapped pages and the copy). bfloat16, the dtype of most published checkpoints, is read as
    ml_dtypes' bfloat16, which numpy lacks."""

    def __init__(self, path: str | Path, prefix: str = ""):
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
    if vocab_rows and value.shape[0] < (ids := m.vocab_valid or m.vocab_size) <= expected[0]:
        raise ConfigError(
            f"{path}: {name} has {value.shape[0]} rows, but config.json's vocab_size is {ids}: ids "
            f"{value.shape[0]}-{ids - 1} would get zero rows that still get probability; config.json and the tensors "
            f"disagree: give vocab_size {value.shape[0]} in config.json, or the whole tensor"
        )
    if vocab_rows and value.shape[0] < expected[0]:  # a vocabulary padded for speed
        padded = np.zeros(expected, dtype)
        padded[: value.shape[0]] = value
        value = padded
    if value.shape != expected:
        where = ".".join(map(str, slot.path))
        needs = f", which is {expected} transposed" if slot.transposed and expected != shape else ""
        raise ConfigError(f"{path}: {name} has shape {value.shape}; jdp's {where} is {shape}{needs}")
    return (value.T if slot.transposed else value).astype(dtype, copy=False)


def _export_architecture(cfg) -> Architecture:
    """The architecture of the model's family: the one its bias switch asks for (Qwen2 when a Llama's q/k/v have
    biases), else the one the run was imported from, else the family's first (GPT-2, Llama)."""
    m = cfg.model
    ours = list(models.hf_architectures(m.arch).values())
    if not ours:
        raise ConfigError(
            f"model.arch={m.arch}: no Hugging Face architecture reads into this family (jdp writes "
            f"{', '.join(sorted({a.family for a in architectures().values()}))})"
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
    out = new_directory(out_dir)
    tokenizer = load_tokenizer(tokenizer_path)
    tokenizer_files = _tokenizer_files(tokenizer_path)
    arch = _export_architecture(cfg)
    imported = bool(source) and is_hf_dir(source)
    vocab = output_rows(cfg, tokenizer)
    tensors = _export_tensors(model, m, arch, vocab)
    ids = {"bos_token_id": tokenizer.eod_id, "eos_token_id": tokenizer.eod_id}
    if imported:  # the original's special ids (Llama's bos differs from its eos), as its tokenizer has them
        original = json.loads((Path(source) / CONFIG).read_text())
        ids = {k: original[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in original} or ids
    if m.pad_id >= 0:  # the row transformers then builds with padding_idx, as jdp trained it
        ids["pad_token_id"] = m.pad_id
    hf_config = {"architectures": [arch.class_name], "model_type": arch.model_type, "vocab_size": vocab,
                 **arch.hf_config(m), **ids, "torch_dtype": "float32", "dtype": "float32"}  # fmt: skip
    with written_whole(out) as tmp:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})  # transformers requires the format key
        (tmp / WEIGHTS).chmod(0o644)  # safetensors writes it owner-only, unlike every other file here
        (tmp / CONFIG).write_text(json.dumps(hf_config, indent=2) + "\n")
        for file, name in tokenizer_files:
            shutil.copy2(file, tmp / name)
        if imported and (Path(source) / GENERATION_CONFIG).is_file():
            shutil.copy2(Path(source) / GENERATION_CONFIG, tmp / GENERATION_CONFIG)
        if tokenizer_path == "byte":
            _write_byte_tokenizer(tmp)
    return sorted(p.name for p in out.iterdir())


def output_rows(cfg, tokenizer) -> int:
    """The output rows an export writes: an import's own (its config.json's vocab_size, jdp's padding cut off); for
    a model jdp made, only the ids its tokenizer has."""
    vocab = cfg.model.vocab_valid or cfg.model.vocab_size
    return vocab if cfg.train.init_from else min(vocab, tokenizer.vocab_size)


def new_directory(out_dir: str | Path) -> Path:
    """An export's directory: refused unless it is new or empty (before anything is written)."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} exists and is not an empty directory; give a new directory (nothing was written)")
    return out


@contextlib.contextmanager
def written_whole(out: Path):
    """A temporary directory beside `out` to write into, renamed into place at the end: `out` is complete or
    absent."""
    tmp = out.with_name(out.name + ".tmp-export")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    yield tmp
    if out.exists():
        out.rmdir()
    tmp.rename(out)


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
