"""jdp's answer weights against transformers' own assistant masks, token by token (issue 43).

Each template below is a model card's published chat template (shortened where it only adds options these
conversations do not use), written here with `{% generation %}` markers around what its assistant turn trains on:
the answer and its end-of-turn token. transformers' `apply_chat_template(..., return_assistant_tokens_mask=True)` on
the marked template is the reference; jdp must give the same tokens and the same weights from the marked template
(transformers' rule) and from the same template without markers (jdp's rule for the templates models ship). The
tokenizer is a byte-level BPE trained here on the rendered conversations, its chat markers atomic, as real ones
are: tokens then straddle the prompt's end (Vicuna's "ASSISTANT: " + " Hello") as they do in practice.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from jdp.config import ConfigError, DataConfig
from jdp.data.chat import ChatTemplate, chat_example
from jdp.data.tokens import HFTokenizer

transformers = pytest.importorskip("transformers", reason="the comparison needs transformers (CI installs it)")

G, EG = "{% generation %}", "{% endgeneration %}"
ALTERNATE = ("{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
             "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}")  # fmt: skip

TEMPLATES = {
    # Qwen2.5-Instruct (ChatML with its default system prompt; tool calls below, in "chatml-tools")
    "chatml": (
        "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + "
        "'<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a "
        "helpful assistant.<|im_end|>\\n' }}{%- endif %}{%- for message in messages %}{%- if message.role == 'user' "
        "or (message.role == 'system' and not loop.first) %}{{- '<|im_start|>' + message.role + '\\n' + "
        "message.content + '<|im_end|>' + '\\n' }}{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + "
        "message.role + '\\n' }}" + G + "{{- message.content + '<|im_end|>' }}" + EG + "{{- '\\n' }}{%- endif %}"
        "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    ),
    # Llama-3.x-Instruct (without its tool and date preamble)
    "llama-3": (
        "{{- bos_token }}{%- for message in messages %}{%- if message['role'] == 'assistant' %}"
        "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}" + G + "{{- message['content'] | trim + "
        "'<|eot_id|>' }}" + EG + "{%- else %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' "
        "+ message['content'] | trim + '<|eot_id|>' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}"
        "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
    ),
    # Llama-2-chat: [INST], the system prompt inside the first user turn
    "llama-2": (
        "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = "
        "messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}"
        "{% endif %}{% for message in loop_messages %}" + ALTERNATE + "{% if loop.index0 == 0 and system_message "
        "!= false %}{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
        "{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}"
        "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}" + G +
        "{{ ' ' + content.strip() + ' ' + eos_token }}" + EG + "{% endif %}{% endfor %}"
    ),
    # Mistral-7B-Instruct-v0.1: no system role
    "mistral": (
        "{{ bos_token }}{% for message in messages %}" + ALTERNATE + "{% if message['role'] == 'user' %}"
        "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}" + G +
        "{{ message['content'] + eos_token }}" + EG + "{% else %}{{ raise_exception('Only user and assistant "
        "roles are supported!') }}{% endif %}{% endfor %}"
    ),
    # Gemma-it: the assistant is `model`, no system role
    "gemma": (
        "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}{% for message in messages %}" + ALTERNATE + "{% if (message['role'] == 'assistant') %}"
        "{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + "
        "'\\n' }}{% if role == 'model' %}" + G + "{{ message['content'] | trim + '<end_of_turn>' }}" + EG +
        "{{ '\\n' }}{% else %}{{ message['content'] | trim + '<end_of_turn>\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
    ),
    # Phi-3-mini-instruct: an eos_token only where the conversation ends
    "phi-3": (
        "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\\n' + message['content'] + "
        "'<|end|>\\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\\n' + message['content'] + '<|end|>\\n'}}"
        "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\\n'}}" + G + "{{message['content'] + '<|end|>'}}"
        + EG + "{{'\\n'}}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}"
        "{{ eos_token }}{% endif %}"
    ),
    # SmolLM2-Instruct: ChatML with a default system prompt of its own
    "smollm2": (
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system"
        "\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}{% endif %}"
        "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}" + G + "{{ message['content'] + "
        "'<|im_end|>' }}" + EG + "{{ '\\n' }}{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + "
        "message['content'] + '<|im_end|>' + '\\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
    # Vicuna v1.5: the generation prompt ends with a space, so the answer's first token starts inside the prompt
    "vicuna": (
        "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + ' ' }}{% set loop_messages = "
        "messages[1:] %}{% else %}{{ 'A chat between a curious user and an artificial intelligence assistant. ' }}"
        "{% set loop_messages = messages %}{% endif %}{% for message in loop_messages %}{% if message['role'] == "
        "'user' %}{{ 'USER: ' + message['content'] + ' ' }}{% elif message['role'] == 'assistant' %}"
        "{{ 'ASSISTANT: ' }}" + G + "{{ message['content'] + eos_token }}" + EG + "{{ ' ' }}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT: ' }}{% endif %}"
    ),
    # Qwen2.5's tool calling: the assistant's tool calls are its answer, a tool's result is not
    "chatml-tools": (
        "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0]['role'] == 'system' %}"
        "{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
        "{{- '\\n\\n# Tools\\n<tools>' }}{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
        "{{- '\\n</tools><|im_end|>\\n' }}{%- elif messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + "
        "messages[0]['content'] + '<|im_end|>\\n' }}{%- endif %}{%- for message in messages %}{%- if message.role "
        "== 'user' or (message.role == 'system' and not loop.first) %}{{- '<|im_start|>' + message.role + '\\n' + "
        "message.content + '<|im_end|>\\n' }}{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
        + G + "{%- if message.content %}{{- message.content }}{%- endif %}{%- for tool_call in message.tool_calls | "
        "default([]) %}{{- '<tool_call>\\n{\"name\": \"' + tool_call.function.name + '\", \"arguments\": ' + "
        "tool_call.function.arguments | tojson + '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>' }}" + EG +
        "{{- '\\n' }}{%- elif message.role == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' + "
        "message.content + '\\n</tool_response><|im_end|>\\n' }}{%- endif %}{%- endfor %}{%- if "
        "add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    ),
}
NO_SYSTEM = {"mistral", "gemma"}  # their templates refuse a system message
SPECIAL = ["<s>", "</s>", "<|endoftext|>", "<|begin_of_text|>", "<|im_start|>", "<|im_end|>", "<|start_header_id|>",
           "<|end_header_id|>", "<|eot_id|>", "<start_of_turn>", "<end_of_turn>", "<|system|>", "<|user|>",
           "<|assistant|>", "<|end|>", "<bos>", "<eos>", "<tool_call>", "</tool_call>"]  # fmt: skip
BOS_EOS = {"llama-3": ("<|begin_of_text|>", "<|eot_id|>"), "gemma": ("<bos>", "<eos>"),
           "phi-3": ("<s>", "<|endoftext|>")}  # fmt: skip


def conversations(with_system: bool) -> list[list[dict]]:
    """Conversations of one to three assistant turns, with answers that start with a word, a space, a newline or
    punctuation, and end with spaces or a newline (which `trim` templates drop and others keep)."""
    rng = np.random.default_rng(7)
    words = ["amber", "basil", "cedar", "delta", "ember", "fjord", "gamma", "hazel", "inlet", "juniper", "kelp"]
    answers = ["{w} and {v}.", " {w}, then {v}", "\n{w}\n{v}", "Sure: {w} {v}  ", "({w}) {v}\n", "{w}!"]
    out = []
    for n in range(24):
        messages = [{"role": "system", "content": f"Be brief about {words[n % len(words)]}."}] if with_system and n % 3 == 0 else []
        for turn in range(1 + n % 3):
            w, v = (words[k] for k in rng.integers(len(words), size=2))
            messages.append({"role": "user", "content": f"Tell me about {w} {'and ' + v if turn else ''}".strip()})
            messages.append({"role": "assistant", "content": answers[(n + turn) % len(answers)].format(w=w, v=v)})
        if n % 4 == 3:  # a conversation that ends with the user's question, unanswered
            messages.append({"role": "user", "content": "Anything else?"})
        out.append(messages)
    return out


TOOLS = [{"type": "function", "function": {"name": "weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip


def tool_conversations() -> list[list[dict]]:
    out = []
    for city in ("Oslo", "Lima", "Pune"):
        out.append([
            {"role": "user", "content": f"Weather in {city}?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "weather", "arguments": {"city": city}}}]},
            {"role": "tool", "content": f'{{"city": "{city}", "sky": "clear"}}'},
            {"role": "assistant", "content": f"It is clear in {city}."},
        ])  # fmt: skip
    return out


def tokenizer_dir(tmp_path, texts, bos, eos):
    """A byte-level BPE trained on `texts`, its chat markers atomic, saved as transformers and jdp read it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIAL,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))  # fmt: skip
    d = tmp_path / "tokenizer"
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": bos, "eos_token": eos}))
    return d


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_answer_weights_are_transformers_assistant_masks_token_for_token(tmp_path, name):
    marked = TEMPLATES[name]
    plain = marked.replace(G, "").replace(EG, "")
    bos, eos = BOS_EOS.get(name, ("<s>", "</s>"))
    tools = TOOLS if name == "chatml-tools" else None
    convs = tool_conversations() if tools else conversations(with_system=name not in NO_SYSTEM)
    texts = [ChatTemplate(plain, name, {"bos_token": bos, "eos_token": eos}).render(c, tools=tools) for c in convs]
    d = tokenizer_dir(tmp_path, texts, bos, eos)
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"), bos_token=bos,
                                                  eos_token=eos)  # fmt: skip
    ours = HFTokenizer(str(d))
    files = {}
    for kind, source in (("marked", marked), ("plain", plain)):
        files[kind] = tmp_path / f"{kind}.jinja"
        files[kind].write_text(source)
    templates = {k: ChatTemplate.load(DataConfig(tokenizer=str(d), chat_template=str(f))) for k, f in files.items()}
    assert templates["marked"].marked and not templates["plain"].marked
    answer_tokens, disagree = 0, {"marked": 0, "plain": 0}
    for conv in convs:
        ref = theirs.apply_chat_template(conv, tools=tools, chat_template=marked, tokenize=True, return_dict=True,
                                         return_assistant_tokens_mask=True)  # fmt: skip
        want_ids, want = np.asarray(ref["input_ids"]), np.asarray(ref["assistant_masks"])
        answer_tokens += int(want.sum())
        for kind, template in templates.items():
            ids, weights = chat_example(conv, template, ours, "test", tools)
            assert ids.tolist() == want_ids.tolist(), (kind, conv)  # the same text, the same tokens
            disagree[kind] += int((weights != want).sum())
    print(f"{name}: {answer_tokens} answer tokens in {len(convs)} conversations; disagreeing tokens {disagree}")
    assert answer_tokens > 0 and disagree == {"marked": 0, "plain": 0}, disagree


def test_the_rule_trains_the_straddling_token_and_not_the_text_after_the_end_of_turn(tmp_path):
    """The three disagreements issue 43 found, stated on the text: Vicuna's first answer token (" amber", which
    starts in the prompt's trailing space) is trained; ChatML's newline after <|im_end|> is not; Phi-3's eos_token
    at the end of the conversation is not."""
    conv = [{"role": "user", "content": "Tell me"}, {"role": "assistant", "content": "amber and basil."}]
    for name, first, last in (("vicuna", " amber", "</s>"), ("chatml", "amber", "<|im_end|>"),
                              ("phi-3", "amber", "<|end|>")):  # fmt: skip
        plain = TEMPLATES[name].replace(G, "").replace(EG, "")
        bos, eos = BOS_EOS.get(name, ("<s>", "</s>"))
        d = tokenizer_dir(tmp_path / name, [ChatTemplate(plain, name, {"eos_token": eos}).render(conv)] * 50, bos, eos)
        template = ChatTemplate.load(DataConfig(tokenizer=str(d), chat_template=str(_write(tmp_path / f"{name}.jinja", plain))))
        tok = HFTokenizer(str(d))
        ids, weights = chat_example(conv, template, tok, "test")
        trained = [tok._tok.id_to_token(int(i)) for i, w in zip(ids, weights, strict=True) if w]  # Ġ: a space
        assert trained[0].startswith(first.replace(" ", "Ġ")) and trained[-1] == last, (name, trained)
        assert len(ids) > len(trained) + 2  # the prompt's tokens are not trained


def _write(path, text):
    path.write_text(text)
    return path


def test_a_transformers_5_tokenizer_directory_is_enough_and_named_templates_are_chosen(tmp_path):
    """save_pretrained in transformers 5 writes chat_template.jinja (and additional_chat_templates/NAME.jinja);
    jdp read only tokenizer_config.json, so `data.tokenizer=DIR` alone failed with "has no chat_template". The
    special tokens come from tokenizer_config.json whichever file holds the template; data.chat_template_name picks
    a named one."""
    conv = conversations(with_system=False)[:4]
    plain = TEMPLATES["llama-3"].replace(G, "").replace(EG, "")
    d = tokenizer_dir(tmp_path, [ChatTemplate(plain, "x", {"bos_token": "<|begin_of_text|>"}).render(c) for c in conv],
                      "<|begin_of_text|>", "<|eot_id|>")  # fmt: skip
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"), bos_token="<|begin_of_text|>",
                                                  eos_token="<|eot_id|>")  # fmt: skip
    theirs.chat_template = {"default": plain, "tool_use": TEMPLATES["chatml"].replace(G, "").replace(EG, "")}
    saved = tmp_path / "saved"
    theirs.save_pretrained(saved)
    written = sorted(p.relative_to(saved).as_posix() for p in saved.rglob("*") if p.is_file())
    template = ChatTemplate.load(DataConfig(tokenizer=str(saved)))
    assert template.special.get("bos_token") == "<|begin_of_text|>"
    for c in conv:
        assert template.render(c) == theirs.apply_chat_template(c, tokenize=False), written
    named = ChatTemplate.load(DataConfig(tokenizer=str(saved), chat_template_name="tool_use"))
    assert named.render(conv[0]) == theirs.apply_chat_template(conv[0], tokenize=False, chat_template="tool_use")
    with pytest.raises(ConfigError, match=r"no chat template named 'rag'"):
        ChatTemplate.load(DataConfig(tokenizer=str(saved), chat_template_name="rag"))
    assert re.search(r"chat_template", " ".join(written)), written


# A Qwen3-like template (shortened: its thinking switch, ChatML turns), marked: enable_thinking=false writes an empty
# think block after each assistant header, as Qwen3's generation prompt does.
QWEN3_LIKE = (
    "{%- for message in messages %}{%- if message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    + G + "{{- message.content + '<|im_end|>' }}" + EG + "{{- '\\n' }}{%- else %}{{- '<|im_start|>' + message.role + "
    "'\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)


def test_chat_template_kwargs_reach_the_template_as_transformers_passes_them(tmp_path):
    """Issue 65, item 5: a template variable (Qwen3's enable_thinking) could not be passed. data.chat_template_kwargs
    is given to the template as apply_chat_template(**kwargs) gives it: the same tokens and assistant masks, with
    the variable and without it, from the marked template and from the plain one (jdp's rule)."""
    plain = QWEN3_LIKE.replace(G, "").replace(EG, "")
    convs = conversations(with_system=True)[:8]
    texts = [ChatTemplate(plain, "q", kwargs=kw).render(c) for c in convs for kw in ({}, {"enable_thinking": False})]
    d = tokenizer_dir(tmp_path, texts + ["<think>\n\n</think>\n\n"] * 20, "<s>", "</s>")
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"), bos_token="<s>", eos_token="</s>")
    ours = HFTokenizer(str(d))
    for kwargs in ({}, {"enable_thinking": False}):
        rendered = []
        for kind, source in (("marked", QWEN3_LIKE), ("plain", plain)):
            cfg = DataConfig(tokenizer=str(d), chat_template=str(_write(tmp_path / f"{kind}.jinja", source)),
                             chat_template_kwargs=kwargs)  # fmt: skip
            template = ChatTemplate.load(cfg)
            for conv in convs:
                ref = theirs.apply_chat_template(conv, chat_template=QWEN3_LIKE, tokenize=True, return_dict=True,
                                                 return_assistant_tokens_mask=True, **kwargs)  # fmt: skip
                ids, weights = chat_example(conv, template, ours, "test")
                assert ids.tolist() == list(ref["input_ids"]), (kind, kwargs)
                assert weights.tolist() == list(ref["assistant_masks"]), (kind, kwargs)
            rendered.append(template.render(convs[0]))
        assert ("<think>" in rendered[0]) == (kwargs == {"enable_thinking": False}) and rendered[0] == rendered[1]


def test_tojson_takes_transformers_arguments_and_content_parts_reach_a_template_that_reads_them(tmp_path):
    """Issue 65, items 5 and 3: `tojson(sort_keys=..., separators=...)` was refused (transformers' filter takes
    ensure_ascii, indent, separators, sort_keys); content parts are passed to a template that renders a text part
    as it renders a string, as transformers passes them: the same text as transformers'."""
    from tokenizers import Tokenizer, models

    from jdp.data.chat import conversation

    dumps = "{{ messages | tojson(sort_keys=True, separators=(',', ':')) }}|{{ tools | tojson(indent=2) }}"
    conv = [{"role": "user", "content": "hé", "name": "b"}]
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()))  # renders only
    want = theirs.apply_chat_template(conv, tools=TOOLS, chat_template=dumps, tokenize=False)
    assert ChatTemplate(dumps, "t").render(conv, tools=TOOLS) == want and '"content":"hé"' in want
    reads_parts = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n{%- if m.content is string %}{{ m.content }}"
                   "{%- else %}{%- for p in m.content %}{%- if p.type == 'text' %}{{ p.text }}{%- endif %}{%- endfor %}"
                   "{%- endif %}<|im_end|>\n{%- endfor %}")  # fmt: skip
    template = ChatTemplate(reads_parts, "parts")
    parted = [{"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
              {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]}]  # fmt: skip
    assert template.takes_parts()
    ours = template.render(conversation(parted, "t", template.takes_parts))
    assert ours == theirs.apply_chat_template(parted, chat_template=reads_parts, tokenize=False) and "Hi there" in ours
