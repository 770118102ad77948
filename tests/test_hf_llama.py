"""The Llama family in and out of Hugging Face, against tests/data/hf-llama-tiny (LlamaForCausalLM: GQA, head_dim
other than hidden / heads, untied lm_head, llama3 RoPE scaling) and tests/data/hf-qwen2-tiny (Qwen2ForCausalLM:
multi-query, q/k/v biases, tied, sharded), both made by scripts/make_hf_fixture.py with transformers and torch; CI
needs neither. Import gives torch's logits, export returns every tensor and key, what jdp cannot compute is refused
by name, a fine-tune from each exports what it trained; with transformers installed it loads every export."""

import dataclasses
import json
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import yaml
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from jdp import hf
from jdp.config import Config, ConfigError, DataConfig, ModelConfig, TrainConfig

DATA = Path(__file__).parent / "data"
LLAMA, QWEN2, GPT2 = DATA / "hf-llama-tiny", DATA / "hf-qwen2-tiny", DATA / "hf-gpt2-tiny"
FIXTURES = pytest.mark.parametrize("path", [LLAMA, QWEN2], ids=["llama", "qwen2"])
# config.json keys that do not change what the model computes, which the export does not copy
UNCOMPUTED = {"transformers_version", "initializer_range", "use_cache", "pretraining_tp", "max_window_layers"}


def reference(path: Path) -> tuple[np.ndarray, np.ndarray]:
    return np.load(path / "inputs.npy"), np.load(path / "logits.npy")


def file_tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a directory, by its name in the files, read with safetensors' own reader."""
    files = [hf.WEIGHTS]
    if (path / hf.INDEX).is_file():
        files = sorted(set(json.loads((path / hf.INDEX).read_text())["weight_map"].values()))
    out = {}
    for file in files:
        with safe_open(str(path / file), "np") as f:
            out |= {k: f.get_tensor(k) for k in f.keys()}
    return out


def run_config(m: ModelConfig, path: Path | None = None) -> Config:
    """The config of a run imported from `path` (None: a model jdp made, with the byte tokenizer)."""
    if path is None:
        return Config(model=m)
    return Config(model=m, data=DataConfig(tokenizer=str(path)), train=TrainConfig(init_from=str(path)))


def padded(path: Path) -> ModelConfig:
    """The model as `jdp train` imports it: config.json's, its vocabulary padded to a multiple of 64."""
    return hf.adopt(ModelConfig(), path).model


@FIXTURES
def test_import_gives_torchs_logits(path):
    inputs, logits = reference(path)
    V = logits.shape[-1]
    model, info = hf.load_model(hf.model_config(path), path)
    assert info.n_params == sum(v.size for v in file_tensors(path).values())
    diff = np.abs(np.asarray(model(inputs)) - logits).max()
    print(f"{path.name}: max |logit difference| against torch {diff:.1e}")
    assert diff < 1e-5
    m = padded(path)  # 280 -> 320 rows (Llama: embedding and lm_head), 288 -> 320 (Qwen2, tied)
    assert (m.vocab_size, m.vocab_valid) == (320, V)
    ours = np.asarray(hf.load_model(m, path)[0](inputs))
    np.testing.assert_allclose(ours[..., :V], logits, atol=1e-5, rtol=0)
    assert (ours[..., V:] <= -1e29).all()  # the padding never gets probability


@pytest.mark.parametrize(
    "path, change",
    [
        (LLAMA, {"rope_scaling": "", "rope_factor": 8.0, "rope_original_max_len": 8192}),
        (LLAMA, {"rope_factor": 8.0}),
        (QWEN2, {"rope_theta": 1e6}),
    ],
    ids=["llama-without-llama3-scaling", "llama-other-factor", "qwen2-other-theta"],
)
def test_the_fixtures_tell_a_wrong_model_apart(path, change):
    """Each fixture's logits move far beyond the tests' 1e-5 when the model computes something else."""
    inputs, logits = reference(path)
    model, _ = hf.load_model(dataclasses.replace(hf.model_config(path), **change), path)
    assert np.abs(np.asarray(model(inputs)) - logits).max() > 1e-2


def _copy(tmp_path: Path, path: Path, config: dict | None = None, replace_config: dict | None = None) -> Path:
    d = tmp_path / path.name
    shutil.copytree(path, d)
    original = json.loads((d / hf.CONFIG).read_text())
    new = replace_config if replace_config is not None else {**original, **(config or {})}
    (d / hf.CONFIG).write_text(json.dumps({k: v for k, v in new.items() if v is not ...}))
    return d


def test_a_config_json_as_transformers_v4_writes_it_reads_as_v5s():
    """config-v4.json is the fixture's config.json as transformers 4.57 wrote it: rope_theta + rope_scaling, not
    rope_parameters. Both read to the same model, and so do v4's older spellings ("type", both forms at once)."""
    v5, v4 = (json.loads((LLAMA / name).read_text()) for name in ("config.json", "config-v4.json"))
    assert "rope_parameters" in v5 and "rope_theta" not in v5 and "rope_scaling" not in v5
    assert "rope_parameters" not in v4 and v4["rope_scaling"]["rope_type"] == "llama3"
    fields = hf.model_fields(v5)
    assert fields["rope_scaling"] == "llama3" and fields["rope_original_max_len"] == 32 and fields["rope_factor"] == 4
    assert hf.model_fields(v4) == fields
    older = {**v4, "rope_scaling": {("type" if k == "rope_type" else k): v for k, v in v4["rope_scaling"].items()}}
    assert hf.model_fields(older) == fields
    both = {**v4, "rope_parameters": v5["rope_parameters"]}  # an export: both forms, the same values
    assert hf.model_fields(both) == fields


def test_a_v4_directory_imports_to_torchs_logits(tmp_path):
    d = _copy(tmp_path, LLAMA, replace_config=json.loads((LLAMA / "config-v4.json").read_text()))
    inputs, logits = reference(LLAMA)
    model, _ = hf.load_model(hf.model_config(d), d)
    np.testing.assert_allclose(np.asarray(model(inputs)), logits, atol=1e-5, rtol=0)


REFUSED = [
    (LLAMA, {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    (LLAMA, {"attention_bias": True}, "attention_bias true"),
    (LLAMA, {"mlp_bias": True}, "mlp_bias true"),
    (QWEN2, {"use_sliding_window": True}, "use_sliding_window true"),
    (QWEN2, {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    (LLAMA, {"model_type": "mistral", "sliding_window": 32}, "sliding_window 32 \\(shorter than"),
    (LLAMA, {"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    (LLAMA, {"num_key_value_heads": 3}, "num_key_value_heads 3 does not divide num_attention_heads 4"),
    (LLAMA, {"model_type": "gemma"}, "model_type 'gemma'; jdp imports gpt2"),
    (LLAMA, {"rope_theta": 500000.0}, "rope_theta 500000.0 and rope_parameters.rope_theta 10000.0 disagree"),
    (LLAMA, {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling type 'dynamic' and"),
    (LLAMA, {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}}, "rope_parameters.factor missing"),
    (LLAMA, {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor 0.5"),
] + [
    (QWEN2, {"rope_parameters": {"rope_type": kind, "rope_theta": 1e4, "factor": 2.0}}, f"rope_parameters type '{kind}'")
    for kind in ("linear", "dynamic", "yarn", "longrope")
] + [
    (QWEN2, {"rope_parameters": ..., "rope_theta": 1e4, "rope_scaling": {"type": "yarn", "factor": 4.0}},
     "rope_scaling type 'yarn' \\(jdp computes plain RoPE and llama3"),
]  # fmt: skip


@pytest.mark.parametrize("path, change, message", REFUSED, ids=[m.split(" ")[0].strip("'") for _, _, m in REFUSED])
def test_what_jdp_cannot_compute_is_refused_by_name_before_any_tensor_is_read(tmp_path, path, change, message):
    d = _copy(tmp_path, path, change)
    for shard in [*d.glob("*.safetensors")]:
        shard.write_bytes(b"not safetensors")  # never read: the refusal comes from config.json alone
    with pytest.raises(ConfigError, match=message):
        hf.model_config(d)
    with pytest.raises(ConfigError, match=message):
        hf.load_model(ModelConfig(arch="llama"), d)


def test_a_refusal_stops_jdp_train_before_any_data(tmp_path):
    from jdp.config import load_config
    from jdp.lm import checked_import

    d = _copy(tmp_path, LLAMA, {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}})
    overrides = [f"train.init_from={d}", f"data.tokenizer={d}", "data.source=/nonexistent/*.jsonl"]
    with pytest.raises(ConfigError) as e:
        checked_import(load_config("hf-finetune", overrides))
    assert str(e.value) == (
        f"{d / 'config.json'}: this llama model differs from what jdp computes: rope_parameters type 'yarn' (jdp "
        f"computes plain RoPE and llama3 scaling; not linear, dynamic, yarn, longrope or others)"
    )


@pytest.mark.parametrize("window", [None, 64, 4096, ...], ids=["null", "=positions", "longer", "missing"])
def test_mistral_without_a_sliding_window_is_llama(tmp_path, window):
    """Mistral's tensors are Llama's: with no window shorter than its positions it computes Llama's logits."""
    d = _copy(tmp_path, LLAMA, {"model_type": "mistral", "architectures": ["MistralForCausalLM"],
                                "sliding_window": window})  # fmt: skip
    inputs, logits = reference(LLAMA)
    m = hf.model_config(d)
    assert m == hf.model_config(LLAMA)
    model, _ = hf.load_model(m, d)
    np.testing.assert_allclose(np.asarray(model(inputs)), logits, atol=1e-5, rtol=0)


@FIXTURES
def test_export_returns_every_tensor_and_config_key(tmp_path, path):
    m = padded(path)
    model, _ = hf.load_model(m, path)
    files = hf.export(model, run_config(m, path), tmp_path / "out", str(path))
    out = tmp_path / "out"
    assert files == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]
    original, exported = file_tensors(path), file_tensors(out)
    assert sorted(original) == sorted(exported)  # model.* names, lm_head.weight only when untied
    for name in original:
        assert original[name].dtype == exported[name].dtype and np.array_equal(original[name], exported[name]), name
    theirs, ours = (json.loads((p / hf.CONFIG).read_text()) for p in (path, out))
    for key in theirs.keys() - UNCOMPUTED:
        assert ours[key] == theirs[key], key
    assert hf.model_fields(ours) == hf.model_fields(theirs)
    for name in ("generation_config.json", "tokenizer.json"):
        assert (out / name).read_bytes() == (path / name).read_bytes(), name
    inputs, _ = reference(path)
    back, _ = hf.load_model(hf.model_config(out), out)
    V = theirs["vocab_size"]
    assert np.array_equal(np.asarray(back(inputs)), np.asarray(model(inputs))[..., :V])
    with pytest.raises(ConfigError, match="not an empty directory"):
        hf.export(model, run_config(m, path), out, str(path))


def _made(m: ModelConfig, seed: int = 4):
    """A Llama jdp made (not imported): random, with norm scales and biases moved off their 1 and 0."""
    from jdp.models import make_model

    model = make_model(m, nnx.Rngs(seed))
    params = nnx.state(model, nnx.Param)
    rng = np.random.default_rng(seed)
    nnx.update(model, _moved(params, rng, 0.1))
    return model


def _moved(params, rng, scale: float):
    import jax

    return jax.tree.map(lambda p: (p + scale * rng.standard_normal(p.shape)).astype(np.float32), params)


MADE = {
    "llama": ModelConfig(arch="llama", vocab_size=320, max_seq_len=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                         d_ff=64, tie_embeddings=False, rope_scaling="llama3", rope_original_max_len=32, rope_factor=4.0),
    "qwen2": ModelConfig(arch="llama", vocab_size=320, max_seq_len=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=1,
                         d_ff=48, qkv_bias=True, norm_eps=1e-6, rope_theta=1e6),
}  # fmt: skip


@pytest.mark.parametrize("kind", MADE)
def test_a_llama_jdp_made_exports_the_byte_tokenizers_ids(tmp_path, kind):
    """A fresh jdp Llama with the byte tokenizer: LlamaForCausalLM (Qwen2ForCausalLM with q/k/v biases), only the
    257 ids the tokenizer has, and jdp reads it back to the same probabilities over them."""
    import jax

    m = MADE[kind]
    model = _made(m)
    files = hf.export(model, run_config(m), tmp_path / "out")
    assert files == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    config = json.loads((tmp_path / "out" / hf.CONFIG).read_text())
    assert (config["model_type"], config["vocab_size"], config["eos_token_id"]) == (kind, 257, 256)
    back, _ = hf.load_model(hf.model_config(tmp_path / "out"), tmp_path / "out")
    inputs = np.random.default_rng(0).integers(0, 257, (2, 16)).astype(np.int32)
    ours = np.asarray(jax.nn.softmax(np.asarray(model(inputs))[..., :257]))
    np.testing.assert_allclose(np.asarray(jax.nn.softmax(back(inputs))), ours, atol=1e-6, rtol=0)


def test_explicit_keys_must_agree_and_the_rest_comes_from_config_json():
    from jdp.config import explicit_keys, load_config
    from jdp.lm import checked_import

    def imported(path, *overrides):
        overrides = [f"train.init_from={path}", f"data.tokenizer={path}", *overrides]
        return checked_import(load_config("hf-finetune", overrides), explicit_keys(overrides))

    cfg, changes = imported(LLAMA)
    assert cfg.model == dataclasses.replace(padded(LLAMA), dtype="bfloat16") and cfg.data.seq_len == 64
    for change in ["model.arch 'gpt' -> 'llama' (from config.json)", "model.n_kv_heads 0 -> 2 (from config.json)",
                   "model.head_dim 0 -> 16 (from config.json)", "model.rope_scaling '' -> 'llama3' (from config.json)",
                   "model.tie_embeddings True -> False (from config.json)",
                   "model.vocab_valid 0 -> 280 (ids 280-319 are padding and never get probability)",
                   "data.seq_len 2048 -> 64 (the model's positions, from config.json)"]:  # fmt: skip
        assert change in changes, changes
    agreeing, _ = imported(LLAMA, "model.n_kv_heads=2", "model.head_dim=16", "model.arch=llama", "model.d_ff=64")
    assert agreeing.model == cfg.model
    qwen, _ = imported(QWEN2, "model.head_dim=8", "model.n_kv_heads=1", "model.tie_embeddings=true")
    # 8 is hidden / heads, config.json's heads (its head_dim reads as 0): kept as set, and it agrees
    assert qwen.model == dataclasses.replace(padded(QWEN2), dtype="bfloat16", head_dim=8) and qwen.model.qkv_bias
    with pytest.raises(ConfigError) as e:  # every disagreement at once, with config.json's values
        imported(LLAMA, "model.n_kv_heads=4", "model.rope_theta=500000", "model.tie_embeddings=true", "model.arch=gpt")
    assert str(e.value).splitlines()[1:-1] == [
        "  model.arch=gpt (config.json: 'llama')",
        "  model.n_kv_heads=4 (config.json: 2)",
        "  model.rope_theta=500000.0 (config.json: 10000.0)",
        "  model.tie_embeddings=True (config.json: False)",
    ]
    # q/k/v biases dropped on request only when they are zero (as GPT-2's model.bias=false)
    no_bias, _ = imported(QWEN2, "model.qkv_bias=false")
    with pytest.raises(ConfigError, match="self_attn.q_proj.bias is not zero, but model.qkv_bias=false"):
        hf.load_model(no_bias.model, QWEN2)


def test_hf_finetune_sets_no_model_shape(tmp_path):
    """configs/hf-finetune.yaml: fine-tuning settings only; every fixture's model comes whole from its config.json."""
    from jdp.config import load_config
    from jdp.lm import checked_import

    raw = yaml.safe_load((Path(__file__).parent.parent / "configs" / "hf-finetune.yaml").read_text())
    assert set(raw["model"]) <= {"dtype", "param_dtype", "attention"}
    for path in (GPT2, LLAMA, QWEN2):
        cfg, _ = checked_import(load_config("hf-finetune", [f"train.init_from={path}", f"data.tokenizer={path}"]))
        assert cfg.model == dataclasses.replace(padded(path), dtype="bfloat16"), path.name


def test_gpt2s_layer_norm_epsilon_is_model_norm_eps(tmp_path):
    d = _copy(tmp_path, GPT2, {"layer_norm_epsilon": 1e-6})
    assert hf.model_config(d).norm_eps == 1e-6 and hf.model_config(GPT2).norm_eps == 1e-5


def test_a_bfloat16_checkpoint_imports_as_float32(tmp_path):
    """Most published checkpoints are bfloat16 (numpy has no such dtype): each tensor is read and widened."""
    import ml_dtypes

    d = _copy(tmp_path, LLAMA)
    tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in file_tensors(LLAMA).items()}
    save_file(tensors, str(d / hf.WEIGHTS), metadata={"format": "pt"})
    model, _ = hf.load_model(hf.model_config(d), d)
    q = np.asarray(model.blocks[1].attn.q.kernel.get_value())
    assert q.dtype == np.float32 and np.array_equal(q, tensors["model.layers.1.self_attn.q_proj.weight"].T)
    inputs, logits = reference(LLAMA)
    assert np.abs(np.asarray(model(inputs)) - logits).max() < 0.2  # bfloat16's 8 bits of mantissa, not a wrong map


def test_damaged_and_mismatched_files_are_errors_naming_the_tensor(tmp_path):
    d = _copy(tmp_path, QWEN2)
    index = json.loads((d / hf.INDEX).read_text())
    shard = d / index["weight_map"]["model.layers.1.self_attn.k_proj.bias"]
    shard.write_bytes(shard.read_bytes()[:-8])  # truncated
    with pytest.raises(ConfigError, match=f"{shard.name}: not a readable safetensors file .*data_offsets"):
        hf.load_model(hf.model_config(d), d)
    d = _copy(tmp_path / "b", LLAMA)
    t = file_tensors(LLAMA)
    save_file({**t, "lm_head.weight": t["lm_head.weight"][:, :16]}, str(d / hf.WEIGHTS), metadata={"format": "pt"})
    with pytest.raises(
        ConfigError, match=r"lm_head.weight has shape \(280, 16\); jdp's lm_head.kernel is \(32, 320\), wh"
    ):
        hf.load_model(padded(d), d)
    tied = _copy(tmp_path / "c", QWEN2)  # a tied model whose file has an lm_head that is not the embedding
    t = file_tensors(QWEN2)
    (tied / hf.INDEX).unlink()
    for f in tied.glob("model-*.safetensors"):
        f.unlink()
    save_file({**t, "lm_head.weight": t["model.embed_tokens.weight"] + 1}, str(tied / hf.WEIGHTS))
    with pytest.raises(ConfigError, match="lm_head.weight differs from embed_tokens.weight, but the model ties"):
        hf.load_model(hf.model_config(tied), tied)
    save_file({**t, "lm_head.weight": t["model.embed_tokens.weight"]}, str(tied / hf.WEIGHTS))  # equal: accepted
    hf.load_model(hf.model_config(tied), tied)


@FIXTURES
def test_generate_samples_from_a_llama_family_directory(path):
    """`jdp generate DIR`: the model and tokenizer from the directory; greedy sampling takes torch's argmax."""
    from jdp.generate import load, sample_tokens

    inputs, logits = reference(path)
    cfg, model, tokenizer, step = load(path)
    assert step is None and cfg.model.arch == "llama" and cfg.model == hf.model_config(path)
    ids, new = sample_tokens(model, tokenizer, tokenizer.decode(inputs[0, :5]), max_new_tokens=1, temperature=0)
    assert ids == inputs[0, :5].tolist() and new == [int(np.argmax(logits[0, 4]))]


# ---- a fine-tune from each fixture, exported --------------------------------------------------------------------


def _corpus(tmp_path: Path) -> Path:
    root = Path(sysconfig.get_paths()["stdlib"])
    path = tmp_path / "docs.jsonl"
    names = ["textwrap.py", "heapq.py", "bisect.py", "colorsys.py", "shlex.py", "fnmatch.py"]
    path.write_text("".join(json.dumps({"text": (root / n).read_text()}) + "\n" for n in names))
    return path


@pytest.fixture(scope="module", params=[LLAMA, QWEN2], ids=["llama", "qwen2"])
def finetuned(request, tmp_path_factory):
    """`jdp train hf-finetune train.init_from=FIXTURE ...` for 2 steps at a negligible learning rate on the
    tests' 4 devices, then `jdp export RUN OUT`: (fixture, run directory, export)."""
    from jdp.cli import main

    path, tmp = request.param, tmp_path_factory.mktemp(request.param.name)
    args = ["train", "hf-finetune", f"train.init_from={path}", f"data.tokenizer={path}",
            f"data.source={_corpus(tmp)}", f"data.cache_dir={tmp / 'cache'}", "data.val_tokens=0", "optim.lr=1e-9",
            "optim.warmup_steps=0", "train.steps=2", "train.batch_size=4", "train.eval_every=0",
            "train.progress=false", f"train.run_dir={tmp / 'run'}"]  # fmt: skip
    assert main(args) == 0
    assert main(["export", str(tmp / "run"), str(tmp / "out")]) == 0
    return path, tmp / "run", tmp / "out"


def test_a_fine_tune_exports_what_it_trained(finetuned):
    """The export is the checkpoint's parameters bit for bit (the padding rows cut off), in the fixture's names
    and config; at a learning rate of 1e-9 its logits are still torch's for the fixture."""
    from jdp.generate import load_run

    path, run, out = finetuned
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                    "tokenizer.json"]  # fmt: skip
    assert hf.model_fields(json.loads((out / hf.CONFIG).read_text())) == hf.model_fields(hf.read_config(path))
    cfg, model, _, step = load_run(run)
    assert step == 2 and cfg.model.arch == "llama" and cfg.model.vocab_valid == reference(path)[1].shape[-1]
    back, _ = hf.load_model(cfg.model, out)  # the export into the run's own (padded) model
    trained, exported = (dict(nnx.to_flat_state(nnx.state(x, nnx.Param))) for x in (model, back))
    assert trained.keys() == exported.keys()
    for where in trained:
        assert np.array_equal(np.asarray(trained[where].get_value()), exported[where].get_value()), where
    assert sorted(file_tensors(out)) == sorted(file_tensors(path))
    inputs, logits = reference(path)
    again, _ = hf.load_model(hf.model_config(out), out)
    ours = np.asarray(again(inputs))
    assert 0 < np.abs(ours - logits).max() < 1e-4  # moved, by little


# ---- transformers itself (needs transformers and torch) ---------------------------------------------------------


def _transformers_logits(out: Path, inputs: np.ndarray) -> np.ndarray:
    torch = pytest.importorskip("torch", reason="the live transformers check needs torch (pip install -e .[hf])")
    transformers = pytest.importorskip("transformers", reason="the live check needs transformers (.[hf])")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        return theirs(torch.from_numpy(inputs.astype(np.int64))).logits.numpy()


def _live_check(out: Path, inputs: np.ndarray, ours: np.ndarray, what: str) -> None:
    logits = _transformers_logits(out, inputs)
    import transformers

    print(f"{what}: transformers {transformers.__version__} vs jdp: max |logit difference| "
          f"{np.abs(logits - ours).max():.2e}")  # fmt: skip
    assert logits.shape == ours.shape
    np.testing.assert_allclose(logits, ours, atol=1e-5, rtol=0)


@pytest.mark.parametrize("path", [LLAMA, QWEN2, "mistral"], ids=["llama", "qwen2", "mistral"])
def test_transformers_loads_each_export(tmp_path, path):
    """Each fixture imported, moved off its own values as training would, exported: transformers' own model
    (LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM) computes jdp's logits."""
    inputs, reference_logits = reference(LLAMA if path == "mistral" else path)
    if path == "mistral":
        path = _copy(tmp_path, LLAMA, {"model_type": "mistral", "architectures": ["MistralForCausalLM"],
                                       "sliding_window": None})  # fmt: skip
    m = padded(path)
    model, _ = hf.load_model(m, path)
    nnx.update(model, _moved(nnx.state(model, nnx.Param), np.random.default_rng(1), 0.02))
    hf.export(model, run_config(m, path), tmp_path / "out", str(path))
    config = json.loads((tmp_path / "out" / hf.CONFIG).read_text())
    assert config["model_type"] == json.loads((path / hf.CONFIG).read_text())["model_type"]
    ours = np.asarray(model(inputs))[..., : reference_logits.shape[-1]]
    _live_check(tmp_path / "out", inputs, ours, f"{config['model_type']} ({path.name})")
    assert np.abs(ours - reference_logits).max() > 1e-2  # not the fixture's own logits


@pytest.mark.parametrize("kind", MADE)
def test_transformers_loads_a_llama_jdp_made(tmp_path, kind):
    model = _made(MADE[kind])
    hf.export(model, run_config(MADE[kind]), tmp_path / "out")
    inputs = np.random.default_rng(0).integers(0, 257, (2, 16)).astype(np.int32)
    import jax

    logits = _transformers_logits(tmp_path / "out", inputs)
    ours = np.asarray(jax.nn.softmax(np.asarray(model(inputs))[..., :257]))
    np.testing.assert_allclose(np.asarray(jax.nn.softmax(logits)), ours, atol=1e-6, rtol=0)


def test_transformers_loads_a_fine_tunes_export(finetuned):
    """A 2-step fine-tune from each fixture, exported: transformers computes the logits jdp computes for it."""
    path, _, out = finetuned
    inputs, _ = reference(path)
    pytest.importorskip("transformers", reason="the live check needs transformers (.[hf])")
    model, _ = hf.load_model(hf.model_config(out), out)
    _live_check(out, inputs, np.asarray(model(inputs)), f"{path.name} fine-tuned")


def test_a_square_tensor_of_the_wrong_shape_is_named_without_a_transpose_that_changes_nothing(tmp_path):
    """`has shape (16, 17); jdp's ... is (16, 16), which is (16, 16) transposed` read as nonsense: a square
    parameter's message names its shape once."""
    d = _copy(tmp_path, LLAMA)
    with safe_open(str(d / hf.WEIGHTS), "np") as f:
        weights = {k: f.get_tensor(k) for k in f.keys()}
    name = "model.layers.0.self_attn.v_proj.weight"
    rows, cols = weights[name].shape
    assert rows == cols  # square in this model
    weights[name] = np.zeros((rows, cols + 1), weights[name].dtype)
    save_file(weights, str(d / hf.WEIGHTS))
    with pytest.raises(ConfigError) as e:
        hf.load_model(hf.model_config(d), d)
    assert f"has shape ({rows}, {cols + 1}); jdp's blocks.0.attn.v.kernel is ({rows}, {cols})" in str(e.value)
    assert "transposed" not in str(e.value)


def test_the_pad_token_ids_row_gets_no_gradient_from_its_lookups_as_with_transformers_padding_idx(tmp_path):
    """Issue 43: transformers builds the embedding with padding_idx=pad_token_id, so fine-tuning never moves that
    row through its lookups; jdp's did (norm 7.4e-2 in one step). config.json's pad_token_id is model.pad_id now:
    the same loss, the same gradient everywhere else, none on that row from the lookups; an export writes it back."""
    from jdp.models import make_model
    from jdp.models.common import lm_loss

    d = tmp_path / "padded"
    shutil.copytree(LLAMA, d)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "pad_token_id": 3}))
    assert hf.model_config(d).pad_id == 3 and hf.model_config(LLAMA).pad_id == -1
    small = ModelConfig(arch="llama", vocab_size=64, max_seq_len=16, d_model=32, n_layers=1, n_heads=2, d_ff=64,
                        tie_embeddings=False)  # fmt: skip
    rng = np.random.default_rng(0)
    inputs = rng.integers(0, 64, (4, 16)).astype(np.int32)
    inputs[:, ::3] = 3  # the padding id as an input, as packed data with pad = eos has it
    batch = {"inputs": inputs, "targets": rng.integers(0, 64, (4, 16)).astype(np.int32),
             "weights": np.ones((4, 16), np.float32)}  # fmt: skip
    grads = {}
    for pad in (-1, 3):
        model = make_model(dataclasses.replace(small, pad_id=pad), nnx.Rngs(0))
        loss, grad = nnx.value_and_grad(lambda m: lm_loss(m, batch)[0])(model)
        grads[pad] = (float(loss), np.asarray(grad.embed.embedding[...]))
    assert grads[-1][0] == grads[3][0]  # the values computed are the same
    assert np.abs(grads[-1][1][3]).max() > 0 and np.abs(grads[3][1][3]).max() == 0
    np.testing.assert_array_equal(np.delete(grads[-1][1], 3, axis=0), np.delete(grads[3][1], 3, axis=0))
