"""LoRA (model.lora_rank, jdp/adapters.py, jdp/peft.py): peft's logits and adapter gradients on peft-saved
adapters, 4 devices = 1 under every strategy with the base untouched and stateless, exact resume and a refused
other base, PEFT's files out and back in, and the config's refusals.

The references are tests/data/lora-hf-*-tiny, made by scripts/make_lora_fixture.py with torch and peft (CI needs
neither); test_peft_loads_jdps_export_... checks an export with peft itself where it is installed (CI's oldest
stack)."""

import dataclasses
import functools
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_hf_llama import _corpus as corpus
from test_llama import CFG, batch
from test_parallel import make_batch, params_close

from jdp import adapters, parallel, peft
from jdp.build import run_model
from jdp.config import ConfigError, OptimConfig, ParallelConfig, explicit_keys, load_config, validate
from jdp.lm import checked_import, train
from jdp.metrics import read_metrics
from jdp.models import lora_names, make_model
from jdp.models.common import lm_loss
from jdp.nn import Frozen
from jdp.optim import make_optimizer
from jdp.parallel.remat import Remat

DATA = Path(__file__).parent / "data"
FIXTURES = pytest.mark.parametrize("base", ["hf-llama-tiny", "hf-qwen2-tiny"])


def fixture_config(base: str, *extra: str):
    """`jdp train` over the fixture base with the peft-saved adapter beside it, as the command line makes it."""
    overrides = [f"train.init_from={DATA / base}", f"data.tokenizer={DATA / base}", "train.run_dir=unused",
                 f"train.init_adapter={DATA / ('lora-' + base)}", *extra]  # fmt: skip
    return checked_import(load_config(None, overrides), explicit_keys(overrides))


def lm_batch(inputs: np.ndarray) -> dict:
    """The fixture's loss: every next token of `inputs` (the last position has none)."""
    weights = np.ones(inputs.shape, np.float32)
    weights[:, -1] = 0
    return {"inputs": inputs, "targets": np.roll(inputs, -1, axis=1), "weights": weights}


@FIXTURES
def test_peft_saved_adapters_give_peft_logits_and_gradients(base):
    """jdp reads peft's files and computes peft's forward (1e-5) and the adapters' gradients (1e-5 of the largest):
    A and B transposed, the scale (alpha / r; rsLoRA's alpha / sqrt(r)), the targets, lm_head trained whole."""
    ref = DATA / f"lora-{base}"
    cfg, changes = fixture_config(base)
    m = cfg.model
    spec = json.loads((ref / peft.ADAPTER_CONFIG).read_text())
    assert (m.lora_rank, m.lora_alpha, m.lora_rslora) == (spec["r"], spec["lora_alpha"], spec["use_rslora"])
    assert any(c.startswith("model.lora_rank 0 -> ") for c in changes), changes
    model, _ = run_model(cfg)
    inputs = np.load(DATA / base / "inputs.npy")
    logits = np.load(ref / "logits.npy")
    V = logits.shape[-1]
    ours = np.asarray(model(inputs))[..., :V]
    assert np.abs(ours - logits).max() < 1e-5
    base_model, _ = run_model(dataclasses.replace(cfg, model=dataclasses.replace(m, lora_rank=0, lora_alpha=8.0,
                              lora_targets="all-linear", lora_rslora=False, lora_modules_to_save="")))  # fmt: skip
    assert np.abs(np.asarray(base_model(inputs))[..., :V] - logits).max() > 1e-2  # the adapters move the logits

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p):
        return lm_loss(nnx.merge(graphdef, p, rest), lm_batch(inputs))[0]

    value, grads = jax.value_and_grad(loss)(params)
    assert abs(float(value) - float(np.load(ref / "loss.npy"))) < 1e-4 * float(value)
    expected = dict(np.load(ref / "grads.npz"))
    modules = lora_names.names(m).modules
    found = {}
    for path, g in nnx.to_flat_state(grads):
        g, module = np.asarray(g[...]), peft._PREFIX + modules[tuple(path[:-1])]
        name = {"lora_a": ".lora_A.weight", "lora_b": ".lora_B.weight"}.get(path[-1], ".weight")
        found[module + name] = g if path[-1] == "embedding" else g.T
    assert found.keys() == expected.keys()
    for name, g in expected.items():
        mine = found[name][: g.shape[0]]  # lm_head: jdp's padded vocabulary rows beyond peft's (no gradient)
        assert np.abs(mine - g).max() <= 1e-5 * np.abs(g).max(), name


def test_every_parameter_but_the_adapters_is_frozen_and_they_start_as_peft_does():
    model = adapters.add(make_model(CFG, nnx.Rngs(0)), ["q", "v"], rank=4, alpha=8.0, train=["lm_head"])
    params = {".".join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    lora = {k for k in params if k.endswith(("lora_a", "lora_b"))}
    assert lora == {f"blocks.{i}.attn.{x}.{ab}" for i in range(2) for x in "qv" for ab in ("lora_a", "lora_b")}
    assert set(params) - lora == {"lm_head.kernel"}
    base = nnx.state(model, Frozen)
    assert len(jax.tree.leaves(base)) == len(jax.tree.leaves(nnx.state(make_model(CFG, nnx.Rngs(0)), nnx.Param))) - 1
    a = np.asarray(params["blocks.0.attn.q.lora_a"][...])  # U(-1/sqrt(in), 1/sqrt(in)), B zero: the base's output
    assert np.abs(a).max() <= 1 / np.sqrt(CFG.d_model) and np.abs(a).max() > 0.5 / np.sqrt(CFG.d_model)
    assert not np.any(np.asarray(params["blocks.0.attn.q.lora_b"][...]))
    tokens = np.arange(16).reshape(2, 8) % CFG.vocab_size
    np.testing.assert_array_equal(np.asarray(model(tokens)), np.asarray(make_model(CFG, nnx.Rngs(0))(tokens)))
    with pytest.raises(ValueError, match="match none of the model's linear layers"):
        adapters.add(make_model(CFG, nnx.Rngs(0)), ["q_proj"], rank=4, alpha=8.0)


# ---- 4 devices = 1, the base untouched, no state for it ---------------------------------------------------------

# Each variant 4 devices against the same one-device run: zero1 with grad_accum, hsdp with recomputation.
STRATEGIES = {"ddp": {}, "zero1-grad_accum=2": {}, "fsdp": {}, "hsdp-remat=dots": {"shard_size": 2}}


ADAMW = OptimConfig(lr=1e-3, warmup_steps=0)


def lora_model(dropout: float):
    return adapters.add(make_model(CFG, nnx.Rngs(0)), "all-linear", 4, 8.0, dropout=dropout, train=["lm_head"],
                        base_dtype=jnp.bfloat16, rngs=nnx.Rngs(1))  # fmt: skip


def even_batch(i: int) -> dict:
    b = make_batch(i)  # every row the same weight: DiLoCo's average of the groups' means is then the global mean
    return {**b, "inputs": b["inputs"] % CFG.vocab_size, "targets": b["targets"] % CFG.vocab_size}


@functools.cache
def lora_steps(n_devices: int, option: str, steps: int = 3, optim: OptimConfig = ADAMW, sync: tuple = (),
               dropout: float = 0.1):  # fmt: skip
    """(final state, metrics per step, the frozen base at start) of `steps` steps of the LoRA model on
    test_llama's batches (params_close's atol: 1% of an AdamW step at lr 1e-3)."""
    strategy = option.split("-")[0]
    grad_accum = 2 if "grad_accum" in option else 1
    p = ParallelConfig(strategy=strategy, bucket_mb=0.01, **STRATEGIES.get(option, {}), **dict(sync))
    mesh = parallel.mesh_for(p) if strategy == "hsdp" or sync else parallel.make_mesh(jax.devices()[:n_devices])
    opt, schedule = make_optimizer(optim, 10)
    remat = Remat("dots") if "remat" in option else None
    a = parallel.assemble(lora_model(dropout), lm_loss, opt, mesh, p, grad_accum, schedule, remat=remat)
    state = a.state
    before = jax.device_get(adapters.frozen(state.rest))
    history = []
    for i in range(steps):
        rows = batch(i) if dropout else even_batch(i)  # uneven padding (test_llama's) but where DiLoCo is compared
        state, metrics = a.train_step(state, parallel.shard_batch(rows, mesh))
        history.append({k: float(v) for k, v in metrics.items() if v.ndim == 0})
    return state, history, before


def assert_base_untouched(state, before):
    after = jax.device_get(adapters.frozen(state.rest))
    assert jax.tree.structure(after) == jax.tree.structure(before) and jax.tree.leaves(before)
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        assert x.dtype == jnp.bfloat16 and np.array_equal(x, y)


@pytest.mark.parametrize("option", list(STRATEGIES))
def test_four_devices_train_adapters_as_one_and_the_base_never_moves(option):
    """4 devices give one device's losses and adapters (dropout on, drawn per global row), under every strategy; the
    frozen base (bfloat16) is bit-identical after training, has no optimizer state, and no gradient leaves the step
    for it; the optimizer holds AdamW's two moments of the adapters and lm_head alone. Under fsdp (hsdp: inside each
    group of 2) the base stays in rows: each device holds 1/4 (1/2) of every leaf a block or module holds."""
    one, hist1, _ = lora_steps(1, "ddp")
    four, hist4, before = lora_steps(4, option)
    for a, b in zip(hist1, hist4, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * a["loss"] and a["skipped"] == b["skipped"] == 0, (a, b)
    assert all(np.any(np.asarray(b[...])) for p, b in nnx.to_flat_state(four.params) if p[-1] == "lora_b")
    cut = lambda s: jax.tree.map(lambda x, w: x[: w.shape[0]], s.params, one.params)  # noqa: E731  (fsdp's padding)
    assert params_close(one.params, cut(four), atol=1e-5) <= 0
    assert_base_untouched(four, before)
    k = {"fsdp": 4, "hsdp": 2}.get(option.split("-")[0], 1)
    for path, v in nnx.to_flat_state(adapters.frozen(four.rest)):
        x = v.get_value()
        rows = {s.data.shape[0] for s in x.addressable_shards}
        assert rows == {x.shape[0] // k if len(path) > 1 else x.shape[0]}, (option, path, x.shape, rows)
    trained = sum(x.size for x in jax.tree.leaves(jax.tree.map(np.asarray, one.params)))
    moments = sum(x.size for x in jax.tree.leaves(one.opt_state) if x.ndim)
    assert moments == 2 * trained  # mu and nu of what trains; nothing for the base
    names = parallel.param_names(four.params)
    assert all(n.endswith(("lora_a", "lora_b")) or n == "lm_head.kernel" for n in names), names


def test_diloco_groups_train_adapters_and_never_send_the_base():
    """DiLoCo's two groups, H=1 with a plain outer average and SGD (elementwise, unclipped: then ddp's arithmetic),
    train the adapters as ddp does (without dropout: a group numbers its rows for RowDropout within itself); the
    base stays as it was in every group."""
    sgd = OptimConfig(name="sgd", grad_clip=0.0, lr=0.05, warmup_steps=0, momentum=0.0)
    ddp, hist, _ = lora_steps(4, "ddp", optim=sgd, dropout=0.0)
    h1 = (("sync", "diloco"), ("groups", 2), ("outer_every", 1), ("outer_lr", 1.0), ("outer_momentum", 0.0))
    groups, hist_g, before = lora_steps(4, "ddp", optim=sgd, sync=h1, dropout=0.0)
    assert [round(h["loss"], 4) for h in hist] == [round(h["loss"], 4) for h in hist_g]
    assert params_close(ddp.params, groups.params, atol=1e-6) <= 0
    assert_base_untouched(groups, before)
    for x in jax.tree.leaves(adapters.frozen(groups.inner["rest"])):  # each group's copy, its leading axis
        assert x.shape[0] == 2 and np.array_equal(np.asarray(x[0]), np.asarray(x[1]))


def test_gpt2s_adapters_train_as_one_device_and_are_written_as_peft_writes_conv1d_ones(tmp_path):
    """GPT (GPT-2's names, c_attn and c_fc): 4 devices = 1 device, and its adapters are PEFT's for Conv1D layers
    (fan_in_fan_out, lora_A [r, in] and lora_B [out, r] all the same)."""
    cfg = load_config(None, ["model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.max_seq_len=16",
                             "model.vocab_size=64", "model.bias=true", "model.lora_rank=2",
                             "model.lora_targets=c_attn,c_fc", "train.run_dir=unused"])  # fmt: skip
    opt, _ = make_optimizer(OptimConfig(lr=1e-3, warmup_steps=0), 10)
    trained = []
    for n in (1, 4):
        mesh = parallel.make_mesh(jax.devices()[:n])
        model = peft.add_adapters(make_model(cfg.model, nnx.Rngs(0)), cfg.model)
        a = parallel.assemble(model, lm_loss, opt, mesh, ParallelConfig())
        state = a.state
        for i in range(2):
            state, _ = a.train_step(state, parallel.shard_batch(even_batch(i), mesh))
        trained.append(state)
    assert params_close(trained[0].params, trained[1].params, atol=1e-5) <= 0
    names = parallel.param_names(trained[0].params)
    assert sorted({n.split(".", 2)[2] for n in names}) == ["attn.qkv.lora_a", "attn.qkv.lora_b", "mlp.up.lora_a",
                                                           "mlp.up.lora_b"]  # fmt: skip
    nnx.update(model, trained[0].params)
    peft.save_adapter(model, cfg, tmp_path / "gpt")
    spec = json.loads((tmp_path / "gpt" / peft.ADAPTER_CONFIG).read_text())
    assert spec["fan_in_fan_out"] is True and spec["target_modules"] == ["c_attn", "c_fc"]
    from safetensors.numpy import load_file

    tensors = load_file(str(tmp_path / "gpt" / peft.ADAPTER_WEIGHTS))
    assert tensors["base_model.model.transformer.h.0.attn.c_attn.lora_A.weight"].shape == (2, 32)
    assert tensors["base_model.model.transformer.h.1.mlp.c_fc.lora_B.weight"].shape == (128, 2)


def test_a_library_users_model_trains_adapters_on_the_layers_it_names(tmp_path):
    """jdp.Trainer with a user's own model and jdp.adapters.add on the nnx.Linear it names: the base stays as it
    was, the checkpoint holds the adapters, and jdp.load gives the trained model back onto its base."""
    import optax
    from test_trainer import MLP, data, mse

    import jdp

    def model():
        return adapters.add(MLP(nnx.Rngs(0)), ["hidden"], rank=2, alpha=4.0, rngs=nnx.Rngs(1))

    cfg = jdp.load_config(None, [f"train.run_dir={tmp_path}", "train.steps=4", "train.batch_size=16",
                                 "train.ckpt_every=2", "train.progress=false", "train.tensorboard=false"])  # fmt: skip
    result = jdp.Trainer(model, mse, optax.adam(1e-2), data(64, 0), cfg).fit()
    trained = result["model"]
    np.testing.assert_array_equal(np.asarray(trained.out.kernel[...]), np.asarray(model().out.kernel[...]))
    assert isinstance(trained.out.kernel, Frozen) and np.any(np.asarray(trained.hidden.lora_b[...]))
    back = jdp.load(tmp_path, model)
    x = data(8, 2)["x"]
    np.testing.assert_array_equal(np.asarray(back(x)), np.asarray(trained(x)))


# ---- a run: resume, another strategy, another base, export and back --------------------------------------------


def run_overrides(run_dir: Path, data: Path, base: Path, *extra: str) -> list[str]:
    return [f"train.init_from={base}", f"data.tokenizer={DATA / 'hf-llama-tiny'}", f"data.source={data}",
            "data.seq_len=16", "data.val_tokens=256", "train.batch_size=8", "train.log_every=1",
            "train.eval_every=0", "train.progress=false", "train.tensorboard=false", "optim.lr=1e-2",
            "optim.warmup_steps=0", "model.lora_rank=4", "model.lora_targets=q_proj,v_proj,down_proj",
            "model.lora_modules_to_save=lm_head", f"train.run_dir={run_dir}", *extra]  # fmt: skip


def run_config(run_dir: Path, data: Path, base: Path, *extra: str):
    overrides = run_overrides(run_dir, data, base, *extra)
    return checked_import(load_config(None, overrides), explicit_keys(overrides))[0]


def losses(run_dir: Path) -> dict:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A 4-step LoRA fine-tune of the Llama fixture on 4 devices, checkpoints at 2 and 4: (data, run directory)."""
    tmp = tmp_path_factory.mktemp("lora")
    data = corpus(tmp)  # test_hf_llama's: six standard-library modules as documents
    train(run_config(tmp / "ref", data, DATA / "hf-llama-tiny", "train.steps=4", "train.ckpt_every=2"))
    return data, tmp / "ref"


def resumed_at_2(ref: Path, to: Path) -> Path:
    """A copy of the run as it stood at its checkpoint at step 2 (the later one gone, as after a kill)."""
    shutil.copytree(ref, to)
    shutil.rmtree(to / "checkpoints" / "4")
    return to


def test_a_lora_run_killed_while_saving_resumes_bit_identically_and_its_checkpoints_hold_no_base(lora_run, tmp_path):
    """`jdp train` (4 devices) SIGKILLed just after it starts saving step 4: run again, it resumes from its checkpoint
    at 2, made its base again, and ends as the uninterrupted run, bit for bit (every loss, the adapters' digest)."""
    import inject

    data, ref = lora_run
    resumed = tmp_path / "resumed"
    job = ["train.steps=4", "train.ckpt_every=2"]
    env, override = inject.register(dict(os.environ), JDP_TEST_KILL="4:save")
    killed = subprocess.run([sys.executable, "-m", "jdp.cli", "train", *run_overrides(resumed, data, DATA / "hf-llama-tiny",
                                                                                      *job), override],
                            env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert sorted(p.name for p in (resumed / "checkpoints").iterdir() if p.name.isdigit()) == ["2"]
    train(run_config(resumed, data, DATA / "hf-llama-tiny", *job))
    summary = lambda d: json.loads((d / "summary.json").read_text())  # noqa: E731
    assert summary(resumed)["resumed_from"] == 2
    assert summary(resumed)["params_sha256"] == summary(ref)["params_sha256"]
    assert losses(resumed) == losses(ref) and len(losses(ref)) == 4
    record = json.loads((ref / "checkpoints" / "4" / "record" / "metadata").read_text())
    assert not [k for k in record["checksums"] if k.startswith(".rest")]  # the base is not saved
    assert record["base"]["leaves"] == 2 * 9 + 2  # 2 blocks of 9 frozen leaves, the final norm, the embedding
    saved = [k for k in record["checksums"] if k.startswith(".params")]
    assert saved and all("lora_" in k or "lm_head" in k for k in saved), saved


def test_a_lora_checkpoint_continues_under_fsdp_and_refuses_another_base(lora_run, tmp_path):
    data, ref = lora_run
    moved = resumed_at_2(ref, tmp_path / "moved")
    train(run_config(moved, data, DATA / "hf-llama-tiny", "train.steps=4", "parallel.strategy=fsdp"))
    assert all(abs(losses(moved)[s] - losses(ref)[s]) <= 1e-5 * losses(ref)[s] for s in (3, 4))
    other = tmp_path / "other-base"  # the same model with one weight changed
    shutil.copytree(DATA / "hf-llama-tiny", other)
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(other / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1e-3
    save_file(tensors, str(other / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="were trained on another base model than this run's"):
        train(run_config(moved, data, other, "train.steps=6"))


def test_a_diloco_lora_run_resumes_bit_for_bit_with_no_base_in_its_groups_checkpoint(lora_run, tmp_path):
    """DiLoCo's checkpoint holds each group's adapters and optimizer state, not each group's copy of the base; a run
    stopped at a sync and run again ends as the uninterrupted one."""
    data, _ = lora_run
    diloco = ["parallel.sync=diloco", "parallel.groups=2", "parallel.outer_every=2", "train.ckpt_every=2"]
    ref, resumed = tmp_path / "ref", tmp_path / "resumed"
    train(run_config(ref, data, DATA / "hf-llama-tiny", "train.steps=4", *diloco))
    record = json.loads((ref / "checkpoints" / "4" / "record" / "metadata").read_text())
    assert record["groups"] == 2 and record["base"] and not [k for k in record["inner_checksums"] if "rest" in k]
    resumed_at_2(ref, resumed)
    train(run_config(resumed, data, DATA / "hf-llama-tiny", "train.steps=4", *diloco))
    summary = lambda d: json.loads((d / "summary.json").read_text())  # noqa: E731
    assert summary(resumed)["params_sha256"] == summary(ref)["params_sha256"] and losses(resumed) == losses(ref)


def test_exported_adapters_read_back_give_the_runs_logits_and_the_merged_export_too(lora_run, tmp_path):
    """`jdp export RUN OUT --adapter` writes PEFT's files; train.init_adapter reads them onto the base: the run's
    logits exactly. `jdp export RUN OUT` folds them into the weights: the same logits to float32 rounding."""
    import argparse

    from jdp import generate, hf

    _, ref = lora_run
    cfg, model, _, step = generate.load_run(ref)
    assert step == 4 and adapters.has_adapters(model)
    generate.export(argparse.Namespace(run_dir=str(ref), out_dir=str(tmp_path / "adapter"), step=None, adapter=True))
    generate.export(argparse.Namespace(run_dir=str(ref), out_dir=str(tmp_path / "merged"), step=None, adapter=False))
    spec = json.loads((tmp_path / "adapter" / peft.ADAPTER_CONFIG).read_text())
    assert (spec["r"], spec["lora_alpha"], spec["target_modules"], spec["modules_to_save"]) == (
        4, 8.0, ["down_proj", "q_proj", "v_proj"], ["lm_head"])  # fmt: skip
    assert spec["base_model_name_or_path"] == str(DATA / "hf-llama-tiny")
    inputs = np.load(DATA / "hf-llama-tiny" / "inputs.npy")
    theirs = np.asarray(model(inputs))
    back_cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, init_adapter=str(tmp_path / "adapter")))
    back, _ = run_model(back_cfg)
    np.testing.assert_array_equal(np.asarray(back(inputs)), theirs)
    ids, new = generate.sample_tokens(model, generate.load_tokenizer(cfg.data.tokenizer), "def f", max_new_tokens=3,
                                      temperature=0)  # the KV cache through the adapters: greedy = the logits' argmax
    full = np.asarray(model(np.asarray([ids + new[:2]], np.int32)))[0]
    assert new == [int(np.argmax(full[len(ids) - 1 + i])) for i in range(3)]
    merged, _ = hf.load_model(hf.adopt(cfg.model, tmp_path / "merged").model, tmp_path / "merged")
    assert not adapters.has_adapters(merged)
    np.testing.assert_allclose(np.asarray(merged(inputs)), theirs, atol=1e-5, rtol=0)
    with pytest.raises(ConfigError, match="missing base_model.model.model.layers.0.self_attn.k_proj.lora_A"):
        run_model(dataclasses.replace(back_cfg, model=dataclasses.replace(back_cfg.model, lora_targets="all-linear")))


def test_peft_loads_jdps_export_with_every_key_and_gives_its_logits(tmp_path):
    """peft itself (where torch and peft are installed: CI's oldest stack): PeftModel.from_pretrained on jdp's
    export (the Llama fixture's adapters, read by jdp, then written by jdp: every A, B and lm_head) warns of no
    missing or unexpected key (a wrong prefix loads silently with lora_B at zero) and computes jdp's logits."""
    torch = pytest.importorskip("torch", reason="peft's own check needs torch and peft (CI's oldest stack)")
    pytest.importorskip("peft", reason="peft's own check needs torch and peft (CI's oldest stack)")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg, _ = fixture_config("hf-llama-tiny")
    model, _ = run_model(cfg)
    peft.save_adapter(model, cfg, tmp_path / "adapter")
    base = AutoModelForCausalLM.from_pretrained(DATA / "hf-llama-tiny", torch_dtype=torch.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        theirs = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    said = [str(w.message) for w in caught]
    assert not [s for s in said if "missing" in s.lower() or "unexpected" in s.lower()], said
    inputs = np.load(DATA / "hf-llama-tiny" / "inputs.npy")
    with torch.no_grad():
        logits = theirs(torch.from_numpy(inputs.astype(np.int64))).logits.numpy()
    np.testing.assert_allclose(np.asarray(model(inputs))[..., : logits.shape[-1]], logits, atol=1e-5, rtol=0)


# ---- the config ---------------------------------------------------------------------------------------------------


def test_lora_keys_that_cannot_work_are_refused_by_name():
    def problems(*overrides):
        with pytest.raises(ConfigError) as e:
            validate(load_config(None, [*overrides, "train.run_dir=unused"]), n_devices=1)
        return str(e.value)

    said = problems("model.lora_alpha=16", "model.base_dtype=bfloat16")
    assert "model.lora_alpha=16.0 is read only with model.lora_rank > 0" in said
    assert "model.base_dtype='bfloat16' is read only with model.lora_rank > 0" in said
    said = problems("model.arch=llama", "model.lora_rank=8", "model.lora_targets=q_proj,qproj",
                    "model.lora_modules_to_save=lm_head")  # fmt: skip
    assert "model.lora_targets: qproj is not a linear layer of model.arch=llama" in said and "gate_proj" in said
    assert "lm_head is not a module of this model (the output is tied to the embedding: train embed_tokens)" in said
    assert "with optim.name=muon" in problems("model.lora_rank=8", "optim.name=muon")
    assert "with train.live=true" in problems("model.lora_rank=8", "train.live=true")
    assert "model.lora_dropout=1.0 must be in [0, 1)" in problems("model.lora_rank=8", "model.lora_dropout=1")
    assert "c_proj" in problems("model.lora_rank=8", "model.lora_targets=q_proj")  # GPT's names for GPT
    validate(load_config(None, ["model.lora_rank=8", "model.lora_targets=c_attn,c_fc", "train.run_dir=x"]), 1)
    with pytest.raises(ConfigError, match=r"model.lora_rank=2 \(the adapter's is 4\)"):
        fixture_config("hf-llama-tiny", "model.lora_rank=2")


def test_fsdps_compiled_step_gathers_the_base_by_block_and_scatters_adapter_gradients_only():
    """`jdp allreduce` of a LoRA run under fsdp (llama-tiny, 2 blocks, 4 devices): the reduce-scatters carry the
    adapters' gradients alone (their padded bytes); the base is all-gathered in rows, one collective per block for
    its forward and (JAX 0.11 on, resharding) one for its backward, one per module (embedding, final norm, head),
    each carrying its whole leaves; nothing else but scalars."""
    from jdp.hlo import all_reduce_report

    cfg = load_config("llama-tiny", ["model.n_layers=2", "model.lora_rank=4", "parallel.strategy=fsdp",
                                     "train.batch_size=8", "data.seq_len=32"])  # fmt: skip
    text, numbers = all_reduce_report(cfg)
    assert numbers["gradient_bytes_total"] == numbers["padded_parameter_bytes"], text
    again = 2 if jax.__version_info__ >= (0, 11) else 0
    assert numbers["base_all_gathers"] == 2 + again + 3, text
    model = nnx.eval_shape(lambda: run_model(cfg)[0])
    base = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model, Frozen)))
    blocks = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model.blocks, Frozen)))
    assert "frozen base: blocks.0.attn.k.kernel" in text and sum(numbers["other_bytes"]) <= 256, text
    assert f"the frozen base (LoRA's, in rows): {2 + again + 3} all-gather(s), {base + (blocks if again else 0):,}" in text
