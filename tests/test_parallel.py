"""The data-parallel step: N devices compute exactly what one device computes on the same global batch."""

import functools

import jax
import numpy as np
import pytest
from flax import nnx

from jdp import parallel
from jdp.config import ModelConfig, OptimConfig
from jdp.hlo import all_reduces, compiled_text
from jdp.models.common import lm_loss
from jdp.models.gpt import GPT
from jdp.optim import make_optimizer

CFG = ModelConfig(vocab_size=64, max_seq_len=16, d_model=32, n_layers=2, n_heads=4)
B, L = 8, 16


def make_batch(seed=0, uneven_padding=False):
    rng = np.random.default_rng(seed)
    batch = {
        "inputs": rng.integers(0, CFG.vocab_size, (B, L)).astype(np.int32),
        "targets": rng.integers(0, CFG.vocab_size, (B, L)).astype(np.int32),
        "weights": np.ones((B, L), np.float32),
    }
    if uneven_padding:
        # Device 0's rows (0-1 of 8 on 4 devices) are almost all padding, device 3's not at all, and
        # rows in between are masked at random: a mean of per-device means would weight these wrongly.
        batch["weights"][0, 2:] = 0
        batch["weights"][1, :] = 0
        batch["weights"][2:6] = rng.random((4, L)) > 0.5
    return batch


def rel_diff(a, b) -> float:
    """Largest, over leaves, of |a - b| / |a| in the Frobenius norm."""
    worst = 0.0
    for x, y in zip(jax.tree.leaves(jax.device_get(a)), jax.tree.leaves(jax.device_get(b)), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        worst = max(worst, float(np.linalg.norm(x - y) / max(np.linalg.norm(x), 1e-30)))
    return worst


def params_close(a, b, rtol=1e-5, atol=2e-6) -> float:
    """Largest elementwise excess of |a - b| over rtol * |a| + atol (<= 0: close).

    atol is 0.2% of one AdamW step (lr 1e-3): Adam turns a gradient that happens to be near zero (4 orders
    of magnitude below its neighbours) into a step whose size follows the rounding of that gradient, and
    1 and N devices sum in different orders (JAX 0.10 on an Intel Xeon, Sapphire Rapids, differed by 1.06e-6
    with uneven padding: 0.1% was too tight there). A data-parallel bug (wrong rows, wrong scale) moves
    parameters by whole steps.
    """
    worst = -np.inf
    for x, y in zip(jax.tree.leaves(jax.device_get(a)), jax.tree.leaves(jax.device_get(b)), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        worst = max(worst, float(np.max(np.abs(x - y) - (rtol * np.abs(x) + atol))))
    return worst


def setup(n_devices, optim="adamw", grad_accum=1):
    mesh = parallel.make_mesh(jax.devices()[:n_devices])
    opt, schedule = make_optimizer(OptimConfig(name=optim, lr=1e-2 if optim == "sgd" else 1e-3, warmup_steps=0), 10)
    graphdef, state = parallel.init_state(GPT(CFG, nnx.Rngs(0)), opt, mesh)
    step = parallel.make_train_step(graphdef, lm_loss, opt, mesh, grad_accum, schedule)
    return mesh, graphdef, state, step


@functools.cache
def run(n_devices, optim="adamw", grad_accum=1, steps=4, uneven_padding=False):
    mesh, graphdef, state, step = setup(n_devices, optim, grad_accum)
    history = []
    for i in range(steps):
        state, metrics = step(state, parallel.shard_batch(make_batch(i, uneven_padding), mesh))
        history.append({k: float(v) for k, v in metrics.items()})
    return state, history


@functools.cache
def grads(n_devices, uneven_padding, grad_accum=1):
    mesh, graphdef, state, _ = setup(n_devices)
    grad_fn = parallel.make_grad_fn(graphdef, lm_loss, mesh, grad_accum)
    return grad_fn(state, parallel.shard_batch(make_batch(0, uneven_padding), mesh))


@pytest.mark.parametrize("uneven_padding", [False, True])
@pytest.mark.parametrize("n_devices", [2, 4])
def test_gradients_match_one_device(n_devices, uneven_padding):
    g1, loss1, w1 = grads(1, uneven_padding)
    gn, lossn, wn = grads(n_devices, uneven_padding)
    assert float(w1) == float(wn)
    assert abs(float(loss1) - float(lossn)) <= 1e-5 * abs(float(loss1))
    # A summed instead of averaged gradient would be n_devices times too large here.
    assert rel_diff(g1, gn) <= 1e-5


def test_loss_is_global_token_weighted_mean():
    batch = make_batch(0, uneven_padding=True)
    _, loss, weight = grads(4, uneven_padding=True)
    model = GPT(CFG, nnx.Rngs(0))
    logits = np.asarray(model(batch["inputs"]), np.float64)
    logp = (
        logits
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - logits.max(-1, keepdims=True)
    )
    nll = -np.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
    expected = (nll * batch["weights"]).sum() / batch["weights"].sum()
    assert float(weight) == batch["weights"].sum()
    assert abs(float(loss) - expected) <= 1e-5 * expected


@pytest.mark.parametrize("uneven_padding", [False, True])
@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_training_matches_one_device(optim, uneven_padding):
    state1, hist1 = run(1, optim, uneven_padding=uneven_padding)
    state4, hist4 = run(4, optim, uneven_padding=uneven_padding)
    for a, b in zip(hist1, hist4, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * abs(a["grad_norm"]), (a, b)
    assert params_close(state1.params, state4.params) <= 0
    assert rel_diff(state1.opt_state, state4.opt_state) <= 1e-5
    assert hist4[-1]["loss"] < hist4[0]["loss"]


def test_replicas_bit_identical_after_training():
    state, _ = run(4, "adamw", steps=5, uneven_padding=True)
    for tree in (state.params, state.opt_state):
        leaves = jax.tree.leaves(tree)
        assert all(len(leaf.addressable_shards) == 4 for leaf in leaves)
        assert parallel.replica_mismatches(tree) == []


def test_replica_mismatch_is_detected_and_named():
    mesh = parallel.make_mesh(jax.devices()[:4])
    good = np.arange(6, dtype=np.float32)
    shards = [jax.device_put(good + (i == 2), d) for i, d in enumerate(mesh.devices.flat)]
    arr = jax.make_array_from_single_device_arrays((6,), parallel.replicated(mesh), shards)
    problems = parallel.replica_mismatches({"w": arr})
    assert len(problems) == 1, problems
    assert "['w']" in problems[0] and str(mesh.devices.flat[2]) in problems[0], problems


def test_grad_accum_equals_one_big_batch():
    g1, loss1, _ = grads(4, uneven_padding=True, grad_accum=1)
    g2, loss2, _ = grads(4, uneven_padding=True, grad_accum=2)
    assert abs(float(loss1) - float(loss2)) <= 1e-5 * abs(float(loss1))
    assert rel_diff(g1, g2) <= 1e-5
    state1, hist1 = run(4, "adamw", grad_accum=1, uneven_padding=True)
    state2, hist2 = run(4, "adamw", grad_accum=2, uneven_padding=True)
    assert all(abs(a["loss"] - b["loss"]) <= 1e-5 * a["loss"] for a, b in zip(hist1, hist2, strict=True))
    assert params_close(state1.params, state2.params) <= 0


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_one_gradient_all_reduce_per_step_in_compiled_hlo(grad_accum):
    mesh, graphdef, state, step = setup(4, grad_accum=grad_accum)
    hlo = compiled_text(step, state, parallel.shard_batch(make_batch(0), mesh))
    reduces = all_reduces(hlo)
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(state.params))
    assert reduces, "no all-reduce in the compiled step"
    # Nothing is reduced per micro-batch: no all-reduce inside the accumulation loop...
    assert not [r for r in reduces if r.in_loop], [r for r in reduces if r.in_loop]
    # ...and, outside it, every gradient element is reduced exactly once (plus the loss and weight scalars).
    total = sum(r.bytes for r in reduces)
    assert param_bytes <= total <= param_bytes + 64, (total, param_bytes, reduces)
    if grad_accum > 1:
        # The accumulation really is a loop in the compiled step (so the check above means something).
        assert "while(" in hlo or " while" in hlo


def test_all_reduce_parser_sees_reduction_inside_a_loop():
    # A deliberately wrong step that reduces every micro-batch: the HLO check above must catch it.
    mesh = parallel.make_mesh(jax.devices()[:4])
    from jax.sharding import PartitionSpec as P

    def per_micro(x):
        def body(carry, xi):
            return carry + jax.lax.psum(xi, "data"), None

        return jax.lax.scan(body, jax.numpy.zeros(x.shape[1:], x.dtype), x)[0]

    f = jax.jit(jax.shard_map(per_micro, mesh=mesh, in_specs=P(None, "data"), out_specs=P("data")))
    x = jax.device_put(np.ones((3, 8), np.float32), jax.sharding.NamedSharding(mesh, P(None, "data")))
    reduces = all_reduces(compiled_text(f, x))
    assert reduces and all(r.in_loop for r in reduces)


@pytest.mark.parametrize("strategy, whole", [("ddp", 2.0), ("zero1", 1.5)])
def test_the_compiled_step_updates_the_optimizer_state_in_place(strategy, whole):
    """A model whose state outweighs its activations (6 x 256, 32 tokens a row): the compiled step's temporaries are
    its gradients and the bucket being reduced (ddp: both whole, 2 x the parameter bytes; zero1: the gradients
    and the scattered slices, 1.5 x on 4 devices) beside the activations, and no copy of AdamW's moments. A
    jnp.where of the new optimizer state and the old (the skip guard as it was) made XLA copy both moments at the
    start of the step: 3.44 x under ddp, 2.34 x under zero1 (JAX 0.12, XLA:CPU)."""
    from jdp import plan
    from jdp.build import batch_spec, build
    from jdp.config import load_config

    cfg = load_config("tiny", ["model.n_layers=6", "model.d_model=256", "data.seq_len=32", "model.max_seq_len=32",
                               "train.batch_size=8", f"parallel.strategy={strategy}"])  # fmt: skip
    mesh = parallel.make_mesh(jax.devices()[:4])
    b = build(cfg, mesh)
    temp = b.train_step.lower(b.state, batch_spec(cfg, mesh)).compile().memory_analysis().temp_size_in_bytes
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(b.state.params))
    activations = plan.activation_bytes(cfg, 2, fused_attention=False)
    print(f"{strategy}: temporaries {temp / param_bytes:.2f} x the parameter bytes, activations {activations:,}")
    assert temp <= whole * param_bytes + activations, (temp, param_bytes, activations)
