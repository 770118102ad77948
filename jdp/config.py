"""The one config schema: frozen dataclasses, filled from a YAML file and `key.sub=value` overrides."""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from jdp import models
from jdp.data import formats
from jdp.errors import ConfigError
from jdp.models import lora_names
from jdp.models.config import SHARED_KEYS, ModelConfig
from jdp.parallel import strategies, sync
from jdp.rundir import RunDir

__all__ = [
    "CHOICES",
    "DEFAULT_CONFIG",
    "DTYPES",
    "RANGES",
    "Config",
    "ConfigError",
    "check",
    "DataConfig",
    "Derived",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "TrainConfig",
    "explicit_keys",
    "read_yaml",
    "load_config",
    "resolve_config_path",
    "save_config",
    "split_config_args",
    "valid_keys",
    "validate",
]


@dataclass(frozen=True)
class DataConfig:
    source: str = "stdlib"  # "stdlib", a hub dataset name, local files (glob), or a save_to_disk directory
    name: str = ""  # hub dataset configuration name, if the dataset has several
    split: str = "train"
    text_column: str = "text"
    tokenizer: str = "byte"  # "byte" or a local path to a Hugging Face tokenizer
    seq_len: int = 128
    val_tokens: int = 32768  # whole documents are held out for validation until this many tokens
    cache_dir: str = ""  # default: $JDP_CACHE or ~/.cache/jdp
    num_proc: int = 0  # tokenization worker processes; 0 picks from the CPU count
    streaming: bool = False  # read an IterableDataset: each process its own shards, packed on the fly
    prefetch: int = 2  # batches prepared ahead on a background thread; 0 prepares them in the loop
    encoding_errors: str = "strict"  # text/json/csv files not valid UTF-8: strict (an error), replace or ignore
    text_unit: str = "file"  # .txt files: one document per file, per line, or per paragraph (blank-line separated)
    # validation: "auto" (the dataset's `validation` or `test` split when it has one, else documents held out of
    # data.split), a split's name, or "holdout" (always held out of data.split)
    val_split: str = "auto"
    # A weighted mixture instead of data.source: entries {source: ..., weight: ..., label: ...} with any of
    # SOURCE_KEYS for that source alone (docs/data.md#mixtures). In YAML a list; on the command line YAML's flow
    # form: data.sources='[{source: data/web, weight: 3}, {source: stdlib, weight: 1}]'
    sources: tuple = ()
    # across: attention spans the whole packed window, positions count from its start (GPT-2's training);
    # within: each document attends only to itself and its positions restart (docs/data.md); auto: within for
    # fine-tuning data (data.format chat or prompt: formats.py says), across for text
    document_attention: str = "auto"
    # text: documents in data.text_column; chat: a `messages` column rendered with the tokenizer's chat template,
    # the loss on assistant turns only; prompt: `prompt` and `completion` columns, the loss on the completion; or a
    # format registered with jdp.data.formats.register
    format: str = "text"
    # data.format=chat: a .jinja file, a chat_template.json or tokenizer_config.json, or a tokenizer directory; "":
    # data.tokenizer's own (chat_template.jinja, chat_template.json, tokenizer_config.json, as transformers saves it)
    chat_template: str = ""
    chat_template_name: str = ""  # one of several named templates (tool_use, rag, ...); "": the default
    # extra template variables, as transformers' apply_chat_template(**kwargs) passes them (they override a special
    # token of the same name): data.chat_template_kwargs='{enable_thinking: false}'
    chat_template_kwargs: dict = field(default_factory=dict)
    overlong: str = "truncate"  # a fine-tuning example longer than a window: truncate or drop it (counted either way)
    # Resume although the data changed since the checkpoint (its fingerprint differs): refused by default, since
    # the held-out documents and the window order follow from the data (docs/data.md#changed-data)
    accept_changes: bool = False

    @property
    def within_documents(self) -> bool:
        """Whether attention stays within documents (data.document_attention, auto resolved)."""
        auto = self.document_attention == "auto" and self.format in formats.names()
        return self.document_attention == "within" or (auto and formats.get(self.format).within_documents)


# What a data.sources entry may set for its source alone; the rest of data.* is the mixture's.
SOURCE_KEYS = ("source", "weight", "label", "name", "split", "text_column", "text_unit", "val_split",
               "encoding_errors", "val_tokens")  # fmt: skip


@dataclass(frozen=True)
class OptimConfig:
    name: str = "adamw"  # adamw, sgd or muon (Muon for the hidden matrices, AdamW for the rest: docs/muon.md)
    lr: float = 1e-3  # peak learning rate
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * min_lr_ratio
    weight_decay: float = 0.1  # adamw only; never applied to norms, biases or embeddings
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    momentum: float = 0.9  # sgd only; 0 for plain SGD
    grad_clip: float = 1.0  # clip by global norm; 0 switches clipping off
    # muon only: the hidden matrices' peak rate (0: optim.lr), momentum, Nesterov, Newton-Schulz steps and their
    # coefficients (3 numbers, or 3 per step), the shape's scale ("rms": AdamW's update RMS, so optim.lr carries
    # over; "width": sqrt(max(1, out/in)), Keller Jordan's), and the name fragments of matrices left to AdamW
    muon_lr: float = 0.0
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5
    muon_ns_coeffs: str = "3.4445,-4.775,2.0315"
    muon_scale: str = "rms"
    muon_adamw: str = "embed,norm,head"


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 300
    batch_size: int = 32  # global batch, in sequences, over all devices of all processes
    grad_accum: int = 1  # micro-batches per optimizer step; one gradient all-reduce per step
    seed: int = 0
    run_dir: str = ""  # default: runs/<config>-<time>
    log_every: int = 10
    eval_every: int = 100  # 0: evaluate only at the end
    progress: bool = True
    ckpt_every: int = 100  # checkpoint every N steps (asynchronously) and at the end; 0: only at the end
    ckpt_keep: int = 3  # checkpoints kept (the newest)
    resume: bool = True  # resume from the run directory's latest checkpoint; false archives it and starts over
    max_bad_steps: int = 5  # more non-finite steps than this in a row stop the run
    check_replicas_every: int = 100  # compare a digest of every replica's parameters; 0: only at start
    step_timeout_s: int = 600  # no step finished for this long: a peer is stalled or dead, so exit
    tensorboard: bool = True  # TensorBoard event files in RUN_DIR/tensorboard, beside metrics.jsonl
    wandb_project: str = ""  # a Weights & Biases project name switches W&B logging on (needs `pip install wandb`)
    compile_cache: bool = True  # JAX's persistent compilation cache under the jdp cache: restarts skip compiling
    init_from: str = ""  # a local Hugging Face GPT-2 directory to start from (a resumed run uses its checkpoint)
    # a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) to go on training from, on the base
    # of train.init_from; model.lora_* are taken from it (a resumed run uses its checkpoint)
    init_adapter: str = ""
    callbacks: str = ""  # module:name[,module:name]: jdp.Callback objects of your own, run after jdp's (callbacks.py)
    memory_check: bool = True  # refuse, before allocating, a run whose planned bytes per device exceed the device's
    live: bool = False  # live membership (torchft): a lost process costs one step, a joiner copies a peer (live.py)
    live_min: int = 1  # train.live: members a step needs (fewer: the step waits for joiners)
    live_timeout_s: float = 10.0  # train.live: a member's all-reduce or RPC silent this long is lost
    lighthouse: str = ""  # train.live: torchft Lighthouse address (default: the TORCHFT_LIGHTHOUSE variable)
    # The loss: lm (next-token, on the text or the answers), or dpo, ipo, simpo, orpo on data.format=preference's
    # pairs, as TRL defines each (jdp/preference.py, docs/preference.md)
    objective: str = "lm"
    beta: float = 0.1  # dpo, ipo, simpo: beta (TRL's beta)
    label_smoothing: float = 0.0  # dpo, simpo: the chance a pair's labels are flipped (cDPO's epsilon)
    simpo_gamma: float = 0.5  # simpo: gamma, the target reward margin (TRL's simpo_gamma)
    orpo_lambda: float = 0.1  # orpo: lambda, the odds-ratio term's weight (TRL's ORPOConfig.beta)
    # dpo, ipo: the reference's log-probabilities of every pair computed once, before the first step, and kept in
    # RUN_DIR/reference_logps.npz (no reference in memory or in the step: TRL's precompute_ref_log_probs)
    precompute_reference: bool = False
    # lm-evaluation-harness tasks (comma-separated names) run on the model while it trains, every eval_tasks_every
    # steps (0: only after the last) and at the end; their metrics beside eval_loss (jdp/harness.py, docs/evaluation.md)
    eval_tasks: str = ""
    eval_tasks_every: int = 0
    eval_tasks_path: str = ""  # a directory of task YAMLs (the harness's --include_path): tasks over local files
    eval_tasks_limit: int = 0  # the first N documents of each task (the harness's --limit); 0: all


@dataclass(frozen=True)
class ParallelConfig:
    # ddp: all-reduce, every replica updates; zero1: ddp with the optimizer state split over the devices
    # (reduce-scatter, update a slice, all-gather); fsdp: parameters, gradients and optimizer state split too, each
    # block gathered for its forward and backward (ZeRO-3); dp: PyTorch DataParallel's master (a baseline)
    strategy: str = "ddp"
    # fsdp: drop a block's gathered parameters after its forward and gather them again for backward (ZeRO-3, FSDP2's
    # default); false keeps them until backward: one more all-gather saved, one model's parameters more held
    reshard_after_forward: bool = True
    # fsdp/hsdp with train.grad_accum > 1: keep the micro-batches' gradients whole on each device and reduce-scatter
    # them once per step (FSDP2's set_requires_gradient_sync(False)): 1/grad_accum of the scatters, a whole
    # model's gradients more held; false (the default) reduce-scatters each micro-batch's into a 1/N running sum
    accumulate_unsharded: bool = False
    # hsdp: the devices of one group (a node's GPUs); the state is split inside each group, groups are replicas
    shard_size: int = 0
    bucket_mb: float = 25.0  # gradient all-reduce bucket size in MiB (DDP's bucket_cap_mb); 0: one bucket
    reduce_dtype: str = "float32"  # dtype gradients travel in; bfloat16 halves the bytes (DDP's bf16 hook)
    # none: every bucket all-reduced whole; powersgd: gradient matrices sent as rank-r factors (ddp only; parallel/comm_hooks.py)
    compression: str = "none"
    powersgd_rank: int = 4  # r: an m x n gradient travels as r(m + n) numbers instead of mn
    powersgd_warmup: int = 100  # plain all-reduce for the first steps (PyTorch: start_powerSGD_iter)
    powersgd_error_feedback: bool = True  # add what compression left out to the next step's gradient
    powersgd_min_ratio: float = 2.0  # compress a matrix only if that shrinks it at least this much
    powersgd_uncompressed: str = ""  # comma-separated parts of parameter names never compressed (e.g. "embed")
    init_timeout_s: int = 300  # how long a process waits for all others to join the job
    heartbeat_timeout_s: int = 30  # a process silent this long is declared dead and the job stops
    # where process 0's coordination service listens (HOST or HOST:PORT); default: only where the coordinator
    # address points (the loopback for a single-node job), never every interface unless asked ("0.0.0.0")
    coordinator_bind: str = ""
    # How the groups of devices agree (parallel/sync/): step, every step (the strategy's own collectives, today's);
    # diloco, every parallel.outer_every steps (DiLoCo: each group trains alone, then the groups average what they
    # moved and an outer Nesterov step applies it; docs/diloco.md)
    sync: str = "step"
    groups: int = 0  # diloco: how many groups of devices train apart (0: one per host); each a contiguous block
    outer_every: int = 50  # diloco: H, the inner steps between syncs
    outer_lr: float = 0.7  # diloco: the outer SGD's learning rate (1 with no momentum: the groups' plain average)
    outer_momentum: float = 0.9  # diloco: the outer SGD's Nesterov momentum (0: none)
    # diloco: how the groups' pseudo-gradients travel: float32, bfloat16, int8 or int4 (absmax per block of 256)
    outer_dtype: str = "float32"
    # streaming (streaming DiLoCo): the model in F fragments (block b in fragment b mod F), each synced every
    # outer_every steps at its own offset; its outer step lands outer_delay steps later (the exchange overlapping
    # them), mixed into each group as outer_mix x its own + (1 - outer_mix) x the round's
    fragments: int = 1
    outer_delay: int = 0
    outer_mix: float = 0.0


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def to_dict(self) -> dict[str, Any]:
        """The config as plain data (config.yaml, the checkpoint record, the trackers). The model section holds the
        keys of its family only: a Llama run's never lists GPT's keys, nor the reverse (another family's keys can
        only be at their defaults: validate refuses them set)."""
        out = dataclasses.asdict(self)
        out["model"] = {k: out["model"][k] for k in models.keys(self.model.arch)}
        return out


_SECTION_TYPES = {
    "model": ModelConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "train": TrainConfig,
    "parallel": ParallelConfig,
}
_TYPES = {"int": int, "float": float, "str": str, "bool": bool, "tuple": tuple, "dict": dict}
DTYPES = ("float32", "bfloat16", "float16")


def valid_keys() -> list[str]:
    return [f"{s}.{f.name}" for s, cls in _SECTION_TYPES.items() for f in dataclasses.fields(cls)]


def _field_type(section: str, key: str) -> type:
    if section not in _SECTION_TYPES:
        hint = _did_you_mean(section, list(_SECTION_TYPES))
        if hint:
            raise ConfigError(f"unknown config section {section!r}{hint}\nthe sections: {', '.join(_SECTION_TYPES)}")
        raise ConfigError(f"unknown config section {section!r}; valid keys:\n  " + "\n  ".join(valid_keys()))
    for f in dataclasses.fields(_SECTION_TYPES[section]):
        if f.name == key:
            return _TYPES[f.type]
    dotted = f"{section}.{key}"
    if hint := _did_you_mean(dotted, valid_keys()):
        raise ConfigError(f"unknown config key '{dotted}'{hint}\nthe keys of {section}:{_keys_of(section)}")
    if section == "model":
        raise ConfigError(f"unknown config key '{dotted}'; the keys of model:{_keys_of(section)}")
    raise ConfigError(f"unknown config key '{dotted}'; valid keys:\n  " + "\n  ".join(valid_keys()))


def _keys_of(section: str) -> str:
    """A section's keys for a message; the model's by family (a Llama user reads Llama's keys apart from GPT's)."""
    if section != "model":
        return " " + ", ".join(f"{section}.{f.name}" for f in dataclasses.fields(_SECTION_TYPES[section]))
    parts = [f"every family's {', '.join(SHARED_KEYS)}"] + [
        f"{models.get(n).TITLE}'s (model.arch={n}) {', '.join(k for k in models.keys(n) if k not in SHARED_KEYS)}"
        for n in models.names()
    ]
    return " " + "; ".join(parts)


def _did_you_mean(name: str, names: list[str]) -> str:
    """`: did you mean train.steps?` for the nearest names (a typo, a missing letter, the wrong section)."""
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.75)
    if not close and "." in name:  # the right key in the wrong section: data.steps -> train.steps
        close = [k for k in names if k.split(".")[1] == name.split(".")[1]]
    return f": did you mean {' or '.join(close)}?" if close else ""


def _coerce(where: str, typ: type, value: Any, from_text: bool) -> Any:
    """Check (file values) or parse (command-line text) one value against its field type."""
    if typ is tuple:
        return _sources(where, value, from_text)
    if typ is dict:
        return _mapping(where, value, from_text)
    try:
        if typ is bool:
            if isinstance(value, bool):
                return value
            if from_text and str(value).lower() in ("true", "1", "yes", "false", "0", "no"):
                return str(value).lower() in ("true", "1", "yes")
        elif typ is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return value
            if from_text:
                return int(str(value).replace("_", ""))
        elif typ is float:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
            if from_text or isinstance(value, str):
                return float(value)
        elif typ is str:
            if isinstance(value, str):
                return value
            if from_text or isinstance(value, (int, float)):
                return str(value)
    except ValueError:
        pass
    raise ConfigError(f"{where}: expected {typ.__name__}, got {value!r}")


def _sources(where: str, value: Any, from_text: bool) -> tuple:
    """data.sources: a list of mappings (YAML, or its flow form on the command line), each checked for its keys."""
    if from_text:
        try:
            value = yaml.load(value, Loader=_UniqueKeys) if str(value).strip() else []
        except _Duplicate as e:
            raise ConfigError(f"{where}: {str(e).split(': ', 1)[1]}") from None
        except yaml.YAMLError as e:
            raise ConfigError(
                f"{where}: not valid YAML ({e}); write data.sources='[{{source: a, weight: 3}}, ...]'"
            ) from None
    if not isinstance(value, (list, tuple)) or not all(isinstance(e, dict) for e in value):
        raise ConfigError(
            f"{where}: expected a list of sources, each a mapping like {{source: data/web, weight: 3}}; got {value!r}"
        )
    out = []
    for i, entry in enumerate(value):
        if unknown := [k for k in entry if k not in SOURCE_KEYS]:
            hints = "".join(_did_you_mean(k, list(SOURCE_KEYS)) for k in unknown)
            raise ConfigError(
                f"{where}: source {i + 1} has unknown key(s) {', '.join(map(str, unknown))}{hints}; a source may "
                f"set {', '.join(SOURCE_KEYS)}"
            )
        if "source" not in entry:
            raise ConfigError(f"{where}: source {i + 1} ({entry}) has no 'source:' (a path, a hub name, or stdlib)")
        typed = {}
        for k, v in entry.items():
            field_type = {"weight": float, "label": str}.get(k) or _field_type("data", k)
            typed[k] = _coerce(f"{where}: source {i + 1} {k}", field_type, v, from_text=False)
        out.append(typed)
    return tuple(out)


def _mapping(where: str, value: Any, from_text: bool) -> dict:
    """A mapping of names to values (YAML, or its flow form on the command line: key='{a: 1, b: false}')."""
    if from_text:
        try:
            value = yaml.load(value, Loader=_UniqueKeys) if str(value).strip() else {}
        except _Duplicate as e:
            raise ConfigError(f"{where}: {str(e).split(': ', 1)[1]}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{where}: not valid YAML ({e}); write a mapping: '{{name: value, ...}}'") from None
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ConfigError(f"{where}: expected a mapping of names to values like {{name: value}}; got {value!r:.80}")
    return dict(value)


def resolve_config_path(name: str) -> Path:
    """A config given as a path, or by name from the repository's configs/ (or the copy inside the wheel)."""
    candidates = [Path(name)]
    stem = name if name.endswith((".yaml", ".yml")) else name + ".yaml"
    here = Path(__file__).resolve().parent
    candidates += [here.parent / "configs" / stem, here / "_configs" / stem]
    for path in candidates:
        if path.is_file():
            return path
    raise ConfigError(f"config file {name!r} not found (looked in: {', '.join(str(p) for p in candidates)})")


DEFAULT_CONFIG = "tiny"  # what the commands train, plan or inspect when no CONFIG is given


def split_config_args(args: list[str] | tuple[str, ...]) -> tuple[str, list[str]]:
    """The commands' `[CONFIG] [section.key=value ...]`: (config name or path, overrides)."""
    args = list(args)
    if args and "=" not in args[0]:
        return args[0], args[1:]
    return DEFAULT_CONFIG, args


class _UniqueKeys(yaml.SafeLoader):
    """yaml.safe_load that refuses a key given twice in one mapping (PyYAML keeps the last one without a word: a
    second `train:` section would drop the first)."""

    def construct_mapping(self, node, deep=False):
        first: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in first:
                raise _Duplicate(f"line {line}: {key!r} is given twice in one mapping (first at line {first[key]}); "
                                 f"YAML would keep only the second: keep one")  # fmt: skip
            first.setdefault(key, line)
        return super().construct_mapping(node, deep)


class _Duplicate(Exception):
    pass


def read_yaml(path: Path) -> Any:
    """A YAML file's contents; a file that is not UTF-8, not YAML, or gives a key twice is a ConfigError naming it."""
    try:
        return yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeys) or {}
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8") from None
    except _Duplicate as e:
        raise ConfigError(f"{path}, {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from e


def explicit_keys(overrides: list[str] | tuple[str, ...]) -> frozenset[str]:
    """The keys the command line sets (`model.d_model=64` -> `model.d_model`), as opposed to the config file's."""
    return frozenset(item.split("=", 1)[0] for item in overrides if "=" in item)


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults, then the YAML file's values, then `section.key=value` overrides, in that order."""
    values: dict[str, dict[str, Any]] = {s: {} for s in _SECTION_TYPES}
    if path is not None:
        path = resolve_config_path(str(path))
        raw = read_yaml(path)
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping of sections (model, data, optim, train, parallel)")
        for section, entries in raw.items():
            if section not in _SECTION_TYPES:
                _field_type(section, "")  # raises with the list of valid keys
            if not isinstance(entries, dict):
                raise ConfigError(f"{path}: section {section!r} must be a mapping")
            for key, value in entries.items():
                where = f"{path}: {section}.{key}"
                values[section][key] = _coerce(where, _field_type(section, key), value, from_text=False)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form section.key=value")
        dotted, text = item.split("=", 1)
        if dotted.count(".") != 1:
            raise ConfigError(
                f"override {item!r}: the key must be section.key; valid keys:\n  " + "\n  ".join(valid_keys())
            )
        section, key = dotted.split(".")
        values[section][key] = _coerce(f"override {item!r}", _field_type(section, key), text, from_text=True)
    cfg = Config(**{s: cls(**values[s]) for s, cls in _SECTION_TYPES.items()})
    if not cfg.train.run_dir:
        stem = Path(path).stem if path is not None else "default"
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, run_dir=f"runs/{stem}-{stamp}"))
    return cfg


@dataclass(frozen=True)
class Derived:
    """Numbers that follow from the config and the device count; computed once, never configured."""

    n_devices: int
    n_processes: int
    per_device_batch: int
    micro_batch: int  # sequences per device per micro-batch
    tokens_per_step: int
    unit: str = "tokens"  # what tokens_per_step counts: a library model's rows are "examples"

    def describe(self) -> str:
        return (
            f"devices {self.n_devices} over {self.n_processes} process(es) | per-device batch "
            f"{self.per_device_batch} ({self.micro_batch} x grad_accum) | {self.unit}/step {self.tokens_per_step:,}"
        )


def ns_coeffs(text: str) -> tuple[tuple[float, float, float], ...]:
    """optim.muon_ns_coeffs: 3 numbers (a, b, c of every Newton-Schulz step) or 3 per step, `,` or `;` between;
    ValueError if it is not."""
    values = tuple(float(v) for v in str(text).replace(";", ",").split(",") if v.strip())
    if not values or len(values) % 3 or not all(math.isfinite(v) for v in values):
        raise ValueError(f"{text!r}: expected 3 finite numbers, or 3 per Newton-Schulz step")
    return tuple(values[i : i + 3] for i in range(0, len(values), 3))


def _coeffs_ok(text: str) -> bool:
    try:
        return bool(ns_coeffs(text))
    except ValueError:
        return False


_POSITIVE = (lambda v: v > 0, "positive")
_NON_NEGATIVE = (lambda v: v >= 0, ">= 0")
_FRACTION = (lambda v: 0 <= v < 1, "in [0, 1)")
# Every number's range, checked at validation (every float must also be finite: NaN or Inf never passes).
RANGES = {
    **dict.fromkeys(
        ["model.vocab_size", "model.max_seq_len", "model.d_model", "model.n_layers", "model.n_heads",
         "model.mlp_ratio", "data.seq_len", "train.steps", "train.batch_size", "train.grad_accum", "train.log_every",
         "train.ckpt_keep", "train.step_timeout_s", "parallel.init_timeout_s", "parallel.heartbeat_timeout_s",
         "optim.lr", "optim.eps", "parallel.powersgd_rank", "model.norm_eps", "model.rope_theta", "model.rope_factor",
         "model.rope_low_freq_factor", "model.rope_high_freq_factor", "model.rope_original_max_len",
         "model.remat_every", "parallel.outer_every", "parallel.outer_lr", "parallel.fragments"],
        _POSITIVE,
    ),
    **dict.fromkeys(
        ["model.vocab_valid", "data.val_tokens", "data.prefetch", "data.num_proc", "train.eval_every", "train.ckpt_every",
         "train.max_bad_steps", "train.check_replicas_every", "optim.warmup_steps", "optim.weight_decay",
         "optim.grad_clip", "parallel.bucket_mb", "parallel.powersgd_warmup", "model.n_kv_heads", "model.d_ff",
         "model.head_dim", "parallel.groups", "parallel.outer_delay", "model.lora_rank", "train.eval_tasks_every",
         "train.eval_tasks_limit"],
        _NON_NEGATIVE,
    ),
    **dict.fromkeys(["optim.b1", "optim.b2", "optim.momentum", "parallel.outer_momentum", "parallel.outer_mix",
                     "optim.muon_momentum"], _FRACTION),
    "optim.muon_lr": _NON_NEGATIVE,
    "model.lora_alpha": _POSITIVE,
    "model.lora_dropout": _FRACTION,
    # unrolled in the compiled step: 10^6 steps compiled for 9+ minutes (Muon uses 5)
    "optim.muon_ns_steps": (lambda v: 1 <= v <= 100, "in [1, 100] (Muon's is 5; each step is compiled in)"),
    "optim.muon_ns_coeffs": (_coeffs_ok, "3 numbers (a,b,c of every Newton-Schulz step) or 3 per step"),
    "optim.min_lr_ratio": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "parallel.powersgd_min_ratio": (lambda v: v >= 1, ">= 1 (compression must not grow a gradient)"),
    "train.beta": (lambda v: v > 0, "> 0"),
    "train.label_smoothing": (lambda v: 0 <= v < 0.5, "in [0, 0.5) (0.5 would make chosen and rejected alike)"),
    "train.orpo_lambda": (lambda v: v >= 0, ">= 0"),
}  # fmt: skip
CHOICES = {
    "model.dtype": DTYPES,
    "model.param_dtype": DTYPES,
    "model.attention": ("auto", "einsum", "xla", "cudnn"),
    "model.remat": ("none", "dots", "full"),
    "model.base_dtype": ("", *DTYPES),
    "model.arch": models.names,  # the families, those registered later too
    "data.encoding_errors": ("strict", "replace", "ignore"),
    "data.text_unit": ("file", "line", "paragraph"),
    "data.document_attention": ("auto", "across", "within"),
    "data.format": formats.names,  # jdp's formats, those registered later too
    "data.overlong": ("truncate", "drop"),
    "train.objective": ("lm", "dpo", "ipo", "simpo", "orpo"),  # lm_loss, or jdp/preference.py's losses()
    "optim.name": ("adamw", "sgd", "muon"),
    "optim.muon_scale": ("rms", "width"),
    "parallel.strategy": strategies.names,  # looked up at each check: a strategy registered later counts
    "parallel.reduce_dtype": ("float32", "bfloat16"),
    "parallel.compression": ("none", "powersgd"),
    "parallel.sync": sync.names,
    "parallel.outer_dtype": ("float32", "bfloat16", "int8", "int4"),
}


def choices_of(name: str) -> tuple[str, ...]:
    """The values `name` may take (CHOICES holds a tuple, or a function for a registry that may grow)."""
    choices = CHOICES[name]
    return tuple(choices() if callable(choices) else choices)


def _value_problems(cfg: Config) -> list[str]:
    """Numbers outside their range (or not finite) and names outside their choices."""
    problems = []
    for section, cls in _SECTION_TYPES.items():
        for f in dataclasses.fields(cls):
            name, v = f"{section}.{f.name}", getattr(getattr(cfg, section), f.name)
            if f.type == "float" and not math.isfinite(v):
                problems.append(f"{name}={v} must be a finite number")
            elif name in RANGES and not RANGES[name][0](v):
                problems.append(f"{name}={v} must be {RANGES[name][1]}")
            elif name in CHOICES and v not in (choices := choices_of(name)):
                same = [c for c in choices if str(c).lower() == str(v).lower()]
                close = same or difflib.get_close_matches(str(v), [str(c) for c in choices], n=1, cutoff=0.6)
                hint = f" (did you mean {close[0]}?)" if close else ""
                problems.append(f"{name}={v!r} must be one of {', '.join(choices)}{hint}")
    return problems


def source_labels(sources: tuple) -> list[str]:
    """Each data.sources entry's label: its `label:`, else its path's last name without glob or extension
    (data/web/*.jsonl -> web, data/code.parquet -> code), else the hub name's last part."""
    out = []
    for entry in sources:
        if entry.get("label"):
            out.append(str(entry["label"]))
            continue
        parts = [p for p in str(entry["source"]).replace("\\", "/").split("/") if p and not set(p) & set("*?[")]
        name = parts[-1] if parts else str(entry["source"])
        out.append(name.split(".")[0] if "." in name[1:] else name)
    return out


def mixture_problems(d: DataConfig) -> list[str]:
    """What a data.sources mixture gets wrong (each entry's keys were checked as it was read)."""
    if not d.sources:
        return []
    problems = []
    if d.source != DataConfig.source:
        problems.append(
            f"data.source={d.source} and data.sources are both set; a mixture names every source in data.sources "
            f"(add {{source: {d.source}, weight: 1}} there and leave data.source out)"
        )
    if d.format in formats.names() and not (fmt := formats.get(d.format)).mixes:
        problems.append(f"data.format={d.format} with data.sources: a mixture of {fmt.what} is not supported yet")
    for i, entry in enumerate(d.sources):
        w = entry.get("weight", 1.0)
        if not (math.isfinite(w) and w > 0):
            problems.append(f"data.sources: source {i + 1} ({entry['source']}) has weight {w}; weights must be > 0 "
                            f"and finite (the shares are the weights over their sum)")  # fmt: skip
        for k, v in entry.items():
            name = f"data.{k}"
            if name in CHOICES and v not in (choices := choices_of(name)):
                problems.append(f"data.sources: source {i + 1} {k}={v!r} must be one of {', '.join(choices)}")
            elif name in RANGES and not RANGES[name][0](v):
                problems.append(f"data.sources: source {i + 1} {k}={v} must be {RANGES[name][1]}")
    labels = source_labels(d.sources)
    if dupes := sorted({x for x in labels if labels.count(x) > 1}):
        problems.append(
            f"data.sources: more than one source is labelled {', '.join(dupes)} (labels name each source's metrics); "
            f"give each a label: {{source: ..., label: NAME}}"
        )
    return problems


# Keys that only some settings read (key prefixes end in "_"): (the keys, the setting that decides, the values of it
# that read them). Set away from its default under another value, a key would be dropped without a word: validate
# refuses it by this one rule (the strategies' and parallel.sync's own options: their registries, in the same words;
# data.format's: formats.Format.keys).
READ_ONLY_UNDER = (
    (("optim.muon_",), "optim.name", ("muon",)),
    (("optim.b1", "optim.b2", "optim.eps", "optim.weight_decay"), "optim.name", ("adamw", "muon")),
    (("optim.momentum",), "optim.name", ("sgd",)),
    (("model.remat_every",), "model.remat", ("dots", "full")),
    (("train.live_",), "train.live", (True,)),
    (("train.lighthouse",), "train.live", (True,)),
    (("train.beta",), "train.objective", ("dpo", "ipo", "simpo")),
    (("train.label_smoothing",), "train.objective", ("dpo", "simpo")),
    (("train.simpo_gamma",), "train.objective", ("simpo",)),
    (("train.orpo_lambda",), "train.objective", ("orpo",)),
    (("train.precompute_reference",), "train.objective", ("dpo", "ipo")),
)


def _shown(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def unread_problems(cfg: Config) -> list[str]:
    """Keys set (away from their defaults) that the chosen settings do not read: READ_ONLY_UNDER, and the data
    keys of formats other than data.format (formats.Format.keys)."""
    rules = list(READ_ONLY_UNDER)
    for name in formats.names():
        if keys := formats.get(name).keys:
            readers = tuple(n for n in formats.names() if set(keys) <= set(formats.get(n).keys))
            if (rule := (tuple(f"data.{k}" for k in keys), "data.format", readers)) not in rules:  # one per key set
                rules.append(rule)
    out = []
    for keys, switch, readers in rules:
        section, key = switch.split(".")
        now = getattr(getattr(cfg, section), key)
        if now in readers or (switch == "data.format" and any(e.get("format") in readers for e in cfg.data.sources)):
            continue  # (a data.sources entry of a format that reads them)
        for name in (n for n in valid_keys() if any(n == k or (k.endswith("_") and n.startswith(k)) for k in keys)):
            part, field_ = name.split(".")
            value, default = getattr(getattr(cfg, part), field_), getattr(_SECTION_TYPES[part](), field_)
            if value != default:
                read_by = " or ".join(f"{switch}={_shown(r)}" for r in readers)
                # (a config file's value is left out by giving the default on the command line)
                out.append(f"{name}={_shown(value)} is read by {read_by} only, not {_shown(now)}: leave it out (its "
                           f"default: {_shown(default)}), or set {switch}={_shown(readers[0])}")  # fmt: skip
    return out


def optim_problems(o: OptimConfig) -> list[str]:
    """Newton-Schulz coefficients that are neither one triple nor one per step (Muon's keys set for another
    optimizer: unread_problems)."""
    if o.name != "muon":
        return []
    triples = len(ns_coeffs(o.muon_ns_coeffs)) if _coeffs_ok(o.muon_ns_coeffs) else 1
    if triples not in (1, o.muon_ns_steps):
        return [
            f"optim.muon_ns_coeffs holds {triples} triples of coefficients for optim.muon_ns_steps={o.muon_ns_steps} "
            f"steps: give one triple for every step, or one per step"
        ]
    return []


def lora_problems(cfg: Config) -> list[str]:
    """model.lora_* (lora_names.problems), and what LoRA does not go with yet, by name."""
    m, out = cfg.model, lora_names.problems(cfg.model)
    if cfg.train.init_adapter and not m.lora_rank:
        out.append(f"train.init_adapter={cfg.train.init_adapter} with model.lora_rank=0: the adapter's rank is read "
                   f"from it by `jdp train`; set model.lora_rank for a library run")  # fmt: skip
    if not m.lora_rank:
        return out
    if cfg.train.live:
        out.append("model.lora_rank with train.live=true: live membership trains every parameter (docs/live.md); "
                   "train adapters without train.live")  # fmt: skip
    if cfg.optim.name == "muon":
        out.append("model.lora_rank with optim.name=muon: Muon orthogonalises whole weight matrices, and LoRA's "
                   "factors A and B are not; use optim.name=adamw (PEFT's and TRL's)")  # fmt: skip
    return out


def objective_problems(cfg: Config) -> list[str]:
    """train.objective against the data and the settings a preference objective does not go with yet, by name."""
    t, d = cfg.train, cfg.data
    if t.objective == "lm":
        if d.format == "preference":
            return ["data.format=preference holds pairs for a preference objective: set train.objective=dpo (or ipo, "
                    "simpo, orpo; docs/preference.md)"]  # fmt: skip
        return []
    out = []
    if d.format != "preference" or d.sources:
        out.append(f"train.objective={t.objective} trains on pairs of a chosen and a rejected answer: set "
                   f"data.format=preference and data.source to them (one source; docs/preference.md)")  # fmt: skip
    if d.document_attention == "within":
        out.append(f"data.document_attention=within with train.objective={t.objective}: each sequence of a pair is "
                   f"one document already; leave it at auto")  # fmt: skip
    if t.live:
        out.append(f"train.live=true with train.objective={t.objective}: live membership trains the lm objective "
                   f"only (docs/live.md)")  # fmt: skip
    if t.objective in ("dpo", "ipo") and t.init_adapter:
        out.append(f"train.init_adapter with train.objective={t.objective}: the reference would be the base with the "
                   f"adapters off, not the adapter you start from; merge it into the base first (jdp export) or "
                   f"train a new adapter")  # fmt: skip
    return out


def harness_problems(cfg: Config) -> list[str]:
    """train.eval_tasks_* without train.eval_tasks, and what in-training evaluation does not go with, by name."""
    t = cfg.train
    if not t.eval_tasks.strip():
        stray = [k for k in ("eval_tasks_every", "eval_tasks_path", "eval_tasks_limit") if getattr(t, k)]
        return [f"train.{k} is set but train.eval_tasks names no task: name the tasks (or leave it out)" for k in stray]
    if t.live:
        return ["train.eval_tasks with train.live=true: live membership's loop evaluates the loss only (docs/live.md); "
                "run `jdp eval RUN --tasks ...` on its checkpoints"]  # fmt: skip
    return []


def check(cfg: Config) -> None:
    """The config's values alone (choices, ranges, the optimizer's keys), before anything is built from them: what
    `jdp train` and `jdp allreduce` ask first, so a typo is one line, never a traceback. validate() asks it again."""
    if problems := _value_problems(cfg) + optim_problems(cfg.optim) + unread_problems(cfg) + harness_problems(cfg):
        raise ConfigError("invalid config:\n  " + "\n  ".join(problems))


def validate(cfg: Config, n_devices: int, n_processes: int = 1) -> Derived:
    """Everything about the config alone that can be wrong, checked before data or compilation."""
    m, d, t, par = cfg.model, cfg.data, cfg.train, cfg.parallel
    problems = _value_problems(cfg) + models.problems(m) + mixture_problems(d) + optim_problems(cfg.optim)
    problems += unread_problems(cfg)
    problems += lora_problems(cfg) + objective_problems(cfg) + harness_problems(cfg)
    if d.streaming and d.format in formats.names() and not (fmt := formats.get(d.format)).streams:
        problems.append(f"data.format={d.format} with data.streaming=true: streamed {fmt.what} is not supported yet")
    if d.seq_len > m.max_seq_len:
        problems.append(
            f"data.seq_len={d.seq_len} is longer than the model supports (model.max_seq_len={m.max_seq_len}); "
            f"lower data.seq_len or raise model.max_seq_len"
        )
    if par.strategy in strategies.REGISTRY:
        problems += strategies.get(par.strategy).problems(par, n_processes, n_devices)
    if par.sync in sync.REGISTRY:
        problems += sync.get(par.sync).problems(par, t, n_devices)
    per_step = n_devices * max(t.grad_accum, 1)
    if t.batch_size > 0 and t.batch_size % per_step:
        lo = max(per_step, t.batch_size // per_step * per_step)
        problems.append(
            f"train.batch_size={t.batch_size} is not divisible by devices ({n_devices}) x train.grad_accum "
            f"({t.grad_accum}) = {per_step}; use a multiple of {per_step}, e.g. {lo} or {lo + per_step}"
        )
    if t.wandb_project:
        try:
            import wandb  # noqa: F401
        except ImportError:
            problems.append(
                f"train.wandb_project={t.wandb_project!r} switches Weights & Biases on, but wandb is not "
                f"installed: pip install wandb (or leave train.wandb_project empty)"
            )
    if problems:
        raise ConfigError("invalid config:\n  " + "\n  ".join(problems))
    per_device = t.batch_size // n_devices
    return Derived(n_devices, n_processes, per_device, per_device // t.grad_accum, t.batch_size * d.seq_len)


def save_config(cfg: Config, run_dir: str | Path) -> Path:
    """Write the resolved config as YAML into the run directory (loadable again with load_config), its local paths
    absolute (absolute_paths: `jdp generate` and `jdp export` read it from any directory)."""
    path = RunDir(run_dir).config
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(absolute_paths(json.loads(json.dumps(cfg.to_dict()))), sort_keys=False))
    return path


# The keys that may name a local file or directory (data.sources' entries' `source` too)
LOCAL_PATHS = ("data.source", "data.tokenizer", "data.chat_template", "data.cache_dir", "train.init_from",
               "train.init_adapter")  # fmt: skip


def absolute_paths(values: dict) -> dict:
    """A config's plain data (Config.to_dict) with each LOCAL_PATHS value that names a path existing here (a glob:
    one that matches) made absolute, `~` expanded; a hub name, "byte", "stdlib" or a missing path stays as given."""
    from glob import glob, has_magic
    from os.path import abspath, exists, expanduser

    def absolute(value):
        if not isinstance(value, str) or value in ("", "byte", "stdlib"):
            return value
        path = expanduser(value)
        return abspath(path) if (glob(path) if has_magic(path) else exists(path)) else value

    out = {section: dict(keys) if isinstance(keys, dict) else keys for section, keys in values.items()}
    for name in LOCAL_PATHS:  # (a checkpoint's record of an older jdp may lack a key)
        section, key = name.split(".")
        if isinstance(out.get(section), dict) and key in out[section]:
            out[section][key] = absolute(out[section][key])
    if isinstance(out.get("data"), dict) and isinstance(out["data"].get("sources"), (list, tuple)):
        out["data"]["sources"] = [{**e, "source": absolute(e["source"])} if isinstance(e, dict) and "source" in e
                                  else e for e in out["data"]["sources"]]  # fmt: skip
    return out
