"""jdp.Loader over a stream (`datasets.IterableDataset`): each process its own shards, every row once per epoch,
exact resume from position(), evaluation like the map-style loader's, clear refusals, and the trainer resuming."""

from __future__ import annotations

import json

import datasets
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jdp
from jdp import parallel
from jdp.config import ConfigError
from jdp.data.dataset import Loader, StreamLoader
from jdp.rundir import RunDir


def table(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 3)).astype(np.float32)
    return {"id": np.arange(n), "x": x, "y": (x @ np.array([1.0, -2.0, 0.5]) + 0.1).astype(np.float32)}


def stream(n: int, shards: int) -> datasets.IterableDataset:
    return datasets.Dataset.from_dict(table(n)).to_iterable_dataset(num_shards=shards)


def share(batch: int, world: int, rank: int) -> slice:
    per = batch // world
    return slice(rank * per, (rank + 1) * per)


# ---------------------------------------------------------------------------------------------- who reads what


@pytest.mark.parametrize("shards, world", [(4, 1), (4, 2), (4, 4), (3, 2)])
def test_each_process_reads_its_own_rows_and_all_of_them_cover_the_stream_once_per_epoch(shards, world):
    n, per, steps = 24, 5, 8  # 5 rows a step against 24/world an epoch: batches straddle the epochs
    loaders = [Loader(stream(n, shards), per * world, rows=share(per * world, world, r)) for r in range(world)]
    assert all(isinstance(ld, StreamLoader) for ld in loaders)
    seqs = [np.concatenate([ld.local_batch(s)["id"] for s in range(steps)]) for ld in loaders]
    epoch_rows = n // world  # equal shards (3 shards over 2: every other row), so every epoch of a process is this long
    for e in range(steps * per // epoch_rows):  # every whole epoch each process finished
        parts = [seq[e * epoch_rows : (e + 1) * epoch_rows] for seq in seqs]
        np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(n))  # disjoint, complete
    for ld in loaders:
        assert [ld.epoch(s) for s in (1, steps)] == [0.0, float(steps * per // epoch_rows)]
    first = next(iter(stream(n, shards)))  # the rows come back with the source's dtypes, as the map-style path's
    batch = Loader(stream(n, shards), 4).local_batch(0)
    assert batch["x"].dtype == np.float32 and batch["x"].shape == (4, 3)
    np.testing.assert_array_equal(batch["x"][0], first["x"])


def test_collate_gets_this_process_rows_as_dicts_of_numpy_values():
    seen = []

    def collate(rows):
        seen.append(rows)
        return {"xy": np.stack([np.append(r["x"], r["y"]) for r in rows]), "id": np.array([r["id"] for r in rows])}

    loader = Loader(stream(24, 4), 8, rows=share(8, 2, 1), collate=collate)
    batch = loader.local_batch(0)
    assert batch["xy"].shape == (4, 4) and batch["xy"].dtype == np.float32
    assert isinstance(seen[-1][0]["x"], np.ndarray) and seen[-1][0]["x"].dtype == np.float32
    assert "stream" in loader.describe() and "xy (4,) float32" in loader.describe()


# ---------------------------------------------------------------------------------------------- resume


def test_a_position_taken_after_any_batch_resumes_with_exactly_the_rows_that_followed(tmp_path):
    files = []
    for f in range(4):  # files of 5, 7, 6 and 6 rows: uneven shards, streamed from disk
        rows = [{"id": 100 * f + i, "x": [float(f), float(i)]} for i in range((5, 7, 6, 6)[f])]
        files.append(tmp_path / f"part{f}.jsonl")
        files[-1].write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = datasets.load_dataset("json", data_files=[str(p) for p in files], split="train", streaming=True)
    rows, steps = share(6, 2, 1), 10  # 3 rows a step; this process's 2 files hold 12 or 13 rows an epoch
    whole = Loader(ds, 6, rows=rows)
    positions = [json.loads(json.dumps(whole.position()))]  # as the trainer saves it beside a checkpoint
    batches = []
    for s in range(steps):
        batches.append(whole.local_batch(s)["id"])
        positions.append(json.loads(json.dumps(whole.position())))
    assert whole.epoch(steps) >= 2  # the positions span epoch boundaries
    for k in range(steps):  # a fresh process restarted from the position after k batches, then again at k2
        resumed = Loader(ds, 6, rows=rows)
        resumed.load_position(positions[k])
        assert resumed.position() == positions[k]
        k2 = (k + steps) // 2
        for s in range(k, k2):
            np.testing.assert_array_equal(resumed.local_batch(s)["id"], batches[s], err_msg=f"resumed at {k}")
        again = Loader(ds, 6, rows=rows)
        again.load_position(json.loads(json.dumps(resumed.position())))  # datasets may word it differently
        for s in range(k2, steps):
            np.testing.assert_array_equal(again.local_batch(s)["id"], batches[s], err_msg=f"resumed at {k}, {k2}")
    with pytest.raises(ConfigError, match="a stream is read in order: batch 3 was asked for, but the next one is 0"):
        Loader(ds, 6, rows=rows).local_batch(3)


@pytest.mark.parametrize(
    "saved_by, loaded_by, match",
    [
        ((2, 0, 4), (4, 0, 4), "saved by process 0 of 2 cannot be restored on process 0 of 4: .*resume on 2"),
        ((2, 0, 4), (2, 1, 4), "saved by process 0 of 2 cannot be restored on process 1 of 2: each process"),
        ((2, 0, 4), (2, 0, 2), "saved for a dataset of 4 shards, this one has 2: resume with the same data"),
    ],
)
def test_a_position_from_another_process_count_or_dataset_is_refused(saved_by, loaded_by, match):
    def loader(world, rank, shards):
        return Loader(stream(24, shards), 4 * world, rows=share(4 * world, world, rank))

    saved = loader(*saved_by)
    saved.local_batch(0)
    with pytest.raises(ConfigError, match=match):
        loader(*loaded_by).load_position(saved.position())
    with pytest.raises(ConfigError, match="not a stream position saved by jdp's StreamLoader"):
        loader(*loaded_by).load_position({"epoch": 0})


# ---------------------------------------------------------------------------------------------- evaluation


@pytest.mark.parametrize("n", [21, 5])
def test_eval_batches_of_a_stream_are_the_map_style_ones_on_every_process(n):
    B, world = 8, 2
    for r in range(world):
        streamed = list(Loader(stream(n, 3), B, rows=share(B, world, r), train=False).eval_batches())
        mapped = list(
            Loader(datasets.Dataset.from_dict(table(n)), B, rows=share(B, world, r), train=False).eval_batches()
        )
        assert len(streamed) == len(mapped) == -(-n // B)  # as many batches on every process
        for a, b in zip(streamed, mapped, strict=True):
            assert a.keys() == b.keys()
            for k in a:
                np.testing.assert_array_equal(a[k], b[k])
    assert "evaluation" in Loader(stream(n, 3), B, train=False).describe()


# ---------------------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "source, rows, match",
    [
        (stream(24, 4).shuffle(seed=0, buffer_size=8), None, r"shuffled with a buffer.*Dataset.shuffle"),
        (stream(1, 1), slice(4, 8), r"process 1 of 2 got no rows from the stream \(1 shard\); give the dataset"),
        (stream(24, 4), slice(0, 3), "not one of equal parts: a stream is split between processes"),
        (
            datasets.Dataset.from_dict({"x": [[1.0, 2.0]] * 5 + [[1.0]] * 3}).to_iterable_dataset(),
            None,
            r"column 'x': row 5 is \(1,\) float32 but row 0 is \(2,\) float32.*counted in the order process 0 of 1",
        ),
        (datasets.Dataset.from_dict({"x": [1] * 8, "s": ["a"] * 8}).to_iterable_dataset(), None, "'s' holds <U1"),
        (datasets.Dataset.from_dict({"x": [1] * 8, "valid": [1] * 8}).to_iterable_dataset(), None, "named 'valid'"),
    ],
)
def test_bad_streams_are_refused_at_construction_with_what_and_how_to_fix(source, rows, match):
    with pytest.raises(ConfigError, match=match):
        Loader(source, 8, rows=rows)


# ---------------------------------------------------------------------------------------------- the trainer


class Linear(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.w = nnx.Linear(3, 1, rngs=rngs)

    def __call__(self, x):
        return self.w(x)[:, 0]


def mse(model, batch):
    err = model(batch["x"]) - batch["y"]
    return jnp.sum(err * err), jnp.float32(err.shape[0])


def fit(run_dir, steps: int) -> dict:
    cfg = jdp.load_config(None, [f"train.run_dir={run_dir}", f"train.steps={steps}", "train.batch_size=16",
                                 "train.log_every=2", "train.eval_every=4", "train.ckpt_every=4",
                                 "train.progress=false", "train.tensorboard=false"])  # fmt: skip
    trainer = jdp.Trainer(lambda: Linear(nnx.Rngs(0)), mse, optax.sgd(0.05), stream(40, 4), cfg,
                          eval_data=stream(11, 2), mesh=parallel.make_mesh(jax.devices()[:2]))  # fmt: skip
    return trainer.fit()


def test_the_trainer_streams_a_dataset_and_a_resumed_run_ends_where_an_uninterrupted_one_does(tmp_path):
    whole = fit(tmp_path / "whole", 8)  # 40 rows, 16 a step: steps 3, 6 and 8 straddle epochs
    first = fit(tmp_path / "split", 4)
    assert first["params_sha256"] != whole["params_sha256"]
    saved = json.loads(RunDir(tmp_path / "split").data_state(4, 0).read_text())
    assert saved["step"] == 4 and saved["read"] == 64  # the position after step 4's batch, beside checkpoint 4
    resumed = fit(tmp_path / "split", 8)
    assert resumed["params_sha256"] == whole["params_sha256"]
    assert resumed["eval_loss"] == pytest.approx(whole["eval_loss"], rel=1e-6)
    logged = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    assert [r["eval_examples"] for r in logged if "eval_loss" in r] == [11.0, 11.0]  # every eval row once
    assert [r["epoch"] for r in logged if "loss" in r] == [0.0, 1.0, 2.0, 3.0]  # after 32, 64, 96, 128 rows


def test_a_stream_saved_by_another_process_count_is_named_on_resume(tmp_path):
    """The reader of saved positions (the checkpoints'): a missing file of this process beside others names the count."""
    from jdp.checkpoint import Checkpoints
    from jdp.rundir import RunDir

    run = RunDir(tmp_path)
    stream_position = Checkpoints(tmp_path, 3).position
    for process in (1, 2):  # saved by processes 1 and 2 of some job; this one is process 0
        run.data_state(4, process).parent.mkdir(parents=True, exist_ok=True)
        run.data_state(4, process).write_text("{}")
    with pytest.raises(ConfigError, match=r"saved by a streaming run of 2 process\(es\); a stream resumes only on as"):
        stream_position(4)
    run.data_state(4, 0).write_text('{"at": 3}')
    assert stream_position(4) == {"at": 3}
