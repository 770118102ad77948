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
# The tests' model: tiny's shape at a quarter of its width and half its depth, half its windows (what test_faults and
# test_hosts train): every contract here is about the arithmetic of groups, not the model's size.
SMALL = ["model.n_layers=2", "model.d_model=64", "model.max_seq_len=64", "data.seq_len=64", "train.batch_size=16"]
DILOCO_H1 = ["parallel.sync=diloco", "parallel.groups=2", "parallel.outer_every=1", "parallel.outer_lr=1.0",
             "parallel.outer_momentum=0"]  # fmt: skip


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One embedded corpus and token cache for these tests."""
    path = tmp_path_factory.mktemp("jdp-cache")
    os.environ["JDP_CACHE"] = str(path)
    return path


def tiny(tmp_path, *overrides):
    return load_config("tiny", [*SMALL, f"train.run_dir={tmp_path}", "train.steps=6", "train.log_every=1",
                                "train.progress=false", "train.eval_every=0", *overrides])  # fmt: skip


def losses(run_dir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}


def leaves(params) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax_leaves(params)]


def jax_leaves(tree):
    import jax

    return jax.tree.leaves(tree)


@pytest.fixture
def ddp_run(cache, made_once):
    """The plain ddp run (6 steps, PLAIN, 4 devices) the H=1 tests equal: its run directory and final parameters,
    made once per session for test_h1_*, the outer-step test and the two-process test."""

    def make(path):
        ddp = train(tiny(path / "run", *PLAIN))
        assert ddp["state"].inner is None
        np.savez(path / "params.npz", *leaves(ddp["state"].params))

    path = made_once("diloco-ddp-plain", make)
    with np.load(path / "params.npz") as f:
        return path / "run", [f[f"arr_{i}"] for i in range(len(f.files))]


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "fsdp", "hsdp"])
def test_h1_with_a_plain_outer_average_trains_exactly_as_ddp(tmp_path, ddp_run, strategy):
    """Inside each group the strategy's own step (zero1: the optimizer state split over the group's devices; fsdp:
    the parameters too; hsdp with shards of 1: each group's 2 devices replicas, each sending half of the
    pseudo-gradient). Every sync logged: float32's outer step loses nothing and sends 4 bytes a number (int4's:
    test_groups_are_bit_identical_after_every_sync_and_differ_between)."""
    ddp_dir, ddp_params = ddp_run
    inside = [f"parallel.strategy={strategy}", *(["parallel.shard_size=1"] if strategy == "hsdp" else [])]
    diloco = train(tiny(tmp_path / "diloco", *PLAIN, *DILOCO_H1, *inside))
    a, b = losses(ddp_dir), losses(tmp_path / "diloco")
    assert sorted(a) == sorted(b) == list(range(1, 7))
    np.testing.assert_allclose([b[s] for s in a], [a[s] for s in a], rtol=2e-6)
    for x, y in zip(ddp_params, leaves(diloco["state"].params), strict=True):
        np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-7)
    assert diloco["state"].inner is not None
    split = {tuple(x.sharding.spec) for x in jax_leaves(diloco["state"].inner["opt_state"]) if x.ndim > 1}
    placed = {"ddp": {("group",)}, "zero1": {("group", None, "data"), ("group", "data")}, "fsdp": {("group", "data")},
              "hsdp": {("group", "shard"), ("group",)}}  # fmt: skip  (shards of 1: JAX may drop the size-1 axis)
    assert split <= placed[strategy] and split
    records = [r for r in read_metrics(tmp_path / "diloco" / "metrics.jsonl") if "outer_grad_norm" in r]
    assert [r["step"] for r in records] == list(range(1, 7))
    for r in records:
        assert r["outer_grad_norm"] > 0 and r["outer_divergence"] > 0 and r["outer_quant_error"] == 0
    n_params = sum(x.size for x in ddp_params)
    assert records[0]["outer_bytes_per_step"] == pytest.approx(n_params * 4.0, rel=0.01)


def test_the_default_outer_nesterov_step_does_not_train_as_ddp(tmp_path, ddp_run):
    """The H=1 contract is not a ddp in disguise: with the paper's outer step (lr 0.7, Nesterov 0.9) the same run
    trains to other parameters."""
    outer = train(tiny(tmp_path / "outer", *PLAIN, "parallel.sync=diloco", "parallel.groups=2",
                       "parallel.outer_every=1"))  # fmt: skip
    differ = [not np.allclose(x, y, rtol=1e-3) for x, y in zip(ddp_run[1], leaves(outer["state"].params), strict=True)]
    assert any(differ)


def group_params(state) -> list[list[np.ndarray]]:
    """Each group's parameters, read from the devices that hold them (the leading axis is the groups')."""
    out = {}
    for leaf in jax_leaves(state.inner["params"]):
        for shard in leaf.addressable_shards:
            out.setdefault(shard.index[0].start, {}).setdefault(id(leaf), np.asarray(shard.data)[0])
    return [list(v.values()) for _, v in sorted(out.items())]


def test_groups_are_bit_identical_after_every_sync_and_differ_between(tmp_path, cache):
    """With the outer step's pseudo-gradients sent as int4 (every group must dequantise the same bits; float32's
    outer metrics: test_h1_with_a_plain_outer_average_trains_exactly_as_ddp, whose runs sync every step)."""
    seen, dtype = [], "int4"

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
        assert 0 < r["outer_quant_error"] < 0.2  # 4 bits per number: about 1/14 of a block's largest, RMS
    n_params = sum(x.size for x in jax_leaves(result["state"].params))
    per_number = 0.5 + 4 / 256
    assert records[0]["outer_bytes_per_step"] == pytest.approx(n_params * per_number / 3, rel=0.01)


def test_a_run_killed_mid_round_resumes_bit_for_bit(tmp_path, cache):
    """Streaming DiLoCo (2 fragments, an outer delay of 1) with fsdp inside the groups, H=4, a checkpoint every 6
    steps: SIGKILL after step 7 (the checkpoint at 6 is mid-round, the groups apart, fragment 0 synced at 6 and its
    outer step landing at 7) and a re-run to 10 equals 10 steps at once, in every loss, the round's parameters and
    every group's state. (Split rows inside the groups, the layout hsdp's shards of 2 in a group of 2 also give; a
    plain DiLoCo run with ddp inside run again from its mid-round checkpoint, bit for bit:
    test_the_groups_optimizer_state_moves_between_strategies.)"""
    sync = ["parallel.sync=streaming", "parallel.fragments=2", "parallel.outer_delay=1", "parallel.strategy=fsdp"]
    common = [*sync, "parallel.groups=2", "parallel.outer_every=4", "train.ckpt_every=6", "train.steps=10"]
    straight = train(tiny(tmp_path / "a", *common))
    env, override = inject.register(dict(os.environ), JDP_TEST_KILL_ONCE=f"7:0:{tmp_path / 'killed'}")
    args = ["train", "tiny", *SMALL, f"train.run_dir={tmp_path / 'b'}", "train.log_every=1", "train.progress=false",
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


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_device_whose_round_differs_stops_the_run_at_the_next_sync(tmp_path, cache, monkeypatch, strategy):
    """The replica check right after each sync: the round's parameters perturbed on the last device at step 5 (no
    replica check runs between syncs) make its outer step at 8 compute other values; the run stops one step later
    naming that device. Under fsdp each device holds its own rows of the round, compared with the same rows in group
    0. (Runs without the fault pass every sync's check, which always runs: every other DiLoCo run here, fsdp inside
    in test_h1_*[fsdp] and the killed streaming-fsdp-inside run.)"""
    import inject

    from jdp.trainer import RunError

    common = ["parallel.sync=diloco", "parallel.groups=2", "parallel.outer_every=4", "train.steps=10",
              "train.check_replicas_every=0", f"parallel.strategy={strategy}"]  # fmt: skip
    monkeypatch.setenv("JDP_TEST_DIVERGE", "5:end")
    with pytest.raises(RunError, match=r"the groups disagree after the sync at step 8: the round's parameters on") as e:
        train(tiny(tmp_path / "faulty", *common, inject.OVERRIDE))
    named = str(e.value).split("parameters on ", 1)[1].split(" differ", 1)[0]
    assert any(n in named for n in ("TFRT_CPU_3", "id=3", "cpu:3")) and named.count("process") == 1


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["parallel.sync=diloco", "parallel.strategy=dp"], ["parallel.strategy=dp inside a group", "ddp"]),
        (
            ["parallel.sync=diloco", "parallel.groups=2", "parallel.strategy=hsdp", "parallel.shard_size=4"],
            ["parallel.shard_size=4 must split each of the 2 groups' 2 devices", "[1, 2]"],
        ),
        (["parallel.sync=diloco", "parallel.groups=3"], ["parallel.groups=3", "equal groups", "[1, 2, 4]"]),
        (["parallel.outer_every=10"], ["parallel.outer_every=10 is an option of parallel.sync=diloco"]),
        (["parallel.sync=diloco", "parallel.outer_dtype=int2"], ["parallel.outer_dtype='int2' must be one of"]),
        (["parallel.sync=diloco", "parallel.outer_momentum=1.0"], ["parallel.outer_momentum=1.0 must be in [0, 1)"]),
        (["parallel.sync=diloco", "parallel.compression=powersgd"], ["parallel.compression=powersgd", "outer_dtype"]),
        (
            ["parallel.sync=diloco", "parallel.fragments=2"],
            ["parallel.fragments=2 is an option of parallel.sync=streaming"],
        ),
        (
            ["parallel.sync=streaming", "parallel.fragments=3", "parallel.outer_every=4"],
            ["parallel.fragments=3 must divide parallel.outer_every=4"],
        ),
        (
            ["parallel.sync=streaming", "parallel.fragments=2", "parallel.outer_every=4", "parallel.outer_delay=2"],
            ["parallel.outer_delay=2 must be below", "= 2"],
        ),
        (
            ["parallel.sync=streaming", "parallel.fragments=8", "parallel.outer_every=8"],
            ["parallel.fragments=8: fragments [2, 3, 4, 5, 6, 7] hold no parameters"],
        ),
    ],
)
def test_what_diloco_cannot_run_is_refused_before_compiling(tmp_path, cache, overrides, words):
    with pytest.raises(ConfigError) as e:
        train(tiny(tmp_path, *overrides))
    for w in words:
        assert w in str(e.value)


# fsdp inside on 2 processes: tests/test_torchrun.py's two-node run (DiLoCo = jdp launch, bit for bit); hsdp
# inside on one process: test_h1_with_a_plain_outer_average_trains_exactly_as_ddp[hsdp] and the killed-mid-round
# runs (its own two-process case here cost CI 94 s: its sharding of 1 was ddp's layout again).
@pytest.mark.parametrize("strategy", ["ddp"])
def test_h1_equals_ddp_on_two_processes(tmp_path, cache, ddp_run, strategy):
    """2 real processes of 2 devices each, a group each: H=1 with a plain outer average trains to the parameters of
    ddp on 4 devices of one process (the data order does not depend on the layout), with ddp inside."""
    args = ["-m", "jdp.cli", "train", "tiny", *SMALL, f"train.run_dir={tmp_path / 'two'}", "train.steps=6", "train.log_every=1",
            "train.progress=false", "train.eval_every=0", *PLAIN, *DILOCO_H1, f"parallel.strategy={strategy}",
            *(["parallel.shard_size=1"] if strategy == "hsdp" else [])]  # fmt: skip
    results = spawn_processes(args, 2, 2, env={"JDP_CACHE": str(cache)})
    for code, _out, err in results:
        assert code == 0, err[-3000:]
    assert sorted(losses(tmp_path / "two")) == list(range(1, 7))
    from flax import nnx

    from jdp.models import make_model

    model = lambda: make_model(tiny(tmp_path / "two").model, nnx.Rngs(0))  # noqa: E731  (its shapes only)
    saved = nnx.state(jdp.load(tmp_path / "two", model), nnx.Param)  # the round's parameters, as saved
    for x, y in zip(ddp_run[1], leaves(saved), strict=True):
        np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-7)


def test_the_memory_check_counts_the_rounds_parameters_and_momentum(tmp_path):
    from jdp.plan import held_bytes

    step = held_bytes(tiny(tmp_path), "ddp", 4)
    diloco = held_bytes(tiny(tmp_path, "parallel.sync=diloco", "parallel.groups=2"), "ddp", 4)
    plain = held_bytes(tiny(tmp_path, "parallel.sync=diloco", "parallel.groups=2", "parallel.outer_momentum=0"),
                       "ddp", 4)  # fmt: skip
    assert diloco.params == 2 * step.params and diloco.opt_state == step.opt_state + step.params
    assert plain.opt_state == diloco.opt_state and diloco.grads == step.grads  # buffers kept at momentum 0 too
    # zero1 inside groups of 2 devices: each keeps half of its group's AdamW state (not a quarter: the groups are
    # replicas of each other), beside the round's whole parameters and momentum.
    inside = held_bytes(tiny(tmp_path, "parallel.sync=diloco", "parallel.groups=2", "parallel.strategy=zero1"),
                        "zero1", 4)  # fmt: skip
    assert inside.opt_state == held_bytes(tiny(tmp_path, "parallel.strategy=zero1"), "zero1", 2).opt_state + step.params
    assert inside.opt_state < diloco.opt_state


def adam_counts(tree) -> set[int]:
    """The optimizer's step counts (its integer leaves), every group's under DiLoCo."""
    return {int(v) for x in jax_leaves(tree) if x.dtype.kind == "i" for v in np.asarray(x).ravel()}


def test_checkpoints_move_between_every_step_sync_and_diloco(tmp_path, cache):
    """An every-step (ddp) checkpoint continues under DiLoCo with 2 groups or 4 (ddp inside), and with 2 groups and
    zero1 inside (each group's zero1 slices of the ddp AdamW state), every group from its parameters and AdamW
    state, the outer momentum from zero: the first step after the switch computes the same loss as staying (that step's loss is the
    parameters' before its update), the AdamW count goes on from the checkpoint's, and the groups sync at every
    multiple of H after the switch, for several steps. The DiLoCo checkpoint at the end of a round then moves on
    (from_the_end_of_a_round). (The steps' counts are other tests' here, whose programs the compilation cache then
    holds.)"""
    import shutil

    diloco = ["parallel.sync=diloco", "parallel.outer_every=2"]
    cases = {"ddp-then-2": (2, 8, []), "ddp-then-4": (4, 9, []), "ddp-then-2-zero1": (2, 8, ["parallel.strategy=zero1"])}
    train(tiny(tmp_path / "ddp", "train.steps=4", "train.ckpt_every=4"))
    for name in cases:
        shutil.copytree(tmp_path / "ddp", tmp_path / name)
    train(tiny(tmp_path / "ddp", "train.steps=5"))
    for name, (g, steps, inside) in cases.items():  # 2 rounds after the switch in each
        moved = train(tiny(tmp_path / name, f"train.steps={steps}", f"parallel.groups={g}", *diloco, *inside))
        assert jax_leaves(moved["state"].inner)[0].shape[0] == g and adam_counts(moved["state"].inner) == {steps}
        after = losses(tmp_path / name)
        assert after[5] == pytest.approx(losses(tmp_path / "ddp")[5], rel=1e-5)
        assert np.isfinite([after[s] for s in range(5, steps + 1)]).all() and after[steps] < after[5]
        records = read_metrics(tmp_path / name / "metrics.jsonl")
        assert [r["step"] for r in records if "outer_grad_norm" in r] == [6, 8]
        if inside:  # zero1's slices of each group's AdamW state
            opt_state = moved["state"].inner["opt_state"]
            assert {tuple(x.sharding.spec)[-1] for x in jax_leaves(opt_state) if x.ndim > 1} == {"data"}
    from_the_end_of_a_round(tmp_path / "ddp-then-2", diloco)


def from_the_end_of_a_round(d, diloco):
    """`d`'s DiLoCo checkpoint at step 8 (2 groups, ddp inside, H=2: the end of a round) continues under ddp (the
    round's parameters, the groups' AdamW state averaged), with 4 groups (a host added under elastic membership:
    every group from the round, the AdamW state averaged, the outer momentum kept), and with another H and outer
    dtype (H=3, int8: it goes on and syncs at the new multiples). The step after the checkpoint computes the loss of
    the round's parameters in each."""
    import shutil

    for name in ("then-ddp", "then-4-groups"):
        shutil.copytree(d, d.parent / name)
    train(tiny(d, "train.steps=10", "parallel.groups=2", "parallel.sync=diloco", "parallel.outer_every=3",
               "parallel.outer_dtype=int8"))  # fmt: skip
    assert [r["step"] for r in read_metrics(d / "metrics.jsonl") if "outer_grad_norm" in r] == [6, 8, 9]
    staying = losses(d)
    back = train(tiny(d.parent / "then-ddp", "train.steps=10"))
    assert back["state"].inner is None and adam_counts(back["state"].opt_state) == {10}
    after = losses(d.parent / "then-ddp")
    assert after[9] == pytest.approx(staying[9], rel=1e-5) and np.isfinite(after[10])
    four = train(tiny(d.parent / "then-4-groups", "train.steps=9", "parallel.groups=4", *diloco))
    assert jax_leaves(four["state"].inner)[0].shape[0] == 4
    assert losses(d.parent / "then-4-groups")[9] == pytest.approx(staying[9], rel=1e-5)


def test_the_groups_optimizer_state_moves_between_strategies(tmp_path, cache):
    """A DiLoCo checkpoint taken mid-round (step 6 of H=4, the groups apart) with ddp inside the groups, run again as
    it was: 10 steps at once, bit for bit, in every loss, the round's parameters and every group's state (the same,
    killed: test_a_run_killed_mid_round_resumes_bit_for_bit). It continues with zero1 inside (each group's AdamW
    state moved to zero1's slices), then fsdp (parameters and state in padded rows: the embedding's 257 rows to 258)
    and back to ddp, losses as staying to float32 rounding. (No decay: the schedule does not depend on train.steps.
    An every-step ddp checkpoint continued with zero1 inside the groups: test_checkpoints_move_between_every_step_
    sync_and_diloco.)"""
    import shutil

    flat = ["optim.min_lr_ratio=1.0", "optim.warmup_steps=0"]
    diloco = ["parallel.sync=diloco", "parallel.groups=2", "parallel.outer_every=4", *flat]
    staying = train(tiny(tmp_path / "ddp", "train.steps=10", "train.ckpt_every=6", *diloco))  # its checkpoint at 6
    for name in ("again", "zero1"):
        shutil.copytree(tmp_path / "ddp", tmp_path / name)
        shutil.rmtree(tmp_path / name / "checkpoints" / "10")
        (tmp_path / name / "summary.json").unlink()
    again = train(tiny(tmp_path / "again", "train.steps=10", "train.ckpt_every=6", *diloco))
    assert losses(tmp_path / "again") == losses(tmp_path / "ddp") and again["params_sha256"] == staying["params_sha256"]
    assert all(np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax_leaves(staying["state"].inner), jax_leaves(again["state"].inner), strict=True))  # fmt: skip
    assert (tmp_path / "again" / "metrics.superseded.jsonl").exists()  # resumed at 6, not started over
    moved = train(tiny(tmp_path / "zero1", "train.steps=8", "parallel.strategy=zero1", *diloco))
    assert {tuple(x.sharding.spec)[-1] for x in jax_leaves(moved["state"].inner["opt_state"]) if x.ndim > 1} == {"data"}
    rows = train(tiny(tmp_path / "zero1", "train.steps=9", "parallel.strategy=fsdp", *diloco))
    assert {tuple(x.sharding.spec) for x in jax_leaves(rows["state"].inner["params"])} == {("group", "data")}
    back = train(tiny(tmp_path / "zero1", "train.steps=10", *diloco))
    assert {tuple(x.sharding.spec) for x in jax_leaves(back["state"].inner["opt_state"]) if x.ndim > 1} == {("group",)}
    a, b = losses(tmp_path / "ddp"), losses(tmp_path / "zero1")
    assert sorted(a) == sorted(b) == list(range(1, 11))
    np.testing.assert_allclose([b[s] for s in a], [a[s] for s in a], rtol=1e-5)


def fragment_agreement(info, leaves_of) -> list[bool]:
    """For each fragment, whether every group (every device of it) holds the round's values of its leaves, bit for
    bit."""
    flat_t = [np.asarray(t) for t in jax_leaves(info.state.params)]
    flat_x = jax_leaves(info.state.inner["params"])
    return [
        all(
            np.array_equal(np.asarray(shard.data)[0], flat_t[k])
            for k in leaves
            for shard in flat_x[k].addressable_shards
        )
        for leaves in leaves_of
    ]


@pytest.mark.parametrize("delay", [0, 1])
def test_streaming_fragments_agree_at_their_own_steps_and_differ_between(tmp_path, cache, delay):
    """F=2 fragments, H=4: fragment 0 (blocks 0, 2, ... and the leaves of no block) syncs at steps 2, 6, ..., fragment
    1 at 4, 8, ...; with a delay of 1 its outer step lands one step later. At every step a fragment's leaves are the
    round's in every group exactly when its outer step has just landed."""
    from jdp.parallel import param_names
    from jdp.parallel.sync.diloco import fragments

    seen, leaves_of = [], []

    def look(info):
        if not leaves_of:
            leaves_of.extend(leaves for leaves, _ in fragments(param_names(info.state.params), 2, 4))
        seen.append((info.step, fragment_agreement(info, leaves_of)))

    cfg = tiny(tmp_path, "train.steps=10", "optim.warmup_steps=0", "parallel.sync=streaming", "parallel.groups=2",
               "parallel.outer_every=4", "parallel.fragments=2", f"parallel.outer_delay={delay}")  # fmt: skip
    lm = LanguageModel(cfg, handle_signals=False)
    lm.callbacks.append(jdp.every(1, look))
    lm.fit()
    assert [s for s, _ in seen] == list(range(1, 10))
    for step, agree in seen:
        landed = [step > delay and (step - delay) % 4 == offset for offset in (2, 0)]
        assert agree == landed, f"step {step}: {agree}"
    records = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "outer_fragment" in r]
    assert [(r["step"], r["outer_fragment"]) for r in records] == [(2, 0), (4, 1), (6, 0), (8, 1), (10, 0)]


@pytest.mark.alone
def test_sigterm_to_one_process_stops_every_group_at_one_step_after_a_sync(tmp_path, cache):
    """2 processes of 2 devices, a group each, H=4: the groups run apart between syncs, so the agreed stop step is 3
    after the next sync; SIGTERM to process 1 stops both there, each saves, and the launcher exits 0."""
    import json
    import time

    import psutil

    d = tmp_path / "run"
    args = [sys.executable, "-m", "jdp.cli", "launch", "--nproc-per-node", "2", "--devices-per-proc", "2", "--",
            "train", "tiny", *SMALL, "train.steps=100000", "train.ckpt_every=0", "train.eval_every=0", "train.log_every=1",
            "train.progress=false", f"train.run_dir={d}", "parallel.sync=diloco", "parallel.groups=2",
            "parallel.outer_every=4"]  # fmt: skip
    launcher = subprocess.Popen(args, env={**os.environ, "JDP_CACHE": str(cache)}, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not ((d / "metrics.jsonl").exists() and len(losses(d)) >= 6):
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()[1][-3000:]
            time.sleep(0.3)
        rank1 = next(
            p for p in psutil.Process(launcher.pid).children(recursive=True) if p.environ().get("JAX_PROCESS_ID") == "1"
        )
        rank1.send_signal(signal.SIGTERM)
        out, err = launcher.communicate(timeout=180)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 0, err[-3000:]
    stopped = json.loads((d / "summary.json").read_text())
    assert stopped["preempted"] and stopped["steps"] % 4 == 3, stopped["steps"]
    saved = sorted(int(p.name) for p in (d / "checkpoints").iterdir() if p.name.isdigit())
    assert saved == [stopped["steps"]] and max(losses(d)) == stopped["steps"]


def test_jdp_plan_compares_ddp_across_a_slow_link_with_diloco(capsys):
    """`jdp plan --slow-link 1,20`: ddp's step across the link against DiLoCo's at several H, with the bytes each
    sends across it; the numbers follow the model docs/diloco.md states (a larger H is faster and sends less)."""
    from jdp.cli import main
    from jdp.parallel.costs import payload_bytes

    code = main(["plan", "gpt2-small", "--devices", "16", "--gpu", "H100", "--slow-link", "1,20", "--json",
                 "parallel.sync=diloco", "parallel.groups=2", "parallel.outer_every=100", "parallel.outer_dtype=int4"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert "across a slow link between 2 groups of 8 (--slow-link: 1 GB/s, 20 ms one way, no loss)" in out
    import json

    plan = json.loads(out.strip().splitlines()[-1])
    rows = plan["across"]["rows"]
    assert rows[0][0] == "ddp across the link" and [r[0] for r in rows[1:]] == [
        f"DiLoCo H={h}, int4" for h in (10, 50, 100, 500)
    ]
    steps, sent = [r[1] for r in rows[1:]], [r[2] for r in rows[1:]]
    assert steps == sorted(steps, reverse=True) and all(s < rows[0][1] for s in steps)
    assert sent[2] == payload_bytes(plan["n_params"], "int4") / 100
    assert "DiLoCo H=100, int4" in out and "x fewer bytes" in out


def test_the_library_trainer_runs_a_users_model_under_diloco(tmp_path):
    """jdp.Trainer with a user's NNX model and loss, parallel.sync=diloco on 4 devices as 2 groups: it learns, every
    sync is logged, the round's parameters are what `result["model"]` holds."""
    import jax.numpy as jnp
    import optax
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.hidden, self.out = nnx.Linear(2, 32, rngs=rngs), nnx.Linear(32, 2, rngs=rngs)

        def __call__(self, x):
            return self.out(nnx.relu(self.hidden(x)))

    def loss_fn(model, batch):
        losses = optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"])
        return losses.sum(), jnp.float32(losses.shape[0])

    x = np.random.default_rng(0).normal(size=(4096, 2)).astype(np.float32)
    data = {"x": x, "y": (x[:, 0] * x[:, 1] > 0).astype(np.int32)}
    config = jdp.load_config(None, [f"train.run_dir={tmp_path}", "train.steps=60", "train.batch_size=64",
                                    "train.log_every=10", "parallel.sync=diloco", "parallel.groups=2",
                                    "parallel.outer_every=10"])  # fmt: skip
    result = jdp.Trainer(lambda: MLP(nnx.Rngs(0)), loss_fn, optax.adam(1e-2), data, config).fit()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records if "outer_grad_norm" in r] == [10, 20, 30, 40, 50, 60]
    first, last = records[0]["loss"], [r["loss"] for r in records if "loss" in r][-1]
    assert last < 0.7 * first
    model_leaves = leaves(nnx.state(result["model"], nnx.Param))
    assert all(np.array_equal(a, b) for a, b in zip(model_leaves, leaves(result["state"].params), strict=True))


def test_sigterm_to_one_process_holding_every_group_stops_at_once(tmp_path, cache):
    """One process holds both groups, which run in step: a SIGTERM during the save of step 2 stops the run right
    there (as without groups), not at the next sync 8 steps on."""
    import json

    env, override = inject.register({**os.environ, "JDP_CACHE": str(cache)}, JDP_TEST_TERM="2:save")
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    args = ["train", "tiny", *SMALL, f"train.run_dir={tmp_path}", "train.steps=20", "train.ckpt_every=2", "train.log_every=1",
            "train.progress=false", "train.eval_every=0", "parallel.sync=diloco", "parallel.groups=2",
            "parallel.outer_every=8", override]  # fmt: skip
    out = subprocess.run([sys.executable, "-m", "jdp.cli", *args], env=env, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    stopped = json.loads((tmp_path / "summary.json").read_text())
    assert stopped["preempted"] and stopped["steps"] <= 3, stopped["steps"]
