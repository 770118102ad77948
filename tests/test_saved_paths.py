"""Issue 65: relative local paths in a run's config.yaml broke `jdp generate` and `jdp export` run from another
directory. config.save_config writes them absolute; trainer.completed_step still finds the run complete."""

import json
import shutil
from pathlib import Path

import yaml

from jdp.checkpoint import config_differences
from jdp.config import load_config, save_config
from jdp.data.tokens import load_tokenizer
from jdp.rundir import RunDir
from jdp.trainer import completed_step

FIXTURE = Path(__file__).parent / "data" / "hf-gpt2-tiny"


def test_relative_paths_are_saved_absolute_and_the_run_is_still_complete(tmp_path, monkeypatch):
    """A relative data.tokenizer in config.yaml broke `jdp generate` and `jdp export` run from another directory.
    Local paths that exist are saved absolute (hub names, byte and missing paths as given); the same command run
    again still finds its run complete, and so does an older run's relative config.yaml."""
    work = tmp_path / "work"
    (work / "tok").mkdir(parents=True)
    shutil.copy(FIXTURE / "tokenizer.json", work / "tok" / "tokenizer.json")
    (work / "data").mkdir()
    (work / "data" / "a.txt").write_text("some text\n")
    monkeypatch.chdir(work)
    overrides = ["data.tokenizer=tok", "data.source=data/*.txt", "data.chat_template=missing.jinja",
                 "train.init_adapter=", "train.run_dir=run", "train.steps=2"]  # fmt: skip
    cfg = load_config("tiny", overrides)
    saved = yaml.safe_load(save_config(cfg, "run").read_text())
    assert saved["data"]["tokenizer"] == str(work / "tok") and saved["data"]["source"] == str(work / "data" / "*.txt")
    assert saved["data"]["chat_template"] == "missing.jinja" and saved["train"]["run_dir"] == "run"
    assert load_config("tiny", ["data.source=org/name"]).data.source == "org/name"  # a hub name: not a path here
    (work / "run" / "checkpoints" / "2").mkdir(parents=True)
    (work / "run" / "summary.json").write_text(json.dumps({"steps": 2}))
    assert completed_step(RunDir("run"), cfg) == 2  # run again: nothing to do, nothing changed
    assert completed_step(RunDir("run"), load_config("tiny", [*overrides, "optim.lr=0.1"])) == -1
    # resumed as `jdp train run/config.yaml`: its absolute paths and the checkpoint record's relative ones agree
    record, again = (json.loads(json.dumps(c.to_dict())) for c in (cfg, load_config(work / "run" / "config.yaml")))
    assert again["data"]["tokenizer"] == str(work / "tok") and config_differences(record, again) == []
    monkeypatch.chdir(tmp_path)  # another directory: the run's config still names its tokenizer
    assert load_tokenizer(load_config(work / "run" / "config.yaml").data.tokenizer).vocab_size == 320
    (work / "run" / "config.yaml").write_text(yaml.safe_dump(json.loads(json.dumps(cfg.to_dict()))))  # an older one
    monkeypatch.chdir(work)
    assert completed_step(RunDir("run"), cfg) == 2
