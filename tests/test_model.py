"""The model: causal, the configured dtypes, the loss it reports."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jdp import attention as attention_module
from jdp.attention import attention, attention_scores, causal_attention, query_blocks
from jdp.config import ModelConfig
from jdp.models.common import count_params, lm_loss
from jdp.models.gpt import GPT

CFG = ModelConfig(vocab_size=64, max_seq_len=16, d_model=32, n_layers=2, n_heads=4)


def test_causal_later_tokens_never_change_earlier_logits():
    model = GPT(CFG, nnx.Rngs(0))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, CFG.vocab_size, (2, 16)).astype(np.int32)
    base = np.asarray(model(tokens))
    for t in (1, 7, 15):
        changed = tokens.copy()
        changed[:, t:] = (changed[:, t:] + 1 + rng.integers(0, 10, changed[:, t:].shape)) % CFG.vocab_size
        out = np.asarray(model(changed))
        np.testing.assert_array_equal(out[:, :t], base[:, :t])
        assert np.abs(out[:, t] - base[:, t]).max() > 1e-4  # and the changed position does change


@pytest.mark.parametrize("L, blocks", [(32, 1), (128, 2), (512, 8)])
def test_blocked_causal_attention_is_full_masked_attention(L, blocks):
    """Query blocks skip only the masked scores: values and gradients match jax's own masked attention."""
    assert query_blocks(L) == blocks
    assert attention_scores(L) == (L // blocks) ** 2 * blocks * (blocks + 1) // 2 <= L * L
    rng = np.random.default_rng(L)
    q, k, v, g = (jnp.asarray(rng.standard_normal((2, 3, L, 8)), jnp.float32) for _ in range(4))

    def reference(q, k, v):  # jax.nn.dot_product_attention is B x L x H x K
        t = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731
        return t(jax.nn.dot_product_attention(t(q), t(k), t(v), is_causal=True, implementation="xla"))

    np.testing.assert_allclose(causal_attention(q, k, v), reference(q, k, v), atol=2e-6)
    grads = [
        jax.grad(lambda *a, f=f: jnp.sum(f(*a) * g), argnums=(0, 1, 2))(q, k, v) for f in (causal_attention, reference)
    ]
    for ours, theirs in zip(*grads, strict=True):
        np.testing.assert_allclose(ours, theirs, atol=2e-5)


def test_blocked_attention_in_bf16_accumulates_in_float32():
    """Grouped-query heads in bf16: every gradient within what bf16 inputs allow of the float32 result (the values'
    gradient sums R query heads and every query per key; accumulated in bf16 it lost 2.6%), as close as XLA's."""
    rng = np.random.default_rng(0)
    q, dy = (jnp.asarray(rng.standard_normal((2, 128, 4, 64)), jnp.float32) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((2, 128, 2, 64)), jnp.float32) for _ in range(2))

    def grads(kind, dtype):
        loss = lambda *a: jnp.sum(attention(*a, kind).astype(jnp.float32) * dy)  # noqa: E731
        return jax.grad(loss, argnums=(0, 1, 2))(*(x.astype(dtype) for x in (q, k, v)))

    with jax.default_matmul_precision("highest"):
        exact = grads("einsum", jnp.float32)
    for kind in ("einsum", "xla"):
        for ours, truth in zip(grads(kind, jnp.bfloat16), exact, strict=True):
            error = float(jnp.abs(ours.astype(jnp.float32) - truth).max() / jnp.abs(truth).max())
            assert error < 0.01, (kind, error)


def test_auto_attention_on_a_gpu_takes_cudnn_for_16_bit_and_names_a_refusal(monkeypatch, capsys):
    """"auto" on a GPU asks for cuDNN's kernel with bf16 (jax's own default there is XLA's); where cuDNN refuses
    (here: there is no cuDNN) it runs XLA's attention and says why, once; float32 goes to XLA's without a word."""
    monkeypatch.setattr(attention_module.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(attention_module, "_warned", set())
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 64, 4, 16)), jnp.bfloat16) for _ in range(3))
    capsys.readouterr()
    for _ in range(2):
        y = attention(q, k, v)
    said = capsys.readouterr().err
    assert said.count("cuDNN's fused attention refused (1, 64, 4, 16)") == 1 and "cuDNN is not detected" in said, said
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(attention(q, k, v, "xla"), np.float32))
    q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
    y32 = attention(q32, k32, v32)
    assert capsys.readouterr().err == ""
    np.testing.assert_array_equal(y32, attention(q32, k32, v32, "xla"))


def test_compute_dtype_separate_from_parameter_dtype():
    model = GPT(ModelConfig(**{**CFG.__dict__, "dtype": "bfloat16"}), nnx.Rngs(0))
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert all(p.dtype == jnp.float32 for p in params)
    logits = model(jnp.zeros((1, 8), jnp.int32))
    assert logits.dtype == jnp.float32  # logits are upcast for the loss
    # The matmuls run in bfloat16: the jaxpr's dot_generals take bf16 operands.
    jaxpr = jax.make_jaxpr(lambda t: model(t))(jnp.zeros((1, 8), jnp.int32))
    dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert dots and all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars)


def test_output_projection_is_tied_to_embedding():
    model = GPT(CFG, nnx.Rngs(0))
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))]
    assert sum("embedding" in n for n in names) == 1
    d, v, n_layers = CFG.d_model, CFG.vocab_size, CFG.n_layers
    per_layer = 3 * d * d + d * d + 2 * 4 * d * d + 4 * d  # qkv, out, mlp, two layer norms
    assert count_params(model) == v * d + CFG.max_seq_len * d + n_layers * per_layer + 2 * d


def test_loss_returns_weighted_sum_and_weight():
    model = GPT(CFG, nnx.Rngs(0))
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (2, 8)), jnp.int32)
    targets = jnp.asarray(rng.integers(0, CFG.vocab_size, (2, 8)), jnp.int32)
    weights = jnp.zeros((2, 8)).at[0, :3].set(1.0).at[1, 5].set(2.0)
    total, weight = lm_loss(model, {"inputs": tokens, "targets": targets, "weights": weights})
    logp = jax.nn.log_softmax(np.asarray(model(tokens), np.float64))
    nll = -np.take_along_axis(np.asarray(logp), np.asarray(targets)[..., None], -1)[..., 0]
    assert float(weight) == 5.0
    assert np.isclose(float(total), (nll * np.asarray(weights)).sum(), rtol=1e-5)


def test_gpt2_small_config_is_the_124m_model_and_fits_1_to_8_devices():
    from jdp.config import load_config, validate
    from jdp.metrics import flops_per_token

    cfg = load_config("gpt2-small", ["train.run_dir=unused"])
    abstract = nnx.eval_shape(lambda: GPT(cfg.model, nnx.Rngs(0)))  # no memory is allocated
    n = count_params(abstract)
    assert 123e6 < n < 125e6, n  # GPT-2 small: 124M (without projection biases: 123.7M)
    for devices in (1, 2, 4, 8):
        d = validate(cfg, devices)
        assert d.tokens_per_step == 512 * 1024 and d.micro_batch * cfg.train.grad_accum * devices == 512
    # 6 x matmul parameters (12 layers x 12 D^2, plus the tied V x D output) + causal attention 6 x layers x L x D.
    matmul = 12 * 12 * 768**2 + 50304 * 768
    assert flops_per_token(cfg) == 6 * matmul + 6 * 12 * 1024 * 768 == 798_031_872
