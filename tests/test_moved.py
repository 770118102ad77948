"""The module paths the redesign moved still import (jdp/moved.py), warn naming the new home, and give its objects.

Run in a fresh interpreter, so the old names never reach this process's sys.modules."""

import subprocess
import sys
from pathlib import Path

import pytest

from jdp.moved import MOVED

ROOT = Path(__file__).resolve().parents[1]
GONE = {"jdp.faults": "fault injection left jdp: tests/inject.py's callback"}  # removed, with no new home

PROGRAM = """
import importlib, sys, warnings
import jdp
from jdp.moved import MOVED, SPLIT
assert jdp.train.__module__ == "jdp.lm"  # the function, before any old path is imported
for old, new in MOVED.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    said = [str(w.message) for w in caught if w.category is DeprecationWarning and old + " moved to " in str(w.message)]
    assert len(said) == 1 and new in said[0], (old, [str(w.message) for w in caught])
    home = importlib.import_module(new)
    names = [n for n in vars(home) if not n.startswith("_")]
    assert names and all(getattr(module, n) is getattr(home, n) for n in names), old
    for name, where in SPLIT.get(old, {}).items():
        assert where in said[0] and getattr(module, name) is getattr(importlib.import_module(where), name), (old, name)
from jdp.model import lm_loss
from jdp.models.common import lm_loss as now
assert lm_loss is now
import jdp.train  # the attribute becomes the old module, as it did; it still trains
assert callable(jdp.train) and jdp.train.train is sys.modules["jdp.lm"].train
print("ok", len(MOVED))
"""


def test_every_moved_path_imports_warns_with_its_new_home_and_gives_the_same_objects():
    out = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["ok", str(len(MOVED))]


def test_every_module_path_that_left_jdp_is_in_the_table():
    """A module renamed or deleted under jdp/ (git's history) still imports, is in jdp/moved.py's table, or is gone."""
    git = ["git", "-C", str(ROOT)]
    shallow = subprocess.run([*git, "rev-parse", "--is-shallow-repository"], capture_output=True, text=True)
    if shallow.returncode != 0 or shallow.stdout.strip() != "false":
        pytest.skip("needs the whole git history of jdp/")
    log = [*git, "log", "-M", "--diff-filter=RD", "--name-status", "--format=", "--", "jdp/"]
    left = subprocess.run(log, capture_output=True, text=True, check=True).stdout.splitlines()

    def dotted(paths):
        return {p.removesuffix(".py").removesuffix("/__init__").replace("/", ".") for p in paths}

    now = dotted(str(p.relative_to(ROOT)) for p in (ROOT / "jdp").rglob("*.py"))  # jdp.data, jdp.parallel: packages now
    missing = dotted(line.split("\t")[1] for line in left if line) - now - set(MOVED) - set(GONE)
    assert not missing, f"module paths gone from jdp/ without a line in jdp/moved.py's MOVED: {sorted(missing)}"
