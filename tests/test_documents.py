"""Attention within documents (data.document_attention=within): segment ids and positions from the end-of-document
tokens, and a packed window's loss equal to its documents' losses run one by one, for the GPT and the Llama family,
on the blocked einsum path and through jax.nn.dot_product_attention."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jdp.config import ModelConfig, load_config
from jdp.data.tokens import documents
from jdp.lm import train
from jdp.models import make_model
from jdp.models.common import lm_loss

EOD = 256


def test_segments_and_positions_restart_at_each_end_of_document_token():
    inputs = np.array([[5, 6, EOD, 7, 8, 9, EOD, 1], [EOD, 1, 2, 3, 4, 5, 6, 7]], np.int32)
    out = documents({"inputs": inputs, "targets": inputs, "weights": np.ones(inputs.shape, np.float32)}, EOD)
    assert out["segments"].tolist() == [[0, 0, 1, 1, 1, 1, 2, 2], [1, 1, 1, 1, 1, 1, 1, 1]]
    assert out["positions"].tolist() == [[0, 1, 0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 4, 5, 6, 7]]


def packed_and_alone(L: int, seed: int = 0):
    """A window of L+1 tokens packing three documents, each after an end-of-document token (the last one cut by
    the window's end), and each document as a batch of its own: [EOD, its tokens] -> [its tokens, next]."""
    rng = np.random.default_rng(seed)
    lengths = [L // 4, L // 3]
    docs = [rng.integers(0, 256, n) for n in lengths]
    docs.append(rng.integers(0, 256, L + 1 - sum(n + 1 for n in lengths) - 1))
    stream = np.concatenate([np.concatenate([[EOD], d]) for d in docs]).astype(np.int32)
    assert len(stream) == L + 1
    packed = {"inputs": stream[None, :-1], "targets": stream[None, 1:], "weights": np.ones((1, L), np.float32)}
    alone, start = [], 0
    for d in docs:  # its EOD and its tokens, their targets up to the next EOD (the last one cut at L)
        end = min(start + len(d) + 1, L)
        alone.append({"inputs": stream[None, start:end], "targets": stream[None, start + 1 : end + 1],
                      "weights": np.ones((1, end - start), np.float32)})  # fmt: skip
        start = end
    return packed, alone


@pytest.mark.parametrize("arch", ["gpt", "llama"])
@pytest.mark.parametrize("kind", ["einsum", "xla"])
def test_a_packed_windows_loss_is_its_documents_losses_run_one_by_one(arch, kind):
    L = 128  # the einsum path's two query blocks of 64
    cfg = ModelConfig(vocab_size=320, max_seq_len=L, d_model=64, n_layers=2, n_heads=4, attention=kind, arch=arch)
    if arch == "llama":
        cfg = dataclasses.replace(cfg, n_kv_heads=2)  # grouped-query attention, rotary positions
    model = make_model(cfg, nnx.Rngs(0))
    packed, alone = packed_and_alone(L)
    within = documents(packed, EOD)
    total, count = lm_loss(model, {k: jnp.asarray(v) for k, v in within.items()})
    one_by_one = [lm_loss(model, {k: jnp.asarray(v) for k, v in doc.items()}) for doc in alone]
    assert float(count) == sum(float(c) for _, c in one_by_one) == L
    expected = sum(float(s) for s, _ in one_by_one)
    assert abs(float(total) - expected) <= 1e-5 * abs(expected), (float(total), expected)
    # today's default (attention across the window, positions from its start) computes something else: the logits
    # of every document but the first differ by far more than the rounding the equality above allows
    inputs = jnp.asarray(packed["inputs"])
    first = len(alone[0]["inputs"][0])
    gap = jnp.abs(model(inputs) - model(inputs, jnp.asarray(within["segments"]), jnp.asarray(within["positions"])))
    assert float(gap[:, :first].max()) < 1e-5 < 1e-3 < float(gap[:, first:].max())


def test_jdp_train_within_documents_trains_and_evaluates(tmp_path):
    """Short documents (several to a window): the run trains and evaluates, and computes something else than
    attention across the window does."""
    rng = np.random.default_rng(0)
    source = tmp_path / "short.jsonl"
    source.write_text("".join(json.dumps({"text": " ".join(["ab", "cde", "f"][i] for i in rng.integers(0, 3, n))}) + "\n"
                              for n in rng.integers(3, 12, 400)))  # fmt: skip
    cfg = load_config("tiny", ["train.steps=4", "model.n_layers=1", "model.d_model=64", "train.batch_size=8",
                               "data.seq_len=64", "model.max_seq_len=64", "data.val_tokens=512", "train.progress=false",
                               f"data.source={source}", f"data.cache_dir={tmp_path / 'cache'}",
                               "data.document_attention=within", f"train.run_dir={tmp_path / 'run'}"])  # fmt: skip
    across = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, document_attention="across"),
                                 train=dataclasses.replace(cfg.train, run_dir=str(tmp_path / "across")))  # fmt: skip
    got, base = train(cfg), train(across)
    assert jax.device_count() == 4
    assert np.isfinite(got["loss"]) and np.isfinite(got["eval_loss"])
    assert abs(got["loss"] - base["loss"]) > 1e-4 and abs(got["eval_loss"] - base["eval_loss"]) > 1e-4
