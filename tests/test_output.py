"""What `jdp` prints reaches its output file line by line, so a killed process leaves a trace."""

import os
import re
import signal
import subprocess
import sys
import time

BANNER = ["jdp | model ", "jdp | parallel.strategy=", "jdp | data ", "jdp | run dir "]


def test_banner_lines_are_in_the_output_file_when_the_process_is_sigkilled(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"line {i}: the quick brown fox jumps over the lazy dog" for i in range(200)))
    run_dir = tmp_path / "run"
    args = ["train", "tiny", "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.max_seq_len=16"]
    args += [f"data.source={corpus}", "data.seq_len=16", "data.val_tokens=0", "train.batch_size=8"]
    args += ["train.steps=1000000", "train.eval_every=0", "train.ckpt_every=0", "train.progress=false"]
    args += [f"train.run_dir={run_dir}"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # Python's default buffering
    env |= {"JDP_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env |= {"XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"}
    out = tmp_path / "out.txt"
    with open(out, "wb") as f:  # a file, as `jdp train ... > log` gives it: not a pipe this test reads
        proc = subprocess.Popen([sys.executable, "-m", "jdp.cli", *args], stdout=f, stderr=f, env=env)
    try:
        # config.yaml is written just after the banner is printed; waiting on out.txt itself would wait forever
        # where the banner sits in a buffer.
        deadline = time.monotonic() + 300
        while not (run_dir / "config.yaml").exists():
            assert proc.poll() is None, out.read_text()[-3000:]
            assert time.monotonic() < deadline, "jdp train wrote no config.yaml in 300 s"
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGKILL)  # as the OOM killer does: no handler, no flush at exit
        assert proc.wait(timeout=60) == -signal.SIGKILL  # it was still training: the kill is what ended it
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = out.read_text()
    assert [b for b in BANNER if b not in text] == [], text[-3000:]


def test_a_log_file_gets_a_line_per_logged_step_not_a_progress_bar_and_no_gpu_flags_on_a_cpu(tmp_path):
    """Into a file, tqdm's carriage returns made one endless line: a plain line per logged step instead. The CPU
    banner showed six --xla_gpu_* options jdp sets for GPUs: counted instead."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"line {i}: the quick brown fox jumps over the lazy dog" for i in range(200)))
    args = ["train", "tiny", "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.max_seq_len=16"]
    args += [f"data.source={corpus}", "data.seq_len=16", "data.val_tokens=0", "train.batch_size=8"]
    args += ["train.steps=3", "train.log_every=1", "train.ckpt_every=0", f"train.run_dir={tmp_path / 'run'}"]
    env = {**os.environ, "JDP_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env |= {"XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"}
    out = tmp_path / "out.txt"
    with open(out, "wb") as f:
        assert subprocess.run([sys.executable, "-m", "jdp.cli", *args], stdout=f, stderr=f, env=env,
                              timeout=300).returncode == 0, out.read_text()[-3000:]  # fmt: skip
    text = out.read_text()
    assert "\r" not in text and "it/s" not in text and "step/s" not in text, text[-3000:]
    assert [line.split(":")[0] for line in text.splitlines() if line.startswith("step ")] == [
        "step 1/3", "step 2/3", "step 3/3"
    ], text[-3000:]  # fmt: skip
    xla = next(line for line in text.splitlines() if "XLA_FLAGS=" in line)
    assert re.search(r"XLA_FLAGS='[^']*\(and \d --xla_gpu_\* options, unused on CPUs\)'$", xla), xla
    assert "--xla_gpu_" not in xla.split("(and")[0], xla
