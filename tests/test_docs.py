"""The docs are true: every code block of the README and docs/ runs, or says why it cannot; every link resolves.

A ```python block runs as a script with this interpreter; a ```bash, ```sh or ```console block runs command by
command (a console block's `$ ` lines), each in the block's own empty working directory, with `jdp` on PATH, as a
user's shell would. HTML comments directly above a block say how to treat it:

- `<!-- not run: WHY -->`: needs what a CPU machine lacks (GPUs, hosts, a cluster, the hub, torch); reported as a
  skip with its reason (`pytest -rs`);
- `<!-- NAME: this block is run by tests/FILE.py -->`: another test runs it (FILE must name the NAME marker);
- `<!-- same as docs/PAGE.md -->`: each of its commands is a command that PAGE runs (no need to run it twice);
- `<!-- setup: COMMAND -->`: run first, in the same directory (to make a file or a run the block reads).

Output is shown in ```text blocks, never run. A fence with no language fails: say which it is.
"""

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNABLE = {"python", "bash", "sh", "console"}
SHOWN = {"text", "yaml", "json", "toml"}  # content to read, not to run
README_MAX_LINES = 250  # issue 27: what a newcomer reads in five minutes


@dataclass
class Block:
    page: Path
    index: int  # 1-based among the page's fenced blocks
    line: int  # the opening fence's line number
    lang: str
    code: str
    markers: list[str] = field(default_factory=list)  # the HTML comments directly above, top to bottom

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:block{self.index}"

    def marker(self, prefix: str) -> list[str]:
        return [m[len(prefix) :].strip() for m in self.markers if m.startswith(prefix)]

    def commands(self) -> list[str]:
        """The shell commands, continuation lines joined; comments and (console) output left out."""
        lines = self.code.splitlines()
        if self.lang == "console":
            kept, going_on = [], False
            for line in lines:
                if line.startswith("$ ") or going_on:
                    kept.append(line[2:] if line.startswith("$ ") else line)
                    going_on = line.endswith("\\")
            lines = kept
        commands, current = [], ""
        for line in lines:
            current += line[:-1] + " " if line.endswith("\\") else line
            if not line.endswith("\\"):
                if current.strip() and not current.strip().startswith("#"):
                    commands.append(current.strip())
                current = ""
        return commands


def blocks(page: Path) -> list[Block]:
    """Every fenced block of a page, with the comments directly above it."""
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        opening = re.match(r"^```(\S*)\s*$", lines[i])
        if not opening:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].rstrip() == "```"), None)
        assert end is not None, f"{page.name}:{i + 1}: a code fence that is never closed"
        markers, k = [], i - 1
        while k >= 0 and re.match(r"^<!--.*-->\s*$", lines[k]):
            markers.insert(0, lines[k].strip()[4:-3].strip())
            k -= 1
        found.append(
            Block(page, len(found) + 1, i + 1, opening.group(1), "\n".join(lines[i + 1 : end]) + "\n", markers)
        )
        i = end + 1
    return found


ALL = [b for page in PAGES for b in blocks(page)]
CHECKED = [b for b in ALL if b.lang not in SHOWN]


def inventory() -> dict[str, dict[str, int]]:
    """Per page: blocks run here, run by another test or page, and not run (with a reason)."""
    counts: dict[str, dict[str, int]] = {}
    for b in CHECKED:
        kind = "run" if runs_here(b) else "not run" if b.marker("not run:") else "elsewhere"
        page = counts.setdefault(str(b.page.relative_to(ROOT)), {"run": 0, "elsewhere": 0, "not run": 0})
        page[kind] += 1
    return counts


def elsewhere(b: Block) -> bool:
    return bool(b.marker("same as") or any(re.search(r"this block is run by tests/", m) for m in b.markers))


def runs_here(b: Block) -> bool:
    return b.lang in RUNNABLE and not b.marker("not run:") and not elsewhere(b)


def uncommented(command: str) -> str:
    """A command without its trailing `# comment` (the same command may be explained differently on two pages)."""
    return re.sub(r"\s+#\s.*$", "", command)


@pytest.fixture(scope="module")
def shell_env(tmp_path_factory) -> dict[str, str]:
    """A user's shell: the venv's `jdp` on PATH, no simulated devices unless a command asks; one token cache
    for the module, so the stdlib corpus is built once."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # conftest's 4 devices are the tests', not a user's
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["JDP_CACHE"] = str(tmp_path_factory.mktemp("jdp-cache"))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run(argv: list[str], cwd: Path, env: dict[str, str], what: str, timeout: float = 300) -> str:
    """Run argv in its own process group; it must exit 0 within the timeout. Nothing it started outlives it."""
    proc = subprocess.Popen(
        argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    timed_out = False
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        try:  # its process group (jdp launch's workers too): whatever of it is left
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if timed_out:
        out, _ = proc.communicate()
    assert not timed_out, f"{what} ran past {timeout} s:\n{out[-4000:]}"
    assert proc.returncode == 0, f"{what} exited {proc.returncode}:\n{out[-4000:]}"
    return out


@pytest.mark.parametrize("block", CHECKED, ids=[b.name for b in CHECKED])
def test_code_block_runs_or_says_why_not(block: Block, tmp_path, request):
    where = f"{block.name} (line {block.line} of {block.page.name})"
    assert block.lang, f"{where}: a fence with no language; use ```text for output, or name the language"
    assert block.lang in RUNNABLE, f"{where}: unknown fence language {block.lang!r} (run: {RUNNABLE}, shown: {SHOWN})"
    if why := block.marker("not run:"):
        pytest.skip(f"{where} not run: {why[0]}")
    for marker in block.markers:
        if by := re.search(r"^([\w-]+): this block is run by (tests/\w+\.py)", marker):
            test = ROOT / by.group(2)
            assert test.exists() and by.group(1) in test.read_text(), f"{where}: {test.name} does not run {by.group(1)}"
            return
    if same := block.marker("same as"):
        page = ROOT / same[0]
        assert page.exists(), f"{where}: 'same as {same[0]}', which does not exist"
        there = {uncommented(c) for b in blocks(page) if runs_here(b) for c in b.commands()}
        missing = [c for c in block.commands() if uncommented(c) not in there]
        assert not missing, f"{where}: not run by {same[0]}: {missing}"
        return
    env = request.getfixturevalue("shell_env")
    for setup in block.marker("setup:"):
        run(["bash", "-c", setup], tmp_path, env, f"{where}, setup `{setup}`")
    if block.lang == "python":
        (tmp_path / "block.py").write_text(block.code)
        run([sys.executable, "block.py"], tmp_path, env, where)
        return
    commands = block.commands()
    assert commands, f"{where}: a shell block with no command in it"
    for command in commands:
        run(["bash", "-o", "pipefail", "-c", command], tmp_path, env, f"{where}: `{command}`")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def without_code_blocks(page: Path) -> str:
    return re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)


def prose(page: Path) -> str:
    """The page without its code, where link syntax is only an example."""
    return re.sub(r"`[^`\n]*`", "", without_code_blocks(page))


def anchors(page: Path) -> set[str]:
    """The #anchors of a page's headings (a repeated heading gets -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#{1,6} +(.+?)\s*#*$", without_code_blocks(page), re.M):
        base = slug(heading.replace("`", ""))
        found.add(f"{base}-{seen[base]}" if seen.get(base) else base)
        seen[base] = seen.get(base, 0) + 1
    return found


def links(page: Path) -> list[str]:
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", prose(page)) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_and_anchors_resolve(page: Path):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: {file.name} has no heading #{anchor} (it has {sorted(anchors(file))})")
    assert not broken, f"{page.relative_to(ROOT)}: broken links:\n" + "\n".join(broken)


def test_readme_is_a_five_minute_read_and_links_every_page():
    readme = ROOT / "README.md"
    n = len(readme.read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines, at most {README_MAX_LINES}: move depth into docs/"
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(readme) if t.partition("#")[0]}
    unlinked = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not unlinked, f"docs pages the README does not link to: {unlinked}"


def test_every_runnable_block_is_run_or_says_why():
    """The inventory the report gives: a block of a runnable language is run here, run elsewhere, or marked."""
    counts = inventory()
    print("\n".join(f"{page}: {c}" for page, c in counts.items()))
    assert sum(c["run"] for c in counts.values()) >= 5, counts  # the docs show commands a CPU runs


def test_blocks_markers_and_commands_are_read_as_documented(tmp_path):
    """The reading this file relies on, on a page made for it: markers directly above, console prompts,
    continuation lines and comments."""
    page = tmp_path / "page.md"
    page.write_text(
        "Text.\n\n<!-- setup: touch a -->\n<!-- not run: needs a GPU -->\n```bash\njdp train \\\n  x=1   # why\n"
        "# a comment\n\njdp plan\n```\n\n<!-- unrelated -->\n\n```console\n$ jdp allreduce \\\n  --devices 4\n"
        "output\n$ echo hi\nhi\n```\n\n```\nno language\n```\n"
    )
    first, second, third = blocks(page)
    assert (first.lang, first.line, first.index) == ("bash", 5, 1)
    assert first.marker("setup:") == ["touch a"] and first.marker("not run:") == ["needs a GPU"]
    assert [uncommented(c) for c in first.commands()] == ["jdp train    x=1", "jdp plan"]
    assert second.markers == [] and second.commands() == ["jdp allreduce    --devices 4", "echo hi"]
    assert third.lang == "" and not runs_here(third)
