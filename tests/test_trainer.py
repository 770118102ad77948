"""jdp.Trainer for a library user's own model and data: N devices = 1 device, exact resume, callbacks that own
their cadence, a finished run left alone, and `jdp`'s names unchanged by importing its modules."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jdp
from jdp import parallel


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(2, 32, rngs=rngs)
        self.out = nnx.Linear(32, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.gelu(self.hidden(x)))[:, 0]


def mse(model, batch):
    err = model(batch["x"]) - batch["y"]
    return jnp.sum(err * err), jnp.float32(err.shape[0])


def data(n: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, (n, 2)).astype(np.float32)
    return {"x": x, "y": (np.sin(3 * x[:, 0]) + x[:, 1] ** 2).astype(np.float32)}


def config(run_dir, *extra):
    return jdp.load_config(None, [f"train.run_dir={run_dir}", "train.steps=12", "train.batch_size=16",
                                  "train.log_every=4", "train.eval_every=6", "train.ckpt_every=4",
                                  "train.progress=false", "train.tensorboard=false", *extra])  # fmt: skip


def fit(run_dir, devices=None, callbacks=(), *extra):
    mesh = parallel.make_mesh(devices) if devices is not None else None
    trainer = jdp.Trainer(lambda: MLP(nnx.Rngs(0)), mse, optax.adam(1e-2), data(256, 0), config(run_dir, *extra),
                          eval_data=data(40, 1), callbacks=callbacks, mesh=mesh)  # fmt: skip
    return trainer.fit()


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_four_devices_train_like_one_and_the_run_dir_is_jdp_trains(tmp_path):
    one = fit(tmp_path / "one", jax.devices()[:1])
    four = fit(tmp_path / "four")
    assert four["loss"] == pytest.approx(one["loss"], rel=1e-5)
    assert four["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-5)
    for a, b in zip(jax.tree.leaves(one["state"].params), jax.tree.leaves(four["state"].params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)
    summary = json.loads((tmp_path / "four" / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["devices"] == 4 and summary["params_sha256"] == four["params_sha256"]
    logged = records(tmp_path / "four")
    assert [r["step"] for r in logged if "loss" in r] == [4, 8, 12]
    # every eval row counted once: 40 rows, not the 48 of three padded batches of 16
    assert [(r["step"], r["eval_examples"]) for r in logged if "eval_loss" in r] == [(6, 40.0), (12, 40.0)]
    assert sorted(int(p.name) for p in (tmp_path / "four" / "checkpoints").iterdir()) == [4, 8, 12]


def test_a_run_stopped_and_resumed_ends_with_the_same_parameters(tmp_path):
    whole = fit(tmp_path / "whole")
    first = fit(tmp_path / "split", None, (), "train.steps=6")  # stops at 6 (checkpoint 4 and 6)
    assert first["loss"] is not None
    resumed = fit(tmp_path / "split")
    assert resumed["params_sha256"] == whole["params_sha256"]
    again = fit(tmp_path / "split")  # finished: nothing to do, nothing changed
    assert again["already_complete"] == 12 and again["params_sha256"] == whole["params_sha256"]


def test_the_trained_model_comes_back_on_every_path_and_from_any_checkpoint(tmp_path):
    """fit()["model"] is the trained module whether the run trained (its state whole on every device, or split over
    them) or had already finished; jdp.load reads a user's model from any checkpoint, of any strategy, onto one
    device."""
    ddp = fit(tmp_path / "ddp")
    fsdp = fit(tmp_path / "fsdp", None, (), "parallel.strategy=fsdp")
    again = fit(tmp_path / "ddp")  # already finished: nothing loaded but the model, when asked
    x = data(8, 2)["x"]
    want = np.asarray(ddp["model"](x))
    assert isinstance(again["model"], MLP) and again["already_complete"] == 12
    np.testing.assert_allclose(np.asarray(again["model"](x)), want, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(fsdp["model"](x)), want, rtol=1e-4, atol=1e-5)
    early = jdp.load(tmp_path / "fsdp", lambda: MLP(nnx.Rngs(0)), step=4)
    assert not np.allclose(np.asarray(early(x)), want, rtol=1e-3)  # step 4's parameters, not the last
    last = jdp.load(tmp_path / "fsdp", MLP(nnx.Rngs(1)))  # the template's own values play no part
    np.testing.assert_array_equal(np.asarray(last(x)), np.asarray(fsdp["model"](x)))
    with pytest.raises(jdp.ConfigError, match="has no checkpoint at step 5"):
        jdp.load(tmp_path / "ddp", MLP(nnx.Rngs(0)), step=5)


def test_the_learning_rate_is_recorded_from_inject_hyperparams_and_never_written_as_null(tmp_path):
    """Issue 42, item 13: without `schedule=`, every record said `"lr": null`. An optimizer made with
    optax.inject_hyperparams has its rate recorded (the one each update used); one without has no lr key."""
    schedule = optax.linear_schedule(1e-2, 1e-3, 12)
    injected = optax.inject_hyperparams(optax.adam)(learning_rate=schedule)
    jdp.Trainer(lambda: MLP(nnx.Rngs(0)), mse, injected, data(256, 0), config(tmp_path / "inj")).fit()
    logged = [r for r in records(tmp_path / "inj") if "loss" in r]
    assert [r["lr"] for r in logged] == pytest.approx([float(schedule(s - 1)) for s in (4, 8, 12)], rel=1e-6)
    fit(tmp_path / "plain")
    assert all("lr" not in r for r in records(tmp_path / "plain")), records(tmp_path / "plain")[:2]


def test_callbacks_own_their_cadence_and_see_the_state(tmp_path):
    seen = []

    def note(info: jdp.StepInfo):
        seen.append((info.step, float(jnp.sum(info.model.out.bias[...])), info.is_main))

    fit(tmp_path / "run", None, [jdp.every(5, note, at_end=True)])
    assert [s for s, _, _ in seen] == [5, 10, 12]
    assert len({b for _, b, _ in seen}) == 3  # the model the callback sees is the trained one at each step


RECORDER = """
import jdp

class Recorder(jdp.Callback):
    seen = []

    def on_batch(self, loop, step, local):
        Recorder.seen.append(("batch", step, len(local["x"])))
        return local

    def at(self, loop, point, step):
        Recorder.seen.append((point, step))

def not_a_callback():
    return 42
"""


def test_a_callback_named_in_the_config_sees_every_batch_and_the_loops_named_points(tmp_path, monkeypatch):
    """named-callback (docs/training.md): `train.callbacks=module:name` is read by the trainer `jdp train` runs on."""
    (tmp_path / "mine.py").write_text(RECORDER)
    monkeypatch.syspath_prepend(str(tmp_path))
    from mine import Recorder

    fit(tmp_path / "run", None, (), "train.callbacks=mine:Recorder", "train.check_replicas_every=6")
    seen = Recorder.seen
    assert [e for e in seen if e[0] == "batch"] == [("batch", s, 16) for s in range(1, 13)]
    assert set(jdp.callbacks.POINTS) == {e[0] for e in seen} - {"batch"}  # every point is reached
    assert [s for p, s, *_ in seen if p == "log"] == [4, 8, 12]
    assert [s for p, s, *_ in seen if p == "eval"] == [6, 12]
    assert [s for p, s, *_ in seen if p == "replicas"] == [0, 6]  # at start, then every 6 (not the last step)
    assert [s for p, s, *_ in seen if p == "save"] == [s for p, s, *_ in seen if p == "saving"] == [4, 8, 12]
    assert [s for p, s, *_ in seen if p == "step_end"] == list(range(1, 13))
    assert seen.index(("save", 4)) < seen.index(("step_end", 4)) < seen.index(("batch", 5, 16))
    for spec, message in [
        ("mine", "'mine' is not module:name"),
        ("nowhere_at_all:X", "cannot import 'nowhere_at_all'"),
        ("mine:Missing", "module 'mine' has no callable 'Missing'"),
        ("mine:not_a_callback", r"mine:not_a_callback\(\) returned a int, not a jdp.Callback"),
    ]:
        with pytest.raises(jdp.ConfigError, match=f"train.callbacks='{spec}': {message}"):
            fit(tmp_path / "bad", None, (), f"train.callbacks={spec}")
        assert not (tmp_path / "bad").exists()  # refused before anything ran


def test_a_named_callback_module_that_cannot_load_is_one_config_error(tmp_path, monkeypatch):
    """A syntax error, a module that raises on import, a factory that needs arguments: tracebacks before, now each a
    ConfigError naming the spec and what went wrong."""
    (tmp_path / "broken.py").write_text("def f(:\n    pass\n")
    (tmp_path / "raising.py").write_text("raise RuntimeError('no GPU here')\n")
    (tmp_path / "needy.py").write_text("import jdp\n\nclass Needs(jdp.Callback):\n    def __init__(self, n):\n"
                                       "        self.n = n\n")  # fmt: skip
    monkeypatch.syspath_prepend(str(tmp_path))
    for spec, message in [
        ("broken:f", r".*broken.py, line 1: .*\(a syntax error in the module\)"),
        ("raising:X", "importing 'raising' raised RuntimeError: no GPU here"),
        ("needy:Needs", r"needy:Needs\(\) cannot be called without arguments \(.*missing 1 required"),
    ]:
        with pytest.raises(jdp.ConfigError, match=f"train.callbacks='{spec}': {message}"):
            jdp.callbacks.imported(spec)


def test_bad_input_is_refused_before_anything_runs(tmp_path):
    with pytest.raises(jdp.ConfigError, match="train.run_dir is empty"):
        jdp.Trainer(MLP(nnx.Rngs(0)), mse, optax.adam(1e-2), data(64, 0), jdp.Config())
    own = jdp.Loader(data(256, 0), 16)  # a loader of one's own: rows 0:16, this one process's share
    assert jdp.Trainer(MLP(nnx.Rngs(0)), mse, optax.adam(1e-2), own, config(tmp_path / "ok")).fit()["loss"]
    with pytest.raises(
        jdp.ConfigError, match="reads rows 0:8 of global batches of 8, but this process's share is rows 0:16"
    ):
        jdp.Trainer(MLP(nnx.Rngs(0)), mse, optax.adam(1e-2), jdp.Loader(data(256, 0), 8), config(tmp_path / "x")).fit()
    with pytest.raises(jdp.ConfigError, match="train.batch_size=18 is not divisible by devices"):
        fit(tmp_path / "bad", None, (), "train.batch_size=18")
    assert not (tmp_path / "bad").exists()


def test_every_exported_name_is_the_same_object_after_importing_every_module():
    code = """
import importlib, pkgutil
import jdp
before = {name: getattr(jdp, name) for name in jdp.__all__}
for m in pkgutil.iter_modules(jdp.__path__):
    importlib.import_module(f"jdp.{m.name}")
changed = [name for name in jdp.__all__ if getattr(jdp, name) is not before[name]]
assert not changed, f"importing jdp's modules changed jdp.{changed}"
assert callable(jdp.train) and jdp.train.__module__ == "jdp.lm"
print("ok", len(before))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr[-2000:]
