"""Preference training (train.objective=dpo|ipo|simpo|orpo on data.format=preference, jdp/preference.py and
jdp/data/preference.py): TRL's tokens, log-probabilities and losses, 4 devices = 1 under every strategy with the
reference as a frozen copy or LoRA's base, a pair never split, a rule learned, and exact resume.

TRL's own code is the reference where it is installed (CI's oldest stack: torch, transformers, trl)."""

import functools
import json
import shutil
import tempfile
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from test_llama import CFG
from test_parallel import params_close

from jdp import adapters, parallel, preference
from jdp.config import ConfigError, OptimConfig, ParallelConfig, load_config, validate
from jdp.data.preference import pair_rows, pair_tokens
from jdp.data.tokens import load_tokenizer
from jdp.metrics import read_metrics
from jdp.models import make_model
from jdp.nn import Frozen
from jdp.optim import make_optimizer
from jdp.parallel.remat import Remat

DATA = Path(__file__).parent / "data"
LLAMA = DATA / "hf-llama-tiny"
ROWS = [{"prompt": "The sky is", "chosen": " blue today.", "rejected": " green."},
        {"prompt": "Two and two", "chosen": " make four.", "rejected": " make five, surely"},
        {"prompt": "Cats", "chosen": " purr.", "rejected": " bark loudly at night."},
        {"prompt": "Water is", "chosen": " wet", "rejected": " dry"}]  # fmt: skip
OPTIONS = dict(beta=0.1, label_smoothing=0.0, simpo_gamma=0.5, orpo_lambda=0.1)


def pair_batch(seed: int, pairs: int = 8, length: int = 12, vocab: int = CFG.vocab_size) -> dict:
    """Random pairs: a shared prompt of 2-5 tokens, answers of different lengths, the last pair padding."""
    rng = np.random.default_rng(seed)
    tokens, weights = [], []
    for i in range(pairs):
        p = rng.integers(2, 6)
        prompt = rng.integers(0, vocab, p)
        seqs = [np.concatenate([prompt, rng.integers(0, vocab, rng.integers(1, length - p))]) for _ in range(2)]
        t, w, _ = pair_rows(seqs, p, length + 1, vocab - 1)
        tokens.append(t)
        weights.append(w * (i < pairs - 1))
    t, w = np.stack(tokens).astype(np.int32), np.stack(weights).astype(np.float32)
    return {"inputs": t[..., :-1], "targets": t[..., 1:], "weights": w[..., 1:]}


# --- TRL, where it is installed ----------------------------------------------------------------------------------


CHAT = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
TURNS = [({"role": "user", "content": "Name a color."}, "Blue.", "A dog."),
         ({"role": "user", "content": "2+2?"}, "4", "Five, I think")]  # fmt: skip


@functools.cache
def trl_trainer(loss_type: str = "sigmoid", conversational: bool = False):
    """TRL's DPOTrainer over the tiny Llama fixture and ROWS (or TURNS as conversations), in float32 (TRL 1.x's
    default bf16 autocasts on CPU too)."""
    import torch
    from datasets import Dataset
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast
    from trl import DPOConfig, DPOTrainer

    tok = PreTrainedTokenizerFast(tokenizer_file=str(LLAMA / "tokenizer.json"), bos_token="<|begin_of_text|>",
                                  eos_token="<|end_of_text|>", pad_token="<|end_of_text|>")  # fmt: skip
    tok.chat_template = CHAT
    rows = ROWS
    if conversational:
        rows = [{"prompt": [u], "chosen": [{"role": "assistant", "content": c}],
                 "rejected": [{"role": "assistant", "content": r}]} for u, c, r in TURNS]  # fmt: skip
    model = LlamaForCausalLM.from_pretrained(LLAMA, dtype=torch.float32)
    args = DPOConfig(output_dir=tempfile.mkdtemp(), report_to="none", beta=0.1, use_cpu=True, max_length=None,
                     bf16=False, per_device_train_batch_size=len(rows), loss_type=[loss_type])  # fmt: skip
    return DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok)


def trl_batch(examples: list[dict]) -> dict:
    """TRL's tokenized pairs as jdp's batch (pair_rows: what data.format=preference makes of its own tokens)."""
    length = max(len(e["prompt_ids"]) + max(len(e["chosen_ids"]), len(e["rejected_ids"])) for e in examples)
    rows = [pair_rows([np.asarray(e["prompt_ids"] + e[k]) for k in ("chosen_ids", "rejected_ids")],
                      len(e["prompt_ids"]), length, 1) for e in examples]  # fmt: skip
    t, w = np.stack([r[0] for r in rows]).astype(np.int32), np.stack([r[1] for r in rows]).astype(np.float32)
    return {"inputs": t[..., :-1], "targets": t[..., 1:], "weights": w[..., 1:]}


def test_jdp_tokenizes_reads_and_scores_pairs_as_trls_dpo_trainer(tmp_path):
    """The same pairs: jdp's tokens are TRL's (plain text: after jdp's leading end-of-document token;
    conversations, without a prompt column: one for one, the prompt where TRL puts it), its per-answer
    log-probabilities of TRL's tokens under the same tiny Llama equal DPOTrainer's to 1e-5, and each objective's
    loss and metrics on TRL's log-probabilities equal TRL's own code's to 1e-6 (DPOTrainer's sigmoid and ipo,
    CPOTrainer's simpo and its smoothed sigmoid for cDPO, ORPOTrainer's odds ratio)."""
    torch = pytest.importorskip("torch", reason="TRL's check needs torch and trl (CI's oldest stack has them)")
    pytest.importorskip("trl", reason="TRL's check needs torch and trl (CI's oldest stack has them)")
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

    from jdp.build import run_model
    from jdp.data.chat import ChatTemplate
    from jdp.lm import checked_import

    tr = trl_trainer()
    examples = [tr.train_dataset[i] for i in range(len(ROWS))]
    ours = load_tokenizer(str(LLAMA))
    for row, ex in zip(ROWS, examples, strict=True):
        seqs, prompt_len = pair_tokens(row, ours, None, "test")
        assert prompt_len - 1 == len(ex["prompt_ids"])
        assert seqs[0][1:].tolist() == ex["prompt_ids"] + ex["chosen_ids"] and seqs[0][0] == ours.eod_id
        assert seqs[1][1:].tolist() == ex["prompt_ids"] + ex["rejected_ids"]
    inputs = tr.data_collator(examples)
    trl_c, trl_r = (x.numpy() for x in tr.compute_ref_log_probs(tr.model, inputs))
    (tmp_path / "chat.jinja").write_text(CHAT)
    template = ChatTemplate.load(load_config(None, [f"data.chat_template={tmp_path / 'chat.jinja'}",
                                                    f"data.tokenizer={LLAMA}", "data.format=preference"]).data)  # fmt: skip
    conv = trl_trainer(conversational=True)
    for i, (user, c, r) in enumerate(TURNS):  # the conversational form: the template's text, TRL's prompt split
        ex = conv.train_dataset[i]
        row = {"chosen": [user, {"role": "assistant", "content": c}], "rejected": [user, {"role": "assistant",
                                                                                           "content": r}]}  # fmt: skip
        seqs, prompt_len = pair_tokens(row, ours, template, "test")
        assert (seqs[0].tolist(), seqs[1].tolist(), prompt_len) == (ex["prompt_ids"] + ex["chosen_ids"],
                                                                    ex["prompt_ids"] + ex["rejected_ids"],
                                                                    len(ex["prompt_ids"]))  # fmt: skip

    overrides = [f"train.init_from={LLAMA}", f"data.tokenizer={LLAMA}", "train.run_dir=unused"]
    cfg, _ = checked_import(load_config(None, overrides), frozenset())
    model = run_model(cfg)[0]
    batch = trl_batch(examples)
    logps, counts = jax.device_get(preference.answer_logps(model, batch))
    np.testing.assert_allclose(logps, np.stack([trl_c, trl_r], 1), rtol=1e-5, atol=1e-5)

    # the losses, on TRL's log-probabilities, against a reference that differs per pair
    policy = np.stack([trl_c, trl_r], 1)
    ref = policy + np.array([[0.5, -0.3], [-1.2, 0.4], [0.1, 2.0], [-0.7, -0.2]], np.float32)
    inputs = {**inputs, "ref_chosen_logps": torch.tensor(ref[:, 0]), "ref_rejected_logps": torch.tensor(ref[:, 1])}
    for loss_type, objective in (("sigmoid", "dpo"), ("ipo", "ipo")):
        tr = trl_trainer(loss_type)
        tr.precompute_ref_logps, tr._metrics["train"] = True, type(tr._metrics["train"])(list)
        tr.model.train()  # TRL logs under "train" then (its dropout is off: DPOConfig.disable_dropout)
        trl_loss = float(tr._compute_loss(tr.model, inputs, return_outputs=False))
        loss, metrics = preference.losses(objective, policy, counts, ref, **OPTIONS)
        assert abs(float(np.mean(loss)) - trl_loss) <= 1e-6 * max(1.0, abs(trl_loss)), (objective, loss, trl_loss)
        for k in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                  "logps/rejected"):  # fmt: skip
            assert abs(float(np.mean(metrics[k])) - tr._metrics["train"][k][-1]) <= 2e-6, (objective, k)

    mean = policy / counts
    c, r = torch.tensor(mean[:, 0]), torch.tensor(mean[:, 1])
    cpu = type("Accelerator", (), {"device": "cpu"})()
    simpo = type("CPO", (), dict(alpha=0.0, beta=2.0, simpo_gamma=0.8, label_smoothing=0.1, loss_type="simpo",
                                 accelerator=cpu))()  # fmt: skip
    trl_losses, trl_rc, trl_rr = CPOTrainer.cpo_loss(simpo, c, r)
    loss, metrics = preference.losses("simpo", policy, counts, **{**OPTIONS, "beta": 2.0, "simpo_gamma": 0.8,
                                                                   "label_smoothing": 0.1})  # fmt: skip
    np.testing.assert_allclose(loss, trl_losses.numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(metrics["rewards/chosen"], trl_rc.numpy(), rtol=1e-6)
    cdpo = type("CPO", (), dict(alpha=0.0, beta=0.1, label_smoothing=0.2, loss_type="sigmoid", accelerator=cpu))()
    ratios = torch.tensor(policy - ref)
    trl_losses, _, _ = CPOTrainer.cpo_loss(cdpo, ratios[:, 0], ratios[:, 1])
    loss, _ = preference.losses("dpo", policy, counts, ref, **{**OPTIONS, "label_smoothing": 0.2})
    np.testing.assert_allclose(loss, trl_losses.numpy(), rtol=1e-6, atol=1e-6)
    orpo = type("ORPO", (), dict(beta=0.3, accelerator=cpu))()
    trl_ratio_losses, trl_rc, trl_rr, trl_ratio, trl_odds = ORPOTrainer.odds_ratio_loss(orpo, c, r)
    loss, metrics = preference.losses("orpo", policy, counts, **{**OPTIONS, "orpo_lambda": 0.3})
    np.testing.assert_allclose(loss, -mean[:, 0] - trl_ratio_losses.numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.mean(metrics["log_odds_chosen"]), float(trl_odds), rtol=1e-6)
    np.testing.assert_allclose(np.mean(metrics["log_odds_ratio"]), float(trl_ratio), rtol=1e-6)
    np.testing.assert_allclose(metrics["rewards/rejected"], trl_rr.numpy(), rtol=1e-6)


# --- every strategy ------------------------------------------------------------------------------------------------

STRATEGIES = {"ddp": {}, "zero1-grad_accum=2": {}, "fsdp": {}, "hsdp-remat=dots": {"shard_size": 2}}


@functools.cache
def dpo_steps(n_devices: int, option: str, lora: bool, objective: str = "dpo", steps: int = 2):
    """(final state, metrics per step, the reference at start) of `steps` steps of `objective` on the tiny Llama:
    the reference a frozen copy of the model, or (lora) the base with the adapters off."""
    strategy = option.split("-")[0]
    p = ParallelConfig(strategy=strategy, bucket_mb=0.01, **STRATEGIES.get(option, {}))
    mesh = parallel.mesh_for(p) if strategy == "hsdp" else parallel.make_mesh(jax.devices()[:n_devices])
    model = make_model(CFG, nnx.Rngs(0))
    if lora:
        model = adapters.add(model, "all-linear", 4, 8.0, rngs=nnx.Rngs(1))
    elif preference.needs_reference(objective):
        model = preference.with_reference(model)
    opt, schedule = make_optimizer(OptimConfig(lr=1e-3, warmup_steps=0), 10)
    remat = Remat("dots") if "remat" in option else None
    loss_fn = preference.make_loss(objective, **OPTIONS)
    a = parallel.assemble(model, loss_fn, opt, mesh, p, 2 if "grad_accum" in option else 1, schedule, remat=remat)
    state, before, history = a.state, jax.device_get(adapters.frozen(a.state.rest)), []
    for i in range(steps):
        state, metrics = a.train_step(state, parallel.shard_batch(pair_batch(i), mesh))
        history.append({k: float(v) for k, v in metrics.items() if v.ndim == 0})
    return state, history, before


@pytest.mark.parametrize("option", list(STRATEGIES))
def test_four_devices_train_preferences_as_one_with_the_reference_untouched(option):
    """DPO with a frozen copy of the starting weights as the reference: 4 devices give one device's losses, TRL's
    metrics and parameters under every strategy (grad_accum, remat); the copy is bit-identical after training, a
    variable of the frozen kind (no gradient, optimizer state or checkpoint), held in rows under fsdp and hsdp."""
    one, hist1, _ = dpo_steps(1, "ddp", False)
    four, hist4, before = dpo_steps(4, option, False)
    assert hist1[0]["loss"] == pytest.approx(np.log(2), abs=1e-6)  # the policy starts as its reference
    assert hist1[0]["tokens"] == 7  # pairs: the 8th is padding
    for a, b in zip(hist1, hist4, strict=True):
        assert a["skipped"] == b["skipped"] == 0
        for k in ("loss", "rewards/chosen", "rewards/margins", "rewards/accuracies", "logps/chosen"):
            assert abs(a[k] - b[k]) <= 1e-5 * max(1.0, abs(a[k])), (k, a, b)
    assert hist1[1]["rewards/margins"] != 0 and hist1[1]["loss"] < hist1[0]["loss"]
    cut = lambda s: jax.tree.map(lambda x, w: x[: w.shape[0]], s.params, one.params)  # noqa: E731  (fsdp's padding)
    assert params_close(one.params, cut(four), atol=1e-5) <= 0
    after = jax.device_get(adapters.frozen(four.rest))
    ref = {k: v for k, v in nnx.to_flat_state(after) if k[0] == preference.REFERENCE}
    assert len(ref) == len(jax.tree.leaves(one.params)) and all(isinstance(v, Frozen) for v in ref.values())
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        assert np.array_equal(x, y)
    assert sum(x.size for x in jax.tree.leaves(one.opt_state) if x.ndim) == 2 * sum(
        x.size for x in jax.tree.leaves(jax.device_get(one.params)))  # fmt: skip  (AdamW's moments: policy only)


@pytest.mark.parametrize("objective", ["ipo", "orpo"])
def test_lora_takes_the_base_as_reference_and_each_objective_trains_as_on_one_device(objective):
    """With LoRA the reference is the model with its adapters off (no copy: nothing frozen but the base); ipo's
    first loss is its target (1/(2 beta))^2 exactly then; orpo reads no reference (its log(1 - exp) of a padding
    pair's empty answer must not poison the gradient). 4 devices under fsdp = 1 device. (simpo's arithmetic is
    TRL's: the test above; its step is the same loss contract.)"""
    one, hist1, _ = dpo_steps(1, "ddp", True, objective)
    four, hist4, _ = dpo_steps(4, "fsdp", True, objective)
    assert not any(k[0] == preference.REFERENCE for k, _ in nnx.to_flat_state(adapters.frozen(one.rest)))
    if objective == "ipo":
        assert hist1[0]["loss"] == pytest.approx((1 / (2 * OPTIONS["beta"])) ** 2, rel=1e-6)
    for a, b in zip(hist1, hist4, strict=True):
        assert a["skipped"] == b["skipped"] == 0
        for k in ("loss", "rewards/chosen", "rewards/rejected", "logps/rejected"):
            assert abs(a[k] - b[k]) <= 1e-5 * max(1.0, abs(a[k])), (k, a, b)
    assert all(np.any(np.asarray(v[...])) for p, v in nnx.to_flat_state(one.params) if p[-1] == "lora_b")  # trained


# --- the command line ----------------------------------------------------------------------------------------------

COLORS = ["red", "blue", "green", "gold", "gray", "pink"]


def rule_pairs(path: Path, n: int = 320) -> Path:
    """Pairs whose chosen answer repeats the prompt's last word and whose rejected answer is another word."""
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for _ in range(n):
            p = list(rng.choice(COLORS, 3))
            other = rng.choice([w for w in COLORS if w != p[-1]])
            f.write(json.dumps({"prompt": " ".join(p) + ":", "chosen": " " + p[-1], "rejected": " " + other}) + "\n")
    return path


def test_a_dpo_run_learns_a_rule_on_held_out_pairs_and_resumes_bit_for_bit(tmp_path):
    """`jdp train` with train.objective=dpo on pairs whose chosen answer follows a rule: rewards/accuracies on the
    held-out pairs ends above 0.9, every metric under TRL's name in metrics.jsonl, training and evaluation; run again
    from its middle checkpoint, it writes the same records bit for bit."""
    from jdp.cli import main

    data = rule_pairs(tmp_path / "pairs.jsonl")
    args = ["train", "tiny", f"data.source={data}", "data.format=preference", "train.objective=dpo", "data.seq_len=24",
            "train.batch_size=16", "train.steps=100", "train.log_every=10", "train.eval_every=50", "data.val_tokens=1200",
            "optim.lr=5e-3", "optim.warmup_steps=5", "train.beta=0.5", "train.ckpt_every=50", "train.progress=false"]  # fmt: skip
    a = tmp_path / "a"
    assert main([*args, f"train.run_dir={a}"]) == 0
    records = read_metrics(a / "metrics.jsonl")
    evals = [r for r in records if "eval_rewards/accuracies" in r]
    assert [r["step"] for r in evals] == [50, 100] and evals[-1]["eval_pairs"] >= 20
    assert evals[-1]["eval_rewards/accuracies"] > 0.9 and evals[-1]["eval_rewards/margins"] > 0.5, evals
    trained = [r for r in records if "loss" in r]
    assert trained[-1]["loss"] < 0.5 < trained[0]["loss"], trained
    assert {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
            "logps/rejected"} <= set(trained[-1])  # fmt: skip
    # the model alone (generate, export) loads without the reference copy the run held
    assert main(["generate", str(a), "--prompt", "red blue gold:", "--max-new-tokens", "2"]) == 0
    b = tmp_path / "b"
    shutil.copytree(a, b)
    shutil.rmtree(b / "checkpoints" / "100")
    assert main([*args, f"train.run_dir={b}"]) == 0
    again = [r for r in read_metrics(b / "metrics.jsonl") if "loss" in r and r["step"] > 50]
    keys = ("loss", "grad_norm", "rewards/margins", "logps/chosen")
    assert [[r[k] for k in keys] for r in again] == [[r[k] for k in keys] for r in trained if r["step"] > 50]


def test_preference_pairs_are_read_as_trl_reads_them_and_refused_by_name_when_wrong(tmp_path):
    """Plain and conversational rows (with a prompt column, or two whole conversations whose shared turns are the
    prompt) give the same pair; the answer weights start where the prompt's tokens end; a batch holds whole pairs
    (the leading axis), so a split over devices or micro-batches keeps each pair's two answers together; wrong
    rows and configs are refused before anything is built."""
    from jdp.data.chat import ChatTemplate
    from jdp.data.tokens import ByteTokenizer

    byte = ByteTokenizer()
    seqs, n = pair_tokens({"prompt": "2+2=", "chosen": "4", "rejected": "5"}, byte, None, "row")
    assert [s.tolist() for s in seqs] == [[256, *b"2+2=4", 256], [256, *b"2+2=5", 256]] and n == 5
    (tmp_path / "t.jinja").write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>{% endfor %}"
                                      "{% if add_generation_prompt %}<assistant>{% endif %}")  # fmt: skip
    cfg = load_config(None, [f"data.chat_template={tmp_path / 't.jinja'}", "data.format=preference"]).data
    template = ChatTemplate.load(cfg)
    user, yes, no = {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}, {"role": "assistant",
                                                                                                    "content": "5"}
    explicit = pair_tokens({"prompt": [user], "chosen": [yes], "rejected": [no]}, byte, template, "row")
    implicit = pair_tokens({"chosen": [user, yes], "rejected": [user, no]}, byte, template, "row")
    assert [s.tolist() for s in explicit[0]] == [s.tolist() for s in implicit[0]] and explicit[1] == implicit[1]
    assert bytes(explicit[0][0][: explicit[1]].tolist()) == b"<user>2+2?</s><assistant>"
    batch = pair_batch(0)
    assert batch["inputs"].shape == (8, 2, 12) and batch["weights"].shape == (8, 2, 12)
    mesh = parallel.make_mesh(jax.devices())
    sharded = parallel.shard_batch(batch, mesh)
    for shard in sharded["inputs"].addressable_shards:  # each device's pairs: both answers, the same prompt
        rows = np.asarray(shard.data)
        assert rows.shape[1:] == (2, 12) and all(np.array_equal(r[0, :2], r[1, :2]) for r in rows)
    for row, words in (({"prompt": "a", "chosen": ["x"], "rejected": "y"}, "both be text or both message lists"),
                       ({"prompt": [user], "chosen": [user], "rejected": [no]}, "must be assistant turns")):  # fmt: skip
        with pytest.raises(ConfigError, match=words):
            pair_tokens(row, byte, template, "row")
    for overrides, words in ((["train.objective=dpo"], "set data.format=preference"),
                             (["data.format=preference"], "set train.objective=dpo"),
                             (["train.objective=simpo", "data.format=preference", "train.beta=0"], "train.beta=0.0 must"),
                             (["train.objective=orpo", "data.format=preference", "train.beta=0.5"], "train.beta=0.5 is read by"),
                             (["train.objective=dpo", "data.format=preference", "train.live=true"], "live membership"),
                             ):  # fmt: skip
        with pytest.raises(ConfigError, match=words):
            validate(load_config(None, overrides), 1)


def test_a_precomputed_reference_trains_as_the_frozen_copy_does_resumes_and_is_planned(tmp_path, capsys):
    """train.precompute_reference=true (fsdp, 4 devices): the reference's log-probabilities of every pair, computed
    once at the start and kept in the run directory, give the frozen copy's run (ddp) its losses; resumed from
    its middle checkpoint it reads them back and gives the same records; gone, the resume is refused by name.
    `jdp plan` counts the frozen copy (twice the parameters' bytes), neither for a precomputed reference nor
    with LoRA, and a pair's two sequences' activations."""
    from jdp import plan
    from jdp.cli import main

    data = rule_pairs(tmp_path / "pairs.jsonl", 96)
    args = ["train", "tiny", f"data.source={data}", "data.format=preference", "train.objective=dpo", "data.seq_len=24",
            "train.batch_size=8", "train.steps=4", "train.log_every=1", "train.eval_every=0", "data.val_tokens=200",
            "train.ckpt_every=2", "train.progress=false"]  # fmt: skip
    copy, pre = tmp_path / "copy", tmp_path / "pre"
    assert main([*args, f"train.run_dir={copy}"]) == 0
    assert main([*args, f"train.run_dir={pre}", "parallel.strategy=fsdp", "train.precompute_reference=true"]) == 0
    with np.load(pre / "reference_logps.npz") as z:
        assert z["train"].shape[1] == 2 and len(z["val"]) >= 1 and np.all(z["train"] < 0)
    keys = ("loss", "rewards/margins", "logps/chosen", "eval_loss", "eval_rewards/chosen")
    records = lambda d: [[r.get(k) for k in keys] for r in read_metrics(d / "metrics.jsonl") if "step" in r]  # noqa: E731
    np.testing.assert_allclose(np.array(records(pre), float), np.array(records(copy), float), rtol=1e-5)
    shutil.rmtree(pre / "checkpoints" / "4")
    before = records(pre)
    assert main([*args, f"train.run_dir={pre}", "parallel.strategy=fsdp", "train.precompute_reference=true"]) == 0
    assert records(pre) == before
    shutil.rmtree(pre / "checkpoints" / "4")
    (pre / "reference_logps.npz").unlink()
    assert main([*args, f"train.run_dir={pre}", "parallel.strategy=fsdp", "train.precompute_reference=true"]) == 2
    assert "reference_logps.npz (the reference's log-probabilities, computed at the run's start) is gone" in (
        capsys.readouterr().err)  # fmt: skip

    def held(*overrides):
        return plan.held_bytes(load_config("tiny", ["data.format=preference", *overrides]), "ddp", 4).params

    lm = plan.held_bytes(load_config("tiny", []), "ddp", 4).params
    assert held("train.objective=dpo") == 2 * lm
    assert held("train.objective=dpo", "train.precompute_reference=true") == held("train.objective=simpo") == lm
    lora = plan.held_bytes(load_config("tiny", ["model.lora_rank=4"]), "ddp", 4).params
    assert held("train.objective=dpo", "model.lora_rank=4") == lora
    dpo = load_config("tiny", ["data.format=preference", "train.objective=dpo"])
    assert plan.device_memory(dpo, 4, 2, False).activations == plan.device_memory(load_config("tiny", []), 4, 4,
                                                                                   False).activations  # fmt: skip


def test_dpo_steps_on_four_devices_equal_a_plain_pytorch_loop_with_trls_loss():
    """4 steps of DPO (Adam, lr 1e-3) on the tiny Llama and TRL's 4 pairs: jdp on 4 devices, one pair each, the
    reference a frozen copy; and a plain PyTorch loop whose loss is DPOTrainer's own (`_compute_loss`, with the
    reference's log-probabilities TRL's `compute_ref_log_probs` gave before the first step). The same losses and
    rewards every step (measured: 1e-5 apart at most), and the trained models give the same log-probabilities
    (8e-7)."""
    torch = pytest.importorskip("torch", reason="the PyTorch loop needs torch and trl (CI's oldest stack has them)")
    pytest.importorskip("trl", reason="the PyTorch loop needs torch and trl (CI's oldest stack has them)")
    import copy

    import optax

    from jdp.build import run_model
    from jdp.lm import checked_import

    tr = trl_trainer()
    examples = [tr.train_dataset[i] for i in range(len(ROWS))]
    inputs = tr.data_collator(examples)
    policy = copy.deepcopy(tr.model).train()
    ref_c, ref_r = tr.compute_ref_log_probs(policy, inputs)
    tr.precompute_ref_logps, tr.loss_types, tr.loss_weights = True, ["sigmoid"], [1.0]
    tr.model.train()  # TRL logs under "train" then
    opt = torch.optim.Adam(policy.parameters(), lr=1e-3)
    theirs = []
    for _ in range(4):
        tr._metrics["train"] = type(tr._metrics["train"])(list)
        loss = tr._compute_loss(policy, {**inputs, "ref_chosen_logps": ref_c, "ref_rejected_logps": ref_r}, False)
        opt.zero_grad()
        loss.backward()
        opt.step()
        theirs.append((float(loss), tr._metrics["train"]["rewards/margins"][-1]))
    trl_c, trl_r = (x.numpy() for x in tr.compute_ref_log_probs(policy, inputs))  # the trained model's

    cfg, _ = checked_import(load_config(None, [f"train.init_from={LLAMA}", f"data.tokenizer={LLAMA}"]), frozenset())
    model = preference.with_reference(run_model(cfg)[0])
    mesh = parallel.make_mesh(jax.devices()[:4])
    a = parallel.assemble(model, preference.make_loss("dpo", **OPTIONS), optax.adam(1e-3), mesh, ParallelConfig())
    batch, state, ours = trl_batch(examples), a.state, []
    for _ in range(4):
        state, metrics = a.train_step(state, parallel.shard_batch(batch, mesh))
        ours.append((float(metrics["loss"]), float(metrics["rewards/margins"])))
    np.testing.assert_allclose(np.array(ours), np.array(theirs), rtol=3e-5, atol=1e-7)
    assert theirs[-1][0] < theirs[0][0] - 0.01  # it trained
    trained = nnx.merge(a.graphdef, jax.device_get(state.params), jax.device_get(state.rest))
    logps, _ = jax.device_get(preference.answer_logps(trained, batch))
    np.testing.assert_allclose(logps, np.stack([trl_c, trl_r], 1), rtol=1e-5)
