"""The run directory: every path under RUN_DIR, in one place, and the lock that keeps it to one job."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
import socket
import threading
import time
from pathlib import Path

import yaml

from jdp.errors import ConfigError

__all__ = ["RunDir", "RunDirEscape", "RunDirInUse", "RunLock"]


class RunDir:
    """RUN_DIR's layout. Process 0 writes the config, metrics, trackers and summary; every process writes
    checkpoints (and, streaming, its own data position)."""

    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser()  # train.run_dir=~/runs/x is under the home directory, not ./~

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    @property
    def config(self) -> Path:
        return self.path / "config.yaml"  # the resolved config

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"  # one orbax checkpoint per step: checkpoints/STEP

    @property
    def damaged_checkpoints(self) -> Path:
        return self.path / "damaged-checkpoints"  # checkpoints that did not restore, set aside

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def superseded_metrics(self) -> Path:
        return self.path / "metrics.superseded.jsonl"  # records of work lost since the checkpoint resumed from

    @property
    def damaged_metrics(self) -> Path:
        return self.path / "metrics.damaged.jsonl"  # lines of metrics.jsonl that did not parse, set aside

    @property
    def summary(self) -> Path:
        return self.path / "summary.json"

    @property
    def tensorboard(self) -> Path:
        return self.path / "tensorboard"

    @property
    def eval_dir(self) -> Path:
        return self.path / "eval"  # the evaluation harness's results: step_N.json (train.eval_tasks, jdp eval)

    @property
    def wandb(self) -> Path:
        return self.path / "wandb"

    @property
    def wandb_run_id(self) -> Path:
        return self.path / "wandb-run-id"  # the same W&B run across restarts

    def checkpoint_steps(self) -> list[int]:
        """The steps of the complete checkpoints on disk (an unfinished save's temporary directory is not one)."""
        if not self.checkpoints.is_dir():
            return []
        return sorted(int(p.name) for p in self.checkpoints.iterdir() if p.name.isdigit() and p.is_dir())

    def unusable(self) -> str | None:
        """Why jdp must not write into this path (None when it may): it is a file, or a directory that holds files
        of something other than a jdp run (a typo'd train.run_dir=. or =~/data must not get checkpoints and
        archives mixed into it)."""
        if self.path.exists() and not self.path.is_dir():
            return f"train.run_dir={self.path} is a file, not a directory; give a new or empty directory, or a run's"
        if not self.path.is_dir():
            return None
        entries = sorted(p.name for p in self.path.iterdir())
        if not entries or self.written_by_jdp(entries):
            return None
        shown = ", ".join(entries[:5]) + (f", ... ({len(entries)} entries)" if len(entries) > 5 else "")
        ours = {p.name for p in self.files() + self.trees()}
        named = [name for name in entries if name in ours]
        mine = f"; its {', '.join(named)} {'is' if len(named) == 1 else 'are'} not jdp's" if named else ""
        return (
            f"train.run_dir={self.path} is not empty and is not a jdp run directory (it holds {shown}{mine}); jdp "
            f"writes checkpoints and metrics there and moves old runs' files around, so it takes only a new or empty "
            f"directory or one a jdp run wrote. Give another train.run_dir (nothing was written)"
        )

    def written_by_jdp(self, entries: list[str]) -> bool:
        """Whether a jdp run wrote this directory: its lock or an archive of an earlier run, a config.yaml of jdp's
        sections (saved before the first step: a run stopped before its first checkpoint has one), a checkpoints/
        of steps (or none yet), or a metrics.jsonl of jdp's records. A file of the same name alone is not enough:
        a directory of the user's own metrics.jsonl or config.yaml is not a run to move files around in."""
        if any(name.startswith((RunLock.NAME, "archived-")) for name in entries):
            return True
        if self.checkpoints.is_dir() and not self.checkpoints.is_symlink():
            names = [p.name for p in self.checkpoints.iterdir()]
            if not names or any(name[:1].isdigit() or name.startswith(".jdp-") for name in names):  # (.jdp-: a probe)
                return True
        return _jdp_config(self.config) or _jdp_metrics(self.metrics)

    @property
    def data_states(self) -> Path:
        return self.path / "data_state"  # a streaming run's stream positions: data_state/STEP/process_N.json

    @property
    def plot(self) -> Path:
        return self.path / "plot.png"  # `jdp plot`'s default output

    @property
    def reference_logps(self) -> Path:
        return self.path / "reference_logps.npz"  # train.precompute_reference: each pair's, computed at step 0

    def data_state(self, step: int, process: int) -> Path:
        """Where a streaming run keeps process `process`'s stream position after step `step`."""
        return self.data_states / str(step) / f"process_{process}.json"

    def files(self) -> list[Path]:
        """The files of this layout (W&B's directory among them: jdp only ever moves it whole)."""
        files = [self.config, self.metrics, self.superseded_metrics, self.damaged_metrics, self.summary]
        return [*files, self.wandb_run_id, self.path / RunLock.NAME, self.wandb, self.plot, self.reference_logps]

    def trees(self) -> list[Path]:
        """The directories of this layout whose contents jdp writes, reads and moves."""
        return [self.checkpoints, self.damaged_checkpoints, self.data_states, self.tensorboard, self.eval_dir]

    def check_contained(self) -> None:
        """Refuse a run directory with a link that leads out of it (raises RunDirEscape): jdp writes metrics,
        checkpoints and summaries into RUN_DIR, moves files around in it and reads checkpoints from it, and a
        directory from someone else must not make it write or read elsewhere (a metrics.jsonl that links to
        ~/.bashrc). Checked: every path of this layout and everything below its directories, except W&B's own
        directory (wandb links its logs to ~/.cache/wandb, and jdp only ever moves that directory whole). Links
        that stay inside are fine; RUN_DIR itself may be a link."""
        if not self.path.exists():
            return
        root = self.path.resolve()
        trees = self.trees()
        below = [Path(d) / n for t in trees for d, ds, fs in os.walk(t) for n in ds + fs]  # links not followed
        for p in self.files() + trees + below:
            if p.is_symlink() and not p.resolve().is_relative_to(root):
                raise RunDirEscape(
                    f"{p} is a link to {os.readlink(p)}, outside the run directory {self.path}; jdp reads and "
                    f"writes only inside it. Replace the link with the file it points to (or use another "
                    f"train.run_dir)"
                )

    def archive(self) -> Path | None:
        """Move a previous run's files into RUN_DIR/archived-TIME (train.resume=false): nothing is deleted.
        Everything moves (config.yaml, metrics, checkpoints, summary, plots, ...) except the live job's lock and
        earlier archives, so the archive holds the old run exactly as it was."""
        old = sorted(p for p in self.path.iterdir() if not p.name.startswith((RunLock.NAME, "archived-")))
        if not old:
            return None
        stamp = f"archived-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"
        dest, n = self.path / stamp, 1
        while dest.exists():  # two archives within a second
            n += 1
            dest = self.path / f"{stamp}-{n}"
        dest.mkdir()
        for p in old:
            shutil.move(str(p), str(dest / p.name))
        return dest

    def missing_dirs(self) -> list[Path]:
        """RUN_DIR and those of its parents that do not exist yet, deepest first: what taking the lock creates."""
        return [p for p in (self.path.absolute(), *self.path.absolute().parents) if not p.exists()]

    @staticmethod
    def remove_if_empty(created: list[Path]) -> None:
        """Remove the directories a job created (missing_dirs) that are still empty, deepest first: a run that
        never started leaves nothing behind. A directory that holds anything, or existed before, stays."""
        for p in created:
            try:
                p.rmdir()  # only ever removes an empty directory
            except OSError:
                return


class RunDirEscape(ConfigError):
    """A link inside the run directory leads out of it: input that cannot run, refused before anything is read."""


class RunDirInUse(RuntimeError):
    """Another live job holds the run directory."""


class RunLock:
    """One job per run directory. The job's process 0 creates RUN_DIR/.jdp-lock (host, pid, process start time,
    job start) atomically and rewrites its `beat` time every BEAT_S seconds while it runs.

    A lock is live when its process still runs (same host: the pid exists with the same start time, so a
    reused pid does not count) or, seen from another host (shared storage), when its beat is younger than
    STALE_S. A dead job's lock is moved aside atomically (of two jobs taking it over, one wins) and taken over.
    """

    NAME = ".jdp-lock"
    BEAT_S = 10.0
    STALE_S = 60.0  # hosts' clocks must agree to well within this for the cross-host check
    WRITE_S = 5.0  # a lock that does not parse and is older than this was cut off while written: its job is dead

    def __init__(self, run_dir: RunDir):
        self.path = run_dir.path / self.NAME
        self.mine: dict | None = None
        self._stop = threading.Event()

    def acquire(self) -> dict | None:
        """Hold the lock; returns the dead job's lock it took over (None if there was none). Raises RunDirInUse."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": _process_start(os.getpid())}
        me |= {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "beat": time.time()}
        taken_over = None
        for _ in range(10):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                raw = _raw(self.path)
                other = _parse(raw) if raw is not None else None
                if other is None and raw is not None and _age(self.path) > self.WRITE_S:
                    other = _damaged(self.path)  # cut off by a crash or a full disk while being created: dead
                if other is None or (not other.get("damaged") and _alive(other)):
                    if other is None:  # being written right now (or just removed)
                        time.sleep(0.2)
                        continue
                    raise RunDirInUse(
                        f"{self.path.parent} is in use by another job: process {other['pid']} on {other['host']}, "
                        f"started {other['started']}. Stop it first, or give this run another train.run_dir"
                    ) from None
                aside = self.path.with_name(f"{self.NAME}.dead-{os.getpid()}")
                try:
                    os.rename(self.path, aside)  # of two jobs taking over, one rename wins
                except FileNotFoundError:
                    continue
                if _raw(aside) != raw:  # a fresh lock appeared in between: put it back, it is live
                    with contextlib.suppress(OSError):
                        os.link(aside, self.path)
                    os.unlink(aside)
                    continue
                os.unlink(aside)
                taken_over = other
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.mine = me
            threading.Thread(target=self._beat, daemon=True, name="jdp-run-lock").start()
            return taken_over
        raise RunDirInUse(
            f"could not take {self.path}: other jobs keep changing it, or one is creating it right now (it does not "
            f"parse yet and is younger than {self.WRITE_S:g} s); try again in a few seconds"
        )

    def _beat(self) -> None:
        while not self._stop.wait(self.BEAT_S):
            current = _read(self.path)
            if current is None or current["pid"] != self.mine["pid"] or current["host"] != self.mine["host"]:
                return  # not ours any more (taken over while this job stalled): leave it to its new owner
            self.mine["beat"] = time.time()
            tmp = self.path.with_name(f"{self.NAME}.tmp-{os.getpid()}")
            tmp.write_text(json.dumps(self.mine))
            os.replace(tmp, self.path)

    def release(self) -> None:
        self._stop.set()
        if self.mine is not None and (current := _read(self.path)) and current["pid"] == self.mine["pid"]:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        self.mine = None


_SECTIONS = {"model", "data", "optim", "train", "parallel"}


def _jdp_config(path: Path) -> bool:
    """Whether `path` is a config.yaml jdp saved: a YAML mapping of jdp's sections."""
    try:
        if not path.is_file() or path.stat().st_size > 1 << 20:
            return False
        saved = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError):
        return False
    return isinstance(saved, dict) and bool(saved) and set(saved) <= _SECTIONS


def _jdp_metrics(path: Path) -> bool:
    """Whether `path` is a metrics.jsonl jdp wrote: its first line one of jdp's records (a step number)."""
    try:
        with path.open("rb") as f:
            first = f.readline(1 << 16)
        record = json.loads(first)
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and isinstance(record.get("step"), int)


def _read(path: Path) -> dict | None:
    raw = _raw(path)
    return None if raw is None else _parse(raw)


def _raw(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def _age(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return 0.0


def _damaged(path: Path) -> dict:
    """What a lock file that does not parse says of its job, for the warning when it is taken over."""
    written = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(time.time() - _age(path)))
    return {
        "damaged": True,
        "pid": "unknown",
        "host": "unknown",
        "started": written,
    }


def _parse(raw: bytes) -> dict | None:
    try:
        info = json.loads(raw)
    except ValueError:
        return None
    fields = {"host": str, "pid": int, "started": str, "beat": (int, float)}
    ok = isinstance(info, dict) and all(isinstance(info.get(k), t) for k, t in fields.items())
    return info if ok else None


def _alive(lock: dict) -> bool:
    if lock["host"] != socket.gethostname():
        return time.time() - lock["beat"] < RunLock.STALE_S
    start = _process_start(lock["pid"])
    return start is not None and start == lock.get("pid_start", start)


def _process_start(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, Linux), or None if it does not exist."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[19])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, IndexError):  # no /proc: fall back to whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return 0
