"""optim.name=muon (jdp/muon.py): optax's arithmetic, and exact under every strategy. zero1, fsdp and hsdp hand the
optimizer their split views of the parameters; Newton-Schulz must see each matrix whole, so a strategy that let it
see a view (zero1's (1, padded) row, fsdp's rows) would train something else, and these tests would show it."""

import os

import jax
import numpy as np
import optax
import pytest
import test_zero1
from flax import nnx
from test_diloco import cache  # noqa: F401  (a fixture: one corpus and token cache)
from test_diloco import losses as diloco_losses
from test_diloco import tiny as diloco_tiny
from test_plan import compiled_per_device

from jdp import muon, parallel, plan
from jdp.config import ConfigError, OptimConfig, load_config, validate
from jdp.hlo import all_reduce_report
from jdp.lm import train as train_lm
from jdp.models import make_model
from jdp.models.common import lm_loss
from jdp.optim import make_optimizer, whole_matrices
from jdp.parallel import strategies

GPT = test_zero1.CFG  # 61 x 30 embeddings, 30 x 90 matrices: 4 devices pad nearly every view


def optimizer(**keys):
    return make_optimizer(OptimConfig(name="muon", lr=1e-2, warmup_steps=0, grad_clip=0.1, **keys), 10)


def test_the_arithmetic_is_optax_muon():
    """Matrices only (two of one shape: one lax.map), the width scale and decay: optax.contrib.muon, bit for bit."""
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    params = {"a": jax.random.normal(keys[0], (30, 90)), "b": jax.random.normal(keys[1], (64, 16)),
              "c": jax.random.normal(keys[2], (30, 90))}  # fmt: skip
    mine = muon.muon(1e-2, 1e-2, beta=0.95, nesterov=True, steps=5, coeffs=((3.4445, -4.775, 2.0315),),
                     scale="width", weight_decay=0.1, adamw_only=(), decay_mask=None, b1=0.9, b2=0.95, eps=1e-8)  # fmt: skip
    theirs = optax.contrib.muon(1e-2, beta=0.95, weight_decay=0.1)
    state = {"mine": mine.init(params), "theirs": theirs.init(params)}
    p = {"mine": params, "theirs": params}
    for i in range(3):
        g = jax.tree.map(lambda x, i=i: jax.random.normal(jax.random.fold_in(keys[3], i), x.shape), params)
        for name, opt in (("mine", mine), ("theirs", theirs)):
            u, state[name] = jax.jit(opt.update)(g, state[name], p[name])
            p[name] = optax.apply_updates(p[name], u)
    for k in params:
        np.testing.assert_array_equal(p["mine"][k], p["theirs"][k])
    assert not np.allclose(p["mine"]["a"], params["a"])


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    model = make_model(load_config("llama-tiny").model, nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    names = parallel.param_names(params)
    cfg = OptimConfig(name="muon")
    picked = {n for n, w in zip(names, whole_matrices(cfg, params), strict=True) if w}
    assert picked == {n for n in names if n.startswith("blocks.") and n.endswith(".kernel")}
    assert "lm_head.kernel" not in picked and "embed.embedding" not in picked
    # The state: Muon's one moment for those, AdamW's two for the rest (optax.partition's masked states).
    state = make_optimizer(cfg, 10)[0].init(params)
    moments = sum(x.size for x in jax.tree.leaves(state) if x.ndim)
    sizes = {n: x.size for n, x in zip(names, jax.tree.leaves(params), strict=True)}
    assert moments == sum(sizes[n] for n in picked) + 2 * sum(v for n, v in sizes.items() if n not in picked)
    assert whole_matrices(OptimConfig(), params) == [False] * len(names)


def test_the_config_refuses_muon_keys_for_another_optimizer_and_odd_coefficients():
    for overrides, words in [
        (["optim.muon_lr=0.02"], "optim.muon_lr=0.02 is read by optim.name=muon only, not adamw"),
        (["optim.name=muon", "optim.muon_ns_coeffs=1,2"], "must be 3 numbers"),
        (["optim.name=muon", "optim.muon_ns_coeffs=1,2,3,4,5,6"], "2 triples of coefficients for optim.muon_ns_steps=5"),
        (["optim.name=muon", "optim.muon_scale=spectral"], "must be one of rms, width"),
    ]:
        with pytest.raises(ConfigError, match=words):
            validate(load_config("tiny", overrides), 1)
    validate(load_config("tiny", ["optim.name=muon", "optim.muon_ns_steps=2", "optim.muon_ns_coeffs=3,-4,2;2,-3,1"]), 1)


@pytest.mark.parametrize("strategy", ["zero1", "fsdp"])
def test_a_split_layout_refuses_optax_muon_which_would_orthogonalise_its_views(strategy):
    mesh = parallel.make_mesh(jax.devices()[:4])
    with pytest.raises(ValueError, match="optax.contrib.muon orthogonalises each leaf.*Use jdp's Muon"):
        parallel.init_state(make_model(GPT, nnx.Rngs(0)), optax.contrib.muon(1e-3), mesh, strategy)
    parallel.init_state(make_model(GPT, nnx.Rngs(0)), optimizer()[0], mesh, strategy)  # jdp's: accepted


def train(cfg, n: int, strategy: str, steps: int = 3, **mesh_keys):
    mesh = parallel.make_mesh(jax.devices()[:n], **mesh_keys)
    opt, schedule = optimizer()
    graphdef, state = parallel.init_state(make_model(cfg, nnx.Rngs(0)), opt, mesh, strategy)
    step = parallel.make_train_step(graphdef, lm_loss, opt, mesh, 1, schedule, strategy=strategy, bucket_mb=0.005)
    history = []
    for i in range(steps):
        state, metrics = step(state, parallel.shard_batch(test_zero1.make_batch(i, uneven_padding=True), mesh))
        history.append(float(metrics["loss"]))
    shapes = jax.tree.leaves(state.param_shapes())
    own = [np.asarray(x)[tuple(slice(0, d) for d in s.shape)] for x, s in zip(jax.tree.leaves(state.params), shapes,
                                                                          strict=True)]  # fmt: skip
    return own, history, state


def test_every_strategy_on_four_devices_trains_as_one_device():
    """The layouts that hand the optimizer views of its matrices, zero1 (a padded row), fsdp (rows) and hsdp (rows
    within groups of 2), on 4 devices against ddp on 1: the same losses and parameters to float32 rounding.
    Orthogonalising a view instead of the matrix would be off by far more. (ddp and dp hand the optimizer whole matrices, as one device does, so their step with Muon is their step
    with any optimizer, tests/test_parallel.py's and the strategies' own tests'; Muon under ddp on 4 devices keeps
    its replicas identical in test_powersgd_under_muon_keeps_the_replicas_identical, and trains as zero1 and fsdp
    inside DiLoCo's groups in test_diloco_groups_train_alike_whichever_strategy_holds_their_state. The Llama
    family's matrices are 2-D kernels as GPT's, gathered the same way: which of them Muon takes is
    test_muon_takes_the_hidden_matrices_and_adamw_the_rest's.)"""
    cfg = GPT
    one, losses_one, _ = train(cfg, 1, "ddp")
    assert losses_one[-1] != losses_one[0]
    for strategy in ("zero1", "fsdp", "hsdp"):
        keys = {"shard_size": 2} if strategies.get(strategy).groups else {}
        got, history, state = train(cfg, 4, strategy, **keys)
        np.testing.assert_allclose(history, losses_one, rtol=2e-6, err_msg=strategy)
        # atol: 0.1% of one step at lr 1e-2 (AdamW turns the rounding of a near-zero gradient, Llama's key bias,
        # into a share of a step: 1.5e-6 seen); a matrix orthogonalised as a view moves by the whole step
        for a, b in zip(got, one, strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5, err_msg=strategy)
        assert parallel.replica_mismatches(state.params) == [], strategy


def test_powersgd_under_muon_keeps_the_replicas_identical():
    from jdp.parallel.comm_hooks import PowerSGD

    mesh = parallel.make_mesh(jax.devices()[:4])
    opt, schedule = optimizer()
    hook = PowerSGD(rank=2, start_step=1)
    graphdef, state = parallel.init_state(make_model(GPT, nnx.Rngs(0)), opt, mesh, comm_hook=hook)
    step = parallel.make_train_step(graphdef, lm_loss, opt, mesh, 1, schedule, comm_hook=hook)
    for i in range(4):
        state, metrics = step(state, parallel.shard_batch(test_zero1.make_batch(i, uneven_padding=True), mesh))
    assert np.isfinite(float(metrics["loss"])) and int(metrics["skipped"]) == 0
    assert parallel.replica_mismatches(state.params) == []


def test_the_plan_counts_muons_bytes_and_gathers():
    """The memory check's bytes per device against the compiled step's (4 devices, a shape whose state outweighs
    its activations: 6 blocks of width 256, 8 sequences of 32 tokens; with 2 blocks zero1's plan is 34% over),
    every planned strategy: never more than 10% under; zero1's update reuses its whole gradients' buffers, so the
    plan may be up to 20% over there. Muon's matrices are the plan's extra all-gathers
    and `jdp allreduce`'s, one loop per shape."""
    n, frees = 4, plan.recomputes_activations("cpu")
    for strategy in plan.planned_strategies():
        group = ["parallel.shard_size=2"] if strategies.get(strategy).groups else []
        state_heavy = ["model.n_layers=6", "model.d_model=256", "data.seq_len=32", "model.max_seq_len=32",
                       "train.batch_size=8"]  # fmt: skip
        cfg = load_config("tiny", [*state_heavy, f"parallel.strategy={strategy}", "optim.name=muon", *group])
        planned = plan.device_memory(cfg, n, validate(cfg, n).micro_batch, False, frees=frees).total
        compiled = compiled_per_device(cfg, n)
        print(f"muon {strategy:6} compiled {compiled / 1e6:7.2f} MB, planned {planned / 1e6:7.2f} MB "
              f"({(planned - compiled) / compiled:+.1%})")  # fmt: skip
        assert -0.10 <= (planned - compiled) / compiled <= 0.20, (strategy, planned, compiled)
    cfg = load_config("tiny", ["optim.name=muon", "parallel.strategy=fsdp"])
    planner = plan.make_planner(cfg)
    traffic, _ = planner.traffic(4)
    whole = [c for c in traffic.collectives if c.what == "Muon's whole matrices"]
    assert len(whole) == 1 and sum(whole[0].nbytes) == 4 * (128 * 384 + 128 * 128 + 2 * 128 * 512) * 4
    assert not [c for c in plan.make_planner(load_config("tiny", ["parallel.strategy=fsdp"])).traffic(4)[0].collectives
                if c.what == "Muon's whole matrices"]  # fmt: skip


@pytest.mark.parametrize("strategy", ["zero1", "fsdp", "ddp"])
def test_allreduce_names_muons_gathers(strategy):
    cfg = load_config("tiny", [f"parallel.strategy={strategy}", "optim.name=muon", "model.n_layers=2"])
    text, numbers = all_reduce_report(cfg)
    if strategy == "ddp":  # whole copies: nothing to gather
        assert numbers["muon_matrices"] == numbers["muon_all_gathers"] == 0
        return
    # 8 matrices of 4 shapes (qkv, out, up, down; 2 blocks): one all-gather in each shape's loop
    assert numbers["muon_matrices"] == 8 and numbers["muon_all_gathers"] == 4, text
    assert "Muon: the whole matrix for Newton-Schulz" in text


@pytest.mark.usefixtures("cache")
def test_diloco_groups_train_alike_whichever_strategy_holds_their_state(tmp_path):
    """DiLoCo (2 groups of 2 devices, H=2) with Muon inside each group: ddp, zero1 and fsdp inside are layouts of
    the same arithmetic (the groups' steps run under jax.vmap), so the same losses to float32 rounding."""
    base = ["optim.name=muon", "parallel.sync=diloco", "parallel.groups=2", "parallel.outer_every=2"]
    for strategy in ("ddp", "zero1", "fsdp"):
        train_lm(diloco_tiny(tmp_path / strategy, *base, f"parallel.strategy={strategy}"))
    ddp = diloco_losses(tmp_path / "ddp")
    assert sorted(ddp) == list(range(1, 7))
    for strategy in ("zero1", "fsdp"):
        mine = diloco_losses(tmp_path / strategy)
        np.testing.assert_allclose([mine[s] for s in ddp], [ddp[s] for s in ddp], rtol=2e-6, err_msg=strategy)


@pytest.mark.usefixtures("cache")
def test_muon_sigkill_resume_is_bit_identical_and_moves_between_strategies(tmp_path):
    """zero1 with Muon, `jdp train` killed while saving step 8 and run again: the uninterrupted run, bit for bit
    (Muon's momentum and AdamW's moments saved and restored; the kill-at-save resume of zero1's layout). The
    uninterrupted run's checkpoint at step 4 continued under fsdp (the state moved from zero1's slices to fsdp's
    rows): the same losses to rounding. Each resumed from step 4: the records of steps 5 to 8 they replace were moved
    aside."""
    import shutil
    import subprocess
    import sys

    import inject
    from test_diloco import SMALL

    from jdp.metrics import read_metrics

    common = ["optim.name=muon", "parallel.bucket_mb=0.05", "train.steps=8", "train.ckpt_every=4",
              "parallel.strategy=zero1"]  # fmt: skip
    ref = train_lm(diloco_tiny(tmp_path / "ref", *common))
    env, override = inject.register(dict(os.environ), JDP_TEST_KILL="8:save")
    args = ["train", "tiny", *SMALL, f"train.run_dir={tmp_path / 'resumed'}", "train.log_every=1",
            "train.progress=false", "train.eval_every=0", *common, override]  # fmt: skip
    out = subprocess.run([sys.executable, "-m", "jdp.cli", *args], env=env, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert out.returncode != 0, out.stderr[-2000:]
    assert sorted(int(p.name) for p in (tmp_path / "resumed" / "checkpoints").iterdir() if p.name.isdigit()) == [4]
    shutil.copytree(tmp_path / "ref", tmp_path / "moved")
    shutil.rmtree(tmp_path / "moved" / "checkpoints" / "8")
    (tmp_path / "moved" / "summary.json").unlink()
    resumed = train_lm(diloco_tiny(tmp_path / "resumed", *common))
    assert resumed["params_sha256"] == ref["params_sha256"]
    assert diloco_losses(tmp_path / "resumed") == diloco_losses(tmp_path / "ref")
    moved = train_lm(diloco_tiny(tmp_path / "moved", *common, "parallel.strategy=fsdp"))
    assert test_zero1.close(diloco_losses(tmp_path / "ref"), diloco_losses(tmp_path / "moved"))
    assert int(moved["state"].step) == 8
    for name in ("resumed", "moved"):
        superseded = read_metrics(tmp_path / name / "metrics.superseded.jsonl")
        assert sorted({r["step"] for r in superseded}) == [5, 6, 7, 8], name
