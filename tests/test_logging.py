"""jdp as a library speaks through `logging`: a program's own handler on "jdp" gets jdp's records (and jdp adds
none), process 0 speaks for the job, the `jdp` command looks as it always did, and `import jdp` needs no JAX."""

import json
import logging
import os
import subprocess
import sys
import textwrap

from jdp.log import EVERY_RANK, PLAIN, Formatter, RankFilter, set_rank

TINY = [
    "model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.max_seq_len=32", "data.seq_len=32",
    "train.batch_size=8", "train.progress=false", "data.val_tokens=1024",
]  # fmt: skip

LIBRARY_USER = textwrap.dedent(
    """
    import json, logging, sys
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append({"logger": record.name, "level": record.levelname, "text": record.getMessage(),
                         "rank": getattr(record, "rank", None)})

    mine = Keep()
    logging.getLogger("jdp").addHandler(mine)  # the program's own, before jdp says anything

    import jax.numpy as jnp, numpy as np, optax
    from flax import nnx
    import jdp
    from jdp.log import RankFilter

    mine.addFilter(RankFilter())  # process 0's notices only, as jdp's own handler keeps them

    def mse(model, batch):
        err = model(batch["x"])[:, 0] - batch["y"]
        return jnp.sum(err * err), jnp.float32(err.shape[0])

    x = np.random.default_rng(0).uniform(-1, 1, (64, 2)).astype(np.float32)
    cfg = jdp.load_config(None, [f"train.run_dir={sys.argv[1]}", "train.steps=2", "train.batch_size=16",
                                 "train.progress=false", "train.tensorboard=false", "train.eval_every=0"])
    jdp.Trainer(lambda: nnx.Linear(2, 1, rngs=nnx.Rngs(0)), mse, optax.sgd(0.1), {"x": x, "y": x.sum(1)}, cfg).fit()
    handlers = [type(h).__name__ for h in logging.getLogger("jdp").handlers]
    print(json.dumps({"records": seen, "handlers": handlers}))
    """
)


def _env(tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    env |= {"JDP_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return env | {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}


def test_a_programs_own_handler_gets_the_banner_records_and_jdp_adds_none(tmp_path):
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, "-c", LIBRARY_USER, str(run_dir)], capture_output=True, text=True,
                         env=_env(tmp_path), timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    *printed, last = out.stdout.strip().splitlines()
    got = json.loads(last)
    assert got["handlers"] == ["Keep"]  # jdp added no handler of its own next to the program's
    assert not [line for line in printed if line.startswith("jdp")], printed  # and wrote nothing itself
    texts = [r["text"] for r in got["records"]]
    banner = ("single process", "model ", "devices 2 over 1 process(es)", "parallel.strategy=ddp", "data 64 rows",
              f"run dir {run_dir} | starting at step 0")  # fmt: skip
    for start in banner:
        assert [t for t in texts if t.startswith(start)], (start, texts)
    assert texts[-1].startswith("done: loss ")
    assert not [t for t in texts if t.startswith(("jdp |", "jdp:"))], texts  # clean text: the prefix is the look's
    assert {(r["level"], r["rank"]) for r in got["records"]} == {("INFO", 0)}
    assert {r["logger"] for r in got["records"]} <= {"jdp.trainer", "jdp.loop"}


def _record(level: int, text: str = "a message", **extra) -> logging.LogRecord:
    record = logging.LogRecord("jdp.trainer", level, __file__, 1, text, None, None)
    record.__dict__.update(extra)
    return record


def test_the_rank_filter_keeps_notices_to_process_0_and_warnings_from_every_process():
    keep = RankFilter().filter
    assert keep(_record(logging.INFO, rank=0)) and not keep(_record(logging.INFO, rank=1))
    assert keep(_record(logging.WARNING, rank=1)) and keep(_record(logging.ERROR, rank=3))
    assert keep(_record(logging.INFO, rank=1, **EVERY_RANK))  # a notice each process gives about itself
    set_rank(2)  # as jdp does once the process has joined its job
    try:
        notice, warning = _record(logging.INFO), _record(logging.WARNING)
        assert not keep(notice) and keep(warning) and notice.rank == warning.rank == 2
    finally:
        set_rank(0)
    assert keep(_record(logging.INFO)) and _record(logging.INFO).__dict__.get("rank") is None


def test_the_formatter_gives_the_commands_look_to_clean_text():
    look = Formatter().format
    assert look(_record(logging.INFO, "done: loss 1.0")) == "jdp | done: loss 1.0"
    assert look(_record(logging.WARNING, "the token cache is damaged")) == "jdp: warning: the token cache is damaged"
    assert look(_record(logging.ERROR, "bad")) == "jdp: error: bad"
    assert look(_record(logging.INFO, "run already complete", **PLAIN)) == "jdp: run already complete"
    assert look(_record(logging.INFO, "\nstopped by a signal")) == "\njdp | stopped by a signal"  # ends a bar's line


def test_the_command_prints_what_it_always_printed_where_it_always_did(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lock = run_dir / ".jdp-lock"
    lock.write_text('{"host": "gone", "pi')  # a lock cut off while written, long ago: a warning, then taken over
    os.utime(lock, (1_000_000_000, 1_000_000_000))
    args = ["train", "tiny", *TINY, "train.steps=2", "train.eval_every=2", f"train.run_dir={run_dir}"]
    out = subprocess.run([sys.executable, "-m", "jdp.cli", *args], capture_output=True, text=True,
                         env=_env(tmp_path), timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    starts = ["jdp | single process", "jdp | model ", "jdp | devices 2 over 1", "jdp | parallel.strategy=ddp",
              "jdp | data ", f"jdp | run dir {run_dir} | starting at step 0", "step 2: eval_loss",
              "jdp | goodput ", "jdp |   startup ", "jdp |   compile ", "jdp |   data wait ", "jdp |   train steps ",
              "jdp |   eval ", "jdp |   checkpoint ", "jdp |   replica checks ", "jdp |   lost work ",
              "jdp | done: loss "]  # fmt: skip
    assert len(lines) == len(starts) and all(a.startswith(b) for a, b in zip(lines, starts, strict=True)), lines
    jdp_err = [line for line in out.stderr.splitlines() if line.startswith("jdp")]
    assert len(jdp_err) == 1, out.stderr[-3000:]  # the warning, on stderr; every notice went to stdout
    assert jdp_err[0].startswith(f"jdp: warning: took over {lock} from a job that is gone (its lock was cut off")


def test_importing_jdp_and_its_command_line_does_not_import_jax():
    program = (
        "import sys, logging\nimport jdp, jdp.cli, jdp.log\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax', 'optax', 'orbax')))\n"
        "print(logging.getLogger('jdp').handlers)\n"
    )
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == ["[]", "[]"]  # and importing adds no handler: that waits for jdp's first record
