"""Working with runs: TensorBoard event files, plots and the goodput summary, made from real tiny runs."""

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from jdp.config import ConfigError, load_config, validate
from jdp.lm import train
from jdp.metrics import read_metrics

SMALL = [
    "model.n_layers=1", "model.d_model=64", "model.max_seq_len=64", "data.seq_len=64", "train.batch_size=8",
    "train.log_every=3", "train.eval_every=6", "train.ckpt_every=6", "train.progress=false", "data.val_tokens=2048",
]  # fmt: skip


@pytest.fixture(scope="module")
def resumed_run(made_once):
    """12 steps; then the checkpoint at 12 is lost (as if the job died before writing it) and the run is
    resumed from step 6 and extended to 18 steps: steps 7-12 are redone, 13-18 are new. (One worker's; the first
    attempt's records kept beside the run.)"""

    def make(d: Path) -> None:
        run_dir = d / "a"
        train(load_config("tiny", [*SMALL, "train.steps=12", f"train.run_dir={run_dir}"]))
        shutil.copy(run_dir / "metrics.jsonl", d / "first-metrics.jsonl")
        shutil.rmtree(run_dir / "checkpoints" / "12")
        train(load_config("tiny", [*SMALL, "train.steps=18", f"train.run_dir={run_dir}"]))

    d = made_once("resumed-run", make)
    return d / "a", read_metrics(d / "first-metrics.jsonl")


def _scalars(run_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_tensorboard_event_files_read_back_with_tensorboards_reader(resumed_run):
    run_dir, _ = resumed_run
    records = read_metrics(run_dir / "metrics.jsonl")
    train_loss = [(r["step"], r["loss"]) for r in records if "loss" in r]
    tb_loss = _scalars(run_dir, "train/loss")
    # Every logged step once (the resumed run's steps 9 and 12 replaced the lost attempt's), same values.
    assert [s for s, _ in tb_loss] == [s for s, _ in train_loss] == [3, 6, 9, 12, 15, 18]
    np.testing.assert_allclose([v for _, v in tb_loss], [v for _, v in train_loss], rtol=1e-6)
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    tb_eval = _scalars(run_dir, "eval/loss")
    assert [s for s, _ in tb_eval] == [s for s, _ in evals] == [6, 12, 18]
    assert [s for s, _ in _scalars(run_dir, "goodput/goodput")] == [18]


def test_goodput_accounts_for_the_wall_clock_and_the_lost_work(resumed_run):
    run_dir, first = resumed_run
    goodputs = [r["goodput"] for r in read_metrics(run_dir / "metrics.jsonl") if "goodput" in r]
    assert len(goodputs) == 1  # the first attempt's summary moved to metrics.superseded.jsonl with its steps
    g = goodputs[0]
    assert g["lost_steps"] == 6 and g["lost_work_s"] > 0
    parts = ["startup_s", "compile_s", "data_wait_s", "train_steps_s", "eval_s", "checkpoint_s"]
    parts += ["replica_checks_s", "lost_work_s"]
    assert all(g[k] >= 0 for k in parts)
    assert sum(g[k] for k in parts) == pytest.approx(g["wall_s"], rel=1e-6)
    assert 0 < g["goodput"] < 1 and g["compile_s"] > 0 and g["eval_s"] > 0
    # Half of this attempt's 12 steps redid lost work: about as much time lost as spent on new steps.
    assert 0.5 < g["lost_work_s"] / g["train_steps_s"] < 2
    first_goodput = [r["goodput"] for r in first if "goodput" in r][0]
    assert first_goodput["lost_steps"] == 0 and first_goodput["lost_work_s"] == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["goodput"] == g and summary["resumed_from"] == 6


def test_plot_overlays_runs_into_a_png(resumed_run, tmp_path):
    import matplotlib.image

    run_dir, _ = resumed_run
    other = tmp_path / "b"
    shutil.copytree(run_dir, other)
    out = tmp_path / "cmp.png"
    result = subprocess.run(
        [sys.executable, "-m", "jdp.cli", "plot", str(run_dir), str(other), "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    image = matplotlib.image.imread(out)
    assert image.shape[0] > 300 and image.shape[1] > 1000
    colours = np.unique((image[..., :3] * 255).astype(np.uint8).reshape(-1, 3), axis=0)
    assert len(colours) > 50  # curves, text and two run colours, not a blank canvas
    bad = subprocess.run(
        [sys.executable, "-m", "jdp.cli", "plot", str(tmp_path / "nope")], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "has no metrics.jsonl" in bad.stderr


def test_wandb_requested_but_not_installed_is_a_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` fail
    with pytest.raises(ConfigError, match="pip install wandb"):
        validate(load_config("tiny", ["train.wandb_project=mine"]), n_devices=1)


def test_wandb_offline_run_gets_every_record_and_keeps_its_id_across_restarts(tmp_path, monkeypatch):
    from jdp.metrics import MetricsLog

    monkeypatch.setenv("WANDB_MODE", "offline")  # no network: W&B writes its run file locally
    monkeypatch.setenv("WANDB_SILENT", "true")
    path = tmp_path / "run" / "metrics.jsonl"
    for attempt in range(2):  # a run and its resumption
        log = MetricsLog(path, tensorboard=False, wandb_project="jdp-test", config={"attempt": attempt})
        log.write({"step": 1 + 2 * attempt, "loss": 2.5, "tokens_per_sec": None})
        log.write({"step": 2 + 2 * attempt, "eval_loss": 2.25, "goodput": {"goodput": 0.5}})
        log.close()
    run_id = (tmp_path / "run" / "wandb-run-id").read_text()
    files = sorted((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2 and all(f.name == f"run-{run_id}.wandb" for f in files)  # one W&B run, resumed
    tags = (b"train/loss", b"eval/loss", b"goodput/goodput")
    deadline = time.monotonic() + 20  # wandb-core (a process of its own) may still be writing the file
    while not all(tag in (data := files[-1].read_bytes()) for tag in tags) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(tag in data for tag in tags), [tag for tag in tags if tag not in data]
    assert b"train/tokens_per_sec" not in data  # None is not a number to chart


@pytest.mark.slow
def test_a_second_run_of_the_same_config_loads_its_programs_from_the_compilation_cache(tmp_path):
    """jdp's own default cache (CACHE/xla, not the suite's JAX_COMPILATION_CACHE_DIR): the first run writes the
    compiled steps, an identical second run finds every one of them there (and writes nothing new)."""
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env |= {"JDP_CACHE": str(tmp_path / "cache"), "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}

    def run(name, *extra):
        args = ["train", "tiny", *SMALL, "train.steps=3", f"train.run_dir={tmp_path / name}", *extra]
        out = subprocess.run([sys.executable, "-m", "jdp.cli", *args], env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout

    xla = tmp_path / "cache" / "xla"
    assert f"compile cache {xla}" in run("first")
    entries = sorted(p.name for p in xla.iterdir())
    assert any(name.startswith("jit_step") for name in entries), entries  # the train step, at least
    run("second")
    assert sorted(p.name for p in xla.iterdir() if not p.name.endswith("-atime")) == [
        e for e in entries if not e.endswith("-atime")
    ]
    shutil.rmtree(xla)
    assert "compile cache off" in run("third", "train.compile_cache=false") and not xla.exists()


def test_a_job_of_two_processes_compiles_with_the_cache_off(tmp_path, spawn):
    """JAX keys its cache per process (process 1 never reads what process 0 wrote), and on jaxlib 0.12.1 a step that
    process 0 read from the cache while process 1 compiled it never finished: a job of several processes switches
    the cache off as it joins, so the cache directory stays empty, even with every program worth caching (a second
    run, the one that hung, then has nothing to read: it runs as this one did)."""
    cache = tmp_path / "xla"
    env = {"JAX_COMPILATION_CACHE_DIR": str(cache), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    args = ["-m", "jdp.cli", "train", "tiny", *SMALL, "train.steps=2", f"train.run_dir={tmp_path / 'run'}"]
    results = spawn(args, 2, 1, env=env, timeout=150)
    assert [rc for rc, _, _ in results] == [0, 0], results[0][2][-2000:] + results[1][2][-2000:]
    assert "compile cache off (several processes" in results[0][1]
    assert not cache.exists() or not any(cache.iterdir()), sorted(p.name for p in cache.iterdir())


def test_a_cut_off_last_line_in_metrics_jsonl_does_not_block_resume_or_plot(tmp_path, capsys):
    run_dir = tmp_path / "run"
    train(load_config("tiny", [*SMALL, "train.steps=6", f"train.run_dir={run_dir}"]))
    log = run_dir / "metrics.jsonl"
    whole = log.read_text()
    log.write_text(whole + '{"step": 7, "loss": 2.71')  # what a crash in mid-write leaves
    from jdp.plot import load_run

    assert load_run(run_dir)  # jdp plot reads what is whole
    assert "metrics.jsonl: line(s) [" in capsys.readouterr().err
    result = train(load_config("tiny", [*SMALL, "train.steps=9", f"train.run_dir={run_dir}"]))
    assert result["loss"] == result["loss"]
    err = capsys.readouterr().err
    assert "cut-off or damaged line(s) moved to" in err and "metrics.damaged.jsonl" in err
    assert (run_dir / "metrics.damaged.jsonl").read_text() == '{"step": 7, "loss": 2.71\n'
    steps = [r["step"] for r in read_metrics(log) if "loss" in r]
    assert steps == sorted(set(steps)) and steps[-1] == 9  # whole again, every step once


def _files(run_dir) -> dict:
    """Every file under a run directory and its bytes."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def test_a_finished_run_run_again_changes_nothing_and_raising_steps_continues_it(tmp_path):
    """A scheduler's retry of a finished run: `jdp train` says so, exits 0, and leaves every file byte-identical
    (no second evaluation, summary or goodput record); a larger train.steps still continues it."""
    import os

    run_dir = tmp_path / "run"
    args = ["tiny", *SMALL, "train.steps=6", f"train.run_dir={run_dir}"]
    first = train(load_config(args[0], args[1:]))
    before = _files(run_dir)
    again = subprocess.run([sys.executable, "-m", "jdp.cli", "train", *args], capture_output=True, text=True,
                           timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})  # fmt: skip
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"jdp: run already complete at step 6 ({run_dir})" in again.stdout, again.stdout
    assert "compil" not in again.stdout.lower() and "goodput" not in again.stdout
    assert _files(run_dir) == before
    in_process = train(load_config(args[0], args[1:]))  # the library says the same
    assert in_process["already_complete"] == 6 and in_process["loss"] == first["loss"]
    assert _files(run_dir) == before
    more = train(load_config(args[0], [*args[1:-2], "train.steps=9", f"train.run_dir={run_dir}"]))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 9 and summary["resumed_from"] == 6 and more["loss"] == summary["loss"]
    assert (summary["platform"], summary["device_kind"]) == ("cpu", "cpu")  # what `jdp plan --calibrate` checks
    evals = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "eval_loss" in r]
    assert evals == [6, 9]  # each evaluation once


def test_a_changed_config_on_a_finished_run_is_refused_not_called_complete(tmp_path):
    run_dir = tmp_path / "run"
    train(load_config("tiny", [*SMALL, "train.steps=3", f"train.run_dir={run_dir}"]))
    with pytest.raises(
        ConfigError, match=r"refusing to resume: the config changes what training computes:\n  optim.lr"
    ):
        train(load_config("tiny", [*SMALL, "train.steps=3", "optim.lr=0.01", f"train.run_dir={run_dir}"]))


def _jdp_train_error(run_dir, capsys) -> tuple[int, str]:
    from jdp.cli import main

    code = main(["train", "tiny", *SMALL, "train.steps=2", f"train.run_dir={run_dir}"])
    return code, capsys.readouterr().err


def test_a_run_dir_that_is_a_file_or_holds_other_files_is_refused_with_exit_2(tmp_path, capsys):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine\n")
    code, err = _jdp_train_error(a_file, capsys)
    assert code == 2 and f"train.run_dir={a_file} is a file, not a directory" in err, err
    code, err = _jdp_train_error(a_file / "run", capsys)  # a file on the way
    assert code == 2 and "cannot be written: Not a directory" in err and str(a_file) in err, err
    assert "Traceback" not in err and "failed while" not in err
    (tmp_path / "data").mkdir()
    for name in ("a.jsonl", "b.jsonl", "notes"):
        (tmp_path / "data" / name).write_text("{}\n")
    code, err = _jdp_train_error(tmp_path / "data", capsys)
    assert code == 2 and "is not empty and is not a jdp run directory (it holds a.jsonl, b.jsonl, notes)" in err
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["a.jsonl", "b.jsonl", "notes"]  # untouched
    assert a_file.read_text() == "mine\n"


def test_a_run_dir_on_a_read_only_file_system_is_exit_2_naming_the_path(tmp_path, capsys):
    mount = tmp_path / "ro"
    mount.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mount)], check=True,
                       capture_output=True)  # fmt: skip
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"mounting a read-only tmpfs needs root: {e}")
    try:
        code, err = _jdp_train_error(mount / "run", capsys)
    finally:
        subprocess.run(["umount", str(mount)], check=True)
    assert code == 2, err
    assert f"train.run_dir={mount / 'run'} cannot be written: Read-only file system" in err, err
    assert "Traceback" not in err and "failed while" not in err


def test_a_full_disk_under_metrics_jsonl_names_the_file_and_the_space_left(tmp_path):
    """Issue 42, item 9: a full disk while writing metrics.jsonl was an OSError (`[Errno 28]`) naming neither the
    file nor the space, as a failed checkpoint save does. /dev/full answers every write with ENOSPC."""
    from jdp.metrics import MetricsLog, MetricsWriteFailed

    (tmp_path / "metrics.jsonl").symlink_to("/dev/full")
    log = MetricsLog(tmp_path / "metrics.jsonl")
    with pytest.raises(MetricsWriteFailed) as failed:
        log.write({"step": 7, "loss": 1.5})
    message = str(failed.value)
    assert message.startswith(f"{tmp_path / 'metrics.jsonl'} could not be written: No space left on device (")
    assert "bytes free there); the record of step 7 was not saved. Free some space and run the same command" in message
    log.close()  # the buffered line is not flushed again at close
