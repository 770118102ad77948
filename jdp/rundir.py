"""The run directory: every path under RUN_DIR, in one place."""

from __future__ import annotations

import datetime
import shutil
from pathlib import Path


class RunDir:
    """RUN_DIR's layout. Process 0 writes the config, metrics, trackers and summary; every process writes
    checkpoints (and, streaming, its own data position)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

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
    def summary(self) -> Path:
        return self.path / "summary.json"

    @property
    def tensorboard(self) -> Path:
        return self.path / "tensorboard"

    @property
    def wandb(self) -> Path:
        return self.path / "wandb"

    @property
    def wandb_run_id(self) -> Path:
        return self.path / "wandb-run-id"  # the same W&B run across restarts

    def data_state(self, step: int, process: int) -> Path:
        """Where a streaming run keeps process `process`'s stream position after step `step`."""
        return self.path / "data_state" / str(step) / f"process_{process}.json"

    def archive(self) -> Path | None:
        """Move a previous run's files into RUN_DIR/archived-TIME (train.resume=false): nothing is deleted."""
        old = [
            self.checkpoints,
            self.metrics,
            self.superseded_metrics,
            self.summary,
            self.path / "data_state",
            self.tensorboard,
            self.wandb_run_id,
            self.wandb,
        ]
        old = [p for p in old if p.exists()]
        if not old:
            return None
        dest = self.path / f"archived-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"
        dest.mkdir(parents=True)
        for p in old:
            shutil.move(str(p), str(dest / p.name))
        return dest
