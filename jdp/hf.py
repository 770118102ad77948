"""Hugging Face models in and out: a GPT-2 directory (config.json + safetensors) <-> jdp's GPT, by a name table.

GPT-2 is jdp's GPT with biases (model.bias=true): the same pre-norm blocks, LayerNorm eps 1e-5, tanh GELU, learned
positions and an output tied to the embedding, and HF's `Conv1D` stores its weights [in, out] like a Flax kernel,
so every tensor maps one to one. Another architecture is one more `Architecture`.

Import reads the tensors with safetensors' numpy API (no torch), from one `model.safetensors` or the shards of a
`model.safetensors.index.json`, one tensor at a time; `parallel.init_state` then places them, replicated, on every
device of every process (each process reads the files itself). The model's shape comes from config.json
(`adopt`): only keys the user set on the command line must agree with it.

Export writes GPT-2's names and shapes, loadable with `transformers.AutoModelForCausalLM.from_pretrained`
unchanged, with only the output rows of ids the tokenizer has (transformers would give the padding probability).
"""

from __future__ import annotations

import dataclasses
import json
import re
import resource
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jdp.config import ConfigError, ModelConfig

__all__ = [
    "CONFIG",
    "INDEX",
    "TOKENIZER_FILES",
    "VOCAB_MULTIPLE",
    "WEIGHTS",
    "Adopted",
    "Architecture",
    "GPT2",
    "Imported",
    "Weights",
    "adopt",
    "export",
    "is_hf_dir",
    "load_model",
    "model_config",
    "model_fields",
    "read_config",
]

CONFIG, WEIGHTS, INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
# The files a tokenizer saved by `transformers` may consist of; export copies those the run's tokenizer has.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
    "added_tokens.json",
)  # fmt: skip


@dataclass(frozen=True)
class Architecture:
    """One Hugging Face architecture: its names for jdp's parameters, per model and per block."""

    model_type: str
    class_name: str
    prefix: str  # before every name in the files ("transformer."); names without it are read too
    top: dict[str, tuple]  # HF name -> jdp parameter path
    block: dict[str, tuple]  # HF name after "{blocks}.{i}." -> path after ("blocks", i)
    blocks: str  # the HF name of the block list
    buffers: re.Pattern  # names in old files that are not parameters (causal-mask buffers): skipped
    tied_output: str  # the output layer's name, tied to the embedding: not written, and checked equal if read

    def table(self, n_layers: int) -> dict[str, tuple]:
        """Every HF name (without the prefix) -> jdp parameter path, for a model of n_layers blocks."""
        names = dict(self.top)
        for i in range(n_layers):
            names.update({f"{self.blocks}.{i}.{k}": ("blocks", i, *v) for k, v in self.block.items()})
        return names


GPT2 = Architecture(
    model_type="gpt2",
    class_name="GPT2LMHeadModel",
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
    tied_output="lm_head.weight",
)
_GELU_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")  # jax.nn.gelu(approximate=True), one formula


def is_hf_dir(path: str | Path) -> bool:
    p = Path(path)
    return (p / CONFIG).is_file() and ((p / WEIGHTS).is_file() or (p / INDEX).is_file())


def read_config(path: str | Path) -> dict:
    """config.json of a Hugging Face model directory, checked to be a GPT-2 jdp can represent exactly."""
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
    if hf.get("model_type") != GPT2.model_type:
        raise ConfigError(f"{where}: model_type {hf.get('model_type')!r}; jdp imports GPT-2 models (model_type gpt2)")
    d = hf.get("n_embd", 768)
    problems = []
    if hf.get("activation_function", "gelu_new") not in _GELU_TANH:
        problems.append(f"activation_function {hf['activation_function']!r} (jdp's MLP uses tanh GELU, gelu_new)")
    if hf.get("layer_norm_epsilon", 1e-5) != 1e-5:
        problems.append(f"layer_norm_epsilon {hf['layer_norm_epsilon']} (jdp's LayerNorm uses 1e-5)")
    if (n_inner := hf.get("n_inner")) is not None and n_inner % d:
        problems.append(f"n_inner {n_inner} is not a multiple of n_embd {d}")
    if not hf.get("scale_attn_weights", True) or hf.get("scale_attn_by_inverse_layer_idx", False):
        problems.append("attention scaled other than by 1/sqrt(head width)")
    if not hf.get("tie_word_embeddings", True):
        problems.append("tie_word_embeddings false (jdp's output layer is the embedding)")
    if problems:
        raise ConfigError(f"{where}: this GPT-2 differs from what jdp's GPT computes: " + "; ".join(problems))
    return hf


def model_fields(hf: dict) -> dict:
    """jdp's ModelConfig fields that config.json determines."""
    d = hf.get("n_embd", 768)
    return {
        "vocab_size": hf.get("vocab_size", 50257),
        "max_seq_len": hf.get("n_positions", 1024),
        "d_model": d,
        "n_layers": hf.get("n_layer", 12),
        "n_heads": hf.get("n_head", 12),
        "mlp_ratio": (hf.get("n_inner") or 4 * d) // d,
        "bias": True,
    }


def model_config(path: str | Path, base: ModelConfig | None = None) -> ModelConfig:
    """The model a directory holds, as jdp's config (dtypes and attention kept from `base`)."""
    return dataclasses.replace(base or ModelConfig(), **model_fields(read_config(path)), vocab_valid=0)


VOCAB_MULTIPLE = 64  # an imported vocabulary is padded to a multiple of this: faster embedding and output matmuls


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
    model.vocab_size is explicit (then it must hold config.json's ids); model.vocab_valid marks the padding."""
    read = model_fields(read_config(path))
    vocab = read["vocab_size"]
    padded = -(-vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
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
        elif key == "bias":
            why = "GPT-2 has biases"
        if name in explicit:
            # model.bias=false is left to load_model, which accepts it only if the file's biases are all zero
            if ours != theirs and key != "bias":
                conflicts.append(f"{name}={ours} (config.json: {theirs})")
        elif ours != theirs:
            values[key] = theirs
            changes.append(f"{name} {ours} -> {theirs} ({why})")
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


class Weights:
    """The tensors of a Hugging Face directory, by name (prefix removed), from one file or a sharded index."""

    def __init__(self, path: str | Path):
        from safetensors import safe_open

        p = Path(path)
        if (p / INDEX).is_file():
            try:
                weight_map = json.loads((p / INDEX).read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ConfigError(f"{p / INDEX}: not a safetensors index (no weight_map): {e}") from e
            files = sorted(set(weight_map.values()))
        else:
            files = [WEIGHTS]
        self._files, self.names = {}, {}
        for name in files:
            if not (p / name).is_file():
                raise ConfigError(f"{p / INDEX} names {name}, which is not in {p}")
            try:
                self._files[name] = f = safe_open(str(p / name), framework="np")
            except Exception as e:  # safetensors raises its own SafetensorError on a damaged header
                raise ConfigError(f"{p / name}: not a readable safetensors file ({e})") from e
            for key in f.keys():
                self.names[key.removeprefix(GPT2.prefix)] = (name, key)

    def get(self, name: str) -> np.ndarray:
        file, key = self.names[name]
        return self._files[file].get_tensor(key)


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
    """jdp's GPT for config `m` with every parameter read from the directory (no random init is run).

    The values are host numpy arrays: `parallel.init_state` places them. The vocabulary rows beyond the file's
    (a padded model.vocab_size) are zero and, with model.vocab_valid set, never get probability.
    """
    from jdp.model import GPT

    start = time.perf_counter()
    weights = Weights(path)
    model = nnx.eval_shape(lambda: GPT(m, nnx.Rngs(0)))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    wanted = dict(nnx.to_flat_state(params))
    table = GPT2.table(m.n_layers)
    unknown = sorted(n for n in weights.names if n not in table and not GPT2.buffers.match(n) and n != GPT2.tied_output)
    missing = sorted(n for n in table if n not in weights.names)
    if unknown or missing:
        raise ConfigError(
            f"{path}: its tensors are not a GPT-2 of {m.n_layers} blocks:"
            + (f" missing {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''};" if missing else "")
            + (f" unknown {', '.join(unknown[:8])}{' ...' if len(unknown) > 8 else ''}" if unknown else "")
        )
    dtype = jnp.dtype(m.param_dtype)
    loaded, n_read = {}, 0
    for name, where in table.items():
        value = weights.get(name)
        n_read += value.size
        if where not in wanted:  # a bias the model does not have (model.bias=false): only zeros can be dropped
            if np.any(value):
                raise ConfigError(f"{path}: {name} is not zero, but model.bias=false; set model.bias=true")
            continue
        shape = wanted[where].get_value().shape
        if where == GPT2.top["wte.weight"] and value.shape[0] < shape[0]:  # a vocabulary padded for speed
            value = np.concatenate([value, np.zeros((shape[0] - value.shape[0], *value.shape[1:]), value.dtype)])
        if value.shape != shape:
            raise ConfigError(f"{path}: {name} has shape {value.shape}; jdp's {'.'.join(map(str, where))} is {shape}")
        loaded[where] = value.astype(dtype, copy=False)
    if GPT2.tied_output in weights.names:
        embedding = loaded[GPT2.top["wte.weight"]][: weights.get("wte.weight").shape[0]]
        if not np.array_equal(weights.get(GPT2.tied_output).astype(embedding.dtype), embedding):
            raise ConfigError(
                f"{path}: {GPT2.tied_output} differs from wte.weight; jdp ties the output to the embedding"
            )
    for where, variable in wanted.items():
        variable.set_value(loaded[where])
    model = nnx.merge(graphdef, nnx.from_flat_state(wanted), rest)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return model, Imported(str(path), n_read, time.perf_counter() - start, peak_mb)


def export(model, cfg, out_dir: str | Path, tokenizer_path: str = "byte") -> list[str]:
    """Write `model` (jdp's GPT, config `cfg`) as a GPT-2 directory: config.json, model.safetensors, and the
    tokenizer's files (for the byte tokenizer, a tokenizer.json that encodes like it). Refuses a directory that is
    not empty; writes to a temporary directory beside it and renames it into place, so OUT_DIR is either complete
    or absent.

    Only the output rows of ids the tokenizer has are written (config.json's vocab_size is that count): the
    padding rows, which jdp never samples (model.vocab_valid, or a byte model's 320 rows for 257 ids), would
    otherwise get probability in transformers."""
    from safetensors.numpy import save_file

    from jdp.tokens import load_tokenizer

    m = cfg.model
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} exists and is not an empty directory; give a new directory (nothing was written)")
    tokenizer = load_tokenizer(tokenizer_path)
    tokenizer_files = _tokenizer_files(tokenizer_path)
    vocab = min(m.vocab_valid or m.vocab_size, tokenizer.vocab_size)
    params = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    tensors = {}
    for name, where in GPT2.table(m.n_layers).items():
        if where in params:
            value = np.asarray(params[where].get_value(), np.float32)
        else:  # no biases in this model: GPT-2's are zeros
            width = params[where[:-1] + ("kernel",)].get_value().shape[-1]
            value = np.zeros((width,), np.float32)
        if name == "wte.weight":
            value = value[:vocab]
        tensors[GPT2.prefix + name] = np.ascontiguousarray(value)
    hf_config = {
        "architectures": [GPT2.class_name],
        "model_type": GPT2.model_type,
        "vocab_size": vocab,
        "n_positions": m.max_seq_len,
        "n_embd": m.d_model,
        "n_layer": m.n_layers,
        "n_head": m.n_heads,
        "n_inner": m.mlp_ratio * m.d_model,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": 0.0,  # jdp trains without dropout
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "tie_word_embeddings": True,
        "bos_token_id": tokenizer.eod_id,
        "eos_token_id": tokenizer.eod_id,
        "dtype": "float32",
    }
    tmp = out.with_name(out.name + ".tmp-export")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})  # transformers requires the format key
    (tmp / WEIGHTS).chmod(0o644)  # safetensors writes it owner-only, unlike every other file here
    (tmp / CONFIG).write_text(json.dumps(hf_config, indent=2) + "\n")
    for source, name in tokenizer_files:
        shutil.copy2(source, tmp / name)
    if tokenizer_path == "byte":
        _write_byte_tokenizer(tmp)
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    return sorted(p.name for p in out.iterdir())


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
