"""Full fine-tuning against LoRA (rank 8 and 64), side by side in one run: per-device bytes (jdp plan's, which
tests/test_plan.py checks against the compiled step), ms per step and the eval loss after the same steps, on text
and on a small chat set.

    python scripts/bench_lora.py [--out runs/bench-lora] [--pretrain 150] [--steps 100]

A base is made first: configs/llama-tiny.yaml trained --pretrain steps on the embedded corpus and exported as a
Hugging Face directory (`jdp export`). Each variant then fine-tunes it for --steps on the same text (train.init_from,
the same seed, so the same batches), on this machine's devices; ms/step is the median over the logged steps after
the first 10 (tokens per step / tokens_per_sec; compilation excluded). Then each fine-tunes the same base for --steps
as configs/sft-chat.yaml does (data.format=chat, the loss on the answers only, conversations packed each attending to
itself; float32 on a CPU), on a chat set this script writes: 3,000 conversations asking to reverse, capitalise or
count a word of Python's builtins, the answer following from the question; its eval loss is over held-out
conversations' answers. Prints a Markdown table (docs/adapters.md has the last one) and writes OUT/lora.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

VARIANTS = {
    "full fine-tune": ["optim.lr=5e-4"],
    "LoRA r=8": ["model.lora_rank=8", "model.lora_alpha=16", "optim.lr=2e-3"],
    "LoRA r=64": ["model.lora_rank=64", "model.lora_alpha=128", "optim.lr=2e-3"],
    "LoRA r=8, bfloat16 base": ["model.lora_rank=8", "model.lora_alpha=16", "optim.lr=2e-3", "model.base_dtype=bfloat16"],
}  # fmt: skip
COMMON = ["optim.warmup_steps=10", "train.log_every=1", "train.progress=false", "train.tensorboard=false",
          "train.ckpt_every=0", "data.val_tokens=32768"]  # fmt: skip


TEMPLATE = "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}"


def jdp(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "jdp.cli", *args], check=True)


def chat_set(out: Path, n: int = 3000) -> tuple[Path, Path]:
    """(conversations as JSON lines, a chat template): questions whose answers follow from them."""
    import builtins
    import random

    rng, words = random.Random(0), sorted(w for w in dir(builtins) if w.isalpha() and len(w) > 3)
    tasks = {"reverse": lambda w: w[::-1], "capitalise": str.upper, "count the letters of": lambda w: str(len(w))}
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "chats.jsonl", "w") as f:
        for _ in range(n):
            task, word = rng.choice(sorted(tasks)), rng.choice(words)
            f.write(json.dumps({"messages": [{"role": "user", "content": f"{task} {word}"},
                                             {"role": "assistant", "content": tasks[task](word)}]}) + "\n")  # fmt: skip
    (out / "chat.jinja").write_text(TEMPLATE)
    return out / "chats.jsonl", out / "chat.jinja"


def last_eval(run_dir: Path) -> float:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["eval_loss"] for r in records if "eval_loss" in r][-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/bench-lora"))
    p.add_argument("--pretrain", type=int, default=150)
    p.add_argument("--steps", type=int, default=100)
    args = p.parse_args()
    out = args.out
    base_run, base = out / "base-run", out / "base"
    if not base.is_dir():
        jdp("train", "llama-tiny", f"train.steps={args.pretrain}", f"train.run_dir={base_run}", *COMMON)
        jdp("export", str(base_run), str(base))

    from jdp.config import load_config
    from jdp.lm import checked_import
    from jdp.plan import device_memory

    chats, template = chat_set(out / "chat-set")
    rows = []
    for name, extra in VARIANTS.items():
        run_dir = out / name.replace(" ", "-").replace(",", "").replace("=", "")
        overrides = ["llama-tiny", f"train.init_from={base}", f"data.tokenizer={base}", f"train.steps={args.steps}",
                     f"train.run_dir={run_dir}", "train.resume=false", *COMMON, *extra]  # fmt: skip
        jdp("train", *overrides)
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        cfg, _ = checked_import(load_config(overrides[0], overrides[1:]))
        per_step = cfg.train.batch_size * cfg.data.seq_len
        times = [per_step / r["tokens_per_sec"] for r in records if r.get("tokens_per_sec") and r["step"] > 10]
        evals = [r["eval_loss"] for r in records if "eval_loss" in r]
        m = device_memory(cfg, 1, cfg.train.batch_size, False)
        chat_dir = run_dir.with_name(run_dir.name + "-chat")
        jdp("train", "sft-chat", f"train.init_from={base}", f"data.tokenizer={base}", f"data.source={chats}",
            f"data.chat_template={template}", "model.dtype=float32", "data.seq_len=128", "data.val_tokens=8192",
            "train.batch_size=16", f"train.steps={args.steps}", f"train.eval_every={args.steps}",
            f"train.run_dir={chat_dir}", "train.resume=false", "train.ckpt_every=0", "train.log_every=10",
            "train.progress=false", "train.tensorboard=false", "optim.warmup_steps=10", *extra)  # fmt: skip
        rows.append({"variant": name, "state_mb": (m.params + m.grads + m.opt_state) / 1e6, "total_mb": m.total / 1e6,
                     "ms_per_step": 1e3 * statistics.median(times), "eval_loss": evals[-1],
                     "chat_eval_loss": last_eval(chat_dir)})  # fmt: skip
    (out / "lora.json").write_text(json.dumps(rows, indent=1))
    print("| variant | state MB/device (params + grads + optimizer) | planned MB/device | ms/step | eval loss (text) | "
          "eval loss (chat answers) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['state_mb']:.1f} | {r['total_mb']:.1f} | {r['ms_per_step']:.0f} | "
              f"{r['eval_loss']:.4f} | {r['chat_eval_loss']:.4f} |")  # fmt: skip


if __name__ == "__main__":
    main()
