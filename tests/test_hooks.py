"""Communication hooks (DDP's register_comm_hook) and PowerSGD: replicas stay identical, the bytes shrink by the
rank's factor, error feedback recovers what compression leaves out, and the state survives kills and resumes."""

import math
import os
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from test_faults import ckpt_steps, losses, run, summary
from test_library import readme_block, run_on_four_devices
from test_zero1 import CFG, make_batch, optimizer

from jdp import parallel
from jdp.config import ConfigError, load_config, validate
from jdp.hlo import collectives, compiled_text
from jdp.models.common import lm_loss
from jdp.models.gpt import GPT
from jdp.parallel.comm_hooks import GradBucket, Mean, PowerSGD


def setup(n_devices, hook, bucket_mb=0.005):
    mesh = parallel.make_mesh(jax.devices()[:n_devices])
    opt, schedule = optimizer()
    graphdef, state = parallel.init_state(GPT(CFG, nnx.Rngs(0)), opt, mesh, comm_hook=hook)
    step = parallel.make_train_step(
        graphdef, lm_loss, opt, mesh, 1, schedule, bucket_mb=bucket_mb, comm_hook=hook
    )  # fmt: skip
    return mesh, state, step


def copies(x) -> list[np.ndarray]:
    return [np.asarray(s.data) for s in x.addressable_shards]


def test_powersgd_keeps_replicas_bit_identical_on_four_devices():
    hook = PowerSGD(rank=2, start_step=2)
    mesh, state, step = setup(4, hook)
    plain_mesh, plain, plain_step = setup(4, None)
    for i in range(6):
        batch = make_batch(i, uneven_padding=True)
        state, metrics = step(state, parallel.shard_batch(batch, mesh))
        plain, plain_metrics = plain_step(plain, parallel.shard_batch(batch, plain_mesh))
        if i < 2:  # warm-up: plain all-reduces, the same training as without the hook
            assert abs(float(metrics["loss"]) - float(plain_metrics["loss"])) < 1e-6
        assert np.isfinite(float(metrics["loss"]))
    assert parallel.replica_mismatches(state.params) == []
    assert int(metrics["skipped"]) == 0
    # Q: the same on every device (an all-reduce result); error feedback: each device's own.
    compressed = [k for k, v in state.comm.items() if "q" in v]
    assert len(compressed) >= 4
    for k in compressed:
        q, error = copies(state.comm[k]["q"]), copies(state.comm[k]["error"])
        assert all(np.array_equal(q[0], other) for other in q[1:])
        assert not all(np.array_equal(error[0], other) for other in error[1:])
    # Compression changed the training after the warm-up.
    assert abs(float(metrics["loss"]) - float(plain_metrics["loss"])) > 1e-6


def test_compressible_matrices_are_the_ones_the_rank_shrinks():
    hook = PowerSGD(rank=4)
    assert hook.compresses("w", (64, 256)) and hook.matrix((8, 4, 16)) == (8, 64)
    assert not hook.compresses("b", (256,))  # 1-D: biases, norm scales
    assert not hook.compresses("w", (12, 12))  # 144 numbers would become 96: less than min_ratio=2 smaller
    assert hook.wire_elements([("w", (64, 256)), ("b", (256,))]) == 4 * (64 + 256) + 256
    named = PowerSGD(rank=4, uncompressed=("embed",))
    assert not named.compresses("embed.embedding", (320, 128)) and named.compresses("blocks.0.mlp.up", (128, 512))
    assert named.wire_elements([("embed.embedding", (320, 128))]) == 320 * 128


def test_compiled_powersgd_step_all_reduces_r_m_plus_n_numbers_per_matrix():
    """For an m x n gradient the wire carries r(m + n) numbers instead of mn; the rest travel whole. (In several
    buckets, as the other tests here: the plain step is theirs, compiled once.)"""
    rank = 2
    hook = PowerSGD(rank=rank, start_step=0)
    totals = {}
    for name, h in (("plain", None), ("powersgd", hook)):
        mesh, state, step = setup(4, h)
        text = compiled_text(step, state, parallel.shard_batch(make_batch(0), mesh))
        totals[name] = sum(c.bytes for c in collectives(text) if c.kind == "all-reduce")
    params = nnx.state(GPT(CFG, nnx.Rngs(0)), nnx.Param)
    shapes = [x.shape for x in jax.tree.leaves(params)]
    matrices = [s for s in shapes if len(s) >= 2 and s[0] * math.prod(s[1:]) >= 2 * rank * (s[0] + math.prod(s[1:]))]
    assert len(matrices) >= 4
    dense = 4 * sum(math.prod(s) for s in shapes)
    loss_and_weight = 4 * 2
    assert totals["plain"] == dense + loss_and_weight
    saved = 4 * sum(s[0] * math.prod(s[1:]) - rank * (s[0] + math.prod(s[1:])) for s in matrices)
    assert totals["powersgd"] == totals["plain"] - saved
    named = list(zip(parallel.param_names(params), shapes, strict=True))
    assert totals["powersgd"] == 4 * hook.wire_elements(named) + loss_and_weight
    print(f"all-reduce bytes per step: {totals['plain']:,} plain, {totals['powersgd']:,} with PowerSGD rank {rank}")


def _feed(hook, grads_per_device: np.ndarray, steps: int) -> np.ndarray:
    """The hook's average of the same per-device gradients, `steps` times over; returns the outputs' mean."""
    n = grads_per_device.shape[0]
    mesh = parallel.make_mesh(jax.devices()[:n])
    bucket = GradBucket(0, (0,), ("w",), parallel.AXIS, n)
    state0 = hook.init(0, "w", grads_per_device.shape[1:])

    def one(g, state, step):
        (out,), (new,) = hook.reduce(bucket, [g[0]], [jax.tree.map(lambda x: x[0], state)], step)
        return out, jax.tree.map(lambda x: x[None], new)

    f = jax.jit(jax.shard_map(one, mesh=mesh, in_specs=(P("data"), P("data"), P()), out_specs=(P(), P("data"))))
    state = jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *x.shape)), state0)
    total = np.zeros(grads_per_device.shape[1:])
    for i in range(steps):
        out, state = f(jnp.asarray(grads_per_device), state, jnp.int32(i))
        total += np.asarray(out)
    return total / steps


def test_error_feedback_recovers_what_compression_leaves_out():
    """Fed the same gradients again and again, rank-1 PowerSGD with error feedback averages to the true mean: what
    it leaves out one step it sends later, so the error of the average shrinks as 1/steps. Without feedback only
    the mean's best rank-1 part ever arrives, however long it runs."""
    grads = np.random.default_rng(0).normal(size=(2, 24, 16)).astype(np.float32)
    mean = grads.mean(0)

    def error(feedback, steps):
        got = _feed(PowerSGD(rank=1, start_step=0, error_feedback=feedback), grads, steps)
        return float(np.linalg.norm(got - mean) / np.linalg.norm(mean))

    u, s, vt = np.linalg.svd(mean)
    best_rank1 = float(np.linalg.norm(mean - s[0] * np.outer(u[:, 0], vt[0])) / np.linalg.norm(mean))
    with_50, with_200, without = error(True, 50), error(True, 200), error(False, 200)
    print(f"relative error of the averaged output: {with_50:.3f} after 50 steps and {with_200:.3f} after 200 with "
          f"error feedback, {without:.3f} after 200 without (best rank-1 part: {best_rank1:.3f})")  # fmt: skip
    assert with_200 < 0.1 and with_200 < 0.4 * with_50  # bounded error, spread over more steps
    assert abs(without - best_rank1) < 0.02  # power iteration finds the best rank-1 part, and no more
    assert without > 5 * with_200


def test_the_mean_hook_is_ddps_all_reduce():
    mesh, state, step = setup(4, Mean())
    plain_mesh, plain, plain_step = setup(4, None)
    for i in range(2):
        state, m = step(state, parallel.shard_batch(make_batch(i), mesh))
        plain, pm = plain_step(plain, parallel.shard_batch(make_batch(i), plain_mesh))
    assert state.comm is None
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(plain.params), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_a_hook_with_state_needs_a_state_built_with_it():
    mesh = parallel.make_mesh(jax.devices()[:2])
    opt, schedule = optimizer()
    graphdef, state = parallel.init_state(GPT(CFG, nnx.Rngs(0)), opt, mesh)  # no hook
    step = parallel.make_train_step(graphdef, lm_loss, opt, mesh, 1, schedule, comm_hook=PowerSGD(rank=2))
    with pytest.raises(ValueError, match=r"init_state\(\.\.\., comm_hook=the same hook\)"):
        step(state, parallel.shard_batch(make_batch(0), mesh))
    with pytest.raises(ValueError, match="strategy='zero1' has none to hook"):
        parallel.make_train_step(graphdef, lm_loss, opt, mesh, strategy="zero1", comm_hook=PowerSGD())


def test_compression_needs_ddp_and_sane_knobs():
    cfg = load_config(None, ["parallel.compression=powersgd", "parallel.strategy=zero1"])
    with pytest.raises(ConfigError, match="parallel.compression=powersgd compresses ddp's"):
        validate(cfg, 4)
    cfg = load_config(
        None, ["parallel.compression=powersgd", "parallel.powersgd_rank=0", "parallel.powersgd_min_ratio=0.5"]
    )
    with pytest.raises(ConfigError) as e:
        validate(cfg, 4)
    assert "parallel.powersgd_rank=0 must be" in str(e.value) and "parallel.powersgd_min_ratio=0.5" in str(e.value)


def test_docs_custom_hook_example_trains_on_four_devices(tmp_path):
    page = Path(__file__).resolve().parents[1] / "docs" / "performance.md"
    out = run_on_four_devices(tmp_path, readme_block("hook-example", page))
    match = re.search(r"float16 hook: loss ([\d.]+) \(mean: ([\d.]+)\), replicas differ: (\[.*\])", out.stdout)
    assert match, out.stdout
    assert match.group(3) == "[]"
    assert abs(float(match.group(1)) - float(match.group(2))) < 1e-3 and float(match.group(2)) < 0.1


# Real processes: `jdp train` and `jdp launch`, as a user runs them.

POWERSGD = ["parallel.compression=powersgd", "parallel.powersgd_rank=2", "parallel.powersgd_warmup=2"]
POWERSGD += ["parallel.bucket_mb=0.05", "train.check_replicas_every=1"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return {**os.environ, "JDP_CACHE": str(tmp_path_factory.mktemp("cache")), "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def reference(env, made_once):
    """An uninterrupted 8-step PowerSGD run on 1 process x 4 devices, checkpointing every 4 steps (one worker's)."""
    return made_once("reference-powersgd", lambda d: run(d, env, (1, 4), ["train.steps=8", "train.ckpt_every=4",
                                                                           *POWERSGD]))  # fmt: skip


def at_step_4(reference, d: Path) -> Path:
    """`d`: a copy of the reference run as it stood after its checkpoint at step 4."""
    shutil.copytree(reference, d)
    shutil.rmtree(d / "checkpoints" / "8")
    (d / "summary.json").unlink()
    return d


@pytest.mark.slow
def test_powersgd_resume_is_bit_identical(reference, env, tmp_path):
    """Run again from its checkpoint at step 4: the uninterrupted run, bit for bit. (A run killed while it saves,
    whatever its state holds: tests/test_faults.py.)"""
    d = at_step_4(reference, tmp_path / "run")
    out = run(d, env, (1, 4), ["train.steps=8", "train.ckpt_every=4", *POWERSGD])
    assert "resuming from the checkpoint at step 4" in out.stdout
    assert "fresh state" not in out.stdout  # the error buffers and Q came back from the checkpoint
    assert summary(d)["params_sha256"] == summary(reference)["params_sha256"]
    assert losses(d) == losses(reference)


@pytest.mark.slow
def test_a_powersgd_checkpoint_continues_as_plain_ddp(reference, env, tmp_path):
    d = at_step_4(reference, tmp_path / "run")
    out = run(d, env, (1, 4), ["train.steps=8", "train.ckpt_every=4", "parallel.bucket_mb=0.05"])
    assert "resuming from the checkpoint at step 4" in out.stdout
    assert "the checkpoint's powersgd state is not used (parallel.compression=none)" in out.stdout
    assert ckpt_steps(d) == [4, 8] and "comm" not in os.listdir(d / "checkpoints" / "8")
    assert losses(d).keys() == losses(reference).keys()


@pytest.mark.slow
def test_powersgd_on_two_processes_keeps_replicas_identical(reference, env, tmp_path):
    d = tmp_path / "2x2"
    run(d, env, (2, 2), ["train.steps=8", "train.ckpt_every=4", *POWERSGD])  # replicas compared every step
    got, want = losses(d), losses(reference)
    assert got.keys() == want.keys()
    assert all(abs(got[k] - want[k]) <= 1e-4 * abs(want[k]) for k in want)


def test_a_checkpoint_written_before_hooks_existed_restores(tmp_path):
    """Checkpoints used to hold the four-field TrainState as their one `state` item: they restore unchanged, into a
    state with or without a hook (which then keeps its fresh state)."""
    import dataclasses

    import orbax.checkpoint as ocp

    from jdp.checkpoint import Checkpoints, checksums

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass
    class FourFields:  # TrainState as it was before it had `comm`
        step: jax.Array
        params: dict
        opt_state: tuple
        rest: dict

    _, state, _ = setup(2, None)
    old = FourFields(state.step + 3, state.params, state.opt_state, state.rest)
    ckpts = Checkpoints(tmp_path, keep=2)
    args = ocp.args.Composite(
        state=ocp.args.StandardSave(old), record=ocp.args.JsonSave({"step": 3, "checksums": checksums(old)})
    )
    ckpts.manager.save(3, args=args)
    ckpts.wait()
    for hook in (None, PowerSGD(rank=2)):
        _, like, _ = setup(2, hook)
        restored, _ = ckpts.restore(3, like)
        assert int(restored.step) == 3
        for a, b in zip(jax.tree.leaves(restored.params), jax.tree.leaves(state.params), strict=True):
            assert np.array_equal(np.asarray(a), np.asarray(b))
        assert restored.comm is like.comm  # none saved: the hook's fresh state, or None
    ckpts.close()
