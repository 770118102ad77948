"""Hugging Face GPT-2 in and out, against tests/data/hf-gpt2-tiny (made by scripts/make_hf_fixture.py with
transformers and torch; CI needs neither): import gives torch's logits, export round-trips every tensor and key,
training starts from the import on 2 devices and 2 processes, a resumed run uses its own checkpoint."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from jdp import hf
from jdp.config import ConfigError, ModelConfig
from jdp.generate import load, load_run, sample_tokens

FIXTURE = Path(__file__).parent / "data" / "hf-gpt2-tiny"
INPUTS, REFERENCE = np.load(FIXTURE / "inputs.npy"), np.load(FIXTURE / "logits.npy")
V = REFERENCE.shape[-1]  # 320
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def tensors(path: Path) -> dict[str, np.ndarray]:
    with safe_open(str(path / hf.WEIGHTS), "np") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def imported(m: ModelConfig | None = None, path=FIXTURE):
    model, info = hf.load_model(m or hf.model_config(path), path)
    return model, info


def test_import_gives_torchs_logits():
    model, info = imported()
    assert info.n_params == sum(v.size for v in tensors(FIXTURE).values())
    logits = np.asarray(model(INPUTS))
    np.testing.assert_allclose(logits, REFERENCE, atol=1e-5, rtol=0)


def test_a_padded_vocabulary_is_masked_and_exported_unpadded(tmp_path):
    m = padded_fixture()
    assert m.vocab_valid == V
    model, _ = imported(m)
    logits = np.asarray(model(INPUTS))
    assert logits.shape[-1] == 384
    np.testing.assert_allclose(logits[..., :V], REFERENCE, atol=1e-5, rtol=0)
    assert (logits[..., V:] <= -1e29).all()  # the padding never gets probability
    log_probs = np.asarray(jax.nn.log_softmax(logits))[..., :V]
    np.testing.assert_allclose(log_probs, np.asarray(jax.nn.log_softmax(REFERENCE)), atol=1e-5, rtol=0)
    hf.export(model, _config(m), tmp_path / "out", str(FIXTURE / "tokenizer.json"))
    assert {k: v.shape for k, v in tensors(tmp_path / "out").items()} == {
        k: v.shape for k, v in tensors(FIXTURE).items()
    }


def padded_fixture() -> ModelConfig:
    """The fixture's model with model.vocab_size=384 set on the command line: 64 padding ids."""
    return hf.adopt(ModelConfig(vocab_size=384), FIXTURE, frozenset({"model.vocab_size"})).model


def _config(m: ModelConfig):
    from jdp.config import Config

    return Config(model=m)


def test_export_round_trips_every_tensor_and_config_key(tmp_path):
    model, _ = imported()
    files = hf.export(model, _config(hf.model_config(FIXTURE)), tmp_path / "out", str(FIXTURE))
    assert files == ["config.json", "model.safetensors", "tokenizer.json"]
    original, exported = tensors(FIXTURE), tensors(tmp_path / "out")
    assert sorted(original) == sorted(exported)
    for name in original:
        assert original[name].dtype == exported[name].dtype and np.array_equal(original[name], exported[name]), name
    theirs, ours = (json.loads((p / "config.json").read_text()) for p in (FIXTURE, tmp_path / "out"))
    for key in ("model_type", "vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "activation_function",
                "layer_norm_epsilon", "tie_word_embeddings", "bos_token_id", "eos_token_id", "architectures"):  # fmt: skip
        assert ours[key] == theirs[key], key
    assert ours["n_inner"] == 4 * theirs["n_embd"] and theirs["n_inner"] is None  # the same MLP width, spelled out
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (FIXTURE / "tokenizer.json").read_bytes()
    with pytest.raises(ConfigError, match="not an empty directory"):
        hf.export(model, _config(hf.model_config(FIXTURE)), tmp_path / "out", "byte")


def test_a_bias_free_model_exports_zero_biases_and_imports_back(tmp_path):
    from jdp.models.gpt import GPT

    m = ModelConfig(vocab_size=V, max_seq_len=64, d_model=64, n_layers=2, n_heads=4)
    model = GPT(m, nnx.Rngs(3))
    hf.export(model, _config(m), tmp_path / "out", str(FIXTURE / "tokenizer.json"))
    exported = tensors(tmp_path / "out")
    assert not exported["transformer.h.1.mlp.c_fc.bias"].any() and exported["transformer.h.1.mlp.c_fc.bias"].shape == (
        256,
    )
    back, _ = hf.load_model(m, tmp_path / "out")  # into model.bias=false again: the zero biases are dropped
    assert np.array_equal(np.asarray(back(INPUTS)), np.asarray(model(INPUTS)))
    with pytest.raises(ConfigError, match="is not zero, but model.bias=false"):
        hf.load_model(dataclasses.replace(hf.model_config(FIXTURE), bias=False), FIXTURE)


def test_a_sharded_index_imports_like_the_single_file(tmp_path):
    shards = tmp_path / "sharded"
    shards.mkdir()
    shutil.copy(FIXTURE / "config.json", shards)
    everything = tensors(FIXTURE)
    names = sorted(everything)
    weight_map = {}
    for i, part in enumerate([names[: len(names) // 2], names[len(names) // 2 :]]):
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: everything[n] for n in part}, str(shards / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    total = sum(v.nbytes for v in everything.values())
    (shards / hf.INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    single, _ = imported()
    sharded, _ = imported(path=shards)
    assert np.array_equal(np.asarray(sharded(INPUTS)), np.asarray(single(INPUTS)))
    (shards / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ConfigError, match="names model-00002-of-00002.safetensors, which is not in"):
        imported(path=shards)


def _copy_with(tmp_path, config=None, drop=(), extra=None) -> Path:
    d = tmp_path / "model"
    shutil.copytree(FIXTURE, d)
    if config is not None:
        (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()), **config}))
    if drop or extra:
        t = {k: v for k, v in tensors(FIXTURE).items() if k not in drop} | (extra or {})
        save_file(t, str(d / hf.WEIGHTS), metadata={"format": "pt"})
    return d


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "gemma"}, "model_type 'gemma'; jdp imports gpt2 \\(GPT2LMHeadModel\\), llama"),
        ({"activation_function": "relu"}, "activation_function 'relu'"),
        ({"tie_word_embeddings": False}, "tie_word_embeddings false"),
        ({"scale_attn_by_inverse_layer_idx": True}, "attention scaled"),
    ],
)
def test_a_gpt2_jdp_cannot_compute_exactly_is_refused(tmp_path, change, message):
    with pytest.raises(ConfigError, match=message):
        hf.model_config(_copy_with(tmp_path, config=change))


def test_bad_directories_and_mismatched_configs_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="no such directory"):
        hf.read_config(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="has no config.json"):
        hf.read_config(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="has neither model.safetensors nor"):
        hf.read_config(tmp_path / "empty")
    missing = _copy_with(tmp_path / "a", drop=["transformer.h.1.ln_2.bias"])
    with pytest.raises(ConfigError, match="missing h.1.ln_2.bias"):
        imported(path=missing)
    odd = _copy_with(tmp_path / "b", extra={"transformer.h.0.attn.rotary": np.zeros(4, np.float32)})
    with pytest.raises(ConfigError, match="unknown h.0.attn.rotary"):
        imported(path=odd)
    untied = _copy_with(tmp_path / "c", extra={"lm_head.weight": np.ones((V, 64), np.float32)})
    with pytest.raises(ConfigError, match="lm_head.weight differs from wte.weight"):
        imported(path=untied)
    (missing / hf.WEIGHTS).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    with pytest.raises(ConfigError, match="not a readable safetensors file"):
        imported(path=missing)


def test_files_that_disagree_with_themselves_are_refused_not_loaded(tmp_path):
    """A config.json vocab_size over fewer embedding rows loaded, the missing ids zero rows that got probability; a
    header whose data_offsets overlap (one tensor reading another's bytes) loaded and trained. Both refused, as
    the safetensors library refuses the second."""
    wide = _copy_with(tmp_path / "wide", config={"vocab_size": V + 20})
    with pytest.raises(ConfigError, match=rf"wte.weight has {V} rows, but config.json's vocab_size is {V + 20}"):
        imported(hf.adopt(ModelConfig(), wide).model, wide)
    shared = _copy_with(tmp_path / "shared")
    raw = (shared / hf.WEIGHTS).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header["transformer.h.0.ln_1.bias"]["data_offsets"] = header["transformer.h.0.ln_1.weight"]["data_offsets"]
    text = json.dumps(header, separators=(",", ":")).encode().ljust(n)  # as long as before: no offset moves
    assert len(text) == n
    (shared / hf.WEIGHTS).write_bytes(raw[:8] + text + raw[8 + n :])
    with pytest.raises(Exception, match="(?i)invalid.?offset"):
        with safe_open(str(shared / hf.WEIGHTS), "np") as f:
            [f.get_tensor(k) for k in f.keys()]
    with pytest.raises(ConfigError, match=r"h.0.ln_1.(bias|weight)'s data_offsets .* overlap .* \(invalid offset\)"):
        imported(path=shared)


def test_config_json_values_of_the_wrong_kind_are_named_not_a_traceback(tmp_path):
    """Issue 42, item 9: `"n_embd": "64"` (a number in quotes) was a TypeError traceback; a list where a size
    belongs too. Each is one ConfigError naming config.json and the key."""
    quoted = _copy_with(tmp_path / "q", config={"n_embd": "64"})
    with pytest.raises(ConfigError, match=r'config.json: "n_embd": "64": a number in quotes is a string; write it'):
        hf.model_config(quoted)
    listed = _copy_with(tmp_path / "l", config={"n_layer": [2]})
    with pytest.raises(ConfigError, match=r"config.json: .*(model.n_layers would be \[2\], not an int|TypeError)"):
        hf.model_config(listed)


def _import_config(overrides=(), path=FIXTURE):
    """checked_import of `jdp train tiny train.init_from=PATH data.tokenizer=PATH OVERRIDES...`."""
    from jdp.config import explicit_keys, load_config
    from jdp.lm import checked_import

    overrides = [f"train.init_from={path}", f"data.tokenizer={path}", *overrides]
    return checked_import(load_config("tiny", overrides), explicit_keys(overrides))


def test_the_model_comes_from_config_json_and_only_explicit_keys_must_agree():
    cfg, changes = _import_config()
    assert cfg.model == hf.model_config(FIXTURE)  # not tiny's 4 blocks of 128
    assert cfg.data.seq_len == 64
    assert changes == [
        "model.max_seq_len 128 -> 64 (from config.json)",
        "model.d_model 128 -> 64 (from config.json)",
        "model.n_layers 4 -> 2 (from config.json)",
        "model.bias False -> True (GPT-2 has biases)",
        "data.seq_len 128 -> 64 (the model's positions, from config.json)",
    ]
    agreeing, _ = _import_config(["model.d_model=64", "model.n_layers=2", "data.seq_len=32"])
    assert agreeing.model == cfg.model and agreeing.data.seq_len == 32  # a shorter seq_len is the user's choice
    with pytest.raises(ConfigError) as e:  # every disagreement at once, with config.json's values
        _import_config(["model.d_model=128", "model.n_layers=4", "data.seq_len=128", "model.vocab_size=256"])
    assert str(e.value) == (
        f"train.init_from={FIXTURE}: the command line contradicts its config.json:\n"
        "  model.vocab_size=256 (config.json has 320 ids: give 320 or more, e.g. 320)\n"
        "  model.d_model=128 (config.json: 64)\n"
        "  model.n_layers=4 (config.json: 2)\n"
        "  data.seq_len=128 (config.json's model has 64 positions)\n"
        "Leave these keys out (the import takes config.json's values) or set them to agree"
    )


def test_an_imported_vocabulary_is_padded_to_a_multiple_of_64_unless_set(tmp_path):
    wte = tensors(FIXTURE)["transformer.wte.weight"]
    d = _copy_with(tmp_path, config={"vocab_size": 300}, extra={"transformer.wte.weight": wte[:300]})
    cfg, changes = _import_config(path=d)
    assert (cfg.model.vocab_size, cfg.model.vocab_valid) == (320, 300)
    assert "model.vocab_valid 0 -> 300 (ids 300-319 are padding and never get probability)" in changes
    cfg, changes = _import_config(["model.vocab_size=384"], path=d)
    assert (cfg.model.vocab_size, cfg.model.vocab_valid) == (384, 300)
    cfg, changes = _import_config(["model.vocab_size=300"], path=d)
    assert (cfg.model.vocab_size, cfg.model.vocab_valid) == (300, 0)
    with pytest.raises(
        ConfigError, match=r"model.vocab_size=256 \(config.json has 300 ids: give 300 or more, e.g. 320"
    ):
        _import_config(["model.vocab_size=256"], path=d)
    with pytest.raises(ConfigError, match=r"model.vocab_valid=100 \(the import sets it: leave it out\)"):
        _import_config(["model.vocab_valid=100"], path=d)
    # the parameters are the file's, plus only the 20 padding rows (not a 50304-row default vocabulary)
    model, info = hf.load_model(_import_config(path=d)[0].model, d)
    n_params = sum(p.size for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert info.n_params == sum(v.size for v in tensors(d).values()) and n_params == info.n_params + 20 * 64


def _byte_model(seed: int = 5):
    """A fresh byte-level GPT as `jdp train tiny` makes it: 320 output rows for the byte tokenizer's 257 ids."""
    from jdp.models.gpt import GPT

    m = ModelConfig(vocab_size=320, max_seq_len=64, d_model=64, n_layers=2, n_heads=4)
    return m, GPT(m, nnx.Rngs(seed))


TEXT = "héllo, wörld ✓\n\tdef f(x):\n\t\treturn x"


def test_a_byte_export_has_only_the_byte_tokenizers_ids_and_their_probabilities(tmp_path):
    from jdp.data.tokens import ByteTokenizer

    m, model = _byte_model()
    out = tmp_path / "out"
    files = hf.export(model, _config(m), out)
    assert files == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert tensors(out)["transformer.wte.weight"].shape == (257, 64)  # not 320: ids 257-319 never exist
    exported = json.loads((out / "config.json").read_text())
    assert exported["vocab_size"] == 257 and exported["eos_token_id"] == 256
    cfg, back, tokenizer, _ = load(out)  # `jdp generate OUT_DIR` and a re-import read it like this
    byte = ByteTokenizer()
    ids = byte.encode_batch([TEXT])[0]
    assert tokenizer.encode_batch([TEXT])[0].tolist() == ids.tolist() and tokenizer.decode(ids) == TEXT
    assert (tokenizer.vocab_size, tokenizer.eod_id, cfg.model.vocab_size) == (257, 256, 257)
    inputs = ids[None, :32].astype(np.int32)
    run = np.asarray(model(inputs))
    assert np.asarray(jax.nn.softmax(run))[..., 257:].sum(-1).min() > 0.05  # what the unused rows took before
    renormalised = np.asarray(jax.nn.softmax(run[..., :257]))
    np.testing.assert_allclose(np.asarray(jax.nn.softmax(np.asarray(back(inputs)))), renormalised, atol=1e-6, rtol=0)


def test_generate_samples_from_a_hugging_face_directory():
    cfg, model, tokenizer, step = load(FIXTURE)
    assert step is None and cfg.model.bias and tokenizer.eod_id == 0  # <|endoftext|> of the fixture's tokenizer
    prompt = tokenizer.decode(INPUTS[0, :5])
    ids, new = sample_tokens(model, tokenizer, prompt, max_new_tokens=1, temperature=0)
    assert ids == INPUTS[0, :5].tolist()
    assert new == [int(np.argmax(REFERENCE[0, 4]))] or (not new and np.argmax(REFERENCE[0, 4]) == tokenizer.eod_id)
    with pytest.raises(ConfigError, match="Hugging Face model directory: it has no checkpoints"):
        load(FIXTURE, step=3)


def _corpus(tmp_path: Path) -> Path:
    root = Path(sysconfig.get_paths()["stdlib"])
    path = tmp_path / "docs.jsonl"
    names = ["textwrap.py", "heapq.py", "bisect.py", "colorsys.py", "shlex.py", "fnmatch.py", "glob.py", "string.py"]
    path.write_text("".join(json.dumps({"text": (root / n).read_text()}) + "\n" for n in names))
    return path


def _train_args(tmp_path, run_dir, steps):
    return [
        "train", "tiny", f"train.init_from={FIXTURE}", f"data.tokenizer={FIXTURE}", f"data.source={_corpus(tmp_path)}",
        "model.vocab_size=384", "model.max_seq_len=64", "model.d_model=64", "model.n_layers=2", "model.bias=true",
        "data.seq_len=64", "data.val_tokens=2000", f"train.steps={steps}", "train.batch_size=4", "train.eval_every=0",
        "train.log_every=1", "train.ckpt_every=3", f"train.run_dir={run_dir}", "train.progress=false",
        f"data.cache_dir={tmp_path / 'cache'}",
    ]  # fmt: skip


def _jdp(args, devices=2, env=None):
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", **OFFLINE, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "jdp.cli", *args], env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
def test_fine_tune_on_2_devices_export_import_and_resume(tmp_path):
    run = tmp_path / "run"
    first = _jdp(_train_args(tmp_path, run, 3))
    assert first.returncode == 0, first.stderr[-3000:]
    assert f"initialised from {FIXTURE}" in first.stdout and "124,672 parameters read" in first.stdout
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # step 1's loss is the imported model's: near its loss on this text, not a fresh model's log(384) = 5.95
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 3 and losses[-1] < losses[0]

    resumed = _jdp(_train_args(tmp_path, run, 6))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "train.init_from not used: resuming" in resumed.stdout
    assert json.loads((run / "summary.json").read_text())["resumed_from"] == 3

    out = tmp_path / "exported"
    exported = _jdp(["export", str(run), str(out), "--step", "3"], devices=1)
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert "checkpoint at step 3" in exported.stdout
    # the fixture's generation_config.json is kept (transformers' sampling defaults for it)
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]
    assert (out / "generation_config.json").read_bytes() == (FIXTURE / "generation_config.json").read_bytes()
    cfg, model, _, _ = load_run(run, step=3)
    assert cfg.model.vocab_valid == V and json.loads((out / "config.json").read_text())["vocab_size"] == V
    back, _ = imported(path=out)  # the export imported again: the checkpoint's logits, bit for bit
    assert np.array_equal(np.asarray(back(INPUTS)), np.asarray(model(INPUTS))[..., :V])
    trained = np.asarray(back(INPUTS))
    assert not np.allclose(trained, REFERENCE, atol=1e-3)  # three steps moved it

    wrong = _jdp([*_train_args(tmp_path, tmp_path / "other", 3), "model.d_model=128"], devices=1)
    assert wrong.returncode == 2 and "model.d_model=128 (config.json: 64)" in wrong.stderr
    byte = _jdp([*_train_args(tmp_path, tmp_path / "other", 3), "data.tokenizer=byte"], devices=1)
    assert byte.returncode == 2 and "with data.tokenizer=byte" in byte.stderr


@pytest.mark.slow
def test_train_takes_the_model_from_config_json_and_prints_what_it_took(tmp_path):
    """No model keys on the command line: config.json's model trains (not tiny's 4 x 128 with a 25x parameter
    count), and the changes are printed; explicit keys that disagree are one error, before any compute."""
    args = [
        "train", "tiny", f"train.init_from={FIXTURE}", f"data.tokenizer={FIXTURE}", f"data.source={_corpus(tmp_path)}",
        "train.steps=2", "train.batch_size=4", "train.eval_every=0", "train.progress=false",
        f"train.run_dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}",
    ]  # fmt: skip
    run = _jdp(args, devices=1)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    for change in ["model.max_seq_len 128 -> 64 (from config.json)", "model.d_model 128 -> 64 (from config.json)",
                   "model.n_layers 4 -> 2 (from config.json)", "data.seq_len 128 -> 64 (the model's positions, "
                   "from config.json)"]:  # fmt: skip
        assert f"jdp | {change}" in lines, run.stdout
    assert "jdp | model 124,672 parameters" in run.stdout and "(124,672 parameters read" in run.stdout
    assert "d_model: 64" in (tmp_path / "run" / "config.yaml").read_text()
    # run again, it is complete: the config it compares with the saved one is the imported model's
    before = {p: p.read_bytes() for p in sorted((tmp_path / "run").rglob("*")) if p.is_file()}
    again = _jdp(args, devices=1)
    assert again.returncode == 0 and f"jdp: run already complete at step 2 ({tmp_path / 'run'})" in again.stdout
    assert {p: p.read_bytes() for p in sorted((tmp_path / "run").rglob("*")) if p.is_file()} == before

    wrong = _jdp([*args, f"train.run_dir={tmp_path / 'other'}", "model.d_model=128", "model.n_heads=8"], devices=1)
    assert wrong.returncode == 2, wrong.stderr[-3000:]
    assert [line for line in wrong.stderr.splitlines() if line.startswith("jdp: error:")] == [
        f"jdp: error: train.init_from={FIXTURE}: the command line contradicts its config.json:"
    ]
    assert "  model.d_model=128 (config.json: 64)\n  model.n_heads=8 (config.json: 4)\n" in wrong.stderr
    assert "Traceback" not in wrong.stderr and not (tmp_path / "other" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_import_on_2_processes_equals_one_process(tmp_path, spawn):
    """Each process reads the files itself; the replicas start identical (the digest at start checks it) and the
    run equals a single-process run over the same number of devices."""
    args = ["-m", "jdp.cli", *_train_args(tmp_path, tmp_path / "multi", 3)]
    results = spawn(args, n_processes=2, devices_each=1)
    for code, _, err in results:
        assert code == 0, err[-3000:]
    assert "initialised from" in results[0][1]
    single = _jdp(_train_args(tmp_path, tmp_path / "single", 3), devices=2)
    assert single.returncode == 0, single.stderr[-3000:]
    summary = lambda run: json.loads((tmp_path / run / "summary.json").read_text())  # noqa: E731
    assert summary("multi")["params_sha256"] == summary("single")["params_sha256"]


def test_transformers_loads_the_export(tmp_path):
    """The live check: transformers' own GPT-2 reads the export and computes jdp's logits."""
    torch = pytest.importorskip("torch", reason="the live transformers check needs torch (pip install -e .[hf])")
    transformers = pytest.importorskip("transformers", reason="the live check needs transformers (.[hf])")
    m = padded_fixture()
    model, _ = imported(m)
    params = nnx.state(model, nnx.Param)  # moved off the fixture's values, as training would
    noise = jax.tree.map(lambda p: 0.02 * np.random.default_rng(p.size).standard_normal(p.shape), params)
    nnx.update(model, jax.tree.map(lambda p, n: (p + n).astype(np.float32), params, noise))
    hf.export(model, _config(m), tmp_path / "out", str(FIXTURE))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        logits = theirs(torch.from_numpy(INPUTS.astype(np.int64))).logits.numpy()
    ours = np.asarray(model(INPUTS))[..., :V]
    print(f"transformers {transformers.__version__} vs jdp: max |logit difference| {np.abs(logits - ours).max():.2e}")
    np.testing.assert_allclose(logits, ours, atol=1e-5, rtol=0)
    assert np.abs(ours - REFERENCE).max() > 1e-2  # not the fixture's own logits


def test_transformers_gives_a_byte_export_only_the_tokenizers_ids(tmp_path):
    """The live check of the byte tokenizer's export: transformers' probabilities are jdp's over the 257 ids it
    can produce (none for the padding rows), and its tokenizer encodes bytes as jdp does."""
    torch = pytest.importorskip("torch", reason="the live transformers check needs torch (pip install -e .[hf])")
    transformers = pytest.importorskip("transformers", reason="the live check needs transformers (.[hf])")
    from jdp.data.tokens import ByteTokenizer

    m, model = _byte_model()
    hf.export(model, _config(m), tmp_path / "out")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    ids = ByteTokenizer().encode_batch([TEXT])[0]
    assert tokenizer(TEXT)["input_ids"] == ids.tolist() and tokenizer.eos_token_id == 256
    inputs = ids[None, :32].astype(np.int64)
    with torch.no_grad():
        probs = torch.softmax(theirs(torch.from_numpy(inputs)).logits, -1).numpy()
    ours = np.asarray(jax.nn.softmax(np.asarray(model(inputs.astype(np.int32)))[..., :257]))
    print(f"transformers {transformers.__version__}: max |probability difference| {np.abs(probs - ours).max():.2e}")
    assert probs.shape[-1] == 257
    np.testing.assert_allclose(probs, ours, atol=1e-6, rtol=0)


def test_gpt2_finetune_fits_gpt2_small_and_new_keys_do_not_block_resume(tmp_path):
    from jdp.checkpoint import config_differences
    from jdp.config import load_config, validate
    from jdp.lm import checked_import

    d = tmp_path / "gpt2"
    d.mkdir()
    small = {"model_type": "gpt2", "vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12}
    (d / "config.json").write_text(json.dumps(small))
    (d / "model.safetensors").write_bytes(b"")
    cfg, changes = checked_import(load_config("gpt2-finetune", [f"train.init_from={d}", f"data.tokenizer={d}"]))
    m = cfg.model
    assert m.vocab_valid == 50257 and m.vocab_size == 50304 and m.bias
    assert changes == ["model.vocab_valid 0 -> 50257 (ids 50257-50303 are padding and never get probability)"]
    validate(cfg, n_devices=8)
    with pytest.raises(ConfigError, match="model.vocab_valid=400 is more than model.vocab_size=320"):
        validate(load_config("tiny", ["model.vocab_valid=400"]), n_devices=1)
    # a checkpoint written before model.bias, model.vocab_valid and train.init_from existed resumes as their defaults
    old = load_config("tiny").to_dict()
    for section, key in [("model", "bias"), ("model", "vocab_valid"), ("train", "init_from")]:
        del old[section][key]
    assert config_differences(old, load_config("tiny").to_dict()) == []
    assert config_differences(old, load_config("tiny", ["model.bias=true"]).to_dict()) == ["model.bias: False -> True"]


def test_init_from_a_missing_path_or_a_jdp_run_names_that_before_asking_for_a_tokenizer(tmp_path, capsys):
    """Issue 65: both were answered `set data.tokenizer to it (e.g. data.tokenizer=PATH)`, which could not help."""
    from jdp.cli import main

    run = tmp_path / "runs" / "mine"  # what `jdp train` leaves: config.yaml, checkpoints/
    (run / "checkpoints" / "200").mkdir(parents=True)
    (run / "config.yaml").write_text("train:\n  steps: 200\n")
    out = tmp_path / "new"
    for path, says in [
        (tmp_path / "missing", f"train.init_from={tmp_path / 'missing'}: no such directory; give a local Hugging Face"),
        (run, f"train.init_from={run} is a jdp run directory (its config.yaml and checkpoints/), not a Hugging Face "
              f"model directory: to continue that run give train.run_dir={run} (it resumes from its newest "
              f"checkpoint); to start a new run from its weights, convert them first with `jdp export {run} OUT` and "
              f"give train.init_from=OUT data.tokenizer=OUT"),
    ]:  # fmt: skip
        code = main(["train", f"train.init_from={path}", f"train.run_dir={out}"])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith(f"jdp: error: {says}") and err.count("\n") == 1, err
        assert "data.tokenizer=byte" not in err and not out.exists()
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "config.yaml"]
