"""Sampling with a KV cache (jdp/decode.py): the same tokens as the windowed reference for GPT and Llama, a prompt
continues alike alone or left-padded in a batch, one compile for many prompt lengths, bad prompts refused first."""

import argparse
import json
from pathlib import Path

import jax
import pytest
from flax import nnx

from jdp import decode
from jdp.cli import generate_arguments
from jdp.config import ConfigError, load_config
from jdp.generate import run
from jdp.models import make_model

P = 64  # model.max_seq_len of the test models
SMALL = [f"model.max_seq_len={P}", "model.n_layers=2", "model.d_model=64"]
FAMILIES = {"gpt": ("tiny", []), "llama": ("llama-tiny", ["model.n_kv_heads=1", "model.qkv_bias=true"])}
# 5, 18 and 40 tokens: the last runs past the 64-token context within 40 new tokens (the window slides)
PROMPTS = [list(b"def f"), list(b"import os\nimport s"), list(b"class Config:\n    def __init__(self, x):")]
HF_LLAMA = Path(__file__).parent / "data" / "hf-llama-tiny"


@pytest.fixture(scope="module", params=list(FAMILIES))
def model(request):
    """A randomly initialised small GPT, or Llama with multi-query attention, q/k/v biases and an untied output;
    each parameter scaled x4 (std 0.08) so that the next token is rarely a near-tie of rounding."""
    config, extra = FAMILIES[request.param]
    m = make_model(load_config(config, [*SMALL, *extra]).model, nnx.Rngs(1))
    nnx.update(m, jax.tree.map(lambda x: 4.0 * x, nnx.state(m, nnx.Param)))
    return m


def draw(model, prompts, n=40, **kw):
    return decode.sample(model, prompts, n, **{"temperature": 0.0, "n_vocab": 257, **kw})


def test_greedy_tokens_equal_the_uncached_path_token_for_token(model):
    cached = draw(model, PROMPTS)
    assert cached == draw(model, PROMPTS, cache=False)
    assert [len(row) for row in cached] == [40, 40, 40]
    assert len(set(map(tuple, cached))) == 3


def test_a_left_padded_batch_continues_each_prompt_as_it_would_alone(model):
    """Rows of 5, 18 and 40 tokens: in the batch the third leaves the cache's context first (and all rows go on
    windowed), alone the first two never do; the tokens are the same."""
    for kw in ({}, {"temperature": 1.0, "seed": 3, "eod": 256}):
        batched = draw(model, PROMPTS, 30, **kw)
        assert batched == [draw(model, [p], 30, **kw)[0] for p in PROMPTS]
        assert draw(model, [PROMPTS[1], PROMPTS[0], PROMPTS[1]], 30, **kw) == [batched[1], batched[0], batched[1]]


def test_seeded_sampling_is_reproducible_and_the_same_with_or_without_the_cache(model):
    kw = {"temperature": 1.0, "seed": 7, "eod": 256}
    first = draw(model, PROMPTS, 24, **kw)
    assert draw(model, PROMPTS, 24, **kw) == first
    assert draw(model, PROMPTS, 24, **kw, cache=False) == first
    assert draw(model, PROMPTS, 24, **{**kw, "seed": 8}) != first
    longer = draw(model, PROMPTS, 30, **kw)  # token i's key is fold_in(seed, i): a longer text extends it
    assert [row[: len(short)] for row, short in zip(longer, first, strict=True)] == first


def test_the_cached_program_compiles_once_per_cache_length_and_long_prompts_prefill_in_chunks():
    m = make_model(load_config("llama-tiny", ["model.max_seq_len=100", "model.n_layers=1"]).model, nnx.Rngs(2))
    before = decode._decode._cache_size()
    for length in (1, 7, 30, 50):  # prompt columns 1..50, 10 new tokens: all in one 64-column cache
        assert decode.cache_length(length, 10, 100) == 64
        assert len(draw(m, [list(range(3, 3 + length)), [5]], 10)[1]) == 10
    draw(m, [[5], [6]], 3)  # another prompt length and number of tokens, same cache length
    assert decode._decode._cache_size() == before + 1
    # 70 and 90 columns: a cache of max_seq_len = 100 columns, read in two chunks of 64 (the second from column
    # 36, over columns the first read); the same tokens as the uncached path.
    long = [[(7 * i) % 250 for i in range(90)], [(3 * i) % 250 for i in range(70)]]
    assert draw(m, long, 10) == draw(m, long, 10, cache=False)
    assert draw(m, long[::-1], 10)[0] == draw(m, long, 10)[1]
    assert decode._decode._cache_size() == before + 2
    assert decode.cache_length(3, 30, 4096) == 64 and decode.cache_length(40, 100, 4096) == 256


def test_prompts_that_do_not_fit_are_refused_before_anything_compiles(model):
    before = decode._decode._cache_size(), decode._window_step._cache_size()
    with pytest.raises(ConfigError, match=rf"prompt 2 of 2 is {P + 1} tokens, longer than .*max_seq_len={P}"):
        draw(model, [[1, 2], [3] * (P + 1)])
    with pytest.raises(ConfigError, match=rf"the prompt is {P + 1} tokens, longer than .*max_seq_len={P}"):
        draw(model, [[3] * (P + 1)], cache=False)
    with pytest.raises(ConfigError, match="prompt 1 of 2 is empty"):
        draw(model, [[], [1]])
    with pytest.raises(ConfigError, match="temperature >= 0"):
        draw(model, [[1]], temperature=-1.0)
    assert (decode._decode._cache_size(), decode._window_step._cache_size()) == before


def cli(argv):
    parser = argparse.ArgumentParser()
    generate_arguments(parser)
    return run(parser.parse_args(argv))


def test_cli_prompt_file_prints_one_json_line_per_prompt_and_no_cache_prints_the_same(tmp_path, capsys):
    """prompt-file (docs/metrics.md's batch command, on a Hugging Face Llama: GQA, head_dim != d_model / n_heads,
    llama3 rope scaling, random norms): one JSON line per prompt in the file's order; --no-cache's greedy text."""
    prompts = ["Hello world", "a", "The quick brown fox jumps"]
    (tmp_path / "prompts.txt").write_text("\n".join([prompts[0], "", *prompts[1:]]) + "\n")
    argv = [
        str(HF_LLAMA),
        "--prompt-file",
        str(tmp_path / "prompts.txt"),
        "--max-new-tokens",
        "12",
        "--temperature",
        "0",
    ]
    assert cli(argv) == 0
    cached = capsys.readouterr().out
    lines = [json.loads(line) for line in cached.splitlines()]
    assert [line["prompt"] for line in lines] == prompts
    assert all(len(line["text"]) > len(line["prompt"]) for line in lines)
    assert cli([*argv, "--no-cache"]) == 0
    assert capsys.readouterr().out == cached
    (tmp_path / "blank.txt").write_text("\n \n")
    with pytest.raises(ConfigError, match="holds no prompt"):
        cli([str(HF_LLAMA), "--prompt-file", str(tmp_path / "blank.txt")])
