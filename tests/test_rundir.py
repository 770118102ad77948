"""The run directory across runs: train.resume=false archives the whole old run, a resume notices metrics.jsonl's
lost records, and a run that never starts leaves no directory behind. Tiny real runs."""

import json
import os
import subprocess
import sys

from jdp.cli import main
from jdp.config import load_config
from jdp.lm import train

TINY = [
    "model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.max_seq_len=32", "data.seq_len=32",
    "train.batch_size=8", "train.progress=false", "data.val_tokens=1024",
]  # fmt: skip


def _files(run_dir) -> dict:
    """Every file under a run directory and its bytes."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def test_resume_false_archives_every_file_of_the_old_run_config_included(tmp_path):
    run_dir = tmp_path / "run"
    args = [*TINY, "train.steps=2", "train.ckpt_every=2", f"train.run_dir={run_dir}"]
    train(load_config("tiny", [*args, "optim.lr=0.002"]))
    (run_dir / "plot.png").write_bytes(b"\x89PNG jdp plot's output")
    earlier = run_dir / "archived-20250101-000000"  # an archive of a run before that one: stays where it is
    earlier.mkdir()
    (earlier / "config.yaml").write_text("old\n")
    old = {name: data for name, data in _files(run_dir).items() if not name.startswith("archived-")}
    assert {"config.yaml", "summary.json", "metrics.jsonl", "plot.png"} <= set(old)
    train(load_config("tiny", [*args, "optim.lr=0.001", "train.resume=false"]))
    archives = sorted(p for p in run_dir.iterdir() if p.name.startswith("archived-") and p != earlier)
    assert len(archives) == 1, archives
    assert _files(archives[0]) == old  # file by file, byte for byte: config.yaml's lr 0.002 included
    assert _files(earlier) == {"config.yaml": b"old\n"}
    assert "lr: 0.002" in (archives[0] / "config.yaml").read_text()
    assert "lr: 0.001" in (run_dir / "config.yaml").read_text()  # the new run's
    assert not list(archives[0].glob(".jdp-lock*")) and not (run_dir / "plot.png").exists()


def test_a_deleted_metrics_jsonl_is_named_on_resume_and_counted_in_the_summary(tmp_path, capsys):
    run_dir = tmp_path / "run"
    args = [*TINY, "train.log_every=1", "train.eval_every=4", "train.ckpt_every=4", f"train.run_dir={run_dir}"]
    train(load_config("tiny", [*args, "train.steps=4"]))
    (run_dir / "metrics.jsonl").unlink()
    capsys.readouterr()
    train(load_config("tiny", [*args, "train.steps=5"]))
    err = capsys.readouterr().err
    assert "jdp: warning: metrics.jsonl has no records for steps 1-4 (4 logged steps up to the checkpoint" in err
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from"] == 4 and summary["missing_metrics_steps"] == 4


def _jdp_train(run_dir, capsys, *extra) -> tuple[int, str]:
    code = main(["train", "tiny", *TINY, "train.steps=2", f"train.run_dir={run_dir}", *extra])
    return code, capsys.readouterr().err


def test_a_run_that_never_starts_leaves_no_run_directory(tmp_path, capsys):
    bad_tokenizer = tmp_path / "tokenizer.json"
    bad_tokenizer.write_text("not a tokenizer\n")
    cases = {
        "optim.lr=-1": ["optim.lr=-1"],
        "missing data": [f"data.source={tmp_path / 'no-such-data'}/*.txt"],
        "bad tokenizer": [f"data.tokenizer={bad_tokenizer}"],
    }
    for name, extra in cases.items():
        run_dir = tmp_path / "new" / name.replace(" ", "-") / "run"
        code, err = _jdp_train(run_dir, capsys, *extra)
        assert code == 2 and "jdp: error:" in err and "Traceback" not in err, (name, err)
        assert not run_dir.exists() and not (tmp_path / "new").exists(), name
    empty = tmp_path / "empty"
    empty.mkdir()
    code, err = _jdp_train(empty, capsys, f"data.tokenizer={bad_tokenizer}")
    assert code == 2 and empty.is_dir() and not list(empty.iterdir()), err  # existed before: stays, empty


def test_jdp_train_with_a_bad_value_exits_2_and_creates_nothing(tmp_path):
    run_dir = tmp_path / "run"
    args = ["train", "tiny", *TINY, "train.steps=2", "optim.lr=-1", f"train.run_dir={run_dir}"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-m", "jdp.cli", *args], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 2 and "jdp: error:" in out.stderr and "optim.lr" in out.stderr, out.stderr[-2000:]
    assert not run_dir.exists()


def test_a_lock_cut_off_while_written_is_taken_over_once_old_and_waited_for_while_fresh(tmp_path, capsys):
    """A crash or a full disk between creating RUN_DIR/.jdp-lock and writing it leaves a lock that does not parse:
    once it is older than RunLock.WRITE_S its job is gone and the run takes it over, saying so; a fresh one may
    be a job creating it right now, so it is refused with a retry hint, never taken."""
    import time

    from jdp.rundir import RunDir, RunDirInUse, RunLock

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lock = run_dir / ".jdp-lock"
    lock.write_text('{"host": "node3", "pi')
    fresh = RunLock(RunDir(run_dir))
    try:
        fresh.acquire()
        raise AssertionError("a lock that may be being written was taken")
    except RunDirInUse as e:
        assert "try again in a few seconds" in str(e)
    assert lock.read_text() == '{"host": "node3", "pi'
    old = time.time() - 2 * RunLock.WRITE_S
    os.utime(lock, (old, old))
    code, err = _jdp_train(run_dir, capsys)
    assert code == 0, err
    assert f"jdp: warning: took over {lock} from a job that is gone (its lock was cut off while written" in err
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2 and not lock.exists()


def test_an_unfinished_run_with_train_steps_below_its_checkpoint_is_refused_not_called_done(tmp_path, capsys):
    """Checkpoint at 4 (the run was killed: no summary), then train.steps=2: it would restore step 4, run nothing
    and end `done: loss nan` with exit 0. Refused before any compute, the run directory untouched."""
    run_dir = tmp_path / "run"
    code, err = _jdp_train(run_dir, capsys, "train.steps=4", "train.ckpt_every=2")
    assert code == 0, err
    (run_dir / "summary.json").unlink()  # as a killed run leaves it
    before = _files(run_dir)
    code, err = _jdp_train(run_dir, capsys, "train.steps=3", "train.ckpt_every=2")
    assert code == 2 and "Traceback" not in err, err
    assert f"jdp: error: the run in {run_dir} is already at step 4 >= train.steps=3" in err, err
    assert {k: v for k, v in _files(run_dir).items() if not k.startswith(".jdp-lock")} == {
        k: v for k, v in before.items() if not k.startswith(".jdp-lock")
    }


def test_a_tilde_in_run_dir_and_cache_dir_means_the_home_directory(tmp_path, capsys, monkeypatch):
    """train.run_dir=~/runs/x wrote into ./~/runs/x while the banner said ~/runs/x."""
    from jdp.config import DataConfig
    from jdp.data.corpus import cache_root

    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(), work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    code, err = _jdp_train("~/runs/x", capsys)
    assert code == 0, err
    assert (home / "runs" / "x" / "config.yaml").is_file() and not (work / "~").exists()
    assert cache_root(DataConfig(cache_dir="~/cache")) == home / "cache"


def test_a_resume_over_changed_data_is_refused_unless_accepted_and_the_same_data_rewritten_resumes(tmp_path, capsys):
    """Issue 42, item 1: a file added to the source between runs changed the held-out documents and the window
    order, and the run resumed without a word. The checkpoint record keeps the data's fingerprint; a changed
    source is refused (exit 2, the run directory untouched), data.accept_changes=true goes on with a warning and
    records the new data, and the same files written again (new times) resume as they are."""
    src = tmp_path / "txt"
    src.mkdir()
    for i in range(4):
        (src / f"d{i}.txt").write_text(" ".join(f"word{(i * 7 + j) % 50}" for j in range(600)))
    run_dir = tmp_path / "run"
    data = [f"data.source={src}", "train.ckpt_every=2"]
    code, err = _jdp_train(run_dir, capsys, *data)
    assert code == 0, err
    (src / "d4.txt").write_text(" ".join(f"new{j % 13}" for j in range(900)))
    before = _files(run_dir)
    code, err = _jdp_train(run_dir, capsys, *data, "train.steps=4")
    assert code == 2 and "Traceback" not in err, err
    assert f"jdp: error: refusing to resume: the training data (data.source={src}) changed since the checkpoint " \
           "at step 2:\n  the data: tokens " in err, err
    assert "set data.accept_changes=true to go on from step 2 with the new data" in err
    assert {k: v for k, v in _files(run_dir).items() if not k.startswith(".jdp-lock")} == {
        k: v for k, v in before.items() if not k.startswith(".jdp-lock")
    }
    code, err = _jdp_train(run_dir, capsys, *data, "train.steps=4", "data.accept_changes=true")
    assert code == 0, err
    assert "jdp: warning: data.accept_changes=true: the data changed since the checkpoint at step 2 (the data: " in err
    assert json.loads((run_dir / "summary.json").read_text())["resumed_from"] == 2
    for p in src.iterdir():  # the same bytes written again (as a fresh copy or sync makes them): new times
        p.write_bytes(p.read_bytes())
    code, err = _jdp_train(run_dir, capsys, *data, "train.steps=6")
    assert code == 0 and "changed" not in err, err
    assert json.loads((run_dir / "summary.json").read_text())["resumed_from"] == 4


def test_a_directory_of_ones_own_files_named_like_a_runs_is_refused_and_a_runs_own_is_taken(tmp_path, capsys):
    """Issue 65: train.run_dir at a directory of the user's own files that holds a metrics.jsonl was taken as a run
    (their metrics.jsonl moved aside as damaged). A jdp run is what jdp wrote: its lock, an archive, a config.yaml of
    jdp's sections, a checkpoints/ of steps (or none yet), a metrics.jsonl of jdp's records."""
    from jdp.config import save_config
    from jdp.rundir import RunDir

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "metrics.jsonl").write_text("epoch,acc\n1,0.9\n")
    (mine / "config.yaml").write_text("lr: 0.1\nepochs: 3\n")
    (mine / "notes.md").write_text("mine\n")
    before = _files(mine)
    code, err = _jdp_train(mine, capsys)
    assert code == 2 and "Traceback" not in err, err
    assert (f"jdp: error: train.run_dir={mine} is not empty and is not a jdp run directory (it holds config.yaml, "
            f"metrics.jsonl, notes.md; its config.yaml, metrics.jsonl are not jdp's)") in err, err  # fmt: skip
    assert "Give another train.run_dir (nothing was written)" in err and _files(mine) == before
    assert sorted(p.name for p in mine.iterdir()) == ["config.yaml", "metrics.jsonl", "notes.md"]

    def usable(*made) -> bool:  # a directory holding what a run makes at one moment or another
        run = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        run.mkdir()
        for make in made:
            make(run)
        (run / "notes.md").write_text("the user's, beside the run's\n")
        return RunDir(run).unusable() is None

    saved = lambda run: save_config(load_config("tiny", [f"train.run_dir={run}"]), run)  # noqa: E731
    record = lambda run: (run / "metrics.jsonl").write_text('{"step": 10, "loss": 4.1}\n')  # noqa: E731
    assert usable(saved, record)  # stopped before its first checkpoint
    assert usable(record) and usable(lambda run: (run / "checkpoints" / "20").mkdir(parents=True))
    assert usable(lambda run: (run / "checkpoints").mkdir())  # made before restoring, the run stopped there
    assert usable(lambda run: (run / ".jdp-lock").write_text("{}")) and usable(lambda run: (run / "archived-1").mkdir())
    assert not usable(lambda run: (run / "checkpoints" / "epoch=1.ckpt").mkdir(parents=True))  # Lightning's
    assert not usable(lambda run: (run / "metrics.jsonl").write_text("not jdp's\n"))
