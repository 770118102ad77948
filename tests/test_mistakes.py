"""A command-line user's mistakes (issue 65): each is answered by one error line that names the key, file or value and
a fix that works, exit 2, before anything is compiled; never a traceback, a hang or a lost run."""

import os
import subprocess
import sys
import textwrap

import pytest

from jdp.checkpoint import Checkpoints, checksums
from jdp.cli import main
from jdp.config import ConfigError

# Each: the command, and what its one error line says.
MISTAKES = [
    (["train", "tiny", "optim.name=adam"], "optim.name='adam' must be one of adamw, sgd, muon (did you mean adamw?)"),
    (["train", "tiny", "optim.name=muon", "optim.muon_ns_coeffs=abc"], "optim.muon_ns_coeffs=abc must be 3 numbers"),
    (["train", "tiny", "optim.name=muon", "optim.muon_ns_coeffs=3.4,-4.7"], "optim.muon_ns_coeffs=3.4,-4.7 must be"),
    (["train", "tiny", "optim.name=muon", "optim.muon_ns_steps=1000000"], "optim.muon_ns_steps=1000000 must be in [1, 100]"),
    (["train", "tiny", "parallel.strategy=FSDP"], "parallel.strategy='FSDP' must be one of ddp, zero1, fsdp, hsdp, dp (did you mean fsdp?)"),
    (["train", "tiny", "parallel.groups=-1"], "parallel.groups=-1 must be >= 0"),
    (["allreduce", "tiny", "parallel.strategy=ddpp", "--devices", "2"], "parallel.strategy='ddpp' must be one of"),
    (["allreduce", "tiny", "--devices", "-2"], "argument --devices: -2: give 1 or more"),
    (["plot", "{tmp}", "-o", "{tmp}/out.txt"], "-o {tmp}/out.txt: matplotlib cannot write .txt files; name a .png"),
    (["launch", "--nproc-per-node", "1", "--", "trian", "tiny"], "-- trian: not a jdp command (did you mean train?)"),
    (["launch", "--nproc-per-node", "1", "--max-restarts", "-1", "--", "train"], "--max-restarts -1: give 0"),
    (["launch", "--nproc-per-node", "1", "--devices-per-proc", "0", "--", "train"], "--devices-per-proc 0: each worker"),
    (["launch", "--live", "--nproc-per-node", "1", "--devices-per-proc", "0", "--", "train"], "--devices-per-proc 0"),
    # A key the chosen settings do not read is refused by one rule (config.READ_ONLY_UNDER), never dropped unsaid
    (["train", "tiny", "model.remat_every=2"], "model.remat_every=2 is read by model.remat=dots or model.remat=full only, not none: leave it out (its default: 1), or set model.remat=dots"),
    (["train", "tiny", "data.chat_template_name=tool_use"], "data.chat_template_name=tool_use is read by data.format=chat or data.format=preference only, not text"),
    (["train", "tiny", "optim.name=sgd", "optim.b1=0.8"], "optim.b1=0.8 is read by optim.name=adamw or optim.name=muon only, not sgd"),
    # a shipped file's AdamW keys under sgd: the fix given works on the command line (the defaults given back)
    (["train", "gpt2-finetune", "optim.name=sgd"], "optim.weight_decay=0.01 is read by optim.name=adamw or optim.name=muon only, not sgd: leave it out (its default: 0.1)"),
    (["train", "tiny", "train.live_min=2"], "train.live_min=2 is read by train.live=true only, not false: leave it out (its default: 1), or set train.live=true"),
    (["launch", "--nproc-per-node", "1", "--lighthouse", "http://127.0.0.1:1", "--", "train"], "--lighthouse http://127.0.0.1:1 is read by --live only"),
]  # fmt: skip


@pytest.mark.parametrize("argv, says", MISTAKES, ids=[" ".join(a) for a, _ in MISTAKES])
def test_a_mistake_is_one_error_line_and_exit_2(tmp_path, capfd, monkeypatch, argv, says):
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # jdp allreduce --devices sets them
    monkeypatch.setenv("JAX_PLATFORMS", os.environ.get("JAX_PLATFORMS", ""))
    argv = [a.format(tmp=tmp_path) for a in argv] + ([f"train.run_dir={tmp_path}/run"] if argv[0] == "train" else [])
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capfd.readouterr().err
    errors = [line for line in err.splitlines() if ": error:" in line]
    assert code == 2 and len(errors) == 1, err
    assert says.format(tmp=tmp_path) in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()  # nothing made


def test_jax_platforms_naming_a_platform_this_jaxlib_lacks_is_one_line(tmp_path):
    """`JAX_PLATFORMS=cuda` on a CPU-only jaxlib: JAX 0.10 raised a bare AssertionError."""
    env = {**os.environ, "JAX_PLATFORMS": "cuda"}
    out = subprocess.run([sys.executable, "-m", "jdp.cli", "train", "tiny", f"train.run_dir={tmp_path}/run"],
                         capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.stderr.startswith("jdp: error: JAX_PLATFORMS=cuda: JAX could not start that platform with jaxlib ")
    assert 'pip install -e ".[cuda12]"' in out.stderr and "unset JAX_PLATFORMS" in out.stderr
    assert not (tmp_path / "run").exists()


@pytest.fixture
def read_only_checkpoints(tmp_path):
    """RUN/checkpoints that nobody can write into, root included (a read-only bind mount; chmod where not root)."""
    where = tmp_path / "run" / "checkpoints"
    where.mkdir(parents=True)
    if os.geteuid() != 0:
        where.chmod(0o555)
        yield where
        where.chmod(0o755)
        return
    for command in (["mount", "--bind", where, where], ["mount", "-o", "remount,ro,bind", where]):
        if subprocess.run(command, capture_output=True).returncode:
            subprocess.run(["umount", where], capture_output=True)
            pytest.skip(f"cannot make a read-only bind mount here: {' '.join(map(str, command))} failed")
    try:
        yield where
    finally:
        subprocess.run(["umount", where], check=True)


def test_a_read_only_checkpoints_directory_is_refused_before_any_step(read_only_checkpoints, capfd):
    """Was: the first save failed (SaveFailed ... "free some space"), then orbax's threads held the process forever.
    Now `jdp train` refuses it with the run directory (before the data and the compile), as the library's
    Checkpoints does."""
    code = main(["train", "tiny", f"train.run_dir={read_only_checkpoints.parent}"])
    out, err = capfd.readouterr()
    assert code == 2 and err.count("error:") == 1 and "Traceback" not in err, err
    assert f"{read_only_checkpoints}: cannot write there" in err and "writable" in err and "free some space" not in err
    assert "data " not in out and "starting at step" not in out  # refused before the data was read
    with pytest.raises(ConfigError, match="cannot write there"):
        Checkpoints(read_only_checkpoints.parent, keep=1)


STUCK = """
import threading, sys
from jdp.cli import exit_despite_threads
threading.Thread(target=threading.Event().wait, name="orbax-like").start()  # never ends, not a daemon
exit_despite_threads(1, grace_s=0.5)
print("returned")
"""


def test_threads_that_would_hold_a_failed_run_at_exit_do_not():
    """The exit is cut short only when it hangs: the command returns, and the process ends at the grace's end."""
    out = subprocess.run([sys.executable, "-c", STUCK], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "returned" in out.stdout, out
    assert "1 thread(s) still running 0.5 s after the error (orbax-like); exiting without them" in out.stderr


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "dp"])
def test_every_strategys_state_has_checksums_to_save(strategy):
    """dp keeps its optimizer state on one device and the rest on all: the checksums (each checkpoint's) were one
    computation over both, which JAX refuses ("incompatible devices"): a dp run on 4 devices could not save."""
    import jax
    import optax
    from flax import nnx

    import jdp

    mesh = jdp.make_mesh()
    _, state = jdp.init_state(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), optax.adamw(0.1), mesh, strategy=strategy)
    sums = checksums(state)
    assert len(sums) == len(jax.tree.leaves(state)) and len(set(sums.values())) > 1


DIFFERENT = """
import os, sys
from jdp.cli import main
rank = int(os.environ["JAX_PROCESS_ID"])
sys.exit(main(["train", "tiny", f"optim.lr={3e-4 if rank == 0 else 1e-3}", "train.run_dir=" + sys.argv[1]]))
"""


def test_processes_given_different_configs_are_named_at_start_up(tmp_path, spawn):
    """One rank given another optim.lr by a wrapper trained apart until the first replica check (step 100), unnamed."""
    script = tmp_path / "different.py"
    script.write_text(textwrap.dedent(DIFFERENT))
    results = spawn([str(script), str(tmp_path / "run")], 2, 1, timeout=240)
    for code, _, err in results:
        assert code == 2 and "Traceback" not in err, err[-3000:]
    said = results[0][2]
    assert "the processes of this job resolved different configs: process 1 has optim.lr=0.001, process 0 " \
           "optim.lr=0.0003" in said, said[-3000:]  # fmt: skip
    assert "compil" not in results[0][1].lower()


def test_diloco_with_one_group_says_so(capfd):
    """DiLoCo on one host (a group per host) or parallel.groups=1 ran without a word: there is no group to agree with."""
    from jdp import parallel
    from jdp.config import load_config
    from jdp.lm import LanguageModel

    cfg = load_config("tiny", ["parallel.sync=diloco", "parallel.groups=1", "train.run_dir=x"])
    LanguageModel(cfg).check(parallel.mesh_for(cfg.parallel))
    said = capfd.readouterr().err
    assert "parallel.sync=diloco with one group (parallel.groups=1): no other group to agree with" in said, said
