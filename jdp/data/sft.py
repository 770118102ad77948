"""Fine-tuning data (data.format=chat or prompt): examples whose loss falls only on the answer, packed whole into
windows.

chat: a `messages` column (a list of {role, content}) rendered with the tokenizer's own chat template (the Jinja
`chat_template` of its tokenizer_config.json, or data.chat_template), without `transformers`. The answer tokens are
those of each assistant turn: the text the template adds for message i (rendering messages[:i+1]) beyond the prompt
it renders for it (messages[:i] with add_generation_prompt), end-of-turn markers included, found by character
offsets in the tokenization of the whole conversation, so the tokens are exactly the whole text's.
prompt: `prompt` and `completion` columns; the completion and an end-of-document token are the answer.

Each example is [end-of-document] + its tokens (the end-of-document token starts it, as data.document_attention=within
reads it), with a weight per token: 1 on the answer, 0 elsewhere. Examples are packed in order, whole, into windows
of data.seq_len + 1 tokens, the rest of a window padded with weight 0; one longer than a window is truncated or
dropped (data.overlong) and counted, never cut silently.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from filelock import FileLock

from jdp.config import ConfigError, DataConfig
from jdp.data import formats
from jdp.data.corpus import cache_root
from jdp.data.dataset import GlobalOrder, Windows, digest
from jdp.data.tokens import Tokens
from jdp.log import logger

__all__ = ["ChatTemplate", "ExampleBatches", "Examples", "load_examples", "load_windows", "pack"]

log = logger("jdp.sft")

FORMAT_VERSION = 1


class _TemplateRefused(Exception):
    """raise_exception(message) in a chat template: the template's own refusal of a conversation."""


class ChatTemplate:
    """A tokenizer's Jinja chat template, rendered as transformers renders it (a sandboxed environment with
    trim_blocks and lstrip_blocks, `raise_exception`, `tojson`, `strftime_now`; bos_token and eos_token set)."""

    def __init__(self, source: str, where: str, special: dict | None = None):
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise _TemplateRefused(message)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent,
                                                                                      ensure_ascii=ensure_ascii)  # fmt: skip
        env.globals.update(raise_exception=raise_exception, strftime_now=time.strftime)
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ConfigError(f"the chat template ({where}) is not valid Jinja: line {e.lineno}: {e.message}") from None
        self.source, self.where, self.special = source, where, dict(special or {})
        self.digest = hashlib.sha256(json.dumps([source, self.special]).encode()).hexdigest()[:16]

    def render(self, messages: list[dict], add_generation_prompt: bool = False, at: str = "a conversation") -> str:
        """The template's text for `messages`; what it raises is one ConfigError naming the template and `at`."""
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **self.special)  # fmt: skip
        except _TemplateRefused as e:
            raise ConfigError(f"{at}: the chat template ({self.where}) refused it: {e}") from None
        except Exception as e:  # an undefined attribute, a type error, the sandbox: the template's or the data's
            raise ConfigError(
                f"{at}: the chat template ({self.where}) failed on it: {type(e).__name__}: {e} (is the conversation "
                f"in the shape the template expects, {{role, content}} messages?)"
            ) from None

    @classmethod
    def load(cls, cfg: DataConfig) -> ChatTemplate:
        """data.chat_template (a .jinja file or a tokenizer_config.json), else the tokenizer directory's
        tokenizer_config.json."""
        path = Path(cfg.chat_template or cfg.tokenizer).expanduser()
        if path.is_dir():
            path = path / "tokenizer_config.json"
        elif not cfg.chat_template and path.is_file():  # data.tokenizer=.../tokenizer.json: its directory's
            path = path.with_name("tokenizer_config.json")
        if cfg.chat_template and not path.is_file():
            raise ConfigError(
                f"data.chat_template={cfg.chat_template}: no such file; give a .jinja file or a tokenizer_config.json "
                f"that holds a chat_template"
            )
        if cfg.tokenizer == "byte" and not cfg.chat_template or not path.is_file():
            raise ConfigError(
                f"data.format=chat needs a chat template: data.tokenizer={cfg.tokenizer} "
                f"{'has none' if cfg.tokenizer == 'byte' else f'has no {path}'}; set data.chat_template to a .jinja "
                f"file or a tokenizer_config.json that holds one"
            )
        if path.suffix != ".json":
            return cls(path.read_text(), str(path))
        config = json.loads(path.read_text())
        template = config.get("chat_template")
        if isinstance(template, list):  # several named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if not isinstance(template, str):
            raise ConfigError(f"{path} has no chat_template; set data.chat_template to a .jinja file")
        special = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token")}
        return cls(template, str(path), special)


def _token_text(token) -> str:
    return token.get("content", "") if isinstance(token, dict) else (token or "")


def answer_spans(messages: list[dict], template: ChatTemplate, where: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns."""
    text, spans = template.render(messages, at=where), []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ConfigError(f"{where}: message {i} is {message!r:.80}, not a {{role, content}} mapping")
        if message["role"] != "assistant":
            continue
        before = template.render(messages[:i], add_generation_prompt=True, at=where)
        through = template.render(messages[: i + 1], at=where)
        if not (text.startswith(through) and through.startswith(before)):
            raise ConfigError(
                f"{where}: the chat template ({template.where}) does not render the conversation as a growing text "
                f"(message {i}'s prompt is not a prefix of the conversation), so its answer cannot be located"
            )
        spans.append((len(before), len(through)))
    return text, spans


def encode_with_offsets(tokenizer, text: str) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of `text` and each token's start, in characters."""
    tok = getattr(tokenizer, "_tok", None)
    if tokenizer.name == "byte":
        data = text.encode("utf-8")
        char_at_byte = np.repeat(np.arange(len(text)), [len(c.encode("utf-8")) for c in text])
        return np.frombuffer(data, np.uint8).astype(np.int64), char_at_byte[: len(data)]
    if tok is not None and hasattr(tok, "encode") and hasattr(tok, "get_vocab_size"):  # tokenizers.Tokenizer
        enc = tok.encode(text, add_special_tokens=False)
        return np.asarray(enc.ids, np.int64), np.asarray([start for start, _ in enc.offsets], np.int64)
    out = tok(text, add_special_tokens=False, return_offsets_mapping=True)  # a transformers fast tokenizer
    return np.asarray(out["input_ids"], np.int64), np.asarray([s for s, _ in out["offset_mapping"]], np.int64)


def chat_example(messages, template: ChatTemplate, tokenizer, where: str) -> tuple[np.ndarray, np.ndarray]:
    """(ids, weights) of one conversation: weight 1 on the tokens that start inside an assistant turn."""
    text, spans = answer_spans(list(messages), template, where)
    ids, starts = encode_with_offsets(tokenizer, text)
    weights = np.zeros(len(ids), np.uint8)
    for lo, hi in spans:
        weights[(starts >= lo) & (starts < hi)] = 1
    return ids, weights


def prompt_example(prompt: str, completion: str, tokenizer) -> tuple[np.ndarray, np.ndarray]:
    p, c = (np.asarray(x, np.int64) for x in tokenizer.encode_batch([prompt or "", completion or ""]))
    ids = np.concatenate([p, c, [tokenizer.eod_id]])
    return ids, np.concatenate([np.zeros(len(p), np.uint8), np.ones(len(c) + 1, np.uint8)])


@dataclass
class Examples:
    """Packed windows of examples: tokens and weights (n x seq_len+1), and what packing did."""

    tokens: np.ndarray
    weights: np.ndarray
    n_examples: int
    truncated: int
    dropped: int
    answer_tokens: int

    def batch(self, idx: np.ndarray) -> dict[str, np.ndarray]:
        """Windows `idx` (-1: a zero-weight padding row) as inputs, next-token targets and the targets' weights."""
        valid = idx >= 0
        rows = np.where(valid, idx, 0)
        t = self.tokens[rows].astype(np.int32)
        w = self.weights[rows, 1:].astype(np.float32) * valid[:, None]
        return {"inputs": t[:, :-1], "targets": t[:, 1:], "weights": w}

    def describe(self) -> str:
        cut = f"{self.truncated} truncated, {self.dropped} dropped (longer than a window, data.overlong)"
        return f"{self.n_examples:,} examples in {len(self.tokens):,} windows ({cut}), {self.answer_tokens:,} answer tokens"


def pack(examples: list[tuple[np.ndarray, np.ndarray]], seq_len: int, eod_id: int, overlong: str) -> Examples:
    """Whole examples, in order, each after an end-of-document token, into windows of seq_len + 1 tokens."""
    size = seq_len + 1
    tokens, weights, row_t, row_w = [], [], [], []
    truncated = dropped = kept = 0

    def close():
        pad = size - sum(len(x) for x in row_t)
        tokens.append(np.concatenate([*row_t, np.full(pad, eod_id, np.int64)]))
        weights.append(np.concatenate([*row_w, np.zeros(pad, np.uint8)]))
        row_t.clear()
        row_w.clear()

    for ids, w in examples:
        ids, w = np.concatenate([[eod_id], ids]), np.concatenate([[0], w]).astype(np.uint8)
        if len(ids) > size:
            if overlong == "drop":
                dropped += 1
                continue
            ids, w, truncated = ids[:size], w[:size], truncated + 1
        if sum(len(x) for x in row_t) + len(ids) > size:
            close()
        row_t.append(ids)
        row_w.append(w)
        kept += 1
    if row_t:
        close()
    dtype = np.uint16 if eod_id < 1 << 16 and all(t.max() < 1 << 16 for t in tokens) else np.uint32
    t = np.stack(tokens).astype(dtype) if tokens else np.zeros((0, size), dtype)
    w = np.stack(weights) if weights else np.zeros((0, size), np.uint8)
    return Examples(t, w, kept, truncated, dropped, int(w[:, 1:].sum()))


def _examples(ds, tokenizer, cfg: DataConfig, template: ChatTemplate | None, where: str) -> list:
    out, empty = [], []
    for i, row in enumerate(ds):
        at = f"data.source={cfg.source}{where}, example {i}"
        if cfg.format == "chat":
            if not isinstance(messages := row["messages"], list):
                raise ConfigError(f"{at}: messages is {messages!r:.80}, not a list of {{role, content}} mappings")
            out.append(chat_example(messages, template, tokenizer, at))
            if not any(isinstance(m, dict) and m.get("role") == "assistant" for m in messages):
                empty.append(i)
            continue
        for key in ("prompt", "completion"):
            if not isinstance(row[key], str) and not (key == "prompt" and row[key] is None):  # no prompt: ""
                raise ConfigError(
                    f"{at}: {key} is {row[key]!r:.80}, not text"
                    + (" (an example without an answer would train only the end-of-document token: give it one "
                       "or drop the example)" if key == "completion" and row[key] is None else "")
                )  # fmt: skip
        if not row["completion"].strip():
            empty.append(i)
        out.append(prompt_example(row["prompt"], row["completion"], tokenizer))
    chat = cfg.format == "chat"
    if empty and len(empty) == len(out):
        what = "no conversation has an assistant turn (role 'assistant')" if chat else "every completion is empty"
        raise ConfigError(f"data.source={cfg.source}{where}: {what}, so there is no answer to learn")
    if empty:
        what, trains = (("conversations have no assistant turn", "nothing") if chat else
                        ("examples have an empty completion", "only the end-of-document token"))  # fmt: skip
        log.warning(f"data.source={cfg.source}{where}: {len(empty)} of {len(out)} {what} (examples "
                    f"{', '.join(map(str, empty[:5]))}{', ...' if len(empty) > 5 else ''}): each trains "
                    f"{trains}")  # fmt: skip
    return out


def load_examples(corpus, tokenizer, cfg: DataConfig, seed: int) -> tuple[Examples, Examples]:
    """Training and validation windows (validation: whole examples held out, chosen by the seed, until
    data.val_tokens; or the validation split), cached like the token streams."""
    template = ChatTemplate.load(cfg) if cfg.format == "chat" else None
    val_print = corpus.val._fingerprint if corpus.val is not None else None
    key = json.dumps([FORMAT_VERSION, corpus.train._fingerprint, val_print, tokenizer.name, cfg.format,
                      template.digest if template else None, cfg.seq_len, cfg.overlong, cfg.val_tokens, seed])  # fmt: skip
    cache = cache_root(cfg) / f"examples-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    cache.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache) + ".lock"):
        if not (cache / "meta.json").exists():
            _build(cache, corpus, tokenizer, cfg, seed, template)
    meta = json.loads((cache / "meta.json").read_text())
    parts = []
    for name in ("train", "val"):
        t, w = (np.load(cache / f"{name}_{k}.npy", mmap_mode="r") for k in ("tokens", "weights"))
        parts.append(Examples(t, w, **meta[name]))
    return parts[0], parts[1]


def _build(cache: Path, corpus, tokenizer, cfg: DataConfig, seed: int, template) -> None:
    train = _examples(corpus.train, tokenizer, cfg, template, "")
    if corpus.val is not None:
        val = _examples(corpus.val, tokenizer, cfg, template, " (validation split)")
    else:  # whole examples held out, in a seeded order, until data.val_tokens
        order = np.random.default_rng([seed, 1]).permutation(len(train))
        held, n = set(), 0
        for i in order:
            if n >= cfg.val_tokens:
                break
            held.add(int(i))
            n += len(train[i][0]) + 1
        if len(held) >= len(train):
            raise ConfigError(
                f"data.source={cfg.source}: holding out data.val_tokens={cfg.val_tokens:,} would leave no training "
                f"examples ({len(train)} in all); lower data.val_tokens or set it to 0"
            )
        val = [train[i] for i in sorted(held)]
        train = [e for i, e in enumerate(train) if i not in held]
    packed = {name: pack(examples, cfg.seq_len, tokenizer.eod_id, cfg.overlong)
              for name, examples in (("train", train), ("val", val))}  # fmt: skip
    tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        meta = {}
        for name, ex in packed.items():
            np.save(tmp / f"{name}_tokens.npy", ex.tokens)
            np.save(tmp / f"{name}_weights.npy", ex.weights)
            meta[name] = {k: getattr(ex, k) for k in ("n_examples", "truncated", "dropped", "answer_tokens")}
        (tmp / "meta.json").write_text(json.dumps(meta))
        tmp.rename(cache)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class ExampleBatches(Windows):
    """The training batches of packed examples: global batch `step` is a pure function of (seed, step), every
    window once per epoch (dataset.GlobalOrder), as for text; `eval_batches` every validation window once."""

    def __init__(self, train: Examples, val: Examples, batch_size: int, seed: int):
        self.examples, self.val, self.batch_size = train, val, batch_size
        self.n = len(train.tokens)
        self.order = GlobalOrder(self.n, batch_size, seed)

    def batch(self, step: int, rows: slice = slice(None)) -> dict[str, np.ndarray]:
        return self.examples.batch(self.order.indices(step)[rows])

    def local_batch(self, step: int, rows: slice) -> dict[str, np.ndarray]:
        return self.batch(step, rows)

    def epoch(self, step: int) -> float:
        return self.order.epoch(step)

    def eval_batches(self, rows: slice):
        n = len(self.val.tokens)
        for start in range(0, n, self.batch_size):
            idx = np.arange(start, start + self.batch_size)
            yield self.val.batch(np.where(idx < n, idx, -1)[rows])

    def eval_sets(self, data) -> list:
        return [("", self.eval_batches(data.rows))]

    def describe(self) -> str:
        return f"train {self.examples.describe()} | val {self.val.describe()}"

    def fingerprint(self, data) -> dict[str, dict]:
        """The packed windows and their answer weights, training and validation, whole."""
        t, v = self.examples, self.val
        return {"": {"windows": len(t.tokens), "val_windows": len(v.tokens),
                     "sha256": digest(t.tokens, t.weights, v.tokens, v.weights)}}  # fmt: skip

    def banner(self, data) -> str:
        return f"{self.describe()} | {data.describe_tokenizer()}"


def load_windows(corpus, tokenizer, cfg: DataConfig, batch_size: int, seed: int, rows: slice, rank: int, world: int):
    """data.format=chat or prompt: examples packed whole into windows, the loss on their answers; their validation
    examples are theirs (the returned validation tokens are empty)."""
    train_ex, val_ex = load_examples(corpus, tokenizer, cfg, seed)
    if len(train_ex.tokens) < batch_size:
        raise ConfigError(
            f"data.source={cfg.source}: {train_ex.describe()}, fewer windows than one global batch "
            f"(train.batch_size={batch_size}); use more data, a longer data.seq_len or a smaller batch"
        )
    if train_ex.answer_tokens == 0:
        raise ConfigError(
            f"data.source={cfg.source}: no training example keeps a token of its answer ({train_ex.describe()}): "
            f"they are longer than data.seq_len={cfg.seq_len} and their answers come last; raise data.seq_len "
            f"(and model.max_seq_len)"
        )
    if train_ex.truncated or train_ex.dropped:
        log.warning(f"data.overlong={cfg.overlong}: {train_ex.describe()}")
    if cfg.val_tokens > 0 and not len(val_ex.tokens):
        raise ConfigError(f"data.source={cfg.source}: no validation examples; raise data.val_tokens or set it to 0")
    empty = Tokens(np.zeros(0, np.uint16), np.zeros(0, np.uint16), train_ex.n_examples, 0)
    return ExampleBatches(train_ex, val_ex, batch_size, seed), empty


formats.attach("chat", load_windows)
formats.attach("prompt", load_windows)
