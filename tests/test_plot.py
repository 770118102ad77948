"""`jdp plot`'s figure, drawn from small hand-written metrics.jsonl files (no training)."""

import json
import re

import pytest

from jdp.plot import count_label, figure


def fake_run(run_dir, steps: int, tokens_per_step: int, every: int):
    """A run directory whose metrics.jsonl holds a falling loss every `every` steps and a few evaluations."""
    run_dir.mkdir()
    with open(run_dir / "metrics.jsonl", "w") as f:
        for step in range(every, steps + 1, every):
            loss = 2 + 4 / (1 + 10 * step / steps)
            record = {"step": step, "tokens": step * tokens_per_step, "loss": loss, "tokens_per_sec": 900_000 + step}
            f.write(json.dumps(record) + "\n")
            if step % (every * 10) == 0:
                f.write(json.dumps({"step": step, "eval_loss": loss + 0.1}) + "\n")
    return run_dir


@pytest.mark.parametrize(
    "steps, tokens_per_step",
    [
        (200, 4096),  # the tiny config: 819,200 tokens, which matplotlib wrote as 100000 200000 ... side by side
        (800, 4096),  # 3.3M tokens
        (4000, 524_288),  # 2.1B tokens
        (500_000, 4096),  # 2B tokens in half a million steps
    ],
)
def test_tick_labels_are_short_and_do_not_run_together(tmp_path, steps, tokens_per_step):
    import matplotlib.pyplot as plt

    run = fake_run(tmp_path / "run", steps, tokens_per_step, every=max(steps // 100, 1))
    fig = figure([run])
    try:
        fig.canvas.draw()
        by_step, by_tokens, speed = fig.axes
        for axis in (by_step.xaxis, by_tokens.xaxis, speed.xaxis, speed.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            shown = zip(axis.get_majorticklocs(), axis.get_ticklabels(), strict=True)
            labels = [t for x, t in shown if lo <= x <= hi and t.get_text()]  # matplotlib lays out a few more
            texts = [t.get_text() for t in labels]
            assert len(labels) >= 3, texts
            assert all(re.fullmatch(r"\d+(\.\d+)?[kMBT]?", t) and len(t) <= 5 for t in texts), texts
            assert not axis.get_offset_text().get_text(), texts  # no "1e6" in the corner to multiply by
            boxes = [t.get_window_extent().padded(2) for t in labels]
            for i, a in enumerate(boxes):
                for j, b in enumerate(boxes[i + 1 :], i + 1):
                    assert not a.overlaps(b), f"tick labels {texts[i]!r} and {texts[j]!r} overlap: {texts}"
    finally:
        plt.close(fig)


def test_count_label_writes_counts_with_a_unit():
    assert [count_label(x) for x in (0, 25, 1500, 200_000, 1_250_000, 2e9, 3e12)] == [
        "0", "25", "1.5k", "200k", "1.25M", "2B", "3T",
    ]  # fmt: skip


def test_where_the_plot_goes_is_what_jdp_plot_says_and_a_bad_place_is_one_line(tmp_path):
    """`-o DIR` said `wrote DIR` but wrote DIR.png; `-o FILE/plot.png` and records without a token count were
    tracebacks."""
    import os
    import subprocess
    import sys

    run = fake_run(tmp_path / "run", 200, 4096, every=10)

    def plot(*args):
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        return subprocess.run([sys.executable, "-m", "jdp.cli", "plot", str(run), *args], capture_output=True,
                              text=True, timeout=120, env=env)  # fmt: skip

    (tmp_path / "figs").mkdir()
    out = plot("-o", str(tmp_path / "figs"))
    assert out.returncode == 0 and f"wrote {tmp_path / 'figs' / 'plot.png'}" in out.stdout, out.stderr[-2000:]
    assert (tmp_path / "figs" / "plot.png").stat().st_size > 1000
    out = plot("-o", str(tmp_path / "noext"))
    assert out.returncode == 0 and f"wrote {tmp_path / 'noext.png'}" in out.stdout and (tmp_path / "noext.png").exists()
    (tmp_path / "afile").write_text("x")
    out = plot("-o", str(tmp_path / "afile" / "plot.png"))
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.startswith(f"jdp: error: cannot write {tmp_path / 'afile' / 'plot.png'}: "), out.stderr
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("".join(json.dumps({k: v for k, v in json.loads(line).items() if k != "tokens"})
                                               + "\n" for line in lines))  # fmt: skip
    out = plot("-o", str(tmp_path / "untokened.png"))
    assert out.returncode == 0 and (tmp_path / "untokened.png").exists(), out.stderr[-2000:]
