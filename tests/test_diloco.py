"""parallel.sync=diloco (jdp/parallel/sync/diloco.py): groups of devices that train apart and agree every H steps.

On 4 simulated devices as 2 groups and on 2 real processes: H=1 with a plain outer average is ddp; the groups are
bit-identical right after every sync and differ between syncs; a run stopped mid-round resumes bit for bit; the
config refuses what DiLoCo cannot run before anything compiles."""

import os
import signal
import subprocess
import sys

import inject
import numpy as np
import pytest
from conftest import spawn_processes

import jdp
from jdp.config import ConfigError, load_config
from jdp.lm import LanguageModel, train
from jdp.metrics import read_metrics

# An elementwise inner optimizer without clipping: the mean of the groups' updates is then the update of the mean
# gradient, so H=1 (outer lr 1, no momentum) is ddp. AdamW's update of a mean is not the mean of AdamW's updates,
# and clipping each group's gradient is not clipping their mean (docs/diloco.md).
PLAIN = ["optim.name=sgd", "optim.grad_clip=0", "optim.lr=0.05", "optim.warmup_steps=0"]
DILOCO_H1 = ["parallel.sync=diloco", "parallel.groups=2", "parallel.outer_every=1", "parallel.outer_lr=1.0",
             "parallel.outer_momentum=0"]  # fmt: skip


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One embedded corpus and token cache for these tests."""
    path = tmp_path_factory.mktemp("jdp-cache")
    os.environ["JDP_CACHE"] = str(path)
    return path


def tiny(tmp_path, *overrides):
    return load_config("tiny", [f"train.run_dir={tmp_path}", "train.steps=6", "train.log_every=1",
                                "train.progress=false", "train.eval_every=0", *overrides])  # fmt: skip


def losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}


def leaves(params) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax_leaves(params)]


def jax_leaves(tree):
    import jax

    return jax.tree.leaves(tree)


def test_h1_with_a_plain_outer_average_trains_exactly_as_ddp(tmp_path, cache):
    ddp = train(tiny(tmp_path / "ddp", *PLAIN))
    diloco = train(tiny(tmp_path / "diloco", *PLAIN, *DILOCO_H1))
    a, b = losses(tmp_path / "ddp"), losses(tmp_path / "diloco")
    assert sorted(a) == sorted(b) == list(range(1, 7))
    np.testing.assert_allclose([b[s] for s in a], [a[s] for s in a], rtol=2e-6)
    for x, y in zip(leaves(ddp["state"].params), leaves(diloco["state"].params), strict=True):
        np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-7)
    assert diloco["state"].inner is not None and ddp["state"].inner is None


def test_the_default_outer_nesterov_step_does_not_train_as_ddp(tmp_path, cache):
    """The H=1 contract is not a ddp in disguise: with the paper's outer step (lr 0.7, Nesterov 0.9) the same run
    trains to other parameters."""
    ddp = train(tiny(tmp_path / "ddp", *PLAIN, "train.steps=3"))
    outer = train(tiny(tmp_path / "outer", *PLAIN, "train.steps=3", "parallel.sync=diloco", "parallel.groups=2",
                       "parallel.outer_every=1"))  # fmt: skip
    differ = [not np.allclose(x, y, rtol=1e-3) for x, y in zip(leaves(ddp["state"].params),
                                                                 leaves(outer["state"].params), strict=True)]  # fmt: skip
    assert any(differ)


def group_params(state) -> list[list[np.ndarray]]:
    """Each group's parameters, read from the devices that hold them (the leading axis is the groups')."""
    out = {}
    for leaf in jax_leaves(state.inner["params"]):
        for shard in leaf.addressable_shards:
            out.setdefault(shard.index[0].start, {}).setdefault(id(leaf), np.asarray(shard.data)[0])
    return [list(v.values()) for _, v in sorted(out.items())]


@pytest.mark.parametrize("dtype", ["float32", "int4"])
def test_groups_are_bit_identical_after_every_sync_and_differ_between(tmp_path, cache, dtype):
    seen = []

    def look(info):
        g0, g1 = group_params(info.state)
        same = all(np.array_equal(x, y) for x, y in zip(g0, g1, strict=True))
        is_round = all(np.array_equal(x, np.asarray(t)) for x, t in zip(g0, jax_leaves(info.state.params), strict=True))
        seen.append((info.step, same, is_round))

    cfg = tiny(tmp_path, "train.steps=7", "optim.warmup_steps=0", "parallel.sync=diloco", "parallel.groups=2", "parallel.outer_every=3",
               f"parallel.outer_dtype={dtype}")  # fmt: skip
    lm = LanguageModel(cfg, handle_signals=False)
    lm.callbacks.append(jdp.every(1, look))
    result = lm.fit()
    assert [s for s, _, _ in seen] == list(range(1, 7))  # `every` callbacks: not after the last step
    for step, same, is_round in seen:
        synced = step % 3 == 0
        assert same == synced, f"step {step}: groups {'differ' if synced else 'agree'}"
        assert is_round == synced, f"step {step}"
    records = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "outer_grad_norm" in r]
    assert [r["step"] for r in records] == [3, 6]  # every sync logged, whatever train.log_every
    for r in records:
        assert r["outer_grad_norm"] > 0 and r["outer_divergence"] > 0
        assert (r["outer_quant_error"] == 0) == (dtype == "float32")
        assert r["outer_quant_error"] < 0.2  # 4 bits per number: about 1/14 of a block's largest, RMS
    int4 = dtype == "int4"
    n_params = sum(x.size for x in jax_leaves(result["state"].params))
    per_number = (0.5 + 4 / 256) if int4 else 4.0
    assert records[0]["outer_bytes_per_step"] == pytest.approx(n_params * per_number / 3, rel=0.01)


def test_a_run_killed_mid_round_resumes_bit_for_bit(tmp_path, cache):
    """H=4, a checkpoint every 6 steps: SIGKILL after step 7 (the checkpoint at 6 is mid-round, the groups apart)
    and a re-run to 10 equals 10 steps at once, in every loss, the round's parameters and every group's state."""
    common = ["parallel.sync=diloco", "parallel.groups=2", "parallel.outer_every=4", "train.ckpt_every=6",
              "train.steps=10"]  # fmt: skip
    straight = train(tiny(tmp_path / "a", *common))
    env, override = inject.register(dict(os.environ), JDP_TEST_KILL_ONCE=f"7:0:{tmp_path / 'killed'}")
    args = ["train", "tiny", f"train.run_dir={tmp_path / 'b'}", "train.log_every=1", "train.progress=false",
            "train.eval_every=0", *common, override]  # fmt: skip
    out = subprocess.run([sys.executable, "-m", "jdp.cli", *args], env=env, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    assert sorted(int(p.name) for p in (tmp_path / "b" / "checkpoints").iterdir() if p.name.isdigit()) == [6]
    resumed = train(tiny(tmp_path / "b", *common))
    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert a == b and sorted(a) == list(range(1, 11))
    assert straight["params_sha256"] == resumed["params_sha256"]
    for x, y in zip(jax_leaves(straight["state"].inner), jax_leaves(resumed["state"].inner), strict=True):
        assert np.array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["parallel.sync=diloco", "parallel.strategy=zero1"], ["parallel.strategy=zero1 inside a group", "ddp"]),
        (["parallel.sync=diloco", "parallel.groups=3"], ["parallel.groups=3", "equal groups", "[1, 2, 4]"]),
        (["parallel.outer_every=10"], ["parallel.outer_every=10 is an option of parallel.sync=diloco"]),
        (["parallel.sync=diloco", "parallel.outer_dtype=int2"], ["parallel.outer_dtype='int2' must be one of"]),
        (["parallel.sync=diloco", "parallel.outer_momentum=1.0"], ["parallel.outer_momentum=1.0 must be in [0, 1)"]),
        (["parallel.sync=diloco", "parallel.compression=powersgd"], ["parallel.compression=powersgd", "outer_dtype"]),
    ],
)
def test_what_diloco_cannot_run_is_refused_before_compiling(tmp_path, cache, overrides, words):
    with pytest.raises(ConfigError) as e:
        train(tiny(tmp_path, *overrides))
    for w in words:
        assert w in str(e.value)


def test_h1_equals_ddp_on_two_processes(tmp_path, cache):
    """2 real processes of 2 devices each, a group each: H=1 with a plain outer average trains to the parameters of
    ddp on 4 devices of one process (the data order does not depend on the layout)."""
    ddp = train(tiny(tmp_path / "ddp", *PLAIN))
    args = ["-m", "jdp.cli", "train", "tiny", f"train.run_dir={tmp_path / 'two'}", "train.steps=6", "train.log_every=1",
            "train.progress=false", "train.eval_every=0", *PLAIN, *DILOCO_H1]  # fmt: skip
    results = spawn_processes(args, 2, 2, env={"JDP_CACHE": str(cache)})
    for code, _out, err in results:
        assert code == 0, err[-3000:]
    assert sorted(losses(tmp_path / "two")) == list(range(1, 7))
    from flax import nnx

    expected = leaves(ddp["state"].params)
    saved = nnx.state(jdp.load(tmp_path / "two", ddp["model"]), nnx.Param)  # the round's parameters, as saved
    for x, y in zip(expected, leaves(saved), strict=True):
        np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-7)


def test_a_changed_h_on_resume_goes_on_and_syncs_at_the_new_multiples(tmp_path, cache):
    common = ["parallel.sync=diloco", "parallel.groups=2", "train.ckpt_every=5"]
    train(tiny(tmp_path, *common, "parallel.outer_every=4", "train.steps=5"))
    train(tiny(tmp_path, *common, "parallel.outer_every=3", "parallel.outer_dtype=int8", "train.steps=10"))
    synced = [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl") if "outer_grad_norm" in r]
    assert synced == [4, 6, 9]


def test_the_memory_check_counts_the_rounds_parameters_and_momentum(tmp_path):
    from jdp.plan import held_bytes

    step = held_bytes(tiny(tmp_path), "ddp", 4)
    diloco = held_bytes(tiny(tmp_path, "parallel.sync=diloco", "parallel.groups=2"), "ddp", 4)
    plain = held_bytes(tiny(tmp_path, "parallel.sync=diloco", "parallel.groups=2", "parallel.outer_momentum=0"),
                       "ddp", 4)  # fmt: skip
    assert diloco.params == 2 * step.params and diloco.opt_state == step.opt_state + step.params
    assert plain.opt_state == step.opt_state and diloco.grads == step.grads


def test_checkpoints_move_between_every_step_sync_and_diloco(tmp_path, cache):
    """An every-step (ddp) checkpoint continues under DiLoCo (every group from its parameters and AdamW state), and
    a DiLoCo checkpoint under ddp (the round's parameters, the groups' AdamW state averaged): the first step after
    either computes the same loss as staying (that step's loss is the parameters' before its update)."""
    import shutil

    diloco = ["parallel.sync=diloco", "parallel.groups=2", "parallel.outer_every=4"]
    train(tiny(tmp_path / "ddp", "train.steps=4", "train.ckpt_every=4"))
    shutil.copytree(tmp_path / "ddp", tmp_path / "ddp-then-diloco")
    train(tiny(tmp_path / "ddp", "train.steps=5"))
    moved = train(tiny(tmp_path / "ddp-then-diloco", "train.steps=5", *diloco))
    assert moved["state"].inner is not None
    assert losses(tmp_path / "ddp-then-diloco")[5] == pytest.approx(losses(tmp_path / "ddp")[5], rel=1e-5)

    train(tiny(tmp_path / "diloco", "train.steps=8", "train.ckpt_every=8", *diloco))
    shutil.copytree(tmp_path / "diloco", tmp_path / "diloco-then-ddp")
    train(tiny(tmp_path / "diloco", "train.steps=9", *diloco))
    back = train(tiny(tmp_path / "diloco-then-ddp", "train.steps=9"))
    assert back["state"].inner is None
    assert losses(tmp_path / "diloco-then-ddp")[9] == pytest.approx(losses(tmp_path / "diloco")[9], rel=1e-5)


def test_a_checkpoint_of_other_groups_is_refused(tmp_path, cache):
    train(tiny(tmp_path, "train.steps=2", "train.ckpt_every=2", "parallel.sync=diloco", "parallel.groups=2"))
    with pytest.raises(ConfigError, match="holds the states of 2 DiLoCo groups, this run has 4"):
        train(tiny(tmp_path, "train.steps=4", "parallel.sync=diloco", "parallel.groups=4"))
