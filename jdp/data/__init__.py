"""Data, in the order it flows: documents (corpus.py: the stdlib corpus, local files, saved datasets, the hub),
tokens (tokens.py: tokenizers, the cached token streams, windows), the format that makes them training windows
(formats.py: text; sft.py: chat and prompt; one registered), streams (stream.py) and mixtures (mixture.py), the text
pipeline's global batch of `(seed, step)` (pipeline.py), and data for any model with what the trainer asks of it
(dataset.py: `Source`, `Windows`, `Loader`, the prefetcher).

The text pipeline's names load from here on first use (`from jdp.data import load_data`), so importing one module
of the package (the config imports formats.py) imports no other.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Batches": "jdp.data.pipeline",
    "Data": "jdp.data.pipeline",
    "eval_batches": "jdp.data.pipeline",
    "load_data": "jdp.data.pipeline",
    "load_text": "jdp.data.pipeline",
    "Prefetcher": "jdp.data.dataset",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
