"""fsdp (ZeRO-3): parameters, gradients and optimizer state split over the devices, each block gathered for its
forward and backward; the same training as ddp, on devices and real processes, and checkpoints that move between
strategies and device counts."""

import functools
import json
import math
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from test_faults import killed_at_save_then_resumed, losses, run, summary
from test_parallel import params_close
from test_trainer import data, mse  # the library trainer's regression task
from test_zero1 import CFG, close, make_batch, optimizer

import jdp
from jdp import parallel
from jdp.config import ModelConfig
from jdp.hlo import collectives, compiled_text
from jdp.models.common import lm_loss
from jdp.models.gpt import GPT
from jdp.models.llama import Llama

LLAMA = ModelConfig(arch="llama", vocab_size=61, max_seq_len=16, d_model=30, n_layers=2, n_heads=3, n_kv_heads=1,
                    d_ff=50, tie_embeddings=False)  # fmt: skip


def setup(n_devices, strategy, optim="adamw", grad_accum=1, cfg=CFG, **options):
    mesh = parallel.make_mesh(jax.devices()[:n_devices], shard_size=options.get("shard_size", 0))
    opt, schedule = optimizer(optim)
    model = (Llama if cfg.arch == "llama" else GPT)(cfg, nnx.Rngs(0))
    graphdef, state = parallel.init_state(model, opt, mesh, strategy)
    step = parallel.make_train_step(graphdef, lm_loss, opt, mesh, grad_accum, schedule, strategy=strategy, **options)
    return mesh, state, step


@functools.cache
def train(n_devices, strategy, optim="adamw", grad_accum=1, cfg=CFG, steps=4, reshard=True, shard_size=2,
          unsharded=False):  # fmt: skip
    options = (
        {"reshard_after_forward": reshard, "accumulate_unsharded": unsharded} if strategy in ("fsdp", "hsdp") else {}
    )
    if strategy == "hsdp":
        options["shard_size"] = shard_size
    mesh, state, step = setup(n_devices, strategy, optim, grad_accum, cfg, **options)
    history = []
    for i in range(steps):
        state, metrics = step(state, parallel.shard_batch(make_batch(i, uneven_padding=True), mesh))
        history.append({k: float(v) for k, v in metrics.items()})
    return state, history


def own(state):
    """The parameters cut to their own shapes (fsdp's padding off), on the host."""
    return [np.asarray(x)[: s[0]] for x, s in zip(jax.tree.leaves(state.params), state.shapes, strict=True)]


# Each option in at least one case, several to a case (CI time: each case compiles an fsdp step, and a ddp one
# unless another case's is cached): 1, 2 and 4 devices (2 devices' padding is 2-sgd-accum2's, AdamW's state 4
# devices'), SGD's momentum and AdamW, grad_accum 1 and 2, resharding and keeping the gathered parameters, GPT and
# Llama, accumulate_unsharded. hsdp's cases below reuse these cases' ddp runs.
@pytest.mark.parametrize(
    "n_devices, optim, grad_accum, reshard, cfg, unsharded",
    [(1, "adamw", 1, True, CFG, False), (4, "sgd", 1, False, CFG, False), (4, "adamw", 2, True, CFG, False),
     (2, "sgd", 2, True, CFG, False), (4, "adamw", 2, True, LLAMA, True)],
    ids=["1-adamw", "4-sgd-keep-gathered", "4-adamw-accum2", "2-sgd-accum2", "4-llama-accum2-unsharded"],
)  # fmt: skip
def test_fsdp_trains_as_ddp(n_devices, optim, grad_accum, reshard, cfg, unsharded):
    ddp, ddp_hist = train(n_devices, "ddp", optim, grad_accum, cfg)
    fsdp, fsdp_hist = train(n_devices, "fsdp", optim, grad_accum, cfg, reshard=reshard, unsharded=unsharded)
    same_training(ddp, ddp_hist, fsdp, fsdp_hist, n_devices, optim)


@pytest.mark.parametrize(
    "optim, grad_accum, reshard, cfg, unsharded",
    [("sgd", 1, True, CFG, False), ("adamw", 2, True, CFG, True), ("adamw", 2, False, LLAMA, False)],
    ids=["sgd", "adamw-accum2-unsharded", "llama-accum2-keep-gathered"],
)  # fmt: skip
def test_hsdp_in_groups_of_two_trains_as_ddp(optim, grad_accum, reshard, cfg, unsharded):
    """4 devices as 2 groups of 2: the state split inside each group, the groups replicas of each other."""
    ddp, ddp_hist = train(4, "ddp", optim, grad_accum, cfg)
    hsdp, hsdp_hist = train(4, "hsdp", optim, grad_accum, cfg, reshard=reshard, shard_size=2, unsharded=unsharded)
    assert jax.tree.leaves(hsdp.params)[0].sharding.mesh.shape == {"replica": 2, "shard": 2}
    same_training(ddp, ddp_hist, hsdp, hsdp_hist, 2, optim)


def same_training(ddp, ddp_hist, split, split_hist, shards, optim):
    """The same losses, gradient norms and parameters as ddp's; each device holds its rows (the state split over
    `shards` devices) and the padding rows stay +0.0; the optimizer state is the same numbers."""
    assert any(h["grad_norm"] > 0.1 for h in ddp_hist)  # clipping is active on some step
    for a, b in zip(ddp_hist, split_hist, strict=True):
        for key in ("loss", "grad_norm", "lr", "tokens"):
            assert abs(a[key] - b[key]) <= 1e-5 * abs(a[key]), (key, a, b)
        assert a["skipped"] == b["skipped"] == 0 and math.isfinite(a["loss"])
    assert params_close(jax.tree.leaves(ddp.params), own(split)) <= 0
    for x, shape in zip(jax.tree.leaves(split.params), split.shapes, strict=True):
        rows = -(-shape[0] // shards)
        assert x.shape == (rows * shards, *shape[1:])
        assert all(s.data.shape == (rows, *shape[1:]) for s in x.addressable_shards)
        pad = np.asarray(x)[shape[0] :]
        assert not np.any(pad) and not np.any(np.signbit(pad))
    mesh = jax.tree.leaves(split.params)[0].sharding.mesh
    back = parallel.relayout(split, optimizer(optim)[0], mesh, "ddp")
    for a, b in zip(jax.tree.leaves(ddp.opt_state), jax.tree.leaves(back.opt_state), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=1e-6)


def on_first_device(tree):
    first = jax.devices()[0]
    return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards if s.device == first)


def test_one_device_holds_one_nth_of_the_parameters_and_optimizer_state():
    n = 4
    _, ddp, _ = setup(n, "ddp")
    _, fsdp, _ = setup(n, "fsdp")
    held = {name: on_first_device((s.params, s.opt_state)) for name, s in (("ddp", ddp), ("fsdp", fsdp))}
    # padding: the rows added to make every first axis a multiple of n, for the parameters and Adam's two moments
    padding = 3 * sum(4 * (-s[0] % n) * math.prod(s[1:]) for s in fsdp.shapes)
    scalars = sum(x.nbytes for x in jax.tree.leaves(fsdp.opt_state) if x.ndim == 0)
    assert held["fsdp"] <= (held["ddp"] + padding) / n + scalars
    assert held["fsdp"] < 0.3 * held["ddp"]


def _held(n_layers, strategy, **options):
    cfg = ModelConfig(vocab_size=64, max_seq_len=16, d_model=64, n_layers=n_layers, n_heads=4)
    mesh, state, step = setup(4, strategy, cfg=cfg, **options)
    spec = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=parallel.batch_sharding(mesh)) for k, v in make_batch().items()}  # fmt: skip
    block = sum(4 * x.size for x in jax.tree.leaves(nnx.state(GPT(cfg, nnx.Rngs(0)).blocks[0], nnx.Param)))
    m = step.lower(state, spec).compile().memory_analysis()
    return m.argument_size_in_bytes + m.temp_size_in_bytes, block


def test_the_compiled_step_holds_about_one_block_gathered_at_a_time():
    """From XLA's memory analysis of the compiled step (arguments and temporaries), per added layer: ddp's grow by
    the layer's parameters, AdamW's two moments, its gradient (4 blocks) and its activations; fsdp's (resharding)
    by 1/4 of the state and the matrix products' outputs it keeps, and by no block whole: each block's gather waits
    for the block before it to start (measured 1.18 blocks a layer on JAX 0.11 and 0.12; 2.75 when XLA:CPU
    started every gather at the top of the step). On JAX 0.10 the gathered parameters stay until backward as well
    (3.67 blocks, 1.95 of them whole), as without resharding."""
    n = 4
    (ddp2, block), (ddp4, _) = _held(2, "ddp"), _held(4, "ddp")
    (fsdp2, _), (fsdp4, _) = _held(2, "fsdp"), _held(4, "fsdp")
    per_layer_ddp, per_layer_fsdp = (ddp4 - ddp2) / 2, (fsdp4 - fsdp2) / 2
    activations = per_layer_ddp - 4 * block
    whole = (per_layer_fsdp - activations - 3 * block / n) / block  # blocks held whole per layer
    kept4, _ = _held(4, "fsdp", reshard_after_forward=False)
    print(f"per layer: ddp {per_layer_ddp / block:.2f} blocks, fsdp {per_layer_fsdp / block:.2f}, whole {whole:.2f}")
    if jax.__version_info__ >= (0, 11):
        assert per_layer_fsdp <= 1.5 * block, (per_layer_ddp, per_layer_fsdp, block)
        assert kept4 > fsdp4 + 2 * block  # keeping the gathered parameters for backward (ZeRO-2-like) holds more
    else:  # JAX 0.10's compiled step keeps each block's gathered parameters for backward even when resharding
        assert whole <= 2.25, (per_layer_ddp, per_layer_fsdp, block)
        assert kept4 >= fsdp4 - block / 4


@pytest.mark.parametrize(
    "reshard, unsharded", [(True, False), (False, False), (True, True)], ids=["reshard", "keep-gathered", "unsharded"]
)
def test_compiled_fsdp_step_gathers_per_block_and_has_no_gradient_all_reduce(reshard, unsharded):
    n = 4
    mesh, state, step = setup(n, "fsdp", grad_accum=2, reshard_after_forward=reshard, accumulate_unsharded=unsharded)
    found = collectives(compiled_text(step, state, parallel.shard_batch(make_batch(0), mesh)))
    padded = {k: 4 * math.prod(x.shape) for k, x in enumerate(jax.tree.leaves(state.params))}
    names = parallel.param_names(state.params)
    blocks = sum(v for k, v in padded.items() if names[k].startswith("blocks."))
    outer = sum(padded.values()) - blocks
    gathers = [c for c in found if c.kind == "all-gather"]
    scatters = [c for c in found if c.kind == "reduce-scatter"]
    # Each forward: one gather per block, one per other module (GPT's embedding, used twice, and final norm), one
    # for the parameters the model holds itself (its positions); each block again for backward when resharding.
    # Both micro-batches run inside the accumulation loop, so the loop's body holds one micro-batch's.
    others = 3
    # JAX 0.10's XLA merges a block's backward gather into its forward one, so resharding holds them as keeping does
    again = 2 if reshard and jax.__version_info__ >= (0, 11) else 1
    assert len(gathers) == others + CFG.n_layers * again
    assert sum(c.bytes for c in gathers) == outer + blocks * again
    assert len(scatters) == others + CFG.n_layers and sum(c.bytes for c in scatters) == sum(padded.values())
    assert all(c.in_loop for c in gathers)
    # reduce-scattered per micro-batch into a 1/N sum, or (accumulate_unsharded) summed whole and scattered once
    assert all(c.in_loop != unsharded for c in scatters)
    # No gradient all-reduce: only scalars (loss and token count, the gradient norm's partial sums).
    for c in found:
        if c.kind == "all-reduce":
            assert all(math.prod(int(d) for d in s[s.index("[") + 1 : -1].split(",") if d) <= 2 for s in c.shapes), c


def test_compiled_hsdp_step_reduces_inside_groups_and_all_reduces_only_shards_across_them():
    import re

    from jdp.hlo import _group_size

    mesh, state, step = setup(4, "hsdp", shard_size=2)
    text = compiled_text(step, state, parallel.shard_batch(make_batch(0), mesh))
    padded = sum(4 * math.prod(x.shape) for x in jax.tree.leaves(state.params))
    scattered, across = 0, 0
    for c, line in zip(collectives(text), [ln for ln in text.splitlines() if _is_collective(ln)], strict=True):
        groups = _group_size(line)
        if c.kind in ("reduce-scatter", "all-gather"):
            assert groups == 2, line[:200]  # inside a group
        if c.kind == "reduce-scatter":
            scattered += c.bytes
        if c.kind == "all-reduce" and not all(s.endswith("[]") or re.fullmatch(r"f32\[2\]", s) for s in c.shapes):
            assert groups == 2, line[:200]  # across the 2 groups: one device of each
            across += c.bytes
    assert scattered == padded  # every gradient reduce-scattered once inside its group
    assert across == padded // 2  # and only each device's shard of it all-reduced across the groups


def _is_collective(line: str) -> bool:
    import re

    return bool(re.match(r"^\s*(?:ROOT )?%?[\w.\-]+ = .*? (all-reduce|reduce-scatter|all-gather)(?:-start)?\(", line))


def test_hsdp_replica_digest_finds_a_group_whose_shard_differs():
    mesh, state, _ = setup(4, "hsdp", shard_size=2)
    digest = parallel.make_replica_digest(mesh)
    tree = {"params": state.params, "rest": state.rest}
    assert parallel.replica_digest_mismatches(digest, tree, mesh) == []
    leaves = jax.tree.leaves(state.params)
    leaf = leaves[0]
    parts = [np.asarray(s.data) + (1.0 if s.device.id in (2, 3) else 0.0) for s in leaf.addressable_shards]
    placed = [jax.device_put(p, s.device) for p, s in zip(parts, leaf.addressable_shards, strict=True)]
    # the second group's copy of the first parameter differs from the first group's
    changed = jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, placed)
    params = jax.tree.unflatten(jax.tree.structure(state.params), [changed, *leaves[1:]])
    bad = parallel.replica_digest_mismatches(digest, {"params": params, "rest": state.rest}, mesh)
    assert [b.split(" (")[0] for b in bad] == [str(jax.devices()[2]), str(jax.devices()[3])]


def test_hsdp_refuses_a_shard_size_that_does_not_divide_and_a_mesh_without_groups(tmp_path):
    from jdp.config import ConfigError, load_config, validate

    cfg = load_config(None, ["parallel.strategy=hsdp", "parallel.shard_size=3"])
    with pytest.raises(ConfigError, match="shard_size=3 does not divide the 4 devices: use one of"):
        validate(cfg, n_devices=4)
    mesh = parallel.make_mesh()
    opt, _ = optimizer()
    graphdef, _ = parallel.init_state(GPT(CFG, nnx.Rngs(0)), opt, mesh, "fsdp")
    with pytest.raises(ValueError, match="build it with jdp.make_mesh"):
        parallel.make_train_step(graphdef, lm_loss, opt, mesh, strategy="hsdp", shard_size=2)


def test_fsdp_refuses_a_state_built_for_ddp_and_scalar_parameters():
    mesh, ddp_state, _ = setup(4, "ddp")
    _, _, fsdp_step = setup(4, "fsdp")
    with pytest.raises(ValueError, match="not laid out for fsdp on 4 devices"):
        fsdp_step(ddp_state, parallel.shard_batch(make_batch(0), mesh))
    with pytest.raises(ValueError, match="splits every parameter along its first axis, but s is a scalar"):
        parallel.layout_of({"shards": 4, "rows": True}).check(
            optax.adamw(1e-3), {"s": jnp.zeros(()), "w": jnp.zeros((3, 2))}
        )
    with pytest.raises(ValueError, match="takes no option reshard_after_forward"):
        parallel.make_train_step(*setup(4, "ddp")[1:2], lm_loss, optax.adamw(1e-3), mesh, reshard_after_forward=True)


def test_replica_digest_is_the_logical_parameters_and_finds_a_differing_replicated_leaf():
    mesh, state, _ = setup(4, "fsdp")
    digest = parallel.make_replica_digest(mesh)
    tree = {"params": state.params, "rest": state.rest}
    assert parallel.replica_digest_mismatches(digest, tree, mesh) == []
    first = np.asarray(digest(tree))
    changed = jax.tree.map(lambda x: x, tree)
    leaf = jax.tree.leaves(changed["params"])[0]
    bumped = jax.device_put(np.asarray(leaf) + 1.0, leaf.sharding)  # one parameter changed: every device sees it
    changed["params"] = jax.tree.unflatten(jax.tree.structure(changed["params"]),
                                           [bumped, *jax.tree.leaves(changed["params"])[1:]])  # fmt: skip
    assert np.all(np.asarray(digest(changed)) != first)
    # A replicated leaf whose copy on one device differs is still found.
    x = jnp.zeros((3,))
    odd = jax.make_array_from_single_device_arrays(
        (3,), parallel.replicated(mesh),
        [jax.device_put(np.full(3, float(d.id == 2), np.float32), d) for d in mesh.devices.flat],
    )  # fmt: skip
    assert x.shape == odd.shape
    assert len(parallel.replica_digest_mismatches(digest, {**tree, "odd": odd}, mesh)) == 1


# The library trainer: a user's own model, with a list of blocks (gathered one at a time) and without.


MADE: list[bool] = []  # per Stack made: whether its parameters were being traced (not values on a device)


class Stack(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, blocks: bool):
        self.inp = nnx.Linear(2, 13, rngs=rngs)
        MADE.append(isinstance(self.inp.kernel[...], jax.core.Tracer))
        layers = [nnx.Linear(13, 13, rngs=rngs) for _ in range(3)]
        self.layers = nnx.List(layers) if blocks else None
        self.mid = None if blocks else layers[0]
        self.out = nnx.Linear(13, 1, rngs=rngs)

    def __call__(self, x):
        x = nnx.gelu(self.inp(x))
        for layer in self.layers if self.layers is not None else [self.mid]:
            x = x + nnx.gelu(layer(x))
        return self.out(x)[:, 0]


def fit(run_dir, blocks, *extra):
    cfg = jdp.load_config(None, [f"train.run_dir={run_dir}", "train.steps=8", "train.batch_size=16",
                                 "train.log_every=1", "train.eval_every=4", "train.ckpt_every=4", "optim.grad_clip=0.5",
                                 "train.progress=false", "train.tensorboard=false", *extra])  # fmt: skip
    opt = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2))
    trainer = jdp.Trainer(lambda: Stack(nnx.Rngs(0), blocks), mse, opt, data(256, 0), cfg, eval_data=data(40, 1))
    return trainer.fit()


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("blocks", [True, False], ids=["with-blocks", "without-blocks"])
def test_the_library_trainer_runs_a_users_model_under_fsdp_as_under_ddp(tmp_path, blocks):
    MADE.clear()
    fit(tmp_path / "ddp", blocks, "parallel.strategy=ddp", "train.grad_accum=2")
    assert not all(MADE)  # ddp makes the model as it is, whole on a device
    MADE.clear()
    fit(tmp_path / "fsdp", blocks, "parallel.strategy=fsdp", "train.grad_accum=2")
    # fsdp makes it only inside compiled functions (its shapes, then each device's rows): never whole on a device
    assert MADE and all(MADE)
    a, b = metrics(tmp_path / "ddp"), metrics(tmp_path / "fsdp")
    assert [r["step"] for r in a] == [r["step"] for r in b] and len(a) >= 8
    for x, y in zip(a, b, strict=True):
        for key in ("loss", "grad_norm", "eval_loss"):
            if key in x:
                assert y[key] == pytest.approx(x[key], rel=1e-5), (key, x, y)
    # the summaries' parameter digests are of the parameters themselves: equal fingerprints to rounding
    fa = json.loads((tmp_path / "ddp" / "summary.json").read_text())["params_fingerprint"]
    fb = json.loads((tmp_path / "fsdp" / "summary.json").read_text())["params_fingerprint"]
    assert fa.keys() == fb.keys()
    for k in fa:
        np.testing.assert_allclose(fa[k], fb[k], rtol=1e-4, atol=1e-5)
    # A checkpoint of the fsdp run continues under ddp (and back), as the uninterrupted run.
    moved = tmp_path / "moved"
    shutil.copytree(tmp_path / "fsdp", moved)
    shutil.rmtree(moved / "checkpoints" / "8")
    (moved / "summary.json").unlink()
    fit(moved, blocks, "parallel.strategy=ddp", "train.grad_accum=2")
    c = {r["step"]: r for r in metrics(moved) if "loss" in r}
    for r in b:
        if "loss" in r and r["step"] > 4:
            assert c[r["step"]]["loss"] == pytest.approx(r["loss"], rel=1e-5)


# Real processes: `jdp train` and `jdp launch`, as a user runs them.

FSDP = ["parallel.strategy=fsdp"]
HSDP = ["parallel.strategy=hsdp", "parallel.shard_size=2"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return {**os.environ, "JDP_CACHE": str(tmp_path_factory.mktemp("cache")), "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def runs(reference_runs, made_once, env):
    """Uninterrupted 8-step runs, checkpointing every 4 steps: fsdp and ddp on 1 process x 4 devices; hsdp on 2
    processes x 2 devices through `jdp launch`, each process's 2 devices a group (a "node"), as hsdp is meant to run
    (the process layout gives the same global batches: tests/test_multiprocess.py)."""
    got = {name: reference_runs(name, extra) for name, extra in (("fsdp", FSDP), ("ddp", ["parallel.strategy=ddp"]))}
    got["hsdp"] = made_once("fsdp-hsdp-2x2", lambda d: run(d, {**env}, (2, 2), ["train.steps=8", "train.ckpt_every=4",
                                                                                   *HSDP]))  # fmt: skip
    return got


@pytest.mark.slow
def test_fsdp_hsdp_and_ddp_runs_agree_step_by_step(runs):
    """`jdp train` under fsdp (1 x 4) and `jdp launch` under hsdp (2 processes x 2 devices), AdamW with clipping: ddp's
    loss and gradient norm every step, and its final parameters. fsdp on 2 processes: the 2-process continuation
    below; zero1 on 2 processes: tests/test_zero1.py's; SGD's momentum and grad_accum under each: in-process above."""
    for name in ("fsdp", "hsdp"):
        assert close(losses(runs["ddp"]), losses(runs[name])) and len(losses(runs[name])) == 8, name
        assert close(grad_norms(runs["ddp"]), grad_norms(runs[name])), name
        want, got = summary(runs["ddp"])["params_fingerprint"], summary(runs[name])["params_fingerprint"]
        assert want.keys() == got.keys()
        for key, a in want.items():
            assert np.allclose(a, got[key], rtol=1e-5, atol=1e-6), (name, key)
    record = json.loads((runs["fsdp"] / "checkpoints" / "8" / "record" / "metadata").read_text())
    assert record["optimizer_layout"]["rows"] is True and record["param_shapes"]


def grad_norms(run_dir) -> dict:
    return {r["step"]: r["grad_norm"] for r in metrics(run_dir) if "grad_norm" in r}


# Each strategy's checkpoint read by another (ddp's by fsdp, fsdp's by zero1, hsdp's by fsdp), and across device and
# process counts (fsdp 1 x 4 to 2 processes x 1, hsdp 2 x 2 to 1 x 4). fsdp's read by ddp: zero1 reads it the same way
# (the parameters whole on every device); zero1's by ddp and across processes: tests/test_zero1.py.
@pytest.mark.slow
@pytest.mark.parametrize(
    "written_by, layout, strategy",
    [("ddp", (1, 4), "fsdp"), ("fsdp", (1, 4), "zero1"), ("fsdp", (2, 1), "fsdp"), ("hsdp", (1, 4), "fsdp")],
    ids=["ddp-to-fsdp", "fsdp-to-zero1", "fsdp-x4-to-2-processes-x1", "hsdp-2x2-to-fsdp-x4"],
)  # fmt: skip
def test_checkpoint_continues_under_another_strategy_or_device_count(runs, env, tmp_path, written_by, layout, strategy):
    d = tmp_path / "run"
    shutil.copytree(runs[written_by], d)
    shutil.rmtree(d / "checkpoints" / "8")  # continue from step 4
    (d / "summary.json").unlink()
    out = run(d, env, layout, ["train.steps=8", "train.ckpt_every=4", f"parallel.strategy={strategy}"])
    assert "resuming from the checkpoint at step 4" in out.stdout
    assert "optimizer state moved from" in out.stdout
    assert close(losses(runs[written_by]), losses(d))  # steps 5-8 as the uninterrupted run's, to rounding


@pytest.mark.slow
def test_fsdp_sigkill_then_resume_is_bit_identical(runs, env, tmp_path):
    killed_at_save_then_resumed(tmp_path / "killed", env, ["train.steps=8", "train.ckpt_every=4", *FSDP], runs["fsdp"])


@pytest.mark.slow
def test_generate_and_export_read_an_fsdp_checkpoint(runs):
    """What `jdp generate` and `jdp export` load from an fsdp run (load_run: the model alone, each tensor read cut to
    its own shape) is bit for bit the parameters the run ended with; a 4-device fsdp checkpoint onto one device."""
    from jdp.generate import load_run
    from jdp.metrics import params_sha256

    cfg, model, _, step = load_run(runs["fsdp"])
    params = nnx.state(model, nnx.Param)
    assert step == 8 and {d.id for x in jax.tree.leaves(params) for d in x.sharding.device_set} == {0}
    assert params_sha256(params) == summary(runs["fsdp"])["params_sha256"]


def test_an_hf_import_under_fsdp_places_each_devices_rows_straight_from_the_host():
    """An import's tensors are host arrays read from the files: under fsdp each device receives its own rows of each
    one (an explicit transfer per shard), never the whole tensor first (jit would move it whole, implicitly, onto
    the default device: the guard below refuses that)."""
    from test_hf import imported

    model, _ = imported()
    host = [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    mesh = parallel.make_mesh(jax.devices()[:4])
    with jax.transfer_guard_host_to_device("disallow"):
        _, state = parallel.init_state(model, optax.adamw(1e-3), mesh, "fsdp")
    for x, want, shape in zip(jax.tree.leaves(state.params), host, state.shapes, strict=True):
        rows = -(-shape[0] // 4)
        assert [s.data.shape[0] for s in x.addressable_shards] == [rows] * 4
        np.testing.assert_array_equal(np.asarray(x)[: shape[0]], want)
        assert not np.any(np.asarray(x)[shape[0] :])


def test_accumulating_unsharded_plans_whole_gradients_and_one_scatter_a_step():
    from jdp.parallel.costs import Buckets
    from jdp.parallel.strategies import fsdp, hsdp

    params = {"w": jax.ShapeDtypeStruct((10, 8), jnp.float32), "b": jax.ShapeDtypeStruct((6,), jnp.float32)}
    whole, rows = 4 * (80 + 6), 4 * (12 * 8 + 8) // 4  # bytes: every gradient whole; one device's padded rows
    sharded = fsdp.state_bytes(params, None, optax.adamw(1e-3), 4, 2)
    unsharded = fsdp.state_bytes(params, None, optax.adamw(1e-3), 4, 2, accumulate_unsharded=True)
    assert (sharded.accumulator, unsharded.accumulator) == (rows, whole)
    buckets = Buckets((whole,), (whole,), "float32")
    for module, extra in ((fsdp, {}), (hsdp, {"shard_size": 2})):
        for once in (False, True):
            traffic = module.traffic(buckets, 4, 2, accumulate_unsharded=once, **extra)
            reductions = [c for c in traffic.collectives if c.kind in ("reduce-scatter", "all-reduce")]
            assert all(len(c.nbytes) == (1 if once else 2) for c in reductions), (module, once, reductions)
            assert all((c.overlaps == "") == once for c in reductions)


@pytest.mark.parametrize("strategy", ["fsdp", "hsdp"])
def test_jdp_allreduce_lists_each_units_gathers_and_scatters_adding_up_to_the_parameters(strategy):
    """`jdp allreduce` on 4 devices (hsdp: 2 groups of 2): one reduce-scatter per unit (the 2 blocks, the embedding,
    the final norm, the positions) carrying the padded gradient bytes once, all-gathers carrying the parameters
    once for the forward and the blocks once more for backward (resharding; JAX 0.10 merges that one), and under
    hsdp the gradient shards all-reduced across the groups: half the padded bytes."""
    from jdp.config import load_config
    from jdp.hlo import all_reduce_report

    extra = ["parallel.shard_size=2"] if strategy == "hsdp" else []
    small = ["model.n_layers=2", "model.d_model=64", "model.n_heads=2", "train.batch_size=8", "data.seq_len=32"]
    cfg = load_config("tiny", [*small, f"parallel.strategy={strategy}", *extra])
    text, numbers = all_reduce_report(cfg)
    padded = numbers["padded_parameter_bytes"]
    assert numbers["gradient_collective"] == "reduce-scatter" and numbers["gradient_reduce_scatters"] == 5
    assert numbers["gradient_bytes_total"] == padded, text
    shards = 2 if strategy == "hsdp" else 4
    model = nnx.eval_shape(lambda: GPT(cfg.model, nnx.Rngs(0)))
    blocks = sum(4 * -(-x.shape[0] // shards) * shards * math.prod(x.shape[1:])
                 for x in jax.tree.leaves(nnx.state(model.blocks, nnx.Param)))  # fmt: skip
    again = blocks if jax.__version_info__ >= (0, 11) else 0
    assert numbers["parameter_all_gathers"] == 5 + (2 if again else 0)
    assert numbers["parameter_gather_bytes_total"] == padded + again, text
    across = [b for b in numbers["other_bytes"] if b > 64]
    assert sum(across) == (padded // 2 if strategy == "hsdp" else 0), text
    assert "reduce-scatter" in text and "all-gather" in text
