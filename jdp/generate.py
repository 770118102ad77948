"""`jdp generate`: load a run's latest checkpoint (or a Hugging Face GPT-2) and continue a prompt, with a fixed seed."""

from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jdp import hf
from jdp.checkpoint import Checkpoints
from jdp.config import Config, ConfigError, DataConfig, load_config
from jdp.log import logger
from jdp.model import GPT
from jdp.rundir import RunDir, RunDirEscape
from jdp.tokens import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = ["Tokenizer", "export", "generate", "load", "load_pretrained", "load_run", "run", "sample_tokens"]

log = logger("jdp.generate")
_ON_STDERR = {"stderr": True}  # stdout carries the text alone, for a pipe

Tokenizer = ByteTokenizer | HFTokenizer


def load(path: str | Path, step: int | None = None) -> tuple[Config, GPT, Tokenizer, int | None]:
    """A run directory's checkpoint (load_run), or a Hugging Face GPT-2 directory (load_pretrained, step None)."""
    if not RunDir(path).config.is_file() and hf.is_hf_dir(path):
        if step is not None:
            raise ConfigError(f"{path} is a Hugging Face model directory: it has no checkpoints to pick a step from")
        return (*load_pretrained(path), None)
    return load_run(path, step)


def load_pretrained(path: str | Path) -> tuple[Config, GPT, Tokenizer]:
    """(config, model, tokenizer) of a Hugging Face GPT-2 directory, on one device; its tokenizer from the same
    directory (tokenizer.json, or transformers' files when transformers is installed)."""
    cfg = Config(model=hf.model_config(path), data=DataConfig(tokenizer=str(path)))
    tokenizer = load_tokenizer(str(path))
    model, _ = hf.load_model(cfg.model, path)
    graphdef, state = nnx.split(model)
    return cfg, nnx.merge(graphdef, jax.device_put(state, jax.devices()[0])), tokenizer


def load_run(run_dir: str | Path, step: int | None = None) -> tuple[Config, GPT, Tokenizer, int]:
    """(config, model with the checkpoint's parameters, tokenizer, the checkpoint's step), on one device.

    `step`: that checkpoint (an error if it is missing or damaged); default the newest that restores. The
    checkpoint may come from any number of devices and any strategy: only the model is read (no optimizer
    state), onto the one device, and verified against the checksums saved with it (Checkpoints.restore_model).
    """
    run = RunDir(run_dir)
    try:
        run.check_contained()
    except RunDirEscape as e:
        raise ConfigError(str(e)) from None
    if not run.config.is_file():
        hint = " (or a Hugging Face model directory: config.json + model.safetensors)" if step is None else ""
        raise ConfigError(
            f"{run_dir} is not a jdp run directory (it has no config.yaml); give a run's train.run_dir{hint}"
        )
    cfg = load_config(run.config)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    if not run.checkpoints.is_dir():
        raise ConfigError(f"{run_dir} has no checkpoint yet (no {run.checkpoints}); train it first")
    ckpts = Checkpoints(run_dir, keep=1, read_only=True)  # a training run may be writing next to us
    try:
        steps = ckpts.steps()
        if not steps:
            raise ConfigError(f"{run_dir} has no checkpoint yet ({ckpts.dir} is empty); train it first")
        # The model's structure, shapes and placement on one device (nothing is computed); the checkpoint's model
        # alone is read into it, whatever strategy or device count wrote it, and checked against its checksums.
        graphdef, params, rest = nnx.split(nnx.eval_shape(lambda: GPT(cfg.model, nnx.Rngs(0))), nnx.Param, ...)
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        params, rest = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), (params, rest))
        step, params, rest = ckpts.restore_model(step, params, rest)
    finally:
        ckpts.close()
    return cfg, nnx.merge(graphdef, params, rest), tokenizer, step


# No KV cache: each new token runs the whole forward on the fixed-size window and reads the logits at one
# position. For models this size that is a few milliseconds on a CPU, and a single compiled program serves
# every position and every prompt length.
@functools.partial(jax.jit, static_argnames=("graphdef", "top_k", "n_vocab"))
def _next_token(graphdef, state, window_1xP, pos, key, index, temperature, *, top_k: int, n_vocab: int):
    """The token after window[0, pos]: argmax at temperature 0, else sampled from the top_k (0: all)."""
    logits_V = nnx.merge(graphdef, state)(window_1xP)[0, pos]
    logits_V = jnp.where(jnp.arange(logits_V.shape[0]) < n_vocab, logits_V, -jnp.inf)  # padding ids never appear
    if top_k:
        kth = jax.lax.top_k(logits_V, top_k)[0][-1]
        logits_V = jnp.where(logits_V < kth, -jnp.inf, logits_V)
    # Token i's key depends on (seed, i) only, so a longer generation starts with the shorter one's text.
    sampled = jax.random.categorical(jax.random.fold_in(key, index), logits_V / jnp.maximum(temperature, 1e-6))
    return jnp.where(temperature > 0, sampled, jnp.argmax(logits_V))


def _check_sampling(max_new_tokens: int, temperature: float, top_k: int) -> None:
    if max_new_tokens < 0 or not temperature >= 0 or top_k < 0:
        raise ConfigError(
            f"need max_new_tokens >= 0, temperature >= 0 (0: greedy) and top_k >= 0 (0: no limit); got "
            f"{max_new_tokens}, {temperature}, {top_k}"
        )


def sample_tokens(
    model: GPT,
    tokenizer: Tokenizer,
    prompt: str,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int = 40,
    seed: int = 0,
) -> tuple[list[int], list[int]]:
    """(prompt ids, continuation ids). The continuation stops before the end-of-document token, if drawn."""
    _check_sampling(max_new_tokens, temperature, top_k)
    P = model.cfg.max_seq_len
    prompt_ids = [int(i) for i in tokenizer.encode_batch([prompt])[0]]
    if not prompt_ids:
        raise ConfigError("the prompt is empty (it encodes to no tokens)")
    if len(prompt_ids) > P:
        raise ConfigError(
            f"the prompt is {len(prompt_ids)} tokens, longer than the model's context (model.max_seq_len={P})"
        )
    n_vocab = min(tokenizer.vocab_size, model.cfg.vocab_size)
    top_k = min(top_k, n_vocab)
    eod = getattr(tokenizer, "eod_id", None)
    graphdef, state = nnx.split(model)
    key = jax.random.key(seed)
    ids, new = list(prompt_ids), []
    window_1xP = np.zeros((1, P), np.int32)  # positions after `pos` are never seen (causal attention)
    for i in range(max_new_tokens):
        context = ids[-P:]  # once the context is full, the window slides: the model sees the last P tokens
        window_1xP[0, : len(context)] = context
        token = int(
            _next_token(
                graphdef, state, window_1xP, len(context) - 1, key, i, float(temperature), top_k=top_k, n_vocab=n_vocab
            )
        )
        if token == eod:
            break
        ids.append(token)
        new.append(token)
    return prompt_ids, new


def generate(
    model: GPT,
    tokenizer: Tokenizer,
    prompt: str,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int = 40,
    seed: int = 0,
) -> str:
    """The prompt followed by up to max_new_tokens sampled tokens, decoded together as one text.

    temperature 0 is greedy (argmax); top_k 0 samples from the whole vocabulary. The same model, prompt,
    settings and seed give the same text. With the byte tokenizer the text starts with the prompt exactly.
    """
    prompt_ids, new = sample_tokens(model, tokenizer, prompt, max_new_tokens, temperature, top_k, seed)
    return tokenizer.decode(prompt_ids + new)


def run(args: argparse.Namespace) -> int:
    """Print the prompt and its continuation to stdout (the command's output); a header and the speed are logged
    to stderr."""
    _check_sampling(args.max_new_tokens, args.temperature, args.top_k)
    cfg, model, tokenizer, step = load(args.run_dir)
    what = "Hugging Face model" if step is None else f"checkpoint at step {step}"
    log.info(f"{args.run_dir}: {what} | temperature {args.temperature:g}, top_k {args.top_k}, seed {args.seed}",
             extra=_ON_STDERR)  # fmt: skip
    start = time.perf_counter()
    prompt_ids, new = sample_tokens(
        model, tokenizer, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed
    )
    seconds = time.perf_counter() - start
    print(tokenizer.decode(prompt_ids + new), flush=True)
    log.info(
        f"{len(new)} tokens in {seconds:.1f} s ({len(new) / max(seconds, 1e-9):,.0f} tokens/s, compilation included)",
        extra=_ON_STDERR,
    )
    return 0


def export(args: argparse.Namespace) -> int:
    """`jdp export RUN_DIR OUT_DIR [--step N]`: a checkpoint as a GPT-2 directory transformers loads."""
    cfg, model, _, step = load_run(args.run_dir, args.step)
    files = hf.export(model, cfg, args.out_dir, cfg.data.tokenizer)
    note = " (byte tokenizer: ids 0-255 are bytes, 256 ends a document)" if cfg.data.tokenizer == "byte" else ""
    print(f"jdp | {args.run_dir}: checkpoint at step {step} -> {args.out_dir}: {', '.join(files)}{note}")
    return 0
