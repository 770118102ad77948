"""Fine-tuning data (data.format=chat or prompt): the chat template rendered without transformers, the loss only on
the answer (token by token), examples packed whole into windows and never cut silently, and training that lowers
the answer tokens' loss."""

import dataclasses
import json
from pathlib import Path

import datasets
import numpy as np
import pytest

from jdp.config import ConfigError, DataConfig, load_config, validate
from jdp.data import load_data
from jdp.data.sft import ChatTemplate, chat_example, pack, prompt_example
from jdp.data.tokens import ByteTokenizer, HFTokenizer
from jdp.lm import train

LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)  # Llama 3's layout, shortened
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Say hi"},
    {"role": "assistant", "content": "Hello there"},
    {"role": "user", "content": "Again"},
    {"role": "assistant", "content": "Sure"},
]
TINY_TOKENIZER = Path(__file__).parent / "data" / "hf-llama-tiny" / "tokenizer.json"


@pytest.fixture(autouse=True)
def _isolated_caches(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("JDP_CACHE", str(tmp_path / "jdp-env-cache"))


def template_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokenizer_config.json"
    path.write_text(json.dumps({"chat_template": LLAMA3, "bos_token": {"content": "<|begin_of_text|>"}}))
    return path


def test_only_assistant_turns_carry_weight_token_by_token(tmp_path):
    template = ChatTemplate.load(DataConfig(chat_template=str(template_file(tmp_path))))
    text = template.render(CHAT)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>")
    ids, weights = chat_example(CHAT, template, ByteTokenizer(), "test")
    assert bytes(ids.astype(np.uint8)).decode() == text  # the tokens are the whole rendered text's
    answers = ["Hello there<|eot_id|>", "Sure<|eot_id|>"]  # each turn's content and its end-of-turn marker
    expected = np.zeros(len(text.encode()), np.uint8)
    for answer in answers:
        at = text.index(answer)
        expected[len(text[:at].encode()) : len(text[: at + len(answer)].encode())] = 1
    assert weights.tolist() == expected.tolist()  # token by token: 1 exactly on the answers, 0 on every other


def test_a_bpe_tokenizer_weighs_the_answers_and_nothing_the_user_wrote(tmp_path):
    template = ChatTemplate.load(DataConfig(chat_template=str(template_file(tmp_path))))
    tokenizer = HFTokenizer(str(TINY_TOKENIZER))
    ids, weights = chat_example(CHAT, template, tokenizer, "test")
    bos = tokenizer._tok.token_to_id("<|begin_of_text|>")
    assert ids[0] == bos and weights[0] == 0  # the template's bos_token is the tokenizer's special token
    assert tokenizer.decode(ids) == template.render(CHAT).removeprefix("<|begin_of_text|>")  # decode skips it
    answer = tokenizer.decode(ids[weights == 1])
    assert "Hello there" in answer and "Sure" in answer
    assert not any(word in answer for word in ("brief", "Say hi", "Again", "system", "user"))


def test_prompt_and_completion_weigh_the_completion_and_its_end():
    ids, weights = prompt_example("2+2=", "4", ByteTokenizer())
    assert ids.tolist() == [*b"2+2=", *b"4", ByteTokenizer.eod_id]
    assert weights.tolist() == [0, 0, 0, 0, 1, 1]


def test_examples_are_packed_whole_and_a_long_one_is_truncated_or_dropped_and_counted():
    rng = np.random.default_rng(0)
    examples = [(rng.integers(0, 200, n), np.ones(n, np.uint8)) for n in (5, 9, 3, 30, 7, 12)]
    for overlong, kept in (("truncate", 6), ("drop", 5)):
        packed = pack(examples, seq_len=15, eod_id=256, overlong=overlong)
        assert (packed.truncated, packed.dropped, packed.n_examples) == (
            overlong == "truncate",
            overlong == "drop",
            kept,
        )
        assert packed.tokens.shape[1] == 16
        found = []
        for row in packed.tokens:  # every example whole in one window, after its end-of-document token
            cuts = list(np.flatnonzero(row == 256)) + [16]
            found += [tuple(row[a + 1 : b]) for a, b in zip(cuts, cuts[1:], strict=False) if b > a + 1]
        want = [tuple(ids) for ids, _ in examples if len(ids) + 1 <= 16]
        assert [f for f in found if len(f) < 15] == want  # the short ones exactly, in order
    truncated = pack(examples, 15, 256, "truncate")
    assert (
        truncated.answer_tokens == int(truncated.weights[:, 1:].sum()) == sum(min(n, 15) for n in (5, 9, 3, 30, 7, 12))
    )


def chats(path: Path, n: int = 300) -> Path:
    """Conversations whose answer follows from the question (the user's word, reversed)."""
    rng = np.random.default_rng(1)
    words = ["amber", "basil", "cedar", "delta", "ember", "fjord", "gamma", "hazel"]
    with open(path, "w") as f:
        for _ in range(n):
            w = words[rng.integers(len(words))]
            f.write(json.dumps({"messages": [{"role": "user", "content": f"reverse {w}"},
                                             {"role": "assistant", "content": w[::-1]}]}) + "\n")  # fmt: skip
    return path


def test_examples_that_lose_every_answer_to_truncation_are_refused_before_training(tmp_path):
    source = chats(tmp_path / "chat.jsonl", 40)
    cfg = DataConfig(source=str(source), format="chat", chat_template=str(template_file(tmp_path)), seq_len=64,
                     val_tokens=0, cache_dir=str(tmp_path / "cache"))  # fmt: skip
    with pytest.raises(ConfigError, match="no training example keeps a token of its answer.*40 truncated"):
        load_data(cfg, 320, batch_size=4, seed=0)


def test_examples_without_an_answer_are_refused_or_counted_never_trained_silently(tmp_path, capsys):
    """`completion: null` trained an empty answer (the end-of-document token alone) without a word, and so did data
    whose every answer was empty; an integer completion or a conversation that is not a list was a traceback."""

    def load(rows, name, fmt="prompt"):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        cfg = DataConfig(source=str(path), format=fmt, seq_len=64, val_tokens=0, cache_dir=str(tmp_path / name),
                         chat_template=str(template_file(tmp_path)) if fmt == "chat" else "")  # fmt: skip
        return load_data(cfg, 320, batch_size=2, seed=0)

    good = [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(40)]
    with pytest.raises(ConfigError, match=r"example 3: completion is None, not text \(an example without an answer"):
        load([*good[:3], {"prompt": "q", "completion": None}, *good[3:]], "null")
    with pytest.raises(ConfigError, match=r"example 0: completion is 7, not text"):
        load([{"prompt": "q", "completion": 7}, *good], "int")
    with pytest.raises(ConfigError, match="every completion is empty, so there is no answer to learn"):
        load([{"prompt": f"q{i}", "completion": ""} for i in range(8)], "empty")
    capsys.readouterr()
    load([*good, {"prompt": "q", "completion": " "}], "some")
    assert "1 of 41 examples have an empty completion (examples 40)" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"example 1: messages is 'hi', not a list of \{role, content\}"):
        load([{"messages": CHAT}, {"messages": "hi"}, *[{"messages": CHAT}] * 6], "chat", "chat")


def test_a_chat_template_that_raises_names_the_example_and_the_template(tmp_path):
    """Issue 42, item 9: a template that failed on a conversation (an attribute the data lacks, a type error) was a
    jinja2 traceback; its own raise_exception did not say which example. Both are one ConfigError naming both."""
    source = tmp_path / "chat.jsonl"
    odd = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": 5}]
    source.write_text("".join(json.dumps({"messages": m}) + "\n" for m in [CHAT] * 4 + [odd] + [CHAT] * 4))
    failing = tmp_path / "failing.jinja"
    failing.write_text("{% for m in messages %}{{ m['content'] | upper }}{{ m['content'] + '!' }}{% endfor %}")
    refusing = tmp_path / "refusing.jinja"
    refusing.write_text("{% for m in messages %}{% if m['content'] is not string %}"
                        "{{ raise_exception('content must be text') }}{% endif %}{{ m['content'] }}{% endfor %}")  # fmt: skip
    for template, message in ((failing, r"failed on it: TypeError"), (refusing, r"refused it: content must be text")):
        cfg = DataConfig(source=str(source), format="chat", chat_template=str(template), seq_len=64, val_tokens=0,
                         cache_dir=str(tmp_path / template.stem))  # fmt: skip
        with pytest.raises(ConfigError, match=rf"chat.jsonl, example 4: the chat template \({template}\) {message}"):
            load_data(cfg, 320, batch_size=2, seed=0)


def test_conversations_without_an_assistant_turn_are_named_not_blamed_on_seq_len(tmp_path, capsys):
    """Issue 42, item 10: chat data with no assistant turn said the examples were longer than data.seq_len."""
    user_only = [{"role": "user", "content": "hi"}, {"role": "user", "content": "anyone?"}]

    def load(rows, name):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"messages": r}) + "\n" for r in rows))
        cfg = DataConfig(source=str(path), format="chat", chat_template=str(template_file(tmp_path)), seq_len=256,
                         val_tokens=0, cache_dir=str(tmp_path / name))  # fmt: skip
        return load_data(cfg, 320, batch_size=2, seed=0)

    with pytest.raises(ConfigError, match=r"none.jsonl: no conversation has an assistant turn \(role 'assistant'\)"):
        load([user_only] * 8, "none")
    capsys.readouterr()
    load([CHAT] * 8 + [user_only], "some")
    assert "1 of 9 conversations have no assistant turn (examples 8): each trains nothing" in capsys.readouterr().err


def test_the_wrong_format_names_the_columns_and_the_fix(tmp_path):
    source = chats(tmp_path / "chat.jsonl", 10)
    cfg = DataConfig(source=str(source), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match="data.format=chat for conversations"):
        load_data(cfg, 320, batch_size=4, seed=0)
    with pytest.raises(ConfigError, match="needs a chat template"):
        load_data(DataConfig(source=str(source), format="chat", cache_dir=str(tmp_path / "c")), 320, 4, 0)
    missing = DataConfig(source=str(source), format="chat", chat_template=str(tmp_path / "chat.jinja"),
                         tokenizer=str(TINY_TOKENIZER), cache_dir=str(tmp_path / "m"))  # fmt: skip
    with pytest.raises(ConfigError, match=r"data.chat_template=.*chat.jinja: no such file"):  # not "the tokenizer has
        load_data(missing, 320, 4, 0)  # no template"
    with pytest.raises(ConfigError, match="streamed fine-tuning data is not supported"):
        validate(load_config(None, ["data.format=chat", "data.streaming=true"]), 1)


def test_training_on_conversations_lowers_the_answer_tokens_loss(tmp_path):
    source = chats(tmp_path / "chat.jsonl")
    cfg = load_config("tiny", [
        f"data.source={source}", "data.format=chat", f"data.chat_template={template_file(tmp_path)}",
        "data.seq_len=256", "model.max_seq_len=256", "data.val_tokens=2000", f"data.cache_dir={tmp_path / 'cache'}", "train.steps=40",
        "train.batch_size=8", "train.log_every=1", "train.eval_every=20", "train.progress=false", "optim.lr=3e-3",
        "optim.warmup_steps=5", f"train.run_dir={tmp_path / 'run'}"])  # fmt: skip
    data = load_data(cfg.data, 320, cfg.train.batch_size, 0)
    batch = data.local_batch(0)
    assert batch["weights"].sum() < 0.25 * batch["weights"].size  # only the answers weigh
    result = train(cfg)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    assert losses[-1] < 0.5 * losses[0] and evals[-1] < evals[0], (losses[:3], losses[-3:], evals)
    assert np.isfinite(result["eval_loss"])


def test_configs_sft_chat_fine_tunes_a_llama_family_import(tmp_path):
    """configs/sft-chat.yaml with the tiny Llama fixture, its tokenizer and a chat template: trains and evaluates."""
    from jdp.lm import checked_import

    fixture = TINY_TOKENIZER.parent
    short = tmp_path / "short.jinja"  # markers the fixture's 280-token vocabulary keeps short
    short.write_text("{% for m in messages %}{{ m['role'][0] }}: {{ m['content'] }}\n{% endfor %}"
                     "{% if add_generation_prompt %}a: {% endif %}")  # fmt: skip
    cfg, _ = checked_import(load_config("sft-chat", [
        f"train.init_from={fixture}", f"data.tokenizer={fixture}", f"data.chat_template={short}",
        f"data.source={chats(tmp_path / 'chat.jsonl', 120)}", "data.seq_len=64", "data.val_tokens=300",
        f"data.cache_dir={tmp_path / 'cache'}", "train.steps=3", "train.batch_size=4", "train.eval_every=3",
        "model.dtype=float32", "train.progress=false", f"train.run_dir={tmp_path / 'run'}"]))  # fmt: skip
    assert cfg.model.arch == "llama" and cfg.data.within_documents
    result = train(cfg)
    assert np.isfinite(result["loss"]) and np.isfinite(result["eval_loss"])


def test_fine_tuning_data_mixes_by_weight_each_window_once_per_its_epoch_and_resumes_exactly(tmp_path):
    """Issue 43: a mixture of fine-tuning data was refused. Two sources of conversations and prompt/completion
    pairs are not mixed (data.format is the mixture's), but two chat sources are: each row of the batches comes from
    the source the schedule names (3:1), each source's windows once per its own epoch with their answer weights,
    one validation set per source, a fingerprint per source; and a run stopped and resumed ends bit-identical to
    one that was not."""
    from jdp.data.sft import load_examples

    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    a, b = chats(tmp_path / "a" / "chat.jsonl", 160), chats(tmp_path / "b" / "chat.jsonl", 60)
    template = template_file(tmp_path)
    sources = f"data.sources=[{{source: {a}, weight: 3, label: big}}, {{source: {b}, weight: 1, label: small}}]"
    cfg = load_config("tiny", [sources, "data.format=chat", f"data.chat_template={template}", "data.seq_len=256",
                               "model.max_seq_len=256", "data.val_tokens=1000", f"data.cache_dir={tmp_path / 'cache'}",
                               "train.batch_size=8", "train.progress=false", "train.log_every=1", "train.eval_every=2",
                               "model.n_layers=1", "model.d_model=32", "model.n_heads=2",
                               "train.ckpt_every=2", "optim.warmup_steps=0",
                               "optim.min_lr_ratio=1"])  # fmt: skip  (a constant rate: a run of 2 steps is the start of one of 4)
    data = load_data(cfg.data, 320, 8, seed=0)
    mixture = data.train
    sizes = dict(zip(mixture.labels, mixture.sizes.tolist(), strict=True))
    seen = {label: [] for label in sizes}
    for step in range(40):
        sources, idx = mixture.rows_of(step)
        assert np.bincount(sources, minlength=2).tolist() == [6, 2]  # 3:1 in every batch of 8
        for k, i in zip(sources, idx, strict=True):
            seen[mixture.labels[k]].append(int(i))
    for label, n in sizes.items():
        first = seen[label][:n]
        assert sorted(first) == list(range(n)), label  # every window once in its first epoch
    batch = data.local_batch(0)
    assert 0 < batch["weights"].sum() < 0.5 * batch["weights"].size  # answers only
    sub = dataclasses.replace(cfg.data, sources=(), source=str(b))
    from jdp.data.corpus import open_corpus

    train_b, _ = load_examples(open_corpus(sub), data.tokenizer, sub, 0)
    sources, idx = mixture.rows_of(0)
    want = train_b.batch(idx[sources == 1])
    np.testing.assert_array_equal(batch["inputs"][sources == 1], want["inputs"])  # the small source's own windows
    np.testing.assert_array_equal(batch["weights"][sources == 1], want["weights"])
    assert [label for label, _ in data.eval_sets()] == ["big", "small"]
    assert set(data.fingerprint()) == {"big", "small"}

    def run(name, steps):
        return train(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=steps,
                                                                        run_dir=str(tmp_path / name))))  # fmt: skip

    whole = run("whole", 4)
    run("split", 2)
    resumed = run("split", 4)
    assert resumed["params_sha256"] == whole["params_sha256"]
    records = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    assert {"eval_loss/big", "eval_loss/small"} <= {k for r in records for k in r}
