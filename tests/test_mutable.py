"""Models with mutable state (BatchNorm statistics, dropout streams) under every strategy: their variables are
updated by the step and stay identical on every replica, and with global batch statistics and row-keyed dropout
N devices train exactly as one."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from test_parallel import params_close, rel_diff

from jdp import parallel
from jdp.nn import RowDropout
from jdp.parallel.comm_hooks import Mean

# A global batch of 16 rows: 4 per device on 4 devices, 2 per micro-batch with grad_accum=2.
ROWS, FEATURES, CLASSES = 16, 12, 3


class MLP(nnx.Module):
    """A small classifier. global_stats: SyncBatchNorm (statistics over the whole global batch) and RowDropout;
    else NNX's usual per-device BatchNorm and nnx.Dropout, its rngs held in the module."""

    def __init__(self, global_stats: bool, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(FEATURES, 16, rngs=rngs)
        axis = parallel.AXIS if global_stats else None
        self.norm = nnx.BatchNorm(16, momentum=0.8, axis_name=axis, rngs=rngs)
        self.drop = RowDropout(0.3, rngs=rngs) if global_stats else nnx.Dropout(0.3, rngs=rngs)
        self.head = nnx.Linear(16, CLASSES, rngs=rngs)

    def __call__(self, x):
        return self.head(self.drop(nnx.relu(self.norm(self.hidden(x)))))


def loss_fn(model, batch):
    losses = optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["label"])
    return losses.sum(), jnp.float32(losses.shape[0])


def make_batch(seed, rows=ROWS):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, FEATURES)).astype(np.float32) + 2.0  # off-centre: BatchNorm's statistics matter
    return {"x": x, "label": rng.integers(0, CLASSES, rows)}


def mesh_of(n):
    return parallel.make_mesh(jax.devices()[:n])


@functools.cache
def train(n_devices, strategy="ddp", grad_accum=1, global_stats=True, hook=False, steps=3):
    mesh = mesh_of(n_devices)
    optimizer = optax.sgd(0.05, momentum=0.9)
    comm_hook = Mean() if hook else None
    model = MLP(global_stats, nnx.Rngs(0))
    graphdef, state = parallel.init_state(model, optimizer, mesh, strategy, comm_hook)
    initial_rest = jax.device_get(state.rest)
    step = parallel.make_train_step(
        graphdef, loss_fn, optimizer, mesh, grad_accum, strategy=strategy, comm_hook=comm_hook
    )
    losses = []
    for i in range(steps):
        state, metrics = step(state, parallel.shard_batch(make_batch(i), mesh))
        assert int(metrics["skipped"]) == 0
        losses.append(float(metrics["loss"]))
    return mesh, initial_rest, state, losses


@pytest.mark.parametrize(
    "strategy, grad_accum, hook",
    [("ddp", 1, False), ("ddp", 1, True), ("ddp", 2, False), ("zero1", 1, False), ("dp", 2, False)],
)
def test_per_device_batchnorm_and_dropout_train_with_identical_replicas(strategy, grad_accum, hook):
    mesh, initial, state, losses = train(4, strategy, grad_accum, global_stats=False, hook=hook)
    assert all(np.isfinite(losses))
    # The running statistics were updated (they start at mean 0, variance 1) ...
    assert np.abs(np.asarray(state.rest["norm"]["mean"][...])).max() > 1e-3
    assert np.abs(np.asarray(state.rest["norm"]["var"][...]) - 1).max() > 1e-3
    # ... averaged over the devices, so every replica holds the same bits; the dropout stream is as it was.
    tree = {"params": state.params, "rest": state.rest}
    assert parallel.replica_mismatches(tree) == []
    assert parallel.replica_digest_mismatches(parallel.make_replica_digest(mesh), tree, mesh) == []
    rngs = jax.device_get(state.rest["drop"]["rngs"])
    assert int(rngs["count"][...]) == int(initial["drop"]["rngs"]["count"][...])
    assert np.array_equal(
        jax.random.key_data(rngs["key"][...]), jax.random.key_data(initial["drop"]["rngs"]["key"][...])
    )


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "fsdp", "hsdp"])
def test_a_skipped_step_leaves_the_statistics_and_parameters_as_they_were(strategy):
    """A NaN in one device's rows: the step is skipped on every device (parameters, optimizer state and
    statistics unchanged; under fsdp and hsdp each device's rows), and the next finite step trains."""
    mesh = parallel.make_mesh(jax.devices()[:4], shard_size=2 if strategy == "hsdp" else 0)
    optimizer = optax.sgd(0.05, momentum=0.9)
    graphdef, state = parallel.init_state(MLP(False, nnx.Rngs(0)), optimizer, mesh, strategy)
    step = parallel.make_train_step(graphdef, loss_fn, optimizer, mesh, strategy=strategy)
    state, _ = step(state, parallel.shard_batch(make_batch(0), mesh))
    before = jax.device_get((state.rest["norm"], state.params, state.opt_state))
    bad = make_batch(1)
    bad["x"][5] = np.nan  # one device's statistics (and the loss) become NaN
    state, metrics = step(state, parallel.shard_batch(bad, mesh))
    assert int(metrics["skipped"]) == 1
    assert rel_diff(before, (state.rest["norm"], state.params, state.opt_state)) == 0
    state, metrics = step(state, parallel.shard_batch(make_batch(2), mesh))
    assert int(metrics["skipped"]) == 0 and rel_diff(before[1], state.params) > 0


@pytest.mark.parametrize("strategy, grad_accum", [("ddp", 1), ("zero1", 1), ("ddp", 2)])
def test_global_batch_stats_and_row_dropout_on_4_devices_train_as_on_1(strategy, grad_accum):
    _, _, one, one_losses = train(1, strategy, grad_accum)
    mesh, initial, four, four_losses = train(4, strategy, grad_accum)
    np.testing.assert_allclose(four_losses, one_losses, rtol=1e-5)
    assert params_close(one.params, four.params) <= 0
    assert rel_diff(one.rest["norm"], four.rest["norm"]) <= 1e-5
    assert rel_diff(initial["norm"], four.rest["norm"]) > 1e-3  # and they did change
    assert parallel.replica_mismatches({"params": four.params, "rest": four.rest}) == []


class Masks(nnx.Module):
    """loss = sum(dropout(ones) * w): the gradient for w is the sum of the rows' dropout masks (scaled)."""

    def __init__(self, row_keyed: bool, rngs: nnx.Rngs):
        self.w = nnx.Param(jnp.zeros((64,)))
        self.drop = RowDropout(0.5, rngs=rngs) if row_keyed else nnx.Dropout(0.5, rngs=rngs)


def mask_loss(model, batch):
    out = model.drop(jnp.ones((batch["x"].shape[0], 64))) * model.w
    return out.sum(), jnp.float32(batch["x"].shape[0])


def mask_grads(n_devices, row_keyed, step=0, rows=4):
    """The mean over the rows of their (scaled) dropout masks, as the gradient of w on n devices at `step`."""
    mesh = mesh_of(n_devices)
    graphdef, state = parallel.init_state(Masks(row_keyed, nnx.Rngs(1)), optax.sgd(0.1), mesh)
    state = dataclasses.replace(state, step=jax.device_put(jnp.int32(step), parallel.replicated(mesh)))
    grads, _, _ = parallel.make_grad_fn(graphdef, mask_loss, mesh)(
        state, parallel.shard_batch({"x": np.zeros((rows, 1))}, mesh)
    )
    return np.asarray(grads["w"][...])


def test_nnx_dropout_draws_another_mask_on_each_device_and_step():
    # One row per device: were the masks the same on every device, their mean would hold only 0 and 2 (1 / keep).
    g = mask_grads(4, row_keyed=False)
    assert not np.isin(g, [0.0, 2.0]).all()
    assert not np.array_equal(g, mask_grads(4, row_keyed=False, step=1))


def test_row_dropout_masks_depend_on_the_row_and_step_not_the_devices():
    g = mask_grads(4, row_keyed=True)
    np.testing.assert_allclose(g, mask_grads(1, row_keyed=True), rtol=1e-6)
    assert not np.array_equal(g, mask_grads(4, row_keyed=True, step=1))
    assert not np.isin(g, [0.0, 2.0]).all()  # the rows' masks differ from each other
    # Outside a step, eval mode turns it off, as nnx.Dropout's.
    layer = RowDropout(0.5, rngs=nnx.Rngs(0))
    x = jnp.ones((3, 5))
    assert not np.array_equal(layer(x), x)
    layer.eval()
    assert np.array_equal(layer(x), x)


@pytest.mark.parametrize("global_stats", [False, True])
def test_eval_with_valid_counts_only_the_valid_rows(global_stats):
    model = MLP(global_stats, nnx.Rngs(0))
    model.eval()
    batch = make_batch(7, rows=6)
    padded = {k: np.concatenate([v, v[:2]]) for k, v in batch.items()}
    padded["x"][6:] = np.nan  # padding rows count for nothing, even when they make no sense
    padded["valid"] = np.array([1] * 6 + [0] * 2, np.float32)
    results = []
    for n, b in [(1, batch), (4, padded)]:
        mesh = mesh_of(n)
        graphdef, state = parallel.init_state(model, optax.sgd(0.1), mesh)
        loss, weight = parallel.make_eval_step(graphdef, loss_fn, mesh)(state, parallel.shard_batch(b, mesh))
        results.append((float(loss), float(weight)))
    (loss1, weight1), (loss4, weight4) = results
    assert weight1 == weight4 == 6
    assert abs(loss1 - loss4) <= 1e-5 * abs(loss1)
