"""A run's model read back: its newest (or a given) checkpoint, or a Hugging Face directory, as (config, model,
tokenizer, step) on one device, for `jdp generate`, `jdp export` and `jdp eval`."""

from __future__ import annotations

from pathlib import Path

import jax
from flax import nnx

from jdp import checkpoint, hf
from jdp.build import run_model
from jdp.config import Config, ConfigError, DataConfig, load_config
from jdp.data.tokens import _SLOW_TOKENIZER_FILES as SLOW_TOKENIZER_FILES
from jdp.data.tokens import ByteTokenizer, HFTokenizer, load_tokenizer
from jdp.models import make_model
from jdp.rundir import RunDir

__all__ = ["TOKENIZER_FILES", "Tokenizer", "load", "load_pretrained", "load_run"]

Tokenizer = ByteTokenizer | HFTokenizer
# What a model directory's tokenizer is read from (tokenizers' file, or those transformers reads without it)
TOKENIZER_FILES = ("tokenizer.json", *SLOW_TOKENIZER_FILES)


def load(path: str | Path, step: int | None = None) -> tuple[Config, nnx.Module, Tokenizer, int | None]:
    """A run directory's checkpoint (load_run), or a Hugging Face GPT-2 directory (load_pretrained, step None)."""
    if not RunDir(path).config.is_file() and hf.is_hf_dir(path):
        if step is not None:
            raise ConfigError(f"{path} is a Hugging Face model directory: it has no checkpoints to pick a step from")
        return (*load_pretrained(path), None)
    return load_run(path, step)


def load_pretrained(path: str | Path) -> tuple[Config, nnx.Module, Tokenizer]:
    """(config, model, tokenizer) of a Hugging Face GPT-2 directory, on one device; its tokenizer from the same
    directory (tokenizer.json, or transformers' files when transformers is installed)."""
    cfg = Config(model=hf.model_config(path), data=DataConfig(tokenizer=str(path)))
    if not any((Path(path).expanduser() / name).is_file() for name in TOKENIZER_FILES):
        found = ", ".join(sorted(p.name for p in Path(path).expanduser().iterdir())[:8])
        raise ConfigError(
            f"{path}: a Hugging Face model directory without a tokenizer (none of {', '.join(TOKENIZER_FILES)}; "
            f"found: {found}); jdp generate reads the tokenizer from the model's directory: save the model's own "
            f"tokenizer into it (AutoTokenizer.from_pretrained(NAME).save_pretrained('{path}'), or "
            f"`hf download NAME tokenizer.json tokenizer_config.json --local-dir {path}`)"
        )
    tokenizer = load_tokenizer(str(path))
    model, _ = hf.load_model(cfg.model, path)
    graphdef, state = nnx.split(model)
    return cfg, nnx.merge(graphdef, jax.device_put(state, jax.local_devices()[0])), tokenizer


def load_run(run_dir: str | Path, step: int | None = None) -> tuple[Config, nnx.Module, Tokenizer, int]:
    """(config, model with the checkpoint's parameters, tokenizer, the checkpoint's step), on one device.

    `step`: that checkpoint (an error if it is missing or damaged); default the newest that restores. The
    checkpoint may come from any number of devices and any strategy: only the model is read (no optimizer
    state), onto the one device, and verified against the checksums saved with it (Checkpoints.restore_model).
    """
    run = RunDir(run_dir)
    run.check_contained()
    if not run.config.is_file():
        hint = " (or a Hugging Face model directory: config.json + model.safetensors)" if step is None else ""
        raise ConfigError(
            f"{run_dir} is not a jdp run directory (it has no config.yaml); give a run's train.run_dir{hint}"
        )
    cfg = load_config(run.config)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    # The model's structure and shapes (nothing is computed): the checkpoint's model alone is read into it, on one
    # device, whatever strategy or device count wrote it, and checked against its checksums.
    # Adapters' checkpoints hold no base: the run's base is made again (read from train.init_from, or drawn from
    # train.seed) and checked against the fingerprint its checkpoints keep.
    make = (lambda: run_model(cfg)[0]) if cfg.model.lora_rank else (lambda: make_model(cfg.model, nnx.Rngs(0)))
    step, model = checkpoint.load(run_dir, make, step, with_step=True, cfg=cfg)
    return cfg, model, tokenizer, step
