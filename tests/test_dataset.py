"""jdp.data.dataset: any source of rows in the global order: exactly once, carried across epochs, world-size invariant."""

from __future__ import annotations

import datasets
import numpy as np
import pytest

from jdp.config import ConfigError
from jdp.data.dataset import GlobalOrder, Loader


def images(n: int, seed: int = 0) -> datasets.Dataset:
    rng = np.random.default_rng(seed)
    return datasets.Dataset.from_dict(
        {
            "id": np.arange(n),
            "image": rng.normal(size=(n, 8, 8, 1)).astype(np.float32),
            "label": rng.integers(0, 10, n),
        }
    )


def rank_rows(batch: int, world: int, rank: int) -> slice:
    per = batch // world
    return slice(rank * per, (rank + 1) * per)


def global_batch(source, batch: int, world: int, step: int, **kw) -> dict[str, np.ndarray]:
    """Global batch `step` as `world` processes would assemble it, each materialising only its rows."""
    parts = [Loader(source, batch, rows=rank_rows(batch, world, r), **kw).local_batch(step) for r in range(world)]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


# ---------------------------------------------------------------------------------------------- the order


@pytest.mark.parametrize("n", [40, 37])
def test_every_row_once_per_epoch_and_the_same_global_batches_for_every_world_size(n):
    ds, B = images(n), 8
    steps = -(-3 * n // B)  # three epochs' worth, plus the carried remainder
    per_world = {w: [global_batch(ds, B, w, s, seed=4)["id"] for s in range(steps)] for w in (1, 2, 4)}
    for w in (2, 4):
        for s in range(steps):
            np.testing.assert_array_equal(per_world[w][s], per_world[1][s])
    seq = np.concatenate(per_world[1])
    epochs = [seq[e * n : (e + 1) * n] for e in range(3)]
    for e in epochs:
        np.testing.assert_array_equal(np.sort(e), np.arange(n))  # exactly once, nothing dropped or repeated
    assert not np.array_equal(epochs[0], epochs[1])  # a fresh permutation each epoch


def test_a_batch_straddling_an_epoch_carries_the_end_of_one_into_the_start_of_the_next():
    n, B = 10, 4
    loader = Loader(images(n), B, seed=2)
    order = GlobalOrder(n, B, 2)
    straddle = loader.local_batch(2)["id"]  # entries 8..11: the last two of epoch 0, the first two of epoch 1
    np.testing.assert_array_equal(straddle[:2], np.random.default_rng([2, 0, 0]).permutation(n)[8:])
    np.testing.assert_array_equal(straddle[2:], np.random.default_rng([2, 0, 1]).permutation(n)[:2])
    np.testing.assert_array_equal(straddle, order.indices(2))
    assert loader.epoch(2) == pytest.approx(0.8) and loader.epoch(5) == pytest.approx(2.0)


def test_a_batch_is_a_pure_function_of_seed_and_step():
    ds = images(50)
    walked = Loader(ds, 8, seed=11)
    for s in range(7):
        walked.local_batch(s)
    fresh = Loader(ds, 8, seed=11).local_batch(7)
    for k, v in walked.local_batch(7).items():
        np.testing.assert_array_equal(fresh[k], v)
    other = np.concatenate([Loader(ds, 8, seed=12).local_batch(s)["id"] for s in range(6)])
    assert not np.array_equal(other, np.concatenate([walked.local_batch(s)["id"] for s in range(6)]))


# ---------------------------------------------------------------------------------------------- sources


def test_image_and_label_columns_come_back_as_the_rows_of_the_dataset():
    ds = images(30)
    loader = Loader(ds, 8, seed=1, rows=slice(4, 8))
    batch = loader.local_batch(3)
    idx = GlobalOrder(30, 8, 1).indices(3)[4:8]
    assert batch["image"].shape == (4, 8, 8, 1) and batch["image"].dtype == np.float32
    assert batch["label"].shape == (4,) and batch["label"].dtype.kind == "i"
    np.testing.assert_array_equal(batch["image"], np.asarray(ds["image"], np.float32)[idx])
    np.testing.assert_array_equal(batch["label"], np.asarray(ds["label"])[idx])
    assert loader.n == 30 and loader.position() is None
    assert (
        loader.describe()
        == "30 rows | id () int64, image (8, 8, 1) float32, label () int64 | 3.75 batches of 8 per epoch"
    )


def test_a_dict_of_arrays_and_a_custom_indexable_give_the_batches_an_hf_dataset_gives():
    ds = images(21)
    arrays = ds.with_format("numpy")[:]

    class Rows:  # a user's own source, PyTorch map-style: len() and __getitem__(int) -> dict
        def __len__(self):
            return 21

        def __getitem__(self, i):
            return {k: v[i] for k, v in arrays.items()}

    for s in (0, 3, 9):
        expected = global_batch(ds, 4, 1, s, seed=5)
        for source in (arrays, Rows()):
            got = global_batch(source, 4, 2, s, seed=5)
            assert list(got) == list(expected)
            for k in expected:
                np.testing.assert_array_equal(got[k], expected[k])
                assert got[k].dtype == expected[k].dtype


def test_collate_receives_this_process_rows_in_global_order_and_its_arrays_are_the_batch():
    ds = datasets.Dataset.from_dict({"id": list(range(12)), "text": [f"row {i}" * (i + 1) for i in range(12)]})
    seen = []

    def collate(rows):
        seen.append([int(r["id"]) for r in rows])
        tokens = np.zeros((len(rows), 6), np.int32)
        for i, r in enumerate(rows):
            b = str(r["text"]).encode()[:6]
            tokens[i, : len(b)] = list(b)
        return {"tokens": tokens, "id": np.array([r["id"] for r in rows])}

    loader = Loader(ds, 4, seed=3, collate=collate, rows=slice(2, 4))
    seen.clear()
    batch = loader.local_batch(5)
    idx = GlobalOrder(12, 4, 3).indices(5)[2:]
    assert seen == [idx.tolist()]
    np.testing.assert_array_equal(batch["id"], idx)
    assert batch["tokens"].shape == (2, 6) and bytes(batch["tokens"][0].astype(np.uint8)).startswith(b"row ")
    assert "tokens (6,) int32" in loader.describe()


# ---------------------------------------------------------------------------------------------- evaluation


@pytest.mark.parametrize("world", [1, 2, 4])
def test_eval_batches_cover_every_row_once_in_order_and_mark_the_padding(world):
    n, B = 10, 4
    ds = images(n)
    per_rank = [list(Loader(ds, B, rows=rank_rows(B, world, r), train=False).eval_batches()) for r in range(world)]
    assert {len(p) for p in per_rank} == {3}  # every process runs the same number of eval steps
    ids, valid = [], []
    for step in range(3):
        ids.append(np.concatenate([p[step]["id"] for p in per_rank]))
        valid.append(np.concatenate([p[step]["valid"] for p in per_rank]))
        assert valid[-1].dtype == np.float32 and ids[-1].shape == (B,)
    ids, valid = np.concatenate(ids), np.concatenate(valid)
    np.testing.assert_array_equal(ids[valid == 1], np.arange(n))
    assert valid.tolist() == [1.0] * n + [0.0] * (3 * B - n)
    assert set(ids[valid == 0]) <= set(range(n))  # the padding repeats real rows


def test_an_eval_set_smaller_than_one_batch_is_allowed_but_not_for_training():
    ds = images(3)
    (batch,) = Loader(ds, 8, train=False).eval_batches()
    assert batch["valid"].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    with pytest.raises(ConfigError, match="holds 3 rows, fewer than one global batch .batch_size=8."):
        Loader(ds, 8)


# ---------------------------------------------------------------------------------------------- refused


class Listed:
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def bad_row(i, row, n=8):
    return Listed([row if j == i else {"x": np.zeros(3, np.float32), "y": 1} for j in range(n)])


@pytest.mark.parametrize(
    "source, match",
    [
        (datasets.Dataset.from_dict({"x": []}), "holds no rows"),
        ({}, "holds no rows"),
        (Listed([]), "holds no rows"),
        ({"x": np.zeros(4), "y": np.zeros(5)}, "differ in length"),
        (bad_row(5, (np.zeros(3), 1)), "row 5 of the data is a tuple, not a dict"),
        (
            bad_row(5, {"x": np.zeros(4, np.float32), "y": 1}),
            r"column 'x': row 5 is \(4,\) float32 but row 0 is \(3,\) float32",
        ),
        (bad_row(2, {"x": np.zeros(3, np.float64), "y": 1}), r"column 'x': row 2 is \(3,\) float64 but row 0"),
        (bad_row(3, {"x": np.zeros(3, np.float32)}), r"row 3 of the data has columns \['x'\]"),
        (
            datasets.Dataset.from_dict({"tok": [[1, 2]] * 4 + [[1]] * 4}),
            r"column 'tok': row 4 is \(1,\) int64 but row 0 is \(2,\)",
        ),
        (
            datasets.Dataset.from_dict({"x": [1] * 8, "text": ["a"] * 8}),
            "column 'text' holds <U1 values, not numbers.*collate=",
        ),
        (Listed([{"x": 1, "name": "ab"}] * 8), "column 'name' holds <U2 values, not numbers.*collate="),
        ({"x": np.zeros(8), "tag": np.array(["a"] * 8, object)}, "column 'tag' holds object values"),
        ({"x": np.zeros(8), "valid": np.ones(8)}, "column named 'valid'.*reserves"),
        (  # a stream itself is read by StreamLoader (tests/test_stream_loader.py); a dict of splits is not data
            datasets.IterableDatasetDict({"train": datasets.Dataset.from_dict({"x": [1] * 8}).to_iterable_dataset()}),
            r"an IterableDatasetDict with splits \['train'\]; pass one split",
        ),
        (
            datasets.DatasetDict({"train": datasets.Dataset.from_dict({"x": [1] * 8})}),
            r"DatasetDict with splits \['train'\]; pass one split",
        ),
        (iter([{"x": 1}]), "has no len"),
    ],
)
def test_bad_sources_are_refused_at_construction_with_what_and_where(source, match):
    with pytest.raises(ConfigError, match=match):
        Loader(source, 8, train=False)  # an eval set is sampled in order, so the rows named are fixed


@pytest.mark.parametrize(
    "collate, match",
    [
        (lambda rows: [r["x"] for r in rows], "collate returned a list; it must return a dict"),
        (lambda rows: {"x": np.zeros((len(rows) + 1, 2))}, r"collate returned 'x' with shape \(5, 2\) for 4 rows"),
        (lambda rows: {"x": np.float32(1)}, r"collate returned 'x' with shape \(\) for 4 rows"),
        (lambda rows: {"x": np.array(["a"] * len(rows))}, "collate returned 'x' as <U1 values, not numbers"),
        (lambda rows: {"x": np.zeros(len(rows)), "valid": np.ones(len(rows))}, "column named 'valid'"),
    ],
)
def test_a_bad_collate_is_refused_at_construction(collate, match):
    with pytest.raises(ConfigError, match=match):
        Loader({"x": np.arange(8)}, 4, collate=collate)


@pytest.mark.parametrize("rows", [slice(4, 8), slice(0, 8), slice(2, 2)])
def test_rows_outside_the_global_batch_are_refused(rows):
    with pytest.raises(ConfigError, match=r"is not a non-empty part of a global batch of 4 rows"):
        Loader({"x": np.arange(8)}, 4, rows=rows)


def test_hf_columns_read_from_arrow_equal_datasets_own_numpy_format():
    rng = np.random.default_rng(0)
    features = datasets.Features(
        {
            "nested": datasets.List(datasets.List(datasets.Value("float32"))),
            "grid": datasets.Array2D((3, 2), "int32"),
            "flag": datasets.Value("bool"),
            "label": datasets.ClassLabel(names=["a", "b", "c"]),
        }
    )
    data = {
        "nested": rng.normal(size=(40, 4, 5)).astype(np.float32),
        "grid": rng.integers(0, 9, (40, 3, 2)).astype(np.int32),
        "flag": rng.random(40) > 0.5,
        "label": rng.integers(0, 3, 40),
    }
    ds = datasets.Dataset.from_dict(data, features=features).shuffle(seed=1).select(range(5, 37))  # an indices map
    loader = Loader(ds, 8, seed=2)
    reference = ds.with_format("numpy")
    for step in (0, 5):
        idx = GlobalOrder(len(ds), 8, 2).indices(step)
        expected, got = reference[idx.tolist()], loader.local_batch(step)
        assert list(got) == list(expected)
        for k in expected:
            np.testing.assert_array_equal(got[k], expected[k])
            assert got[k].dtype == expected[k].dtype and got[k].shape == expected[k].shape


def test_64_bit_integers_the_devices_would_wrap_are_refused_naming_the_column():
    """JAX keeps integers in 32 bits unless jax_enable_x64 is on: int64 labels above 2^31 wrapped without a word
    while the banner said int64. In-memory arrays are checked whole at construction, other sources per batch."""
    import datasets

    x = np.zeros((64, 2), np.float32)
    y = np.arange(64, dtype=np.int64)
    assert Loader({"x": x, "y": y}, 8).local_batch(0)["y"].dtype == np.int64  # in range: taken as it is
    y[40] = 2**33
    with pytest.raises(ConfigError, match=r"column 'y' holds 8589934592 \(int64\), beyond int32: .* wrap to 0"):
        Loader({"x": x, "y": y}, 8)
    batches = Loader(datasets.Dataset.from_dict({"x": x, "y": y}), 8, train=False).eval_batches()  # rows in order
    for _ in range(5):
        next(batches)  # rows 0-39: no such value
    with pytest.raises(ConfigError, match=r"column 'y' holds 8589934592"):
        next(batches)  # rows 40-47


def test_a_loader_fingerprints_what_it_can_digest_and_says_none_for_what_it_cannot():
    """What a checkpoint record keeps of a library user's data (issue 42, item 1): equal content, equal
    fingerprint; one value changed, another; an indexable jdp cannot digest is not checked (None)."""
    from jdp.data.dataset import source_for

    arrays = {"x": np.arange(64, dtype=np.float32).reshape(32, 2), "y": np.arange(32)}
    same = {k: v.copy() for k, v in arrays.items()}
    changed = {k: v.copy() for k, v in arrays.items()}
    changed["y"][5] = 7
    prints = [Loader(a, 8).fingerprint() for a in (arrays, same, changed)]
    assert prints[0] == prints[1] != prints[2] and prints[0][""]["rows"] == 32
    assert Loader(images(32), 8).fingerprint() == Loader(images(32), 8).fingerprint() != Loader(images(32, 1), 8).fingerprint()
    rows = [{"x": np.float32(i)} for i in range(32)]
    assert Loader(rows, 8).fingerprint() is None

    class Own:  # a loader of a user's own: Source's default
        def local_batch(self, step):
            return {"x": np.zeros(8)}

    assert source_for(Own(), slice(0, 8), 8, 0, None, train=True).fingerprint() is None
