"""Chat templates as transformers saves and renders them, and which tokens of a conversation are its answers.

Where a template is read from (ChatTemplate.load): data.chat_template (a .jinja file, a chat_template.json, a
tokenizer_config.json or a tokenizer directory), else data.tokenizer's directory, as transformers 4.4x and 5.x save
one: chat_template.jinja, then chat_template.json, then tokenizer_config.json's `chat_template` (a string, or a list
of named templates whose "default" is taken); data.chat_template_name picks a named one (also
additional_chat_templates/NAME.jinja). The tokenizer's special tokens (bos_token, eos_token, ...) are given to every
template, wherever it was read from, and data.chat_template_kwargs after them (as transformers' apply_chat_template
passes its **kwargs: they override a special token of the same name).

The answer (answer_spans): a template with `{% generation %}` markers says it, as transformers' assistant mask
reads them. Without markers, each assistant turn is the text rendering messages[:i+1] adds beyond the prompt that
messages[:i] renders with the generation prompt, up to its last non-space character and without what the template
writes only where a conversation ends (Phi-3's eos_token: the turn is what stays when the conversation goes on):
the end-of-turn token is trained, the newline ChatML, Gemma and Phi-3 write after it is not (it belongs to no
turn). A token is an answer
token when any character of it is (chat_weights): a token that straddles the prompt's end (" Hello" after
"ASSISTANT:") carries answer text and is trained, as transformers' char_to_token rule trains it.

The messages (conversation): a template is given each message without its null keys (datasets gives every message
every key any message has; transformers drops them too). Content given as OpenAI-style parts (`[{type: text, text:
...}, ...]`) is passed through as transformers passes it to a template that renders a text part as it renders the
same text given as a string (ChatTemplate.takes_parts); any other template would print the list as Python writes
it, so it is given the parts' texts joined by newlines (as vLLM joins them for such templates). A part that is not
text (an image, audio) is refused: jdp trains on text. A role that is a near miss of a known one (`asistant`,
`User`) is refused with the role it meant; an assistant turn with nothing to answer (null or blank content, no tool
calls) is refused, since it would train the end-of-turn token alone.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np

from jdp.config import ConfigError, DataConfig

__all__ = ["ROLES", "SPECIAL_TOKENS", "ChatTemplate", "answer_spans", "chat_example", "chat_weights", "conversation",
           "encode_with_offsets", "role_counts", "roles_note"]  # fmt: skip

# What transformers hands every template besides the conversation (its special_tokens_map)
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
_MARKED = re.compile(r"\{%-?\s*generation\s*-?%\}")


class _TemplateRefused(Exception):
    """raise_exception(message) in a chat template: the template's own refusal of a conversation."""


def _generation_extension():
    """The `{% generation %}...{% endgeneration %}` tag transformers' templates mark answers with: the text is
    rendered as is, and its place in the output recorded while `spans` is a list (ChatTemplate.render_marked)."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            self.blocks: list[str] | None = None  # what the template has yielded so far
            self.spans: list[tuple[int, int]] | None = None

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            text = caller()
            if self.spans is not None:
                start = sum(map(len, self.blocks))
                self.spans.append((start, start + len(text)))
            return text

    return Generation


class ChatTemplate:
    """A Jinja chat template, rendered as transformers renders it (a sandboxed environment with trim_blocks and
    lstrip_blocks, `raise_exception`, `tojson`, `strftime_now`, the `generation` tag; the special tokens set)."""

    def __init__(self, source: str, where: str, special: dict | None = None, kwargs: dict | None = None):
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise _TemplateRefused(message)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _generation_extension()]
        )
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=raise_exception, strftime_now=time.strftime)
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ConfigError(f"the chat template ({where}) is not valid Jinja: line {e.lineno}: {e.message}") from None
        self._generation = next(e for e in env.extensions.values() if getattr(e, "tags", None) == {"generation"})
        self.source, self.where, self.special = source, where, dict(special or {})
        self.variables = {**self.special, **(kwargs or {})}  # what it is given besides the conversation
        self.marked = bool(_MARKED.search(source))  # its answers are marked with {% generation %}
        self._takes_parts: bool | None = None
        key = [source, self.special] + ([kwargs] if kwargs else [])
        self.digest = hashlib.sha256(json.dumps(key, default=str).encode()).hexdigest()[:16]

    def takes_parts(self) -> bool:
        """Whether it renders content given as text parts ([{type: text, text}]) as it renders the same string."""
        if self._takes_parts is None:
            probe = [("user", "Say hi"), ("assistant", "Hi")]
            try:
                as_str = self.render([{"role": r, "content": c} for r, c in probe])
                as_parts = self.render([{"role": r, "content": [{"type": "text", "text": c}]} for r, c in probe])
                self._takes_parts = as_str == as_parts
            except ConfigError:
                self._takes_parts = False
        return self._takes_parts

    def render(self, messages: list[dict], add_generation_prompt: bool = False, at: str = "a conversation",
               tools=None) -> str:  # fmt: skip
        """The template's text for `messages`; what it raises is one ConfigError naming the template and `at`."""
        return self._render(messages, add_generation_prompt, at, tools)[0]

    def render_marked(self, messages: list[dict], at: str = "a conversation", tools=None) -> tuple[str, list]:
        """The text and the character spans its `{% generation %}` blocks rendered (transformers' own rule)."""
        return self._render(messages, False, at, tools, track=True)

    def _render(self, messages, add_generation_prompt, at, tools, track=False) -> tuple[str, list]:
        g = self._generation
        g.blocks, g.spans = ([], []) if track else (None, None)
        try:
            blocks = g.blocks if track else []
            for block in self.template.generate(messages=messages, tools=tools,
                                                add_generation_prompt=add_generation_prompt, **self.variables):  # fmt: skip
                blocks.append(block)
            return "".join(blocks), list(g.spans or [])
        except _TemplateRefused as e:
            raise ConfigError(f"{at}: the chat template ({self.where}) refused it: {e}") from None
        except ConfigError:
            raise
        except Exception as e:  # an undefined attribute, a type error, the sandbox: the template's or the data's
            raise ConfigError(
                f"{at}: the chat template ({self.where}) failed on it: {type(e).__name__}: {e} (is the conversation "
                f"in the shape the template expects, {{role, content}} messages?)"
            ) from None
        finally:
            g.blocks = g.spans = None

    @classmethod
    def load(cls, cfg: DataConfig) -> ChatTemplate:
        """data.chat_template, else data.tokenizer's directory (see the module's docstring for the order)."""
        special, kwargs = special_tokens(cfg), template_kwargs(cfg)
        if looks_like_file(cfg.chat_template_name):
            raise ConfigError(
                f"data.chat_template_name={cfg.chat_template_name} is a file name: data.chat_template_name picks one "
                f"of a tokenizer's named templates (tool_use, rag, ...); give a template file as "
                f"data.chat_template={cfg.chat_template_name} (and leave data.chat_template_name unset)"
            )
        if cfg.chat_template:
            path = Path(cfg.chat_template).expanduser()
            if not path.exists():
                raise ConfigError(
                    f"data.chat_template={cfg.chat_template}: no such file; give a .jinja file, a chat_template.json "
                    f"or tokenizer_config.json that holds a template, or a tokenizer directory"
                )
        elif cfg.tokenizer == "byte":
            raise ConfigError(
                "data.format=chat needs a chat template: data.tokenizer=byte has none; set data.chat_template to a "
                ".jinja file or a tokenizer_config.json that holds one"
            )
        else:
            path = tokenizer_dir(cfg)
        source, where, own = _read_template(path, cfg.chat_template_name)
        return cls(source, where, {**special, **own}, kwargs)


# What jdp gives a template itself, and what apply_chat_template takes as its own arguments: not template variables
RESERVED = ("messages", "tools", "documents", "add_generation_prompt", "continue_final_message", "chat_template",
            "tokenize", "return_dict", "return_assistant_tokens_mask")  # fmt: skip


def template_kwargs(cfg: DataConfig) -> dict:
    """data.chat_template_kwargs: extra template variables (enable_thinking, ...), checked."""
    kwargs = getattr(cfg, "chat_template_kwargs", None) or {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) and k.isidentifier() for k in kwargs):
        raise ConfigError(
            f"data.chat_template_kwargs={kwargs!r:.80}: expected a mapping of template variable names to values, "
            f"e.g. data.chat_template_kwargs='{{enable_thinking: false}}'"
        )
    if taken := [k for k in kwargs if k in RESERVED]:
        raise ConfigError(
            f"data.chat_template_kwargs sets {', '.join(taken)}: jdp gives the template messages, tools (the data's "
            f"tools column) and add_generation_prompt itself; leave {', '.join(taken)} out"
        )
    return dict(kwargs)


def looks_like_file(name: str) -> bool:
    return bool(name) and (name.endswith((".jinja", ".json", ".j2")) or "/" in name or "\\" in name)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' tojson filter (its arguments, and no HTML escaping, unlike Jinja's own)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def tokenizer_dir(cfg: DataConfig) -> Path:
    """data.tokenizer's directory (the directory of a tokenizer.json)."""
    path = Path(cfg.tokenizer).expanduser()
    return path.parent if path.is_file() else path


def _token_text(token) -> str:
    return token.get("content", "") if isinstance(token, dict) else (token or "")


def _specials_of(config: dict) -> dict:
    return {k: _token_text(config[k]) for k in SPECIAL_TOKENS if config.get(k) is not None}


def special_tokens(cfg: DataConfig) -> dict:
    """The special tokens of data.tokenizer (tokenizer_config.json, else special_tokens_map.json), by name."""
    if cfg.tokenizer == "byte":
        return {}
    d, out = tokenizer_dir(cfg), {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the second wins, as transformers reads them
        try:
            out.update(_specials_of(json.loads((d / name).read_text())))
        except (OSError, ValueError, AttributeError):
            continue
    return out


def _read_template(path: Path, name: str) -> tuple[str, str, dict]:
    """(template source, where it was read, the special tokens of the file it was read from)."""
    if path.is_dir():
        candidates = [path / "chat_template.jinja", path / "chat_template.json", path / "tokenizer_config.json"]
        if name and (named := path / "additional_chat_templates" / f"{name}.jinja").is_file():
            return named.read_text(encoding="utf-8"), str(named), {}
        found = [p for p in candidates if p.is_file()]
        for p in found:
            got = _template_of(p, name)
            if got is not None:
                return got
        tried = ", ".join(p.name for p in candidates) + (f", additional_chat_templates/{name}.jinja" if name else "")
        what = f"no chat template named {name!r}" if name else "no chat template"
        raise ConfigError(
            f"{path} has {what} (looked in {tried}); set data.chat_template to a .jinja file"
            + (f" or data.chat_template_name to one it has ({_names(found)})" if name and _names(found) else "")
        )
    got = _template_of(path, name)
    if got is None:
        what = f"no chat template named {name!r}" if name else "no chat_template"
        raise ConfigError(f"{path} has {what}; set data.chat_template to a .jinja file" +
                          (f" (it has {_names([path])})" if name and _names([path]) else ""))  # fmt: skip
    return got


def _template_of(path: Path, name: str) -> tuple[str, str, dict] | None:
    if path.suffix != ".json":
        return (path.read_text(encoding="utf-8"), str(path), {}) if not name else None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    template = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(template, list):  # several named templates: the default one, or data.chat_template_name's
        template = next((t.get("template") for t in template if t.get("name") == (name or "default")), None)
    elif name:
        return None
    return (template, str(path), _specials_of(config)) if isinstance(template, str) else None


def _names(paths) -> str:
    names = []
    for p in paths:
        try:
            template = json.loads(p.read_text(encoding="utf-8")).get("chat_template") if p.suffix == ".json" else None
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(template, list):
            names += [str(t.get("name")) for t in template]
    return ", ".join(names)


# The messages a template is given (the module's docstring says what is checked)

ROLES = ("system", "user", "assistant", "tool", "developer", "function", "ipython")  # what templates test for
ALIASES = {"human": "user", "gpt": "assistant", "bot": "assistant", "model": "assistant", "ai": "assistant"}
ANSWERED_BY = ("tool_calls", "reasoning_content", "thinking", "reasoning")  # an answer besides its content


def near_role(role: str) -> str | None:
    """The known role a mistyped one meant (`asistant`, `User`, `users`), or None."""
    low = role.strip().lower()
    if low in ROLES:
        return low
    close = difflib.get_close_matches(low, ROLES, n=1, cutoff=0.8)
    return close[0] if close else None


def _plain(value):
    """A message (or content part) as its author wrote it: without the keys datasets filled with None."""
    return {k: v for k, v in value.items() if v is not None} if isinstance(value, dict) else value


def _parts(parts: list, at: str, as_text: Callable[[], bool]):
    """Text parts as the template takes them (the list, or their texts joined); anything else refused."""
    parts = [_plain(p) for p in parts]
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            what = f"of type {kind!r}" if kind else f"{part!r:.60} (no 'type')"
            raise ConfigError(
                f"{at}'s content part {j} is {what}: jdp trains language models on text, so only {{type: text, "
                f"text: ...}} parts are read; drop that part (or the example), or give its text as a text part"
            )
        if not isinstance(part.get("text"), str):
            raise ConfigError(f"{at}'s content part {j} (type 'text') has text {part.get('text')!r:.60}, not a string")
    return parts if as_text() else "\n".join(p["text"] for p in parts)


def _text_of(content) -> str:
    if isinstance(content, list):
        return "".join(p["text"] for p in content)
    return content if isinstance(content, str) else ""


def _check_answer(message: dict, at: str) -> None:
    """An assistant turn must answer something: non-blank content, or tool calls (or reasoning)."""
    if _text_of(message.get("content")).strip() or any(message.get(k) for k in ANSWERED_BY):
        return
    if message.get("content") is not None and not isinstance(message.get("content"), (str, list)):
        return  # not text: the template says what it makes of it
    has = "no content (null or missing)" if "content" not in message else f"content {message['content']!r:.20}"
    raise ConfigError(
        f"{at} (role 'assistant') has {has} and no tool_calls: it would train only the end-of-turn token; give the "
        f"turn its answer, or drop the turn (a conversation may end with a user's turn) or the example"
    )


def conversation(messages: list, where: str, takes_parts: Callable[[], bool]) -> list[dict]:
    """The messages a template is given (the module's docstring says what is checked); `where` names the example
    in errors, `takes_parts()` says whether the template renders content parts itself (asked only if some are)."""
    out = []
    for i, message in enumerate(messages):
        message = _plain(message)
        at = f"{where}: message {i}"
        if not isinstance(message, dict) or "role" not in message:
            raise ConfigError(f"{at} is {message!r:.80}, not a {{role, content}} mapping")
        role = message["role"]
        if not isinstance(role, str):
            raise ConfigError(f"{at}'s role is {role!r:.40}, not text (the roles: {', '.join(ROLES)})")
        if role not in ROLES and (meant := near_role(role)):
            raise ConfigError(
                f"{at}'s role is {role!r}: did you mean {meant!r}? (roles are compared exactly: the templates' "
                f"roles are {', '.join(map(repr, ROLES))}, and the answers are the turns of role 'assistant')"
            )
        if isinstance(message.get("content"), list):
            message = {**message, "content": _parts(message["content"], at, takes_parts)}
        if role == "assistant":
            _check_answer(message, at)
        out.append(message)
    return out


def role_counts(messages) -> Counter:
    """How many messages of each role a conversation has (a message without a role counts as None)."""
    if not isinstance(messages, list):
        return Counter()
    return Counter(m.get("role") if isinstance(m, dict) else None for m in messages)


def roles_note(seen: Counter) -> str:
    """The roles seen, the one answers have, and what to rename (ShareGPT's human/gpt, ...)."""
    listed = ", ".join(f"{r!r} ({n:,})" for r, n in seen.most_common(8)) or "none"
    rename = {r: ALIASES[r.lower()] for r in seen if isinstance(r, str) and r.lower() in ALIASES}
    hint = "; rename " + ", ".join(f"{r!r} to {to!r}" for r, to in rename.items()) if rename else ""
    return f"the roles seen are {listed}; the answers are the turns of role 'assistant'{hint}"


def answer_spans(messages: list[dict], template: ChatTemplate, where: str, tools=None) -> tuple[str, list]:
    """The rendered conversation and the character spans of its answers (the module's docstring says which)."""
    messages = conversation(messages, where, template.takes_parts)
    if template.marked:
        return template.render_marked(messages, at=where, tools=tools)
    text, spans = template.render(messages, at=where, tools=tools), []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = template.render(messages[:i], add_generation_prompt=True, at=where, tools=tools)
        through = template.render(messages[: i + 1], at=where, tools=tools)
        if not (text.startswith(before) and through.startswith(before)):
            raise ConfigError(
                f"{where}: the chat template ({template.where}) does not render the conversation as a growing text "
                f"(message {i}'s prompt is not a prefix of the conversation), so its answer cannot be located; "
                f"mark the answers in the template with {{% generation %}} ... {{% endgeneration %}}"
            )
        # The turn is what stays when the conversation goes on (after the last message: with a user's turn), so
        # what a template writes only at the very end of a conversation (Phi-3's eos_token) belongs to no turn.
        going_on = text if i + 1 < len(messages) else _continued(template, messages, where, tools)
        turn = through.rstrip()
        eos = template.special.get("eos_token")
        if going_on is not None and not going_on.startswith(turn) and eos and turn.endswith(eos):
            turn = turn[: -len(eos)].rstrip()
        if going_on is not None and not going_on.startswith(turn):
            raise ConfigError(
                f"{where}: the chat template ({template.where}) renders message {i} differently when the "
                f"conversation goes on, so where its answer ends cannot be told; mark the answers in the template "
                f"with {{% generation %}} ... {{% endgeneration %}}"
            )
        spans.append((len(before), max(len(before), len(turn))))
    return text, spans


_PROBE = {"role": "user", "content": "And then?"}


def _continued(template: ChatTemplate, messages: list[dict], where: str, tools) -> str | None:
    """The conversation with one more user turn, or None if the template will not render one there."""
    try:
        return template.render([*messages, _PROBE], at=where, tools=tools)
    except ConfigError:
        return None


def encode_with_offsets(tokenizer, text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Token ids of `text` and each token's first and past-the-last character."""
    tok = getattr(tokenizer, "_tok", None)
    if tokenizer.name == "byte":
        data = text.encode("utf-8")
        char_at_byte = np.repeat(np.arange(len(text)), [len(c.encode("utf-8")) for c in text])[: len(data)]
        return np.frombuffer(data, np.uint8).astype(np.int64), char_at_byte, char_at_byte + 1
    if tok is not None and hasattr(tok, "encode") and hasattr(tok, "get_vocab_size"):  # tokenizers.Tokenizer
        enc = tok.encode(text, add_special_tokens=False)
        offsets = np.asarray(enc.offsets, np.int64).reshape(-1, 2)
        return np.asarray(enc.ids, np.int64), offsets[:, 0], offsets[:, 1]
    out = tok(text, add_special_tokens=False, return_offsets_mapping=True)  # a transformers fast tokenizer
    offsets = np.asarray(out["offset_mapping"], np.int64).reshape(-1, 2)
    return np.asarray(out["input_ids"], np.int64), offsets[:, 0], offsets[:, 1]


def chat_weights(starts: np.ndarray, ends: np.ndarray, spans) -> np.ndarray:
    """1 on each token with a character inside an answer span, 0 elsewhere."""
    weights = np.zeros(len(starts), np.uint8)
    for lo, hi in spans:
        if hi > lo:
            weights[(starts < hi) & (np.maximum(ends, starts + 1) > lo)] = 1
    return weights


def chat_example(messages, template: ChatTemplate, tokenizer, where: str, tools=None) -> tuple[np.ndarray, np.ndarray]:
    """(ids, weights) of one conversation: the whole rendered text's tokens, weight 1 on its answers'."""
    text, spans = answer_spans(list(messages), template, where, tools)
    ids, starts, ends = encode_with_offsets(tokenizer, text)
    return ids, chat_weights(starts, ends, spans)
