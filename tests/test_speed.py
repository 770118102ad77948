"""Gradient buckets, the bf16 reduction, the DP baseline and the XLA options, read off compiled programs."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from test_parallel import CFG, make_batch, params_close, rel_diff

from jdp import parallel
from jdp.build import build as build_from_config
from jdp.config import OptimConfig, load_config
from jdp.hlo import Collective, _rows, all_reduce_report, all_reduces
from jdp.job.xla import set_xla_flags
from jdp.models.common import lm_loss
from jdp.models.gpt import GPT
from jdp.optim import make_optimizer
from jdp.parallel import strategies
from jdp.parallel.buckets import bucket_plan


def build(n_devices=4, grad_accum=1, **step_kw):
    mesh = parallel.make_mesh(jax.devices()[:n_devices])
    opt, schedule = make_optimizer(OptimConfig(lr=1e-3, warmup_steps=0), 10)
    graphdef, state = parallel.init_state(GPT(CFG, nnx.Rngs(0)), opt, mesh, step_kw.get("strategy", "ddp"))
    step = parallel.make_train_step(graphdef, lm_loss, opt, mesh, grad_accum, schedule, **step_kw)
    return mesh, graphdef, state, step


def plan(graphdef, state, bucket_mb, reduce_dtype="float32", micro_rows=2):
    micro = {k: v[:micro_rows] for k, v in make_batch(0).items()}
    return bucket_plan(graphdef, lm_loss, state.params, state.rest, micro, bucket_mb, reduce_dtype)


def gradient_reduces(step, state, mesh, hlo="compiled"):
    lowered = step.lower(state, parallel.shard_batch(make_batch(0), mesh))
    text = lowered.compile().as_text() if hlo == "compiled" else lowered.as_text(dialect="hlo")
    return [r for r in all_reduces(text) if r.shapes != ["f32[2]"]]  # not the loss/token pair


@pytest.mark.parametrize("bucket_mb, grad_accum", [(0.0, 1), (0.04, 2), (0.015, 1)])
def test_compiled_all_reduces_follow_bucket_mb(bucket_mb, grad_accum):
    mesh, graphdef, state, step = build(grad_accum=grad_accum, bucket_mb=bucket_mb)
    buckets = plan(graphdef, state, bucket_mb)
    reduces = gradient_reduces(step, state, mesh)
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(state.params))
    # One all-reduce per planned bucket, each exactly the bucket's bytes, none inside the accumulation loop.
    assert sorted(r.bytes for r in reduces) == sorted(b.nbytes for b in buckets), (reduces, buckets)
    assert not [r for r in reduces if r.in_loop]
    assert sum(r.bytes for r in reduces) == param_bytes
    cap = bucket_mb * 2**20
    leaf_bytes = {k: x.nbytes for k, x in enumerate(jax.tree.leaves(state.params))}
    for b in buckets:  # within the cap, unless one gradient alone is larger (DDP's rule)
        assert bucket_mb == 0 or b.nbytes <= cap or len(b.leaves) == 1
        assert bucket_mb == 0 or len(b.leaves) == 1 or b.nbytes - leaf_bytes[b.leaves[-1]] < cap
    if bucket_mb == 0:
        assert len(buckets) == 1
    else:
        assert len(buckets) >= param_bytes / cap - 1


def test_smaller_buckets_mean_more_buckets():
    # The compiled program follows the plan (above); the plan follows bucket_mb.
    mesh, graphdef, state, _ = build()
    counts = [len(plan(graphdef, state, mb)) for mb in (1.0, 0.04, 0.015, 0.005)]
    assert counts == sorted(counts) and counts[0] == 1 and counts[-1] > counts[1] > 1, counts


def test_buckets_go_in_reverse_layer_order():
    mesh, graphdef, state, _ = build()
    names = [n for b in plan(graphdef, state, 0.005) for n in b.names]
    assert names[:2] == ["norm.bias", "norm.scale"] or names[:2] == ["norm.scale", "norm.bias"], names
    last_block = max(i for i, n in enumerate(names) if n.startswith("blocks.1."))
    first_block = min(i for i, n in enumerate(names) if n.startswith("blocks.0."))
    assert last_block < first_block, names  # block 1's gradients are ready (and reduced) before block 0's
    # The tied embedding is used first (lookup) and last (logits): its gradient completes last.
    assert names[-1] == "embed.embedding", names


# A Llama with every parameter kind: grouped-query attention (4 query heads on 2 key/value heads), q/k/v biases.
LLAMA = ["model.n_layers=2", "model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=48"]
LLAMA += ["model.qkv_bias=true", "model.vocab_size=64", "model.max_seq_len=16", "data.seq_len=16", "train.batch_size=8"]
LLAMA_BLOCK = ["attn_norm.scale", "attn.q.kernel", "attn.q.bias", "attn.k.kernel", "attn.k.bias", "attn.v.kernel"]
LLAMA_BLOCK += ["attn.v.bias", "attn.o.kernel", "mlp_norm.scale", "mlp.gate.kernel", "mlp.up.kernel", "mlp.down.kernel"]


def test_llama_buckets_go_in_backward_order_and_are_the_compiled_all_reduces():
    """`jdp allreduce` for the Llama, one gradient per bucket: the buckets are the parameters' first uses in the
    forward pass, reversed (the output and final norm first, the last block before the first, in a block the MLP
    before attention, the embedding last; tied, the embedding still last), and the compiled step all-reduces
    exactly those buckets, none inside a loop."""
    for tied in (False, True):
        cfg = load_config("llama-tiny", [*LLAMA, f"model.tie_embeddings={tied}", "parallel.bucket_mb=0.0001"])
        built = build_from_config(cfg, parallel.make_mesh(jax.devices()[:4]))
        buckets = plan(built.graphdef, built.state, cfg.parallel.bucket_mb)
        forward = ["embed.embedding", *(f"blocks.{i}.{n}" for i in range(2) for n in LLAMA_BLOCK), "norm.scale"]
        forward += [] if tied else ["lm_head.kernel"]
        assert [n for b in buckets for n in b.names] == forward[::-1] and len(buckets) == len(forward)
    text, numbers = all_reduce_report(cfg)  # the tied Llama's
    assert numbers["planned_bucket_bytes"] == [b.nbytes for b in buckets]  # the report's buckets, in this order
    assert numbers["gradient_all_reduces"] == len(buckets) and numbers["in_loop"] == 0
    assert sorted(numbers["gradient_bytes"]) == sorted(b.nbytes for b in buckets)
    assert numbers["gradient_bytes_total"] == numbers["parameter_bytes"]
    assert "gradients: blocks.1.mlp.down.kernel" in text and "gradients: embed.embedding" in text


def test_bfloat16_reduction_halves_the_bytes_and_matches_float32():
    mesh, graphdef, state, step32 = build(bucket_mb=0.02)
    _, _, _, step16 = build(bucket_mb=0.02, reduce_dtype="bfloat16")
    emitted32 = gradient_reduces(step32, state, mesh, hlo="emitted")
    emitted16 = gradient_reduces(step16, state, mesh, hlo="emitted")
    assert all(s.startswith("bf16[") for r in emitted16 for s in r.shapes), emitted16
    assert sum(r.bytes for r in emitted16) * 2 == sum(r.bytes for r in emitted32)
    # The result: the same gradients to bf16 precision, and not bit-equal (the rounding really happened).
    batch = parallel.shard_batch(make_batch(0, uneven_padding=True), mesh)
    g32, loss32, _ = parallel.make_grad_fn(graphdef, lm_loss, mesh, bucket_mb=0.02)(state, batch)
    g16, loss16, _ = parallel.make_grad_fn(graphdef, lm_loss, mesh, bucket_mb=0.02, reduce_dtype="bfloat16")(
        state, batch
    )
    assert float(loss16) == float(loss32)
    assert 0 < rel_diff(g32, g16) <= 8e-3


def test_dp_baseline_matches_ddp():
    histories, finals = {}, {}
    for strategy in ("ddp", "dp"):
        mesh, _, state, step = build(strategy=strategy)
        history = []
        for i in range(4):
            state, metrics = step(state, parallel.shard_batch(make_batch(i, uneven_padding=True), mesh))
            history.append({k: float(v) for k, v in jax.device_get(metrics).items()})
        histories[strategy], finals[strategy] = history, state
    for a, b in zip(histories["ddp"], histories["dp"], strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * a["loss"] and abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4
    assert params_close(finals["ddp"].params, finals["dp"].params) <= 0
    dp = finals["dp"]
    assert int(dp.step) == 4
    # The DP layout: the optimizer state lives on the master only; the parameters were broadcast to all.
    assert {len(x.sharding.device_set) for x in jax.tree.leaves(dp.opt_state)} == {1}
    assert not parallel.replica_mismatches(dp.params)
    assert {len(x.sharding.device_set) for x in jax.tree.leaves(dp.params)} == {4}


def test_xla_flags_added_only_where_the_user_has_not_set_them():
    env = {"XLA_FLAGS": "--xla_gpu_all_reduce_combine_threshold_bytes=123 --xla_force_host_platform_device_count=2"}
    added = set_xla_flags(bucket_mb=25, environ=env)
    assert "--xla_gpu_all_reduce_combine_threshold_bytes=123" in env["XLA_FLAGS"]
    assert not any("all_reduce_combine_threshold" in a for a in added)
    assert f"--xla_gpu_reduce_scatter_combine_threshold_bytes={25 * 2**20}" in added
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in added
    assert set_xla_flags(bucket_mb=25, environ=env) == []  # idempotent
    env = {}
    set_xla_flags(bucket_mb=4, environ=env)
    assert f"--xla_gpu_all_reduce_combine_threshold_bytes={4 * 2**20}" in env["XLA_FLAGS"]
    assert "cpu-all-reduce-combiner" in env["XLA_FLAGS"]  # ddp's buckets stay apart on CPUs
    zero1 = {}
    strategies.get("zero1").set_xla_flags(4, environ=zero1)  # its only all-reduces are scalars: merge them
    assert "cpu-all-reduce-combiner" not in zero1["XLA_FLAGS"] and "all_gather_combine" in zero1["XLA_FLAGS"]


def test_allreduce_command_reports_buckets_summing_to_parameter_bytes(tmp_path):
    small = ["model.n_layers=2", "model.d_model=64", "train.batch_size=8", "data.seq_len=32", "model.max_seq_len=32"]
    out = subprocess.run(
        [sys.executable, "-m", "jdp.cli", "allreduce", "tiny", "--devices", "2", "--json", "parallel.bucket_mb=0.1"]
        + small,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    numbers = json.loads(out.stdout.strip().splitlines()[-1])
    assert numbers["devices"] == 2
    assert numbers["gradient_bytes_total"] == numbers["parameter_bytes"]
    assert numbers["gradient_all_reduces"] == len(numbers["planned_bucket_bytes"]) > 1
    assert sorted(numbers["gradient_bytes"]) == sorted(numbers["planned_bucket_bytes"])
    assert "gradients:" in out.stdout and "blocks.1" in out.stdout
    assert np.all(np.asarray(numbers["gradient_bytes"]) > 0) and numbers["in_loop"] == 0


def test_allreduce_zero1_table_summarises_the_norms_scalars_in_one_readable_row():
    """zero1's norms come from the gradient slices: XLA all-reduces one scalar per parameter and norm, which once
    filled the result column with dozens of `f32[]` and pushed the rest of the row off the table."""
    small = ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "train.batch_size=8", "data.seq_len=32"]
    out = subprocess.run(
        [sys.executable, "-m", "jdp.cli", "allreduce", "tiny", "parallel.strategy=zero1", "--devices", "4"] + small,
        capture_output=True,
        text=True,
        timeout=300,
        # XLA_FLAGS as in a user's shell: none (this process's keep ddp's all-reduces apart)
        env={
            **{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
        },
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("#  kind"))
    rows = [line for line in lines[header + 1 :] if line[:3].strip().isdigit()]
    assert len(rows) == 4, out.stdout  # loss and count, the reduce-scatter, the norms, the all-gather
    loop_at, contents_at = lines[header].index("in a loop"), lines[header].index("contents")
    for row in rows:  # every row keeps the header's columns
        assert row.count("f32[]") <= 1, row
        assert row[loop_at:contents_at].split() in (["no"], ["yes"]), row
        assert row[contents_at - 1] == " " and row[contents_at] != " ", row
    norms = next(row for row in rows if "gradient norms" in row)
    # 12 parameter arrays, each with two norms over the slices: grad_norm and optim.grad_clip's
    assert "24 x f32[]" in norms and "(12 parameters x 2)" in norms, norms


def test_allreduce_table_puts_the_norms_scalar_all_reduces_in_one_row_when_xla_leaves_them_apart():
    """Without XLA's all-reduce combiner (ddp's CPU flags) each partial sum is an all-reduce of its own."""
    found = [Collective("all-reduce", "psum", "main", False, ["f32[2]"], 8)]
    found += [Collective("all-reduce", f"ar.{i}", "main", False, ["f32[]"], 4) for i in range(24)]
    found += [Collective("all-gather", "ag", "main", False, ["f32[4,6704]"], 107_264)]
    rows = _rows(found, {}, {}, n_leaves=12)
    assert len(rows) == 3, rows
    assert rows[0].split()[1:4] == ["all-reduce", "8", "f32[2]"] and rows[0].endswith("loss and token count")
    assert rows[1].split()[:6] == ["2", "all-reduce", "96", "24", "x", "f32[]"], rows[1]
    assert rows[1].endswith(
        "24 partial sums of squares in 24 all-reduces, one per parameter and norm (12 parameters x 2)"
    )
    assert rows[2].split()[0] == "3"


SCRATCH_PROGRAM = """
import resource, sys
from jdp.job import xla
if sys.argv[1] == "keep":
    assert xla.keep_scratch_memory()
import jax, jax.numpy as jnp
# a 16384 x 1024 float32 temporary (64 MB) the cumsum must hold whole (jaxlib 0.12.1 fused tanh(x @ w) @ w.T and
# kept no such block: 32 faults a call either way)
f = jax.jit(lambda x, w: jnp.sum(jnp.cumsum(jnp.tanh(x @ w), axis=0) @ w.T))
x, w = jnp.ones((16384, 64), jnp.float32), jnp.ones((64, 1024), jnp.float32) * 1e-3
f(x, w).block_until_ready()
faults = []
for _ in range(12):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f(x, w).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
# The fewest of 12 calls. Without the settings every call maps the block afresh and faults it all in (about 52,900
# each); with them a call that finds the block still mapped faults nothing. jaxlib >= 0.11 allocates the temporaries
# as several blocks and the heap takes a few calls to settle; on a loaded machine (CI's part not alone) the XLA
# workers' timing can keep it growing for most of the 12 calls (a median of 16,925 once), never all of them.
print(min(faults))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc options: Linux only")
def test_scratch_memory_is_not_faulted_in_again_every_step():
    """Without keep_scratch_memory glibc maps a step's temporaries afresh every call and the kernel faults every
    page in again; with it, the block stays mapped between calls."""
    faults = {}
    for mode in ("default", "keep"):
        env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="")
        out = subprocess.run([sys.executable, "-c", SCRATCH_PROGRAM, mode], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-2000:]
        faults[mode] = int(out.stdout)
    # Measured: about 52,900 page faults per call without, 0 with (the fewest of 12 calls), jaxlib 0.10.2 to 0.12.1.
    assert faults["default"] >= 4096 and faults["keep"] <= faults["default"] / 10, faults
