"""Remake configs/tasks/: jdp's example lm-evaluation-harness tasks over local JSON-lines files, drawn from this
Python's standard library sources (what `jdp train`'s embedded corpus is made of, so a tiny run scores above
chance; docs/evaluation.md). Three tasks, one of each kind of request, tagged `jdp_stdlib`:

- jdp_stdlib_next_line (multiple_choice): five lines of code, and the true next line among four;
- jdp_stdlib_ppl (loglikelihood_rolling): whole functions, their perplexity and bits per byte;
- jdp_stdlib_complete (generate_until): five lines of code, the next line generated greedily (exact match).

    python scripts/make_eval_tasks.py        # writes configs/tasks/*.jsonl (the YAMLs and utils.py are kept as they are)
"""

import json
import random
import sys
from pathlib import Path

from jdp.data.corpus import stdlib_files

OUT = Path(__file__).resolve().parents[1] / "configs" / "tasks"
CONTEXT = 5  # lines before the one asked for


def code_lines(files: list[Path]) -> list[tuple[Path, list[str]]]:
    out = []
    for f in files:
        try:
            lines = f.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError):
            continue
        out.append((f, lines))
    return out


def good(line: str) -> bool:
    """A line worth asking for: code (not blank, not a comment or docstring), of a sensible length."""
    s = line.strip()
    return 8 <= len(s) <= 60 and not s.startswith(("#", '"', "'")) and line.isascii()


def windows(sources, rng: random.Random, n: int) -> list[tuple[str, str]]:
    """n (five lines, the next line) drawn from distinct places."""
    out = []
    while len(out) < n:
        _, lines = rng.choice(sources)
        if len(lines) < CONTEXT + 2:
            continue
        i = rng.randrange(CONTEXT, len(lines))
        context = lines[i - CONTEXT : i]
        if good(lines[i]) and all(line.isascii() for line in context) and sum(map(len, context)) < 300:
            out.append(("\n".join(context) + "\n", lines[i]))
    return out


def functions(sources, rng: random.Random, n: int) -> list[str]:
    """n whole top-level functions of 300 to 900 characters."""
    out = []
    while len(out) < n:
        _, lines = rng.choice(sources)
        starts = [i for i, line in enumerate(lines) if line.startswith("def ")]
        if not starts:
            continue
        i = rng.choice(starts)
        j = next((k for k in range(i + 1, len(lines)) if lines[k] and not lines[k][0].isspace()), len(lines))
        text = "\n".join(lines[i:j]).rstrip() + "\n"
        if 300 <= len(text) <= 900 and text.isascii():
            out.append(text)
    return out


def write(name: str, rows: list[dict]) -> None:
    (OUT / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{OUT / name}.jsonl: {len(rows)} documents")


def main() -> None:
    rng = random.Random(0)
    sources = code_lines(sorted(stdlib_files()))
    mc = []
    for context, line in windows(sources, rng, 100):
        others = [other for _, other in windows(sources, rng, 3)]
        choices = [line, *others]
        rng.shuffle(choices)
        mc.append({"context": context, "choices": choices, "answer": choices.index(line)})
    write("jdp_stdlib_next_line", mc)
    write("jdp_stdlib_ppl", [{"text": t} for t in functions(sources, rng, 20)])
    write("jdp_stdlib_complete", [{"context": c, "line": line} for c, line in windows(sources, rng, 50)])
    print(f"from the standard library of Python {sys.version.split()[0]}")


if __name__ == "__main__":
    main()
