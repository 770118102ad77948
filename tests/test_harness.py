"""EleutherAI's lm-evaluation-harness on jdp runs (jdp/harness.py, docs/evaluation.md): jdp answers every request as
the harness's own `hf` model answers it on jdp's export; 1 device = 4 devices = 2 processes, request for request;
`train.eval_tasks` inside training; bad input refused before any compute.

One short run (tiny GPT, byte tokenizer, 4 devices, the harness every 20 steps) serves every test here. Its tasks
are made by the test over local JSON-lines files: a multiple-choice task, a rolling-perplexity task and a
generate-until task, the three kinds of request the harness makes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval", reason='the harness: pip install -e ".[eval]" (CI installs it on both stacks)')

from jdp.config import ConfigError, check, load_config  # noqa: E402
from jdp.job.launch import free_port  # noqa: E402

TASKS = ["t_mc", "t_ppl", "t_gen"]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "TOKENIZERS_PARALLELISM": "false"}
MC = [("def add(a, b):\n    return", [" a + b", " a.b()", " ]]", " 12("]), ("import", [" os", " =", " )(", " 3.4.5"]),
      ("for i in", [" range(10):", " ((", " def", " :="]), ("class Foo(", ["object):", "1+", "]]", "def"]),
      ("if x is", [" None:", " ]]]", " ,", " import"]), ("self.", ["assertEqual(", "%%", " )", "9("])]  # fmt: skip
TEXTS = ["def main():\n    print('hello world')\n    return 0\n" * 3, "import sys\nimport os\n\nclass A:\n    pass\n"]
PROMPTS = ["def f(x):\n    return", "import ", "class A", "    def __init__(self", "if __name__ == '__main__':\n"]


def write_tasks(d: Path) -> Path:
    """Three task YAMLs over local JSON-lines files (datasets' `json` builder: nothing is downloaded)."""
    d.mkdir(parents=True, exist_ok=True)

    def task(name: str, rows: list[dict], body: str) -> None:
        (d / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        head = f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files: {{test: {d / name}.jsonl}}\n"
        (d / f"{name}.yaml").write_text(head + "test_split: test\n" + body)

    task("t_mc", [{"q": q, "choices": c, "answer": 0} for q, c in MC],
         'output_type: multiple_choice\ndoc_to_text: "{{q}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: answer\n'
         "metric_list:\n  - {metric: acc, aggregation: mean, higher_is_better: true}\n"
         "  - {metric: acc_norm, aggregation: mean, higher_is_better: true}\n")  # fmt: skip
    task("t_ppl", [{"text": t} for t in TEXTS],
         'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\n'
         "metric_list:\n  - {metric: word_perplexity, aggregation: weighted_perplexity, higher_is_better: false}\n"
         "  - {metric: bits_per_byte, aggregation: bits_per_byte, higher_is_better: false}\n")  # fmt: skip
    task("t_gen", [{"prompt": p, "target": " x"} for p in PROMPTS],
         'output_type: generate_until\ndoc_to_text: "{{prompt}}"\ndoc_to_target: "{{target}}"\n'
         'generation_kwargs: {until: ["<stop>"], max_gen_toks: 12, do_sample: false}\n'
         "metric_list:\n  - {metric: exact_match, aggregation: mean, higher_is_better: true}\n")  # fmt: skip
    return d


@pytest.fixture(scope="module")
def run(made_once):
    """A tiny GPT trained 40 steps by 2 processes x 2 devices (jdp launch), the harness's three tasks run inside
    training every 20 steps (no held-out loss: the evaluation time is the harness's alone): made once per session,
    on one worker (conftest's made_once); tests only read what it wrote."""

    def make(d: Path) -> None:
        tasks = write_tasks(d / "tasks")
        out = subprocess.run(
            [sys.executable, "-m", "jdp.cli", "launch", "--nproc-per-node", "2", "--devices-per-proc", "2",
             "--coordinator", f"127.0.0.1:{free_port()}", "--", "train", "tiny", "train.steps=40",
             "train.batch_size=16", "data.seq_len=64", "data.val_tokens=0", "train.ckpt_every=20",
             "train.progress=false", f"train.run_dir={d / 'run'}", f"train.eval_tasks={','.join(TASKS)}",
             "train.eval_tasks_every=20", f"train.eval_tasks_path={tasks}"],
            env=ENV, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
        (d / "output.txt").write_text(out.stdout + out.stderr)

    d = made_once("harness-run", make)
    return d / "run", d / "tasks", (d / "output.txt").read_text()


def answers(results: dict) -> dict:
    """Every request's answer, by task and document: [(log-likelihood, greedy)] (t_mc), [total] (t_ppl) or [text]
    (t_gen); lm_eval's own command writes the numbers as strings, read back here."""
    kind = {"t_mc": lambda r: (float(r[0]), str(r[1]) == "True"), "t_ppl": float, "t_gen": str}
    return {
        t: {s["doc_id"]: [kind[t](r[0]) for r in s["resps"]] for s in rows} for t, rows in results["samples"].items()
    }


def assert_same_answers(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys() and all(a[t].keys() == b[t].keys() for t in a)
    for t in a:
        for doc, (x, y) in ((d, (a[t][d], b[t][d])) for d in a[t]):
            for u, v in zip(x, y, strict=True):
                if isinstance(u, str):
                    assert u == v, (t, doc, u, v)
                elif isinstance(u, float):  # a rolling total
                    assert abs(u - v) <= atol * max(1.0, abs(u)), (t, doc, u, v)
                else:
                    assert abs(u[0] - v[0]) <= atol * max(1.0, abs(u[0])) and bool(u[1]) == bool(v[1]), (t, doc, u, v)


def jdp_answers(run_dir: Path, tasks: Path, **kwargs) -> dict:
    from jdp import harness

    lm = harness.JdpLM(run=str(run_dir), **kwargs)
    return harness.evaluate(lm, TASKS, harness.task_manager(TASKS, str(tasks)), log_samples=True, bootstrap_iters=0)


def test_in_training_the_harness_writes_its_metrics_and_counts_as_evaluation(run):
    """2 processes x 2 devices trained and evaluated; the numbers logged at step 40 are those of its checkpoint
    evaluated afterwards by one process of 4 devices."""
    run_dir, tasks, output = run
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    harness = {r["step"]: r for r in records if "eval_t_mc/acc" in r}
    assert sorted(harness) == [20, 40], records
    keys = {"eval_t_mc/acc", "eval_t_mc/acc_norm", "eval_t_ppl/word_perplexity", "eval_t_ppl/bits_per_byte",
            "eval_t_gen/exact_match"}  # fmt: skip
    assert keys <= set(harness[40]), harness[40]
    assert harness[40]["eval_t_ppl/bits_per_byte"] < harness[20]["eval_t_ppl/bits_per_byte"]  # it learns
    assert output.count("step 40: harness: t_mc/acc") == 1  # said once, by process 0
    assert "it/s]" not in output and "not a git repository" not in output  # the harness's own noise held back
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(run_dir / "tensorboard"))
    tb.Reload()
    assert [(e.step, e.value) for e in tb.Scalars("eval/t_mc/acc_norm")] == [
        (s, pytest.approx(harness[s]["eval_t_mc/acc_norm"])) for s in (20, 40)
    ]
    for step in (20, 40):
        saved = json.loads((run_dir / "eval" / f"step_{step}.json").read_text())
        assert saved["results"]["t_mc"]["acc,none"] == harness[step]["eval_t_mc/acc"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["goodput"]["eval_s"] > 0, summary  # no held-out loss in this run: the harness's time
    offline = jdp_answers(run_dir, tasks, step=40)["results"]
    for key in keys:
        task, metric = key.removeprefix("eval_").split("/")
        assert offline[task][f"{metric},none"] == pytest.approx(harness[40][key], rel=1e-5), key


def test_one_device_four_devices_and_two_processes_answer_every_request_alike(run, tmp_path):
    """4 devices (this process), 1 device (lm_eval's own command, `--model jdp`), 2 processes (jdp launch -- eval)."""
    run_dir, tasks, _ = run
    four = answers(jdp_answers(run_dir, tasks, step=40, batch_size=5))  # 5 rows a call: padded to 8, 2 a device
    one = subprocess.run(
        [sys.executable, "-m", "jdp.harness", "run", "--model", "jdp", "--model_args", f"run={run_dir},step=40",
         "--tasks", *TASKS, "--include_path", str(tasks), "--log_samples", "--output_path", str(tmp_path / "one")],
        env={**ENV, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert one.returncode == 0, one.stderr[-3000:]
    samples = {t: [json.loads(line) for f in (tmp_path / "one").rglob(f"samples_{t}_*.jsonl")
                   for line in f.read_text().splitlines()] for t in TASKS}  # fmt: skip
    assert_same_answers(four, answers({"samples": samples}), atol=1e-5)
    two = subprocess.run(
        [sys.executable, "-m", "jdp.cli", "launch", "--nproc-per-node", "2", "--coordinator", f"127.0.0.1:{free_port()}",
         "--", "eval", str(run_dir), "--tasks", ",".join(TASKS), "--include-path", str(tasks), "--log-samples",
         "--bootstrap-iters", "0", "--step", "40"],
        env=ENV, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert two.returncode == 0, two.stderr[-3000:]
    assert "|t_mc |" in two.stdout  # the harness's table, printed once, by process 0
    (written,) = (run_dir / "eval").glob("step_40-*.samples.jsonl")  # RUN_DIR/eval/step_N-TIME: the default
    assert written.with_name(written.name.replace(".samples.jsonl", ".json")).is_file()
    rows = [json.loads(line) for line in written.read_text().splitlines()]
    by_task = {t: [r for r in rows if r["task"] == t] for t in TASKS}
    assert_same_answers(four, answers({"samples": by_task}), atol=1e-5)
    assert any(text.strip() for (text,) in four["t_gen"].values()), four["t_gen"]  # generations to compare, not blanks


@pytest.mark.parametrize("family", ["gpt", "llama-lora"])
def test_jdp_answers_every_request_as_lm_eval_hf_does_on_the_export(run, family, tmp_path):
    """The harness's `hf` model (transformers, torch) on `jdp export`'s directory: the same log-likelihood for every
    request to 1e-4, the same greedy flags, accuracies and generated texts. The Llama family with LoRA adapters: the
    run answers with its adapters applied, the export has them folded in."""
    pytest.importorskip("torch", reason="lm_eval's hf model needs torch (CI's oldest stack has it)")
    pytest.importorskip("accelerate", reason="lm_eval's hf model needs accelerate (CI's oldest stack has it)")
    run_dir, tasks, _ = run
    if family == "llama-lora":
        run_dir = tmp_path / "lora"
        out = subprocess.run(
            [sys.executable, "-m", "jdp.cli", "train", "llama-tiny", "model.d_model=64", "model.n_layers=2",
             "model.lora_rank=4", "optim.lr=1e-2", "train.steps=12", "train.batch_size=8", "data.seq_len=64",
             "data.val_tokens=0", "train.progress=false", f"train.run_dir={run_dir}"],
            env={**ENV, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}, capture_output=True, text=True,
            timeout=600,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
    export = tmp_path / "export"
    subprocess.run([sys.executable, "-m", "jdp.cli", "export", str(run_dir), str(export)], env=ENV, check=True,
                   capture_output=True, timeout=300)  # fmt: skip
    from jdp import harness

    manager = harness.task_manager(TASKS, str(tasks))
    hf = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={export},dtype=float32", tasks=TASKS,
                                 task_manager=manager, device="cpu", batch_size=4, bootstrap_iters=0)  # fmt: skip
    ours = jdp_answers(run_dir, tasks)
    assert_same_answers(answers(hf), answers(ours), atol=1e-4)
    for t in TASKS:
        theirs, mine = hf["results"][t], ours["results"][t]
        for key in (k for k in theirs if k.endswith(",none") and "stderr" not in k):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-4), (t, key)


def test_what_the_harness_cannot_run_is_refused_before_any_compute(run, tmp_path):
    run_dir, tasks, _ = run
    from jdp import harness

    with pytest.raises(ConfigError, match=r"no task named t_nope in .*`lm_eval ls tasks --include_path"):
        harness.task_manager(["t_mc", "t_nope"], str(tasks), "train.eval_tasks")
    with pytest.raises(ConfigError, match="the task directory .* does not exist"):
        harness.task_manager(["t_mc"], str(tmp_path / "missing"))
    for overrides, words in [
        (["train.eval_tasks_every=10"], "train.eval_tasks_every is set but train.eval_tasks names no task"),
        (["train.eval_tasks=t_mc", "train.live=true"], "train.eval_tasks with train.live=true"),
        (["train.eval_tasks=t_mc", "train.eval_tasks_every=-1"], "train.eval_tasks_every"),
    ]:
        with pytest.raises(ConfigError, match=words):
            check(load_config(None, overrides))
    # a task that generates text under a strategy that splits the parameters: refused before the first step
    out = subprocess.run(
        [sys.executable, "-m", "jdp.cli", "train", "tiny", "model.n_layers=1", "train.steps=2", "train.batch_size=8",
         "data.seq_len=32", "data.val_tokens=0", "parallel.strategy=fsdp", f"train.run_dir={tmp_path / 'fsdp'}",
         "train.eval_tasks=t_mc,t_gen", f"train.eval_tasks_path={tasks}", "train.progress=false"],
        env={**ENV, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert out.returncode != 0 and "t_gen generate text (generate_until)" in out.stderr, out.stderr[-2000:]
    assert "parallel.strategy=fsdp splits the parameters" in out.stderr
    assert not any('"loss"' in line for line in (tmp_path / "fsdp" / "metrics.jsonl").read_text().splitlines())


def test_under_fsdp_every_row_scores_as_under_ddp(run):
    """In-training evaluation answers through the strategy's own per-row eval step: fsdp's gathers its split
    parameters block by block and gives every row the log-likelihood ddp's replicated copy gives."""
    import jax
    import optax
    from flax import nnx

    from jdp import harness, parallel
    from jdp.saved import load_run

    run_dir, _, _ = run
    cfg, model, _, _ = load_run(run_dir)
    model = nnx.merge(*jax.device_get(nnx.split(model)))  # on the host, for each strategy to place
    mesh = parallel.make_mesh()
    rng = np.random.default_rng(0)
    rows = [(list(rng.integers(0, 256, n)), k) for n, k in [(5, 2), (40, 1), (17, 16), (64, 30), (9, 8)]]
    scores = {}
    for strategy in ("ddp", "fsdp"):
        graphdef, state = parallel.init_state(model, optax.sgd(0.1), mesh, strategy)
        scores[strategy] = harness.Scorer(graphdef, state, mesh, strategy, 257, 4, cfg.model.max_seq_len)(rows)
    assert jax.device_count() == 4 and len(scores["fsdp"]) == len(rows)
    for (a, greedy_a), (b, greedy_b) in zip(scores["ddp"], scores["fsdp"], strict=True):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a)) and greedy_a == greedy_b and a < 0


def test_chat_tasks_are_rendered_with_the_runs_chat_template(run, tmp_path):
    """--apply_chat_template: each request's prompt is the run's template (data.chat_template) rendered over the
    harness's conversation, with the generation prompt; the answer is generated after it."""
    import dataclasses

    from jdp import harness
    from jdp.data.chat import ChatTemplate

    run_dir, tasks, _ = run
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                        "{% if add_generation_prompt %}<assistant>{% endif %}")  # fmt: skip
    source = harness._offline(str(run_dir), 40)
    source.cfg = dataclasses.replace(source.cfg, data=dataclasses.replace(source.cfg.data, chat_template=str(template)))
    lm = harness.JdpLM(source=source)
    out = harness.evaluate(lm, ["t_gen"], harness.task_manager(["t_gen"], str(tasks)), limit=2, log_samples=True,
                           apply_chat_template=True, bootstrap_iters=0)  # fmt: skip
    rendered = ChatTemplate.load(source.cfg.data)
    for sample in out["samples"]["t_gen"]:
        prompt = (
            sample["arguments"][0][0]
            if isinstance(sample["arguments"], list)
            else sample["arguments"]["gen_args_0"]["arg_0"]
        )
        want = rendered.render([{"role": "user", "content": PROMPTS[sample["doc_id"]]}], add_generation_prompt=True)
        assert prompt == want and prompt.endswith("<assistant>"), (prompt, want)
    assert lm.chat_template(True) == template.read_text()


def test_the_entry_point_gives_lm_eval_the_jdp_model():
    """lm-eval releases with plugins resolve `--model jdp` from the `lm_eval.models` entry points (pyproject.toml)."""
    from importlib.metadata import entry_points

    (ep,) = [ep for ep in entry_points(group="lm_eval.models") if ep.name == "jdp"]
    cls = ep.load()
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import get_model

    assert issubclass(cls, TemplateLM) and get_model("jdp") is cls
