"""`jdp generate`: sampling from a trained (4-device) checkpoint is deterministic, greedy at temperature 0."""

import argparse
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jdp.cli import generate_arguments
from jdp.config import ConfigError, load_config
from jdp.generate import generate, load, load_run, run, sample_tokens
from jdp.lm import train
from jdp.metrics import params_sha256

P = 64  # model.max_seq_len of the test run
TINY = [f"model.max_seq_len={P}", f"data.seq_len={P}", "model.n_layers=1", "model.d_model=64"]
TINY += ["train.steps=30", "train.batch_size=8", "train.ckpt_every=10", "train.eval_every=0", "train.log_every=10"]
TINY += ["train.progress=false", "data.val_tokens=4096"]
PROMPT = "def main():\n    "


@pytest.fixture(scope="module")
def run_dir(made_once):
    """A tiny run trained on all 4 simulated devices, so its checkpoints come from a 4-device mesh (one worker's)."""
    path = made_once("generate-run", lambda d: train(load_config("tiny", [*TINY, f"train.run_dir={d / 'run'}"]))) / "run"
    assert json.loads((path / "summary.json").read_text())["devices"] == 4
    return path


@pytest.fixture(scope="module")
def loaded(run_dir):
    return load_run(run_dir)


def listing(path):
    return sorted((str(p.relative_to(path)), p.stat().st_size) for p in path.rglob("*"))


def test_loads_the_latest_checkpoint_of_a_multi_device_run_onto_one_device(run_dir, loaded):
    before = listing(run_dir)
    cfg, model, tokenizer, step = load_run(run_dir)
    assert step == 30 and cfg.model.max_seq_len == P and tokenizer.eod_id == 256
    params = nnx.state(model, nnx.Param)
    assert {d.id for leaf in jax.tree.leaves(params) for d in leaf.sharding.device_set} == {0}
    # The restored parameters are bit-identical to the ones training ended with (on 4 devices).
    assert params_sha256(params) == json.loads((run_dir / "summary.json").read_text())["params_sha256"]
    assert listing(run_dir) == before, "loading must not change the run directory"


def test_same_seed_same_text_and_different_seeds_differ(loaded):
    _, model, tokenizer, _ = loaded
    text = generate(model, tokenizer, PROMPT, max_new_tokens=40, temperature=1.0, top_k=0, seed=7)
    assert isinstance(text, str) and text.startswith(PROMPT) and len(text) > len(PROMPT)
    assert generate(model, tokenizer, PROMPT, max_new_tokens=40, temperature=1.0, top_k=0, seed=7) == text
    others = {generate(model, tokenizer, PROMPT, max_new_tokens=40, temperature=1.0, top_k=0, seed=s) for s in (8, 9)}
    assert text not in others


def test_a_longer_generation_extends_a_shorter_one(loaded):
    _, model, tokenizer, _ = loaded
    _, short = sample_tokens(model, tokenizer, PROMPT, max_new_tokens=10, seed=3)
    _, long = sample_tokens(model, tokenizer, PROMPT, max_new_tokens=30, seed=3)
    assert long[: len(short)] == short


def test_temperature_zero_is_the_argmax_continuation_past_a_full_window(loaded):
    _, model, tokenizer, _ = loaded
    prompt = ("import os\nimport sys\n" * 4)[: P - 4]  # 60 bytes: the window fills and slides within 10 tokens
    prompt_ids, new = sample_tokens(model, tokenizer, prompt, max_new_tokens=10, temperature=0.0, seed=1)
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda state, ids_1xL: nnx.merge(graphdef, state)(ids_1xL))  # unpadded: one compile per length
    ids, expected = list(prompt_ids), []
    for _ in range(10):
        logits_V = forward(state, jnp.asarray([ids[-P:]]))[0, -1, : tokenizer.vocab_size]
        token = int(jnp.argmax(logits_V))
        if token == tokenizer.eod_id:
            break
        ids.append(token)
        expected.append(token)
    assert new == expected and len(prompt_ids) + len(new) > P
    assert sample_tokens(model, tokenizer, prompt, max_new_tokens=10, temperature=0.0, seed=2)[1] == new


def test_top_k_one_is_greedy(loaded):
    _, model, tokenizer, _ = loaded
    greedy = generate(model, tokenizer, PROMPT, max_new_tokens=12, temperature=0.0)
    assert generate(model, tokenizer, PROMPT, max_new_tokens=12, temperature=5.0, top_k=1, seed=4) == greedy


def cli(argv):
    parser = argparse.ArgumentParser()
    generate_arguments(parser)
    return run(parser.parse_args(argv))


def test_cli_prints_the_same_text_for_the_same_seed(run_dir, capsys):
    argv = [str(run_dir), "--prompt", PROMPT, "--max-new-tokens", "24", "--seed", "5"]
    assert cli(argv) == 0
    first = capsys.readouterr()
    assert cli(argv) == 0
    second = capsys.readouterr()
    assert first.out == second.out and first.out.startswith(PROMPT)
    assert "checkpoint at step 30" in first.err and str(run_dir) in first.err


def test_bad_runs_and_prompts_are_clear_errors(run_dir, loaded, tmp_path):
    with pytest.raises(ConfigError, match="not a jdp run directory"):
        load_run(tmp_path)
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    shutil.copy(run_dir / "config.yaml", fresh / "config.yaml")
    with pytest.raises(ConfigError, match="no checkpoint yet"):
        load_run(fresh)
    (fresh / "checkpoints").mkdir()
    with pytest.raises(ConfigError, match="no checkpoint yet"):
        load_run(fresh)
    _, model, tokenizer, _ = loaded
    with pytest.raises(ConfigError, match="prompt is empty"):
        generate(model, tokenizer, "")
    with pytest.raises(ConfigError, match=f"{P + 1} tokens, longer than .*max_seq_len={P}"):
        generate(model, tokenizer, "x" * (P + 1))
    with pytest.raises(ConfigError, match="temperature >= 0"):
        generate(model, tokenizer, PROMPT, temperature=-1.0)


def truncate(checkpoint):
    for p in (checkpoint / "state").rglob("*"):
        if p.is_file() and p.stat().st_size > 100:
            p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def test_a_damaged_latest_checkpoint_falls_back_and_stays_where_it_is(run_dir, tmp_path, capsys):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    truncate(copy / "checkpoints" / "30")
    before = listing(copy)
    assert load_run(copy)[3] == 20
    assert "checkpoints/30 cannot be restored" in capsys.readouterr().err
    assert listing(copy) == before, "a damaged checkpoint is skipped, not moved"
    for step in (10, 20):
        truncate(copy / "checkpoints" / str(step))
    with pytest.raises(ConfigError, match=r"none of the checkpoints \[10, 20, 30\]"):
        load_run(copy)


def jdp_command(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "jdp.cli", *args], env=env, capture_output=True, text=True, timeout=300
    )


def test_generate_and_export_print_no_absl_warnings_and_the_export_generates_alike(run_dir, loaded, tmp_path):
    """orbax's notices that the read-only manager is read-only are not shown; the byte export samples as the run."""
    sampled = jdp_command("generate", str(run_dir), "--prompt", PROMPT, "--max-new-tokens", "8", "--temperature", "0")
    out = tmp_path / "exported"
    exported = jdp_command("export", str(run_dir), str(out))
    for done in (sampled, exported):
        assert done.returncode == 0, done.stderr[-3000:]
        assert "WARNING:absl" not in done.stdout + done.stderr, done.stderr
    _, model, tokenizer, _ = loaded
    greedy = generate(model, tokenizer, PROMPT, max_new_tokens=8, temperature=0.0)
    assert sampled.stdout == greedy + "\n"
    _, back, back_tokenizer, step = load(out)  # what `jdp generate OUT_DIR` runs
    assert step is None and back.cfg.vocab_size == back_tokenizer.vocab_size == 257
    assert generate(back, back_tokenizer, PROMPT, max_new_tokens=8, temperature=0.0) == greedy


def test_a_model_directory_without_a_tokenizer_gets_advice_generate_takes(tmp_path, capsys):
    """Issue 65: `jdp generate DIR` on a model directory without a tokenizer said `or data.tokenizer=byte`, an option
    jdp generate does not have (and a byte tokenizer is not the model's). Refused before the weights are read."""
    from jdp.cli import main

    fixture = os.path.join(os.path.dirname(__file__), "data", "hf-gpt2-tiny")
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(fixture, name), model / name)
    code = main(["generate", str(model), "--prompt", "hi"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "data.tokenizer" not in err, err
    assert f"jdp: error: {model}: a Hugging Face model directory without a tokenizer (none of tokenizer.json" in err
    assert "found: config.json, model.safetensors); jdp generate reads the tokenizer from the model's directory" in err
    assert f"save_pretrained('{model}')" in err
    shutil.copy(os.path.join(fixture, "tokenizer.json"), model / "tokenizer.json")  # the advice taken: it loads
    assert load(model)[2].vocab_size == 320
