"""Checkpoints and faults: exact resume after SIGKILL, preemption, other shapes, NaNs, divergence, stalls."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import inject
import pytest

from jdp.config import ConfigError, load_config
from jdp.lm import train
from jdp.metrics import read_metrics
from jdp.trainer import RunError

pytestmark = pytest.mark.slow

# A small, fast model on the embedded corpus: each run is mostly compilation.
SMALL = ["model.n_layers=2", "model.d_model=64", "model.max_seq_len=64", "data.seq_len=64", "train.batch_size=16"]
SMALL += ["train.log_every=1", "train.eval_every=0", "train.progress=false", "data.val_tokens=4096"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return {**os.environ, "JDP_CACHE": str(tmp_path_factory.mktemp("cache")), "PYTHONUNBUFFERED": "1"}


def run(run_dir, env, layout=(1, 4), extra=(), hooks=None, check=True, timeout=300):
    """`jdp train` as one process with N devices, or through `jdp launch` as P processes x D devices."""
    nproc, devices = layout
    args = ["train", "configs/tiny.yaml", *SMALL, f"train.run_dir={run_dir}", *extra]
    if hooks:  # faults to inject: the tests' own callback (tests/inject.py), registered for this run
        env, override = inject.register(env, **hooks)
        args.append(override)
    if nproc == 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    else:
        args = [
            "launch",
            "--nproc-per-node",
            str(nproc),
            "--devices-per-proc",
            str(devices),
            "--grace-s",
            "20",
            "--",
            *args,
        ]
    out = subprocess.run(
        [sys.executable, "-m", "jdp.cli", *args], capture_output=True, text=True, env=env, timeout=timeout
    )
    if check:
        assert out.returncode == 0, out.stderr[-4000:]
    return out


def losses(run_dir):
    return {r["step"]: r["loss"] for r in read_metrics(Path(run_dir) / "metrics.jsonl") if "loss" in r}


def summary(run_dir):
    return json.loads((Path(run_dir) / "summary.json").read_text())


def ckpt_steps(run_dir):
    return sorted(int(p.name) for p in (Path(run_dir) / "checkpoints").iterdir() if p.name.isdigit())


def killed_at_save_then_resumed(run_dir, env, extra, reference, at=8):
    """Kill `jdp train` (1 x 4 devices) while it writes checkpoint `at`, resume it, and check the result is the
    uninterrupted `reference` run's, bit for bit. Returns the resumed run's output."""
    out = run(run_dir, env, (1, 4), extra, hooks={"JDP_TEST_KILL": f"{at}:save"}, check=False)
    # orbax finished the checkpoint before `at` before it started `at`, which is never seen (atomic)
    assert out.returncode != 0 and at not in ckpt_steps(run_dir) and ckpt_steps(run_dir)
    resumed = run(run_dir, env, (1, 4), extra)
    assert summary(run_dir)["params_sha256"] == summary(reference)["params_sha256"]
    assert losses(run_dir) == losses(reference)
    return resumed


# conftest's reference_runs("ddp", DDP) is an uninterrupted run of JOB on 1 process x 4 devices, made once a session
# (test_zero1 and test_fsdp compare with the same one); launched_2x2 is JOB on 2 x 2, shared with test_launch.
DDP = ["parallel.strategy=ddp"]
JOB = ["train.steps=8", "train.ckpt_every=4", *DDP]


def launched_2x2(made_once, env) -> tuple[Path, str]:
    """JOB as 2 processes x 2 devices through `jdp launch`, uninterrupted, made once a session: (its run directory,
    its stdout and stderr). test_launch's layout comparison and the 2 x 2 kill below read it."""

    def make(d: Path) -> None:
        out = run(d / "run", {**env}, (2, 2), JOB)
        (d / "stdout.txt").write_text(out.stdout)
        (d / "stderr.txt").write_text(out.stderr)

    d = made_once("launched-2x2", make)
    return d / "run", (d / "stdout.txt").read_text() + (d / "stderr.txt").read_text()


def test_sigkill_then_resume_is_bit_identical(tmp_path, env, made_once):
    """2 processes x 2 devices (through `jdp launch`), killed while writing the checkpoint at step 8 and run again:
    the uninterrupted 2 x 2 run's every loss and its parameters, bit for bit. On 1 x 4: killed after a step,
    test_streaming_run_killed_and_resumed_reads_the_documents_an_uninterrupted_run_reads; killed while saving,
    killed_at_save_then_resumed (test_fsdp; zero1's kill at a save: test_muon)."""
    d, (ref, _) = tmp_path / "killed", launched_2x2(made_once, env)
    out = run(d, env, (2, 2), JOB, hooks={"JDP_TEST_KILL": "8:save"}, check=False)
    assert out.returncode != 0, out.stderr[-3000:]
    assert ckpt_steps(d) == [4]  # the complete ones: step 8's, killed while being written, is never seen (atomic)
    resumed = run(d, {**env}, (2, 2), JOB)
    assert "resuming from the checkpoint at step 4" in resumed.stdout
    assert summary(d)["params_sha256"] == summary(ref)["params_sha256"]  # bit-identical parameters
    assert losses(d) == losses(ref)  # every step's loss, exactly (the steps after 4 were redone)
    superseded = read_metrics(d / "metrics.superseded.jsonl")
    assert superseded and all(r["step"] > 4 for r in superseded)  # the lost work, kept aside


@pytest.fixture
def preempted(made_once, env, tmp_path) -> tuple[Path, str]:
    """A copy of JOB on 1 x 4 sent SIGTERM while it wrote its checkpoint at step 4, and its stdout: made once a
    session, resumed by the SIGTERM test on 1 x 4 and by the restore test on 2 x 1."""

    def make(d: Path) -> None:
        out = run(d / "run", env, (1, 4), JOB, hooks={"JDP_TEST_TERM": "4:save"})
        (d / "stdout.txt").write_text(out.stdout)

    made = made_once("preempted-1x4-at-4-save", make)
    shutil.copytree(made / "run", tmp_path / "preempted", symlinks=True)
    return tmp_path / "preempted", (made / "stdout.txt").read_text()


def test_sigterm_saves_at_an_agreed_step_exits_zero_and_resumes_exactly(preempted, env, reference_runs):
    ref, (d, stdout) = reference_runs("ddp", DDP), preempted
    # SIGTERM arrived while the asynchronous save of step 4 was being written; the run exited 0 (run() checks).
    assert "stopped by a signal after step" in stdout
    stopped = summary(d)
    assert stopped["preempted"] and stopped["steps"] in ckpt_steps(d)
    run(d, {**env}, (1, 4), JOB)
    assert summary(d)["params_sha256"] == summary(ref)["params_sha256"]
    assert losses(d) == losses(ref)


@pytest.mark.alone
def test_sigterm_to_any_process_stops_every_process_at_one_step(tmp_path, env):
    d = tmp_path / "mp"
    args = [sys.executable, "-m", "jdp.cli", "launch", "--nproc-per-node", "2", "--", "train", "configs/tiny.yaml"]
    args += [*SMALL, "train.steps=100000", "train.ckpt_every=0", f"train.run_dir={d}"]
    launcher = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        import psutil

        deadline = time.monotonic() + 180
        while not ((d / "metrics.jsonl").exists() and len(losses(d)) >= 3):
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()[1][-3000:]
            time.sleep(0.3)
        rank1 = next(
            p for p in psutil.Process(launcher.pid).children(recursive=True) if p.environ().get("JAX_PROCESS_ID") == "1"
        )
        rank1.send_signal(signal.SIGTERM)  # a preemption notice to one worker only
        out, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, err[-3000:]
    stopped = summary(d)
    assert stopped["preempted"] and ckpt_steps(d) == [stopped["steps"]]
    assert max(losses(d)) == stopped["steps"]


def test_restore_on_other_device_and_process_counts(preempted, env, reference_runs):
    """The checkpoint of 1 process x 4 devices resumed by 2 processes of 1 device: another process count and another
    device count at once. The same data order; every loss within float32 rounding of the 1 x 4 run's (processes of
    one device each train like one process of several)."""
    ref, (d, _) = reference_runs("ddp", DDP), preempted
    assert ckpt_steps(d) == [4]  # preempted right after its checkpoint at step 4 (so that one is complete)
    out = run(d, {**env}, (2, 1), JOB)
    assert "resuming from the checkpoint at step 4" in out.stdout
    a, b = losses(ref), losses(d)
    assert a.keys() == b.keys()
    for step in a:  # the same data order; the same numbers up to the reduction order of other devices
        assert abs(a[step] - b[step]) <= 1e-5 * a[step], (step, a[step], b[step])


@pytest.mark.alone
def test_stalled_worker_makes_the_job_exit_within_the_watchdog_timeout(tmp_path, env):
    """Process 1 stops before its step 5; process 0 comes to that step 5 s later (tests/inject.py: so the stalled
    process's watchdog fires first, and prints its stack before anything ends it)."""
    start = time.monotonic()
    hooks = {"JDP_TEST_STALL": "5:1"}
    out = run(tmp_path / "stall", env, (2, 1), ["train.steps=50", "train.step_timeout_s=10"], hooks=hooks, check=False)
    assert out.returncode != 0
    assert time.monotonic() - start < 150
    said = "process 1 of 2: no step finished for 10 s"
    assert said in out.stderr and "processes behind the others: [1]" in out.stderr, out.stderr[-3000:]
    # each thread's stack: the stalled process's shows where it stopped (the hook's sleep)
    assert re.search(r'\[rank 1\] +File ".*inject\.py", line \d+ in on_batch', out.stderr), out.stderr[-3000:]


# ---------------------------------------------------------------------------- in-process (4 simulated devices)


@pytest.fixture
def small(tmp_path, env, monkeypatch):
    monkeypatch.setenv("JDP_CACHE", env["JDP_CACHE"])

    def cfg(*extra):
        return load_config("tiny", [*SMALL, f"train.run_dir={tmp_path / 'run'}", *extra])

    return cfg


def test_injected_nan_is_skipped_and_too_many_stop_the_run(small, tmp_path, monkeypatch):
    monkeypatch.setenv("JDP_TEST_NAN_STEPS", "3")
    result = train(small("train.steps=5", "train.check_replicas_every=1", "train.ckpt_every=0", inject.OVERRIDE))
    records = {r["step"]: r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r}
    assert records[3]["skipped_steps"] == 1 and records[5]["skipped_total"] == 1
    assert records[3]["loss"] != records[3]["loss"]  # NaN reported, not hidden
    assert all(records[s]["loss"] == records[s]["loss"] for s in (1, 2, 4, 5))  # and never reached the parameters
    assert result["loss"] < records[1]["loss"]

    monkeypatch.setenv("JDP_TEST_NAN_STEPS", "4,5,6,7")
    with pytest.raises(RunError, match="non-finite steps in a row") as info:
        train(
            small(
                "train.steps=10",
                "train.max_bad_steps=2",
                "train.ckpt_every=2",
                "train.run_dir=" + str(tmp_path / "bad"),
                inject.OVERRIDE,
            )
        )
    # Step 4's update was skipped, so its checkpoint holds step 3's finite parameters; nothing is saved after
    # the run stops, and the last checkpoint resumes into finite training.
    assert "newest checkpoint is step 4" in str(info.value)
    assert ckpt_steps(tmp_path / "bad") == [2, 4]
    monkeypatch.delenv("JDP_TEST_NAN_STEPS")
    resumed = train(
        small("train.steps=6", "train.max_bad_steps=2", "train.ckpt_every=2", f"train.run_dir={tmp_path / 'bad'}")
    )
    assert resumed["loss"] == resumed["loss"] and resumed["skipped_total"] == 0


def test_a_run_whose_every_step_was_skipped_fails_instead_of_ending_done(small, tmp_path, monkeypatch):
    """Fewer steps than train.max_bad_steps, every one non-finite: the parameters never moved, so the run is an
    error naming that, not `done: loss nan` with exit 0."""
    monkeypatch.setenv("JDP_TEST_NAN_STEPS", "1,2,3")
    with pytest.raises(RunError, match=r"every step of this run \(1-3\) had a non-finite loss or gradient"):
        train(small("train.steps=3", "train.ckpt_every=0", "data.val_tokens=0", inject.OVERRIDE))


def test_overflowing_update_is_never_checkpointed(small, tmp_path):
    """Finite loss and gradients, but an update that overflows float32: the step is not skipped (only a
    non-finite loss or gradient is), and the check before saving refuses to checkpoint the result."""
    pattern = r"step 1: the parameters hold NaN or Inf \(.*kernel.*Not saved; the newest checkpoint is step none"
    with pytest.raises(RunError, match=pattern):
        train(small("train.steps=3", "train.ckpt_every=1", "optim.lr=1e39", "optim.warmup_steps=0"))
    assert ckpt_steps(tmp_path / "run") == []


def test_injected_replica_divergence_is_detected(small, monkeypatch):
    monkeypatch.setenv("JDP_TEST_DIVERGE", "4")
    with pytest.raises(RunError, match="replicas diverged at step 4") as info:
        train(small("train.steps=8", "train.check_replicas_every=2", inject.OVERRIDE))
    assert "TFRT_CPU_3" in str(info.value) or "id=3" in str(info.value) or "cpu:3" in str(info.value)


def test_truncated_latest_checkpoint_falls_back_to_the_previous_one(small, tmp_path, capsys):
    train(small("train.steps=8", "train.ckpt_every=4"))
    assert ckpt_steps(tmp_path / "run") == [4, 8]
    data = [
        p
        for p in (tmp_path / "run" / "checkpoints" / "8" / "state").rglob("*")
        if p.is_file() and p.stat().st_size > 100
    ]
    for p in data:
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])  # truncate every data file of the newest one
    capsys.readouterr()
    result = train(small("train.steps=10", "train.ckpt_every=4"))
    captured = capsys.readouterr()
    assert "checkpoints/8 cannot be restored" in captured.err and "falling back" in captured.err
    assert "resuming from the checkpoint at step 4" in captured.out
    assert result["preempted"] is False and 10 in ckpt_steps(tmp_path / "run")


def test_resume_refuses_model_or_optimizer_changes_and_allows_step_changes(small, tmp_path, capsys):
    train(small("train.steps=4", "train.ckpt_every=2"))
    with pytest.raises(ConfigError) as info:
        train(small("train.steps=6", "optim.lr=0.5", "model.mlp_ratio=2"))
    assert "optim.lr: 0.002 -> 0.5" in str(info.value) and "model.mlp_ratio: 4 -> 2" in str(info.value)
    result = train(small("train.steps=6", "train.log_every=2"))  # only the step count and logging change
    assert result["loss"] and "resuming from the checkpoint at step 4" in capsys.readouterr().out


def test_resume_false_archives_the_old_run_and_starts_over(small, tmp_path, capsys):
    train(small("train.steps=3", "train.ckpt_every=0"))
    train(small("train.steps=3", "train.resume=false"))
    out = capsys.readouterr().out
    assert "starting at step 0" in out.split("resume=false")[-1]
    archived = [p for p in (tmp_path / "run").iterdir() if p.name.startswith("archived-")]
    assert (
        len(archived) == 1 and (archived[0] / "checkpoints" / "3").is_dir() and (archived[0] / "metrics.jsonl").exists()
    )


def test_an_error_in_a_background_save_ends_the_run_with_its_message(small, monkeypatch):
    import orbax.checkpoint as ocp

    def failing_wait(self):
        raise OSError("disk full (injected)")  # what an asynchronous save's failure looks like when it surfaces

    monkeypatch.setattr(ocp.CheckpointManager, "wait_until_finished", failing_wait)
    with pytest.raises(RunError, match="disk full") as info:
        train(small("train.steps=2", "train.ckpt_every=0"))
    assert "checkpoint" in str(info.value)  # the phase: saving or waiting for a checkpoint


def _alter_in_place(path: Path) -> None:
    """Change 16 bytes in every 4 KiB of a file, keeping its size: what a bad disk or a stray write does."""
    data = bytearray(path.read_bytes())
    for start in range(2048, len(data), 4096):
        for i in range(start, min(start + 16, len(data))):
            data[i] ^= 0x5A
    path.write_bytes(bytes(data))


def test_a_checkpoint_altered_after_it_was_written_is_set_aside_like_a_truncated_one(small, tmp_path, capsys):
    from jdp.generate import load_run

    train(small("train.steps=8", "train.ckpt_every=4"))
    # Every array file of the checkpoint (orbax's data files, under d/), so that the model's arrays are hit too:
    # jdp generate reads the model alone, and damage to the optimizer state alone would rightly not concern it.
    data_files = [p for p in (tmp_path / "run/checkpoints/8/state").rglob("d/*") if p.is_file()]
    assert sum(p.stat().st_size for p in data_files) > 100_000, data_files
    for path in data_files:
        _alter_in_place(path)
    capsys.readouterr()
    assert load_run(tmp_path / "run")[3] == 4  # jdp generate reads through the same check (and moves nothing)
    assert ckpt_steps(tmp_path / "run") == [4, 8]
    result = train(small("train.steps=10", "train.ckpt_every=4"))
    captured = capsys.readouterr()
    assert (
        "checkpoints/8 cannot be restored" in captured.err and "resuming from the checkpoint at step 4" in captured.out
    )
    assert result["loss"] == result["loss"] and result["skipped_total"] == 0  # no NaN ever reached training
    assert any(p.name.startswith("8-") for p in (tmp_path / "run/damaged-checkpoints").iterdir())


def test_checkpoint_arrays_that_differ_from_their_saved_checksums_are_refused(small, tmp_path, capsys):
    train(small("train.steps=8", "train.ckpt_every=4"))
    record = tmp_path / "run/checkpoints/8/record/metadata"
    saved = json.loads(record.read_text())
    leaf = next(iter(saved["checksums"]))
    saved["checksums"][leaf] ^= 1  # the record no longer describes the arrays beside it
    record.write_text(json.dumps(saved))
    capsys.readouterr()
    train(small("train.steps=10", "train.ckpt_every=4"))
    captured = capsys.readouterr()
    assert "its arrays changed after it was written: 1 of" in captured.err and leaf in captured.err
    assert "resuming from the checkpoint at step 4" in captured.out


@pytest.mark.alone
def test_a_second_job_on_a_live_run_directory_is_refused_and_a_dead_jobs_lock_is_taken_over(tmp_path, env):
    d = tmp_path / "shared"
    args = [sys.executable, "-m", "jdp.cli", "train", "configs/tiny.yaml", *SMALL, f"train.run_dir={d}"]
    first = subprocess.Popen(
        [*args, "train.steps=100000", "train.ckpt_every=5"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        while not (d / "checkpoints" / "5").exists():
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()[1][-3000:]
            time.sleep(0.3)
        second = subprocess.run([*args, "train.steps=3"], env=env, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2, second.stderr[-3000:]
        assert f"in use by another job: process {first.pid} on " in second.stderr and "started 20" in second.stderr
        assert not (d / "metrics.superseded.jsonl").exists()  # it touched nothing
        first.kill()  # SIGKILL: its lock stays behind, naming a process that is gone
        first.wait()
        assert (d / ".jdp-lock").exists()
        # a fresh run in its place (the killed run's newest checkpoint is past 8 steps: resuming it with
        # train.steps=8 is refused, test_rundir.py), which takes the dead job's lock over first
        third = subprocess.run([*args, "train.steps=8", "train.resume=false"], env=env, capture_output=True, text=True,
                               timeout=300)  # fmt: skip
        assert third.returncode == 0, third.stderr[-3000:]
        assert f"took over {d / '.jdp-lock'} from a job that is gone (process {first.pid}" in third.stderr
        assert not (d / ".jdp-lock").exists()  # released at the end
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()


def test_a_lock_from_another_host_is_live_while_its_beat_is_fresh(tmp_path):
    from jdp.rundir import RunDir, RunDirInUse, RunLock

    lock_file = tmp_path / RunLock.NAME
    other = {"host": "node-7", "pid": 4242, "pid_start": 1, "started": "2026-12-01 10:00:00 UTC"}
    lock_file.write_text(json.dumps({**other, "beat": time.time() - 5}))
    with pytest.raises(RunDirInUse, match="process 4242 on node-7, started 2026-12-01 10:00:00 UTC"):
        RunLock(RunDir(tmp_path)).acquire()
    lock_file.write_text(json.dumps({**other, "beat": time.time() - RunLock.STALE_S - 1}))
    lock = RunLock(RunDir(tmp_path))
    assert lock.acquire()["host"] == "node-7"  # silent for longer than STALE_S: taken over
    assert json.loads(lock_file.read_text())["pid"] == os.getpid()
    with pytest.raises(RunDirInUse):  # and now this process holds it
        RunLock(RunDir(tmp_path)).acquire()
    lock.release()
    assert not lock_file.exists()


def test_streaming_run_killed_and_resumed_reads_the_documents_an_uninterrupted_run_reads(tmp_path, env):
    """1 process x 4 devices on streamed documents, SIGKILLed after step 6 (its checkpoint at 4 complete) and run
    again: the redone steps read the uninterrupted run's documents, every loss and the parameters bit for bit, and
    the lost steps are kept aside. (Also the 1 x 4 case of test_sigkill_then_resume_is_bit_identical.)"""
    shards = tmp_path / "shards"
    shards.mkdir()
    rng = __import__("random").Random(0)
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta", "iota", "kappa"]
    for f in range(4):  # documents of different lengths, so windows straddle documents and shards
        docs = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 120))) for _ in range(60)]
        (shards / f"part-{f}.jsonl").write_text("\n".join(json.dumps({"text": f"{f}: {d}"}) for d in docs))
    stream = [f"data.source={shards}", "data.streaming=true", "data.val_tokens=1024", "train.steps=8"]
    stream += ["train.ckpt_every=4"]
    ref, killed = tmp_path / "reference", tmp_path / "killed"
    run(ref, {**env}, (1, 4), stream)
    kill = {"JDP_TEST_KILL_ONCE": f"6:0:{tmp_path / 'killed-once'}"}  # once the checkpoint at 4 is on disk
    out = run(killed, env, (1, 4), stream, hooks=kill, check=False)
    assert out.returncode != 0 and ckpt_steps(killed) == [4] and (killed / "data_state" / "4").is_dir()
    resumed = run(killed, {**env}, (1, 4), stream)
    assert "resuming from the checkpoint at step 4" in resumed.stdout
    assert losses(killed) == losses(ref)  # the redone steps saw exactly the reference's documents
    assert summary(killed)["params_sha256"] == summary(ref)["params_sha256"]
    superseded = read_metrics(killed / "metrics.superseded.jsonl")
    assert superseded and all(r["step"] > 4 for r in superseded)  # the lost work, kept aside


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MB tmpfs for a run directory to fill (mounting one needs root), unmounted afterwards."""
    where = tmp_path / "disk"
    where.mkdir()
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounting a tmpfs needs root")
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(where)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def test_a_full_disk_during_a_background_save_stops_the_run_with_one_error_and_resumes_once_freed(small_disk, env):
    """Checkpoints of this model take ~0.9 MB: with 1.6 MB of the 3 MB taken, step 2's fits and step 4's does not."""
    filler, d = small_disk / "filler", small_disk / "run"
    filler.write_bytes(b"\0" * 1_600_000)
    extra = ["model.n_layers=1", "train.batch_size=8", "train.steps=12", "train.ckpt_every=2", "train.ckpt_keep=2"]
    offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    out = run(d, env, (1, 4), extra, hooks=offline, check=False)
    output = out.stdout + out.stderr
    errors = [line for line in output.splitlines() if line.startswith("jdp: error:")]
    assert out.returncode == 1 and len(errors) == 1, output[-4000:]
    assert "the checkpoint at step 4 could not be written to " + str(d / "checkpoints" / "4") in errors[0]
    assert "No space left on device" in errors[0] and " bytes free there" in errors[0], errors[0]
    others = [line for line in output.splitlines() if line.strip() and not line.startswith("jdp |")]
    others = [line for line in others if "examples/s]" not in line]  # progress bars of the data's first preparation
    assert others == errors, output[-4000:]  # no tracebacks, no orbax, absl, asyncio or tensorstore noise
    assert not list(d.rglob("*orbax-checkpoint-tmp*")) and ckpt_steps(d) == [2]  # the partial one removed
    logged = sorted({r["step"] for r in read_metrics(d / "metrics.jsonl") if "loss" in r})
    assert logged == list(range(1, logged[-1] + 1)) and logged[-1] < 12 and not (d / "summary.json").exists()
    filler.unlink()  # space freed: the same command resumes from the last good checkpoint and finishes
    resumed = run(d, env, (1, 4), extra, hooks=offline)
    assert "resuming from the checkpoint at step 2" in resumed.stdout
    assert summary(d)["steps"] == 12 and ckpt_steps(d)[-1] == 12


def test_a_failed_background_save_stops_the_run_at_the_next_step_boundary(small_disk, env):
    """Not at the next save, 200 steps later: the loop looks after every step whether the save in flight failed."""
    (small_disk / "filler").write_bytes(b"\0" * 2_500_000)  # no room for even one checkpoint
    extra = ["model.n_layers=1", "train.batch_size=8", "train.steps=399", "train.ckpt_every=200"]
    out = run(small_disk / "run", env, (1, 4), extra, hooks={"HF_HUB_OFFLINE": "1"}, check=False)
    # Seen after a step (writing) or, when the full disk first failed a metrics write, on the way out (waiting for)
    named = re.search(r"while (writing|waiting for) the checkpoint at step 200: SaveFailed", out.stderr)
    assert out.returncode == 1 and named, out.stderr
    assert "no checkpoint was saved before it" in out.stderr
    logged = [r["step"] for r in read_metrics(small_disk / "run" / "metrics.jsonl") if "loss" in r]
    assert logged[-1] < 399  # stopped before the last step (and its evaluation and save)


# ---------------------------------------------------------------------------------------------- Ctrl-C at start-up

_IN_C = """
import hashlib, os, signal, threading
from jdp.job.process import StartupInterrupts
with StartupInterrupts(lambda: "compiling", cleanup=lambda: print("cleaned up", flush=True)):
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    hashlib.pbkdf2_hmac("sha256", b"x", b"y", 10**9)  # minutes in C with the GIL released, as XLA compiles
    print("carried on")
"""

_IN_DEL = """
import os, signal, time
from jdp.job.process import StartupInterrupts
from jdp.loop import Phases

class Dataset:
    def __del__(self):  # datasets' objects have one: an exception raised in it is printed and dropped
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.5)

phases = Phases()
try:
    with StartupInterrupts(lambda: phases.now) as interrupts:
        phases.check = interrupts.check
        with phases("loading data"):
            Dataset()
            print("went on after the dropped interrupt", flush=True)
        with phases("compiling"):
            print("carried on into the next phase")
except KeyboardInterrupt as e:
    print(f"interrupted while {e.phase}")
"""


def test_ctrl_c_is_never_dropped_and_is_answered_within_seconds_while_the_main_thread_is_in_c():
    """Issue 42, item 8: Python drops a KeyboardInterrupt raised inside a __del__ (the run then trained to the
    end and exited 0) and runs no handler while the main thread is in C++ (XLA compiling: ~12 s late). The
    interrupt is raised again at the next phase, and a thread woken by the signal ends a process whose main
    thread has not answered in 2 s: its line, the cleanup, exit 130."""
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", _IN_C], capture_output=True, text=True, timeout=120)
    assert time.monotonic() - start < 30, "the interrupt waited for the C call to return"
    assert out.returncode == 130 and out.stdout == "cleaned up\n", (out.returncode, out.stdout, out.stderr)
    assert out.stderr == "jdp: interrupted while compiling\n", out.stderr
    out = subprocess.run([sys.executable, "-c", _IN_DEL], capture_output=True, text=True, timeout=120)
    assert out.stdout.splitlines() == ["went on after the dropped interrupt", "interrupted while loading data"], (
        out.stdout, out.stderr)  # fmt: skip


def _interrupted(args, env, when) -> tuple[subprocess.CompletedProcess, float]:
    """`jdp ARGS` sent SIGINT once `when(output so far)` holds; (the finished process, seconds it took after)."""
    proc = subprocess.Popen([sys.executable, "-u", "-m", "jdp.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)  # fmt: skip
    lines = []

    def read():
        for line in proc.stdout:
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + 240
    while not when("".join(lines)) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    sent = time.monotonic()
    try:
        proc.wait(timeout=120)
    finally:
        proc.kill()
    took = time.monotonic() - sent
    reader.join(timeout=10)
    return subprocess.CompletedProcess(args, proc.returncode, "".join(lines), ""), took


PHASES = ("starting", "setting up", "joining the job", "loading data", "building the model", "building the model and compiling",
          "looking for checkpoints")  # fmt: skip


@pytest.mark.parametrize("moment", ["importing", "tokenizing", "after the data", "launched"])
def test_ctrl_c_at_start_up_is_one_line_and_exit_130_never_a_run_that_carries_on(tmp_path, env, moment):
    """Ctrl-C before the first step: `jdp: interrupted while <phase>`, exit 130, no traceback, no run directory
    left behind, nothing trained; under `jdp launch` the same line once and the launcher's own (it used to print
    each worker's traceback, or drop the interrupt and train to the end)."""
    src = tmp_path / "docs"
    src.mkdir()
    for i in range(24):  # enough text that tokenizing takes a moment
        (src / f"{i}.txt").write_text(" ".join(f"w{(i * 31 + j * 7) % 997}" for j in range(40_000)))
    run_dir = tmp_path / "run"
    args = ["train", "configs/tiny.yaml", *SMALL, f"data.source={src}", f"train.run_dir={run_dir}", "train.steps=50"]
    env = {**env, "JDP_CACHE": str(tmp_path / "cache")}
    began = time.monotonic()
    when = {
        "importing": lambda out: time.monotonic() - began > 1.0,
        "tokenizing": lambda out: "tokenizing" in out,
        "after the data": lambda out: "tokenizing: 100%" in out,
        "launched": lambda out: "[Gloo] Rank 0 is connected" in out or "rank 0] jdp" in out,
    }[moment]
    if moment == "launched":
        args = ["launch", "--nproc-per-node", "2", "--grace-s", "20", "--", *args]
    out, took = _interrupted(args, env, when)
    lines = out.stdout.splitlines()
    said = [line for line in lines if "jdp: interrupted while " in line]
    assert out.returncode == 130, out.stdout[-3000:]
    assert len(said) == 1 and said[0].split("interrupted while ")[1] in PHASES, out.stdout[-3000:]
    assert "Traceback" not in out.stdout and "Exception ignored" not in out.stdout, out.stdout[-3000:]
    assert "done:" not in out.stdout and not run_dir.exists(), out.stdout[-3000:]
    assert took < 60, f"answered {took:.0f} s after the signal"
    if moment == "launched":
        assert "jdp launch: got SIGINT: passing it to the workers" in out.stdout
        assert "stopped on the interrupt; waiting for the others to stop on it too" in out.stdout, out.stdout[-3000:]


# A callback that holds the main thread in C for seconds, as XLA compiling does (no Python handler runs meanwhile),
# where the interrupt is wanted: `begin` runs after the replica check at step 0, before the loop takes the signals
# over; `on_batch` of the first step runs where the loop has them and step 1 is about to compile.
_BUSY = """
import hashlib, os, sys
import jdp

class Busy(jdp.Callback):
    def begin(self, loop):
        if os.environ["JDP_TEST_BUSY"] == "begin":
            _in_c()

    def on_batch(self, loop, step, local):
        if os.environ["JDP_TEST_BUSY"] == "step" and step == loop.run.start + 1:
            _in_c()
        return local

def _in_c():
    print("jdp-test: in C", file=sys.stderr, flush=True)
    hashlib.pbkdf2_hmac("sha256", b"x", b"y", 10**7)  # seconds in C with the GIL released
"""


def _ctrl_c_times(args, env, when, then=None) -> tuple[int, list[tuple[float, str]], list[float]]:
    """`jdp ARGS`, SIGINT once `when(output)` holds and again once `then(output)` does (if given); (exit status,
    [(seconds after the first signal, line)], [seconds after the first signal: each signal sent, the exit])."""
    proc = subprocess.Popen([sys.executable, "-u", "-m", "jdp.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)  # fmt: skip
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: lines.extend((time.monotonic(), line) for line in proc.stdout), daemon=True)
    reader.start()
    times: list[float] = []
    try:
        for ready in [when] + ([then] if then else []):
            deadline = time.monotonic() + 240
            while not ready("".join(line for _, line in lines)) and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)
            proc.send_signal(signal.SIGINT)
            times.append(time.monotonic())
        proc.wait(timeout=120)
        times.append(time.monotonic())
    finally:
        proc.kill()
        proc.wait()
    reader.join(timeout=10)
    return proc.returncode, [(t - times[0], line) for t, line in lines], [t - times[0] for t in times]


# where the first Ctrl-C is sent: (JDP_TEST_BUSY, the output it waits for); "twice": a second one after its answer
MOMENTS = {"the banner": ("none", "starting at step 0"), "the replica check at step 0": ("begin", "jdp-test: in C"),
           "the first step, twice": ("step", "jdp-test: in C")}  # fmt: skip


@pytest.mark.alone  # bounds in seconds
@pytest.mark.parametrize("moment", list(MOMENTS))
def test_ctrl_c_after_the_banner_is_answered_at_once_and_never_lost_or_a_crash(tmp_path, env, moment):
    """Issue 65: Ctrl-C 0.2-1 s after the banner said "interrupted while checking the replicas at step 0" and died
    by SIGSEGV (between start-up's handling and the loop's, the interrupt was raised inside a JAX call, and Python's
    finalization then crashed on jaxlib 0.10); during the first step's compile it was silent for 10 s and a second
    one was dropped. Each is answered within a second or two, a second Ctrl-C exits at once, never a crash: exit 130,
    or the documented stop at an agreed step."""
    (tmp_path / "busy.py").write_text(_BUSY)
    busy, started = MOMENTS[moment]
    args = ["train", "configs/tiny.yaml", *SMALL, f"train.run_dir={tmp_path / 'run'}", "train.steps=20"]
    args += ["train.callbacks=busy:Busy"]
    env = {**env, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JDP_TEST_BUSY": busy,
           "PYTHONPATH": os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])}  # fmt: skip
    twice = moment.endswith("twice")
    code, lines, times = _ctrl_c_times(args, env, lambda out: started in out,
                                       (lambda out: "got SIGINT" in out) if twice else None)  # fmt: skip
    shown = "".join(line for _, line in lines)[-3000:]
    after = [(t, line) for t, line in lines if t >= 0]
    assert code in (0, 130), shown  # never a crash (-11)
    assert after and after[0][0] < 2.0, f"the first line after the signal came {after[0][0]:.1f} s later\n{shown}"
    assert "Traceback" not in shown and "Exception ignored" not in shown, shown
    if code == 130 and not twice:
        assert [line for _, line in after if "jdp: interrupted while " in line] == [after[0][1]], shown
    if busy == "begin":  # start-up: nothing trained
        assert code == 130 and "step 1/" not in shown and "got SIGINT" not in shown, shown
    if twice:  # the first answered while step 1 compiled, the second exits at once
        assert "got SIGINT: every process will stop at an agreed step" in after[0][1], shown
        assert code == 130 and "second SIGINT: exiting now, without saving" in shown, shown
        assert times[2] - times[1] < 2.0, f"exited {times[2] - times[1]:.1f} s after the second signal\n{shown}"
    if code == 0:  # it reached the loop: the documented stop at an agreed step, saved
        assert "stopped by a signal after step" in shown, shown
