"""A data format defined outside jdp/ (tests/test_formats.py registers it): each document's text read backwards,
tokenized and cut into windows as data.format=text does. Nothing under jdp/ names it."""

from __future__ import annotations

from jdp.data import Batches
from jdp.data.formats import Format
from jdp.data.tokens import tokenize


def load(corpus, tokenizer, cfg, batch_size: int, seed: int, rows: slice, rank: int, world: int):
    backwards = {cfg.text_column: lambda text: text[::-1]}

    def flip(ds):
        return None if ds is None else ds.map(lambda row: {k: f(row[k]) for k, f in backwards.items()})

    tokens = tokenize(flip(corpus.train), tokenizer, cfg, seed, flip(corpus.val))
    return Batches(tokens.train, cfg.seq_len, batch_size, seed), tokens


REVERSED = Format("reversed", "reversed text", lambda d: [d.text_column], streams=False, load=load)
