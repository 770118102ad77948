"""What live members (train.live=true) leave in their run directory, read back for the tests: each member's
per-step lines, which rows each step trained (every row of the global order exactly once), its final parameters.
Shared by tests/test_live.py and tests/test_slurm.py's srun launch; imports no torch or torchft."""

import json
import time
from pathlib import Path

import numpy as np

from jdp.config import load_config

# A small, fast model on the embedded corpus: 16 rows a step, split over the members.
MODEL = ["model.n_layers=2", "model.d_model=64", "model.max_seq_len=64", "data.seq_len=64", "train.batch_size=16"]
TRAIN = ["train", "configs/tiny.yaml", *MODEL, "train.progress=false", "train.log_every=1"]


def member_pids(run_dir: Path, host: str = "*") -> list[int]:
    """The PIDs of every member that logged a line in run_dir (of those on `host`'s address: all by default), sorted."""
    return sorted(int(f.stem.rpartition("_")[2]) for f in run_dir.glob(f"live-{host}_*.jsonl"))


def lines(run_dir: Path, pid: int) -> list[dict]:
    path = next(run_dir.glob(f"live-*_{pid}.jsonl"), None)
    return [json.loads(x) for x in path.read_text().splitlines()] if path else []


def wait_for_step(run_dir: Path, pid: int, step: int, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (got := lines(run_dir, pid)) and got[-1]["step"] >= step:
            return
        time.sleep(0.05)
    raise AssertionError(f"member {pid} did not reach step {step} in {timeout} s")


def global_batches(steps: int, extra: tuple | list = ()) -> list[np.ndarray]:
    """The window indices of global batches 0..steps-1, in jdp's global order (seed 0), with the `extra` overrides
    the run had (data.val_tokens moves the windows)."""
    from jdp.data.pipeline import load_data

    cfg = load_config("configs/tiny.yaml", [*MODEL, *extra])
    order = load_data(cfg.data, cfg.model.vocab_size, cfg.train.batch_size, cfg.train.seed).train.order
    return [order.indices(s) for s in range(steps)]


def check_rows(
    run_dir: Path, final: list[int], everyone: list[int], steps: int, first: int = 1, extra: tuple | list = ()
) -> int:
    """Every row of steps first..steps trained exactly once, over the final state's history: each step's quorum as
    a member that ended the run logged it, else as one that committed it (a line is written only after its commit);
    each member of that quorum logged its rank's part of the
    global batch, and the parts make the batch. A member SIGKILLed between its step's commit and its line, or cut
    off after an all-reduce the others committed (it copies their state later), has no line for that step: its part
    is its rank's (the PIDs in rank order ride in the all-reduce: a rank held twice or by no one would show).
    Returns how many parts were so attributed. `extra`: the run's data overrides (global_batches)."""
    logged = {pid: {m["step"]: m for m in lines(run_dir, pid)} for pid in everyone}
    batches, unlogged = global_batches(steps, extra), 0
    for s in range(first, steps + 1):
        # a final member's line; else (its quorum all gone since, as at a start, where the first two members
        # trained step 1 and the others copied their state) the line of a member that committed it
        quorum = next(logged[pid][s]["by_rank"] for pid in [*final, *everyone] if s in logged[pid])
        assert sorted(quorum) == sorted(set(quorum)) and all(pid in everyone for pid in quorum), f"step {s}: {quorum}"
        parts = np.array_split(batches[s - 1], len(quorum))
        rows = []
        for rank, pid in enumerate(quorum):
            line = logged[pid].get(s)
            if line is not None and line["by_rank"] == quorum:
                assert line["rows"] == parts[rank].tolist(), f"step {s}: member {pid} trained rows not its own"
                rows += line["rows"]
            else:  # killed after its step's commit, or cut off after the all-reduce others committed (it then
                rows += parts[rank].tolist()  # copies their state): its gradient is in the step, its line is not
                unlogged += 1
        assert sorted(rows) == sorted(batches[s - 1].tolist()), f"step {s}: rows {sorted(rows)}"
    return unlogged


def end(run_dir: Path, pid: int) -> dict:
    """What a member that ended wrote last: its final step (committed, or copied from a peer when the others ended
    the run while it was behind), the steps it saw fail and those it joined at."""
    return json.loads(next(run_dir.glob(f"live-*_{pid}-end.json")).read_text())


def params(run_dir: Path, pid: int) -> np.ndarray:
    return np.load(next(run_dir.glob(f"live-*_{pid}-params.npy")))
