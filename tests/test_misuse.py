"""A library user's mistakes get jdp's words and the fix, before anything compiles, never a raw JAX error or a crash."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from test_library import run_on_four_devices

import jdp
from jdp.config import ConfigError

STRATEGIES = ["ddp", "zero1", "dp"]


class Tiny(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.out = nnx.Linear(2, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(x)


def sum_loss(model, batch):
    losses = optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"])
    return losses.sum(), jnp.float32(losses.shape[0])


def mean_loss(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()


def rows(n: int) -> dict:
    return {"x": np.ones((n, 2), np.float32), "y": np.zeros((n,), np.int32)}


def step_and_state(strategy: str, loss_fn=sum_loss, grad_accum: int = 1):
    mesh, optimizer = jdp.make_mesh(), optax.sgd(0.1)
    graphdef, state = jdp.init_state(Tiny(nnx.Rngs(0)), optimizer, mesh, strategy=strategy)
    step = jdp.make_train_step(graphdef, loss_fn, optimizer, mesh, grad_accum, strategy=strategy)
    return mesh, step, state


def test_shard_batch_refuses_rows_that_do_not_split_over_the_devices():
    # Was: jax's IndivisibleError about "per-dimension tiling factors".
    with pytest.raises(ConfigError, match=r"62 rows \(batch\['x'\]\) .* 4 devices; use a multiple of 4 rows, e.g. 60"):
        jdp.shard_batch(rows(62), jdp.make_mesh())


def test_step_refuses_rows_that_do_not_split_over_the_devices():
    """A batch that bypasses shard_batch (plain numpy) is checked by the step too."""
    _, step, state = step_and_state("ddp")
    with pytest.raises(ConfigError, match=r"62 rows .* 4 devices; use a multiple of 4 rows, e.g. 60 or 64"):
        step(state, rows(62))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_step_refuses_grad_accum_that_does_not_divide_rows_per_device(strategy):
    # Was: "cannot reshape array of shape (16, 2) (size 32) into shape (3, 5, 2)".
    mesh, step, state = step_and_state(strategy, grad_accum=3)
    with pytest.raises(ConfigError) as refused:
        step(state, jdp.shard_batch(rows(64), mesh))
    assert str(refused.value) == (
        "train step: a global batch of 64 rows (batch['x']) does not split evenly over devices (4) x grad_accum (3) "
        "= 12; use a multiple of 12 rows, e.g. 60 or 72, or a grad_accum that divides its 16 rows per device"
    )


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_loss_returning_a_mean_is_refused_with_the_contract(strategy):
    # Was: "expected function with aux output to return a two-element tuple, but got ... LinearizeTracer".
    mesh, step, state = step_and_state(strategy, loss_fn=mean_loss)
    with pytest.raises(ConfigError) as refused:
        step(state, jdp.shard_batch(rows(64), mesh))
    message = str(refused.value)
    assert message.startswith("loss_fn must return (loss_sum, weight_sum), two scalars")
    assert "mean_loss returned one value, float32[] (a mean?)" in message
    assert "`return losses.sum(), jnp.float32(losses.shape[0])`" in message


def test_loss_returning_per_row_losses_is_refused():
    mesh, step, state = step_and_state("ddp", loss_fn=lambda m, b: (sum_loss(m, b)[0][None], jnp.float32(1)))
    with pytest.raises(ConfigError, match=r"returned a pair \(float32\[1\], float32\[\]\), not two scalars"):
        step(state, jdp.shard_batch(rows(64), mesh))


DONATED_TWICE = """
import jax.numpy as jnp, numpy as np, optax
from flax import nnx
import jdp

class Tiny(nnx.Module):
    def __init__(self, rngs):
        self.out = nnx.Linear(2, 2, rngs=rngs)
    def __call__(self, x):
        return self.out(x)

def loss_fn(model, batch):
    losses = optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"])
    return losses.sum(), jnp.float32(losses.shape[0])

mesh, optimizer = jdp.make_mesh(), optax.sgd(0.1)
batch = jdp.shard_batch({"x": np.ones((8, 2), np.float32), "y": np.zeros((8,), np.int32)}, mesh)
for strategy in ("ddp", "zero1", "dp"):
    graphdef, state = jdp.init_state(Tiny(nnx.Rngs(0)), optimizer, mesh, strategy=strategy)
    step = jdp.make_train_step(graphdef, loss_fn, optimizer, mesh, strategy=strategy)
    new, _ = step(state, batch)
    for name, again in (("train", step), ("eval", jdp.make_eval_step(graphdef, loss_fn, mesh))):
        try:
            again(state, batch)  # the state the step consumed
        except jdp.ConfigError as e:
            print(f"{strategy} {name} refused:", e)
    step(new, batch)  # the state it returned still steps
"""


def test_reusing_a_donated_state_is_refused_not_a_crash(tmp_path):
    """In a subprocess: jaxlib 0.10.2 died of a segfault (exit 139) here, jax 0.12 raised a bare RuntimeError."""
    out = run_on_four_devices(tmp_path, DONATED_TWICE)
    refused = [line for line in out.stdout.splitlines() if " refused: " in line]
    expected = [f"{strategy} {name}" for strategy in STRATEGIES for name in ("train", "eval")]
    assert [line.split(" refused:")[0] for line in refused] == expected, out.stdout
    for line in refused:
        assert "this state's arrays were consumed by an earlier train step" in line, line
        assert "`state, metrics = step(state, batch)`" in line, line
