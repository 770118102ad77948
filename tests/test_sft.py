"""Fine-tuning data (data.format=chat or prompt): the chat template rendered without transformers, the loss only on
the answer (token by token), examples packed whole into windows and never cut silently, and training that lowers
the answer tokens' loss."""

import dataclasses
import json
import re
from pathlib import Path

import datasets
import numpy as np
import pytest

from jdp.config import ConfigError, DataConfig, load_config, validate
from jdp.data import load_data
from jdp.data.chat import conversation
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
    validate(load_config(None, ["data.format=chat", "data.streaming=true"]), 1)  # streamed: allowed (issue 43)


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


# Streamed fine-tuning data (issue 43): packed as read, each process its own shards, an exact position.

TAG = re.compile(rb"q(\d+)\.(\d+) ")


def chat_shards(where: Path, files: int = 4, per_file: int = 20, seed: int = 0, long_every: int = 0) -> Path:
    """Conversations tagged `qF.I` (file F, line I) of different lengths (about 130-160 bytes in LLAMA3's layout);
    every `long_every`-th one longer than a 512-token window."""
    where.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for f in range(files):
        with open(where / f"part-{f}.jsonl", "w") as fh:
            for i in range(per_file):
                n = 420 if long_every and (f * per_file + i) % long_every == long_every - 1 else int(rng.integers(1, 25))
                fh.write(json.dumps({"messages": [{"role": "user", "content": f"q{f}.{i} " + "x" * n},
                                                  {"role": "assistant", "content": "y" * int(rng.integers(1, 9))}]}))
                fh.write("\n")
    return where


def tags(batch: dict) -> list[tuple[int, int]]:
    """The conversations whose start a batch's windows hold, in order (byte tokenizer: the ids are the bytes)."""
    rows = np.concatenate([batch["inputs"], batch["targets"][:, -1:]], axis=1)
    return [(int(a), int(b)) for row in rows for a, b in TAG.findall(bytes(row.astype(np.uint8).tolist()))]


def stream_cfg(tmp_path: Path, **kw) -> DataConfig:
    return DataConfig(**{"source": str(tmp_path / "shards"), "format": "chat", "streaming": True, "seq_len": 512,
                         "chat_template": str(template_file(tmp_path)), "val_tokens": 0,
                         "cache_dir": str(tmp_path / "cache"), **kw})  # fmt: skip


def test_streamed_conversations_are_packed_as_map_style_packs_them_each_process_its_shards_once(tmp_path, capsys):
    """data.streaming=true with data.format=chat (refused before issue 43): one process's windows are pack()'s
    windows of the same conversations in file order, token and weight; two processes read disjoint shards, every
    conversation once per epoch between them; a conversation longer than a window is truncated and said."""
    from jdp.data.corpus import open_corpus
    from jdp.data.sft import row_example, stream_examples

    chat_shards(tmp_path / "shards", long_every=7)
    cfg = stream_cfg(tmp_path)
    corpus, tok = open_corpus(cfg, streaming=True), ByteTokenizer()
    one = stream_examples(corpus, tok, cfg, rows=4, rank=0, world=1)
    got = [one.next_batch() for _ in range(10)]
    rows = [json.loads(line) for f in range(4) for line in (tmp_path / "shards" / f"part-{f}.jsonl").open()]
    template = ChatTemplate.load(cfg)
    packed = pack([row_example(r, tok, cfg, template, "")[:2] for r in rows], 512, tok.eod_id, "truncate")
    n = len(packed.tokens) - 1  # the last window of an epoch is filled by the next epoch's first conversation
    assert 10 * 4 > n and one.epoch_count == 1
    want = packed.batch(np.arange(n))
    for key in ("inputs", "targets", "weights"):
        np.testing.assert_array_equal(np.concatenate([g[key] for g in got])[:n], want[key])
    assert 0 < want["weights"].sum() < 0.3 * want["weights"].size
    assert one.counts["truncated"] >= 11  # 80 / 7 conversations are 540+ tokens
    warned = capsys.readouterr().err
    assert "process 0's example 6 is longer than a window" in warned and "1 truncated so far" in warned
    assert "10 truncated so far" in warned and "2 truncated so far" not in warned  # said at the 1st, 10th, ...

    seen = []
    for rank in range(2):
        mine = stream_examples(corpus, tok, cfg, rows=1, rank=rank, world=2)
        read = []
        while mine.epoch_count == 0:
            read += tags(mine.next_batch())
        files = {f for f, _ in read[:40]}
        assert len(files) == 2, files  # two whole shards each
        seen += read[:40]
    assert sorted(seen) == [(f, i) for f in range(4) for i in range(20)]


def test_a_streamed_position_restored_continues_the_open_window_and_validation_is_the_head(tmp_path):
    """A stream stopped after any batch and restored (its position through JSON, as a checkpoint keeps it) gives
    the uninterrupted stream's windows; with data.val_tokens the head of the stream is validation, packed the same
    way, and training never reads those conversations."""
    from jdp.data.corpus import open_corpus
    from jdp.data.sft import stream_examples

    chat_shards(tmp_path / "shards", long_every=9)
    cfg = stream_cfg(tmp_path, val_tokens=300, overlong="drop")
    corpus, tok = open_corpus(cfg, streaming=True), ByteTokenizer()
    straight = stream_examples(corpus, tok, cfg, rows=3, rank=0, world=1)
    expected = [straight.next_batch() for _ in range(40)]  # several epochs
    assert straight.epoch_count >= 2 and straight.counts["dropped"] > 0
    for stop in (1, 6, 17, 33):
        first = stream_examples(corpus, tok, cfg, rows=3, rank=0, world=1)
        got = [first.next_batch() for _ in range(stop)]
        saved = json.loads(json.dumps(first.position()))
        second = stream_examples(open_corpus(cfg, streaming=True), tok, cfg, rows=3, rank=0, world=1)
        second.load_position(saved)
        got += [second.next_batch() for _ in range(40 - stop)]
        for g, e in zip(got, expected, strict=True):
            for key in ("inputs", "weights"):
                np.testing.assert_array_equal(g[key], e[key])
    val = tags(straight.val.batch(np.arange(len(straight.val.tokens))))
    assert val == [(0, i) for i in range(len(val))] and 2 <= len(val) <= 3  # the head, until 300 tokens (~150 each)
    trained = {t for batch in expected for t in tags(batch)}
    assert not trained & set(val) and len(trained) >= 80 - len(val) - straight.counts["dropped"]


def test_streamed_fine_tuning_runs_and_mixtures_stopped_and_resumed_end_as_uninterrupted_runs(tmp_path):
    """Through the trainer: a streamed chat run, and a streamed mixture of two prompt/completion sources (3:1), each
    stopped at step 2 and resumed to 4, end with the parameters of the run that was not stopped; the mixture
    evaluates each source on its own held-out head."""
    chat_shards(tmp_path / "shards")
    for name in ("p", "q"):
        (tmp_path / name).mkdir()
        for f in range(2):
            lines = [json.dumps({"prompt": f"{name}{f}.{i} add {i} and {f}?", "completion": f" {i + f}"})
                     for i in range(30)]  # fmt: skip
            (tmp_path / name / f"part-{f}.jsonl").write_text("\n".join(lines))
    common = ["data.streaming=true", "data.seq_len=512", "model.max_seq_len=512", f"data.cache_dir={tmp_path / 'c'}",
              "train.batch_size=4", "train.progress=false", "train.log_every=1", "train.eval_every=2",
              "model.n_layers=1", "model.d_model=32", "model.n_heads=2", "train.ckpt_every=2",
              "optim.warmup_steps=0", "optim.min_lr_ratio=1"]  # fmt: skip
    chat = [f"data.source={tmp_path / 'shards'}", "data.format=chat", "data.val_tokens=200",
            f"data.chat_template={template_file(tmp_path)}"]  # fmt: skip
    sources = f"data.sources=[{{source: {tmp_path / 'p'}, weight: 3}}, {{source: {tmp_path / 'q'}, weight: 1}}]"
    mixed = [sources, "data.format=prompt", "data.val_tokens=100"]
    for name, extra in (("chat", chat), ("mixed", mixed)):
        cfg = load_config("tiny", common + extra)

        def run(where, steps, cfg=cfg):
            t = dataclasses.replace(cfg.train, steps=steps, run_dir=str(tmp_path / where))
            return train(dataclasses.replace(cfg, train=t))

        whole = run(f"{name}-whole", 4)
        run(f"{name}-split", 2)
        resumed = run(f"{name}-split", 4)
        assert resumed["params_sha256"] == whole["params_sha256"], name
        records = [json.loads(line) for line in (tmp_path / f"{name}-whole" / "metrics.jsonl").read_text().splitlines()]
        keys = {k for r in records for k in r}
        assert ({"eval_loss/p", "eval_loss/q"} if name == "mixed" else {"eval_loss"}) <= keys, keys


# Issue 65: what users still hit with fine-tuning data. Each test makes the mistake and checks the answer.


def chat_rows(tmp_path: Path, name: str, rows: list) -> DataConfig:
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"messages": r}) + "\n" for r in rows))
    return DataConfig(source=str(path), format="chat", chat_template=str(template_file(tmp_path)), seq_len=256,
                      val_tokens=0, cache_dir=str(tmp_path / name))  # fmt: skip


def test_a_mistyped_role_is_named_with_the_role_it_meant_and_the_roles_seen(tmp_path):
    """Item 1: `asistant` or `User` was reported as "no assistant turn", naming neither the roles seen nor the
    expected ones."""
    for wrong, meant in (("asistant", "assistant"), ("User", "user")):
        rows = [CHAT] * 4 + [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]]
        rows[2] = [{**m, "role": wrong} if m["role"] == meant else m for m in CHAT]
        with pytest.raises(ConfigError) as e:
            load_data(chat_rows(tmp_path, wrong, rows), 320, batch_size=2, seed=0)
        first = [i for i, m in enumerate(CHAT) if m["role"] == meant][0]
        assert f"example 2: message {first}'s role is {wrong!r}: did you mean {meant!r}?" in str(e.value)
        assert "'system', 'user', 'assistant', 'tool'" in str(e.value)
    sharegpt = [[{"role": "human", "content": "hi"}, {"role": "gpt", "content": "yo"}]] * 6
    with pytest.raises(ConfigError) as e:
        load_data(chat_rows(tmp_path, "sharegpt", sharegpt), 320, batch_size=2, seed=0)
    assert "no conversation has an assistant turn (role 'assistant')" in str(e.value)
    assert "the roles seen are 'human' (6), 'gpt' (6)" in str(e.value)
    assert "rename 'human' to 'user', 'gpt' to 'assistant'" in str(e.value)


def test_an_assistant_turn_without_an_answer_is_refused_naming_the_example_and_the_turn(tmp_path):
    """Item 2: a null or empty assistant content trained the end-of-turn token alone, silently (a null completion is
    refused); a turn that calls tools has its answer in tool_calls."""
    for content, has in ((None, "no content (null or missing)"), ("", "content ''"), ("  ", "content '  '")):
        rows = [CHAT] * 5
        rows[3] = [*CHAT[:4], {"role": "assistant", "content": content}]
        with pytest.raises(ConfigError) as e:
            load_data(chat_rows(tmp_path, f"empty{len(content or 'x')}", rows), 320, batch_size=2, seed=0)
        assert re.search(rf"empty\d.jsonl, example 3: message 4 \(role 'assistant'\) has {re.escape(has)} and no "
                         r"tool_calls: it would train only the end-of-turn token; give the turn its answer", str(e.value))  # fmt: skip
    calls = [{"role": "user", "content": "Weather?"},
             {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "w"}}]}]  # fmt: skip
    template = ChatTemplate.load(DataConfig(chat_template=str(template_file(tmp_path))))
    chat_example(calls, template, ByteTokenizer(), "test")  # not refused


def test_content_parts_are_read_as_their_text_and_other_parts_are_refused_by_type(tmp_path):
    """Item 3: OpenAI-style content parts were printed as a Python list (the only sign: "54 of 54 truncated"). A
    template that renders only strings (this Llama-3 layout) is given the parts' texts joined (one part: exactly the
    string's tokens and weights); an image part is refused by name."""
    template = ChatTemplate.load(DataConfig(chat_template=str(template_file(tmp_path))))
    assert not template.takes_parts()
    parted = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in CHAT]
    for got, want in zip(chat_example(parted, template, ByteTokenizer(), "t"), chat_example(CHAT, template,
                         ByteTokenizer(), "t"), strict=True):  # fmt: skip
        assert got.tolist() == want.tolist()
    two = [CHAT[1], {"role": "assistant", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    assert "Hello\nthere<|eot_id|>" in template.render(conversation(two, "t", template.takes_parts))  # joined
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}},
                                          {"type": "text", "text": "What is it?"}]}, CHAT[2]]  # fmt: skip
    with pytest.raises(ConfigError, match=r"parts.jsonl, example 1: message 0's content part 0 is of type "
                                          r"'image_url': jdp trains language models on text"):  # fmt: skip
        load_data(chat_rows(tmp_path, "parts", [parted, image, parted]), 320, batch_size=2, seed=0)


def test_fixes_for_dropped_examples_name_seq_len_or_truncate_not_val_tokens(tmp_path):
    """Item 4: every validation example dropped by data.overlong=drop said "raise data.val_tokens" (it cannot help);
    every training example dropped named no fix."""
    long = [{"role": "user", "content": "x" * 600}, {"role": "assistant", "content": "y"}]  # 680 tokens
    (tmp_path / "split").mkdir()
    for name, rows in (("train", [CHAT] * 6), ("validation", [long] * 3)):
        (tmp_path / "split" / f"{name}.jsonl").write_text("".join(json.dumps({"messages": r}) + "\n" for r in rows))
    cfg = dataclasses.replace(chat_rows(tmp_path, "long", [long] * 3), seq_len=512, overlong="drop")  # CHAT: 324 tokens
    with pytest.raises(ConfigError) as e:
        load_data(dataclasses.replace(cfg, source=str(tmp_path / "split"), val_tokens=700), 320, 2, seed=0)
    assert "no validation window (0 examples" in str(e.value) and "raise data.val_tokens" not in str(e.value)
    assert "every validation example is longer than a window (data.seq_len+1=513 tokens) and data.overlong=drop " \
           "dropped it; raise data.seq_len (and model.max_seq_len), or set data.overlong=truncate" in str(e.value)  # fmt: skip
    with pytest.raises(ConfigError, match=r"no training window \(0 examples.*3 dropped.*\): every training example "
                                          r"is longer than a window .* set data.overlong=truncate"):  # fmt: skip
        load_data(cfg, 320, batch_size=2, seed=0)
    load_data(dataclasses.replace(cfg, source=str(tmp_path / "split"), val_tokens=700, overlong="truncate"), 320, 2, 0)


def test_a_stream_with_nothing_left_to_train_says_why_instead_of_asking_for_shards(tmp_path):
    """Item 4: a streamed chat set whose rows all repeat the held-out ones asked for more shards; a stream whose
    every example data.overlong=drop drops read on forever."""
    from jdp.data.corpus import open_corpus
    from jdp.data.sft import stream_examples

    (tmp_path / "shards").mkdir()
    short = [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}] for i in range(3)]
    (tmp_path / "shards" / "part-0.jsonl").write_text("".join(json.dumps({"messages": short[i % 3]}) + "\n"
                                                              for i in range(30)))  # fmt: skip
    cfg = stream_cfg(tmp_path, val_tokens=10**6)
    stream = stream_examples(open_corpus(cfg, streaming=True), ByteTokenizer(), cfg, rows=2, rank=0, world=1)
    with pytest.raises(ConfigError) as e:
        stream.next_batch()
    msg = str(e.value)
    assert "process 0 of 1 got no training documents from the stream: of the 30 rows of its shards in epoch 0, 30 " \
           "repeat an example validation holds out of the stream's head" in msg and "as processes" not in msg  # fmt: skip
    assert "lower data.val_tokens" in msg and "data.val_tokens=0" in msg
    cfg = stream_cfg(tmp_path, seq_len=8, overlong="drop")
    stream = stream_examples(open_corpus(cfg, streaming=True), ByteTokenizer(), cfg, rows=2, rank=0, world=1)
    with pytest.raises(ConfigError, match=r"in epoch 0, 30 are longer than a window \(data.seq_len\+1=9\) and "
                                          r"data.overlong=drop dropped them; raise data.seq_len"):  # fmt: skip
        stream.next_batch()  # no hang


def test_template_options_are_checked_and_chat_template_kwargs_parse(tmp_path):
    """Item 4: data.chat_template_name given a .jinja path told the user to set a .jinja; item 5: the template
    variables a template reads (enable_thinking) are data.chat_template_kwargs, a mapping."""
    jinja = tmp_path / "mine.jinja"
    jinja.write_text(LLAMA3)
    with pytest.raises(ConfigError, match=rf"data.chat_template_name={jinja} is a file name: .* give a template file "
                                          rf"as data.chat_template={jinja}"):  # fmt: skip
        ChatTemplate.load(DataConfig(tokenizer=str(TINY_TOKENIZER), chat_template_name=str(jinja)))
    cfg = load_config(None, ["data.chat_template_kwargs={enable_thinking: false, bos_token: '<B>'}"])
    assert cfg.data.chat_template_kwargs == {"enable_thinking": False, "bos_token": "<B>"}
    template = ChatTemplate.load(dataclasses.replace(cfg.data, chat_template=str(template_file(tmp_path))))
    assert template.render(CHAT).startswith("<B><|start_header_id|>")  # over the special token, as transformers
    with pytest.raises(ConfigError, match="chat_template_kwargs.*expected a mapping"):
        load_config(None, ["data.chat_template_kwargs=[enable_thinking]"])
    with pytest.raises(ConfigError, match="data.chat_template_kwargs sets add_generation_prompt: jdp gives"):
        ChatTemplate.load(DataConfig(chat_template=str(jinja), chat_template_kwargs={"add_generation_prompt": True}))
