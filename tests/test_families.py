"""A model family is one module jdp asks (jdp/models/): a third one, defined in tests/family_parallel.py and
registered from here with no file under jdp/ naming it, trains under `jdp train` (fsdp on 4 devices = 1 device), is
planned, counted by the memory check and sampled with the KV cache; its refusals and the other families' keys are
the config's."""

import json
import os
import subprocess
import sys
from pathlib import Path

import family_parallel
import jax
import numpy as np
import pytest
from flax import nnx

from jdp import decode, memory, models, parallel, plan
from jdp.build import batch_spec, build
from jdp.config import ConfigError, load_config, validate

TESTS = Path(__file__).resolve().parent
models.register(family_parallel)
SMALL = ["model.arch=parallel", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.max_seq_len=32",
         "data.seq_len=32", "train.batch_size=8"]  # fmt: skip
# `jdp train` (the command line's main) in a process that registered the family first, as a user's script would.
JDP_WITH_FAMILY = (
    "import sys; sys.path.insert(0, sys.argv.pop(1)); import family_parallel; from jdp import models; "
    "models.register(family_parallel); from jdp.cli import main; sys.exit(main(sys.argv[1:]))"
)


def jdp_train(tmp_path: Path, devices: int, *overrides: str) -> list[dict]:
    run_dir = tmp_path / f"run-{devices}-{'-'.join(o.split('=')[1] for o in overrides) or 'ddp'}"
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu",
           "JDP_CACHE": str(tmp_path / "cache")}  # fmt: skip
    args = ["train", "tiny", *SMALL, "train.steps=4", "train.log_every=1", "train.eval_every=0",
            "train.progress=false", "train.tensorboard=false", f"train.run_dir={run_dir}", *overrides]  # fmt: skip
    out = subprocess.run([sys.executable, "-c", JDP_WITH_FAMILY, str(TESTS), *args], env=env, capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "arch: parallel" in (run_dir / "config.yaml").read_text()
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


@pytest.mark.slow
def test_a_family_from_a_test_file_trains_under_jdp_train_on_four_devices_as_on_one(tmp_path):
    """1 device (ddp) and 4 under fsdp, which asks the family for its blocks and gathers each: the same losses and
    gradient norms. (Not ddp on 4 devices too, CI time: ddp never looks inside the model, and 4 devices = 1 under
    ddp is tests/test_parallel.py's and tests/test_llama.py's for every family alike.)"""
    one = jdp_train(tmp_path, 1)
    four = jdp_train(tmp_path, 4, "parallel.strategy=fsdp")
    assert [r["step"] for r in four] == [r["step"] for r in one] == [1, 2, 3, 4]
    for a, b in zip(one, four, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * abs(a["grad_norm"]), (a, b)
    assert one[-1]["loss"] < one[0]["loss"]


def test_the_planner_counts_its_activations_as_the_compiled_step_holds_them():
    """As tests/test_plan.py checks GPT's and Llama's: the family's own count against XLA's temporaries."""
    cfg = load_config("tiny", [*SMALL, "train.run_dir=unused"])
    mesh = parallel.make_mesh(jax.devices()[:1])
    _, state, train_step, *_ = build(cfg, mesh)
    temp = train_step.lower(state, batch_spec(cfg, mesh)).compile().memory_analysis().temp_size_in_bytes
    estimate = plan.activation_bytes(cfg, cfg.train.batch_size, fused_attention=False)
    error = (estimate - temp) / temp
    print(f"parallel family: estimate {estimate:,} bytes, compiled {temp:,} bytes, error {error:+.1%}")
    assert abs(error) <= 0.30
    wider = load_config("tiny", [*SMALL, "model.mlp_ratio=8", "train.run_dir=unused"])
    grown = plan.activation_bytes(wider, 8, False) - estimate  # its MLP's 5 NF per block, as it counts them
    assert grown == 2 * 5 * 8 * 32 * (family_parallel.ff_width(wider.model) - family_parallel.ff_width(cfg.model)) * 4


def test_jdp_plan_and_the_memory_check_take_the_family(capsys):
    args = plan_parser().parse_args(["tiny", *SMALL, "--devices", "4", "--gpu", "A100", "--json"])
    assert plan.run(args) == 0
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    cfg = load_config("tiny", [*SMALL, "train.run_dir=unused"])
    assert data["memory"]["activations"] == plan.activation_bytes(cfg, 2, plan.fused_attention(cfg))  # float32: not fused
    derived, mesh = validate(cfg, 4), parallel.make_mesh()
    assert memory.check_memory(cfg, derived, mesh) is None  # fits this host
    with pytest.raises(ConfigError, match="does not fit in memory"):
        memory.check_memory(cfg, derived, mesh, memory.Pool(4, False, 1000, "a test device"))


def plan_parser():
    import argparse

    from jdp.cli import plan_arguments

    parser = argparse.ArgumentParser(prog="jdp plan")
    plan_arguments(parser)
    return parser


def test_it_samples_with_the_kv_cache_as_without():
    cfg = load_config("tiny", [*SMALL, "train.run_dir=unused"])
    model = models.make_model(cfg.model, nnx.Rngs(3))
    prompts = [[5, 6, 7, 8, 9], [40, 41]]
    cached = decode.sample(model, prompts, max_new_tokens=12, temperature=0.0, cache=True)
    windowed = decode.sample(model, prompts, max_new_tokens=12, temperature=0.0, cache=False)
    assert cached == windowed and all(len(row) == 12 for row in cached)
    logits = model(np.asarray([prompts[0]], np.int32))  # the decoder's pieces are the model's forward
    assert int(np.argmax(logits[0, -1])) == cached[0][0]


def test_its_refusals_and_the_other_families_keys_are_the_configs():
    with pytest.raises(ConfigError, match="Parallel's GeGLU needs model.mlp_ratio >= 2"):
        validate(load_config("tiny", [*SMALL, "model.mlp_ratio=1", "train.run_dir=u"]), 1)
    with pytest.raises(ConfigError, match=r"model.n_kv_heads=2: Llama's key\(s\), not Parallel's; .*model.arch=llama"):
        validate(load_config("tiny", [*SMALL, "model.n_kv_heads=2", "train.run_dir=u"]), 1)
    assert "parallel" in models.names()
    with pytest.raises(ConfigError, match="model.arch='nope' must be one of gpt, llama, parallel"):
        models.get("nope")
    with pytest.raises(ConfigError, match="jdp's own family"):
        models.register(type("Fake", (), {k: family_parallel.__dict__[k] for k in (
            "TITLE", "KEYS", "problems", "build", "ff_width", "block_matmul_params", "block_activation_bytes")}
            | {"NAME": "gpt"}))  # fmt: skip
    with pytest.raises(ConfigError, match="lacks block_activation_bytes, build"):
        models.register(type("Half", (), {"NAME": "half", "TITLE": "Half", "KEYS": (), "problems": None,
                                          "ff_width": None, "block_matmul_params": None}))  # fmt: skip


def test_nothing_under_jdp_names_it():
    jdp_dir = TESTS.parent / "jdp"
    for path in jdp_dir.rglob("*.py"):
        text = path.read_text()
        assert "family_parallel" not in text and "ParallelLM" not in text, path
