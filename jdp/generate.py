"""`jdp generate` and `jdp export`: load a run's latest checkpoint (or a Hugging Face model) and continue prompts, with a fixed seed."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from flax import nnx

from jdp import adapters, decode, hf, peft
from jdp.config import ConfigError
from jdp.data.tokens import load_tokenizer  # noqa: F401  (generate.load_tokenizer, as before)
from jdp.log import logger
from jdp.saved import Tokenizer, load, load_pretrained, load_run

__all__ = [
    "Tokenizer",
    "export",
    "generate",
    "load",
    "load_pretrained",
    "load_run",
    "read_prompts",
    "run",
    "sample_batch",
    "sample_tokens",
]

log = logger("jdp.generate")
_ON_STDERR = {"stderr": True}  # stdout carries the text alone, for a pipe


def sample_batch(
    model: nnx.Module,
    tokenizer: Tokenizer,
    prompts: list[str],
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int = 40,
    seed: int = 0,
    cache: bool = True,
) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, continuation ids) of each prompt, sampled together (jdp/decode.py: left-padded, each as it would
    be alone); a continuation stops before the end-of-document token, if drawn. cache=False: the windowed reference."""
    decode.check_sampling(max_new_tokens, temperature, top_k)
    prompt_ids = [[int(i) for i in ids] for ids in tokenizer.encode_batch(list(prompts))]
    n_vocab = min(tokenizer.vocab_size, model.cfg.vocab_size)
    eod = getattr(tokenizer, "eod_id", None)
    new = decode.sample(
        model, prompt_ids, max_new_tokens, temperature, top_k, seed, n_vocab=n_vocab, eod=eod, cache=cache
    )
    return list(zip(prompt_ids, new, strict=True))


def sample_tokens(
    model: nnx.Module,
    tokenizer: Tokenizer,
    prompt: str,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int = 40,
    seed: int = 0,
    cache: bool = True,
) -> tuple[list[int], list[int]]:
    """(prompt ids, continuation ids). The continuation stops before the end-of-document token, if drawn."""
    return sample_batch(model, tokenizer, [prompt], max_new_tokens, temperature, top_k, seed, cache)[0]


def generate(
    model: nnx.Module,
    tokenizer: Tokenizer,
    prompt: str,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int = 40,
    seed: int = 0,
    cache: bool = True,
) -> str:
    """The prompt followed by up to max_new_tokens sampled tokens, decoded together as one text.

    temperature 0 is greedy (argmax); top_k 0 samples from the whole vocabulary. The same model, prompt,
    settings and seed give the same text, with the KV cache or without (cache=False; greedy tokens are equal).
    With the byte tokenizer the text starts with the prompt exactly.
    """
    prompt_ids, new = sample_tokens(model, tokenizer, prompt, max_new_tokens, temperature, top_k, seed, cache)
    return tokenizer.decode(prompt_ids + new)


def read_prompts(path: str | Path) -> list[str]:
    """The prompts of a --prompt-file: one a line, blank lines skipped."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(
            f"--prompt-file {path}: cannot read it ({e}); give a UTF-8 text file, one prompt a line"
        ) from None
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise ConfigError(f"--prompt-file {path} holds no prompt (one prompt a line; blank lines are skipped)")
    return prompts


def run(args: argparse.Namespace) -> int:
    """Print the prompt and its continuation to stdout (the command's output), or with --prompt-file one JSON line
    per prompt ({"prompt", "text"}, in the file's order); a header and the speed are logged to stderr."""
    decode.check_sampling(args.max_new_tokens, args.temperature, args.top_k)
    prompts = read_prompts(args.prompt_file) if args.prompt_file else [args.prompt]
    cfg, model, tokenizer, step = load(args.run_dir)
    what = "Hugging Face model" if step is None else f"checkpoint at step {step}"
    how = "no KV cache" if args.no_cache else "KV cache"
    batch = f"{len(prompts)} prompts, " if args.prompt_file else ""
    log.info(f"{args.run_dir}: {what} | {batch}temperature {args.temperature:g}, top_k {args.top_k}, "
             f"seed {args.seed}, {how}", extra=_ON_STDERR)  # fmt: skip
    start = time.perf_counter()
    results = sample_batch(
        model, tokenizer, prompts, args.max_new_tokens, args.temperature, args.top_k, args.seed, not args.no_cache
    )
    seconds = time.perf_counter() - start
    for prompt, (prompt_ids, new) in zip(prompts, results, strict=True):
        text = tokenizer.decode(prompt_ids + new)
        print(json.dumps({"prompt": prompt, "text": text}) if args.prompt_file else text, flush=True)
    n = sum(len(new) for _, new in results)
    log.info(
        f"{n} tokens in {seconds:.1f} s ({n / max(seconds, 1e-9):,.0f} tokens/s, compilation included)",
        extra=_ON_STDERR,
    )
    return 0


def export(args: argparse.Namespace) -> int:
    """`jdp export RUN_DIR OUT_DIR [--step N] [--adapter]`: a checkpoint as a Hugging Face directory transformers
    loads (a run's adapters folded into its weights), or with --adapter its adapters alone in PEFT's format."""
    cfg, model, _, step = load_run(args.run_dir, args.step)
    if getattr(args, "adapter", False):
        if not cfg.model.lora_rank:
            raise ConfigError(f"{args.run_dir} trained every parameter (model.lora_rank=0): it has no adapters to "
                              f"write; leave out --adapter to export the model")  # fmt: skip
        files = peft.save_adapter(model, cfg, args.out_dir)
        print(f"jdp | {args.run_dir}: the adapters at step {step} -> {args.out_dir}: {', '.join(files)} (PEFT's "
              f"format, for the base {cfg.train.init_from or 'this run made from train.seed'})")  # fmt: skip
        return 0
    files = hf.export(adapters.merged(model) if cfg.model.lora_rank else model, cfg, args.out_dir, cfg.data.tokenizer)
    note = " (byte tokenizer: ids 0-255 are bytes, 256 ends a document)" if cfg.data.tokenizer == "byte" else ""
    note += " (the adapters folded into the weights)" if cfg.model.lora_rank else ""
    print(f"jdp | {args.run_dir}: checkpoint at step {step} -> {args.out_dir}: {', '.join(files)}{note}")
    return 0
