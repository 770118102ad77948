"""Data formats: what `data.format` names, one registry entry each (tests/test_formats.py registers one of its own).

An entry holds what the config and the corpus ask of a format without reading data: the columns it reads, whether
attention stays within documents by default, whether it may be streamed or mixed. Its `load` builds the training
windows (dataset.Windows) from the opened corpus; jdp's own attach theirs where they live (text: data.py; chat and
prompt: sft.py; preference: preference.py), so this module imports none of them and the `jdp` command starts without reading any.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from jdp.errors import ConfigError

__all__ = ["Format", "attach", "get", "names", "register"]


@dataclass(frozen=True)
class Format:
    name: str
    what: str  # how messages name its data ("fine-tuning data")
    columns: Callable[[Any], list[str]]  # DataConfig -> the columns it reads
    within_documents: bool = False  # data.document_attention=auto keeps attention within each document
    streams: bool = True  # data.streaming=true reads it
    mixes: bool = True  # a data.sources entry may be of it
    keys: tuple[str, ...] = ()  # the data.* keys it reads that other formats do not (set for another: refused)
    # (corpus, tokenizer, DataConfig, batch_size, seed, rows, rank, world) -> (dataset.Windows, tokens.Tokens: the
    # validation stream, empty where the windows evaluate themselves)
    load: Callable | None = field(default=None, compare=False)
    # (corpus, tokenizer, DataConfig of the entry, seed, label) -> one source of a map-style mixture (mixture.Source
    # or anything with its methods), its problems found; None: it cannot be a data.sources entry
    mix: Callable | None = field(default=None, compare=False)
    # (corpus, tokenizer, DataConfig of the entry, rows, rank, world, label) -> (its stream: stream.Shards, this
    # process's `rows` windows at a time; a mixture source holding its validation) for a streamed data.sources entry
    stream: Callable | None = field(default=None, compare=False)


_FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("text", "text", lambda d: [d.text_column]),
        Format("chat", "fine-tuning data", lambda d: ["messages"], within_documents=True,
               keys=("chat_template", "chat_template_name", "chat_template_kwargs")),
        Format("prompt", "fine-tuning data", lambda d: ["prompt", "completion"], within_documents=True),
        # `prompt` too where the rows have one (optional in TRL's conversational form: preference.py)
        Format("preference", "preference pairs", lambda d: ["chosen", "rejected"], streams=False, mixes=False,
               keys=("chat_template", "chat_template_name", "chat_template_kwargs")),
    )
}
_BUILTIN = tuple(_FORMATS)


def names() -> tuple[str, ...]:
    return tuple(_FORMATS)


def get(name: str) -> Format:
    if name not in _FORMATS:
        raise ConfigError(f"data.format={name!r} must be one of {', '.join(_FORMATS)}")
    return _FORMATS[name]


def attach(name: str, load: Callable, mix: Callable | None = None, stream: Callable | None = None) -> None:
    """Give jdp's own format `name` its loaders (done where they live, when that module is imported)."""
    _FORMATS[name] = replace(_FORMATS[name], load=load, mix=mix, stream=stream)


def register(fmt: Format) -> None:
    """Make data.format=fmt.name read data with fmt.load (a format of your own: docs/data.md)."""
    if fmt.name in _BUILTIN:
        raise ConfigError(f"data.format={fmt.name} is jdp's own format; register yours under another name")
    if fmt.load is None:
        raise ConfigError(f"data.format={fmt.name}: a format needs its load function")
    _FORMATS[fmt.name] = fmt
