"""Weighted mixtures of sources (`data.sources`): which source each row of global batch `s` comes from, and which
of that source's windows it is.

Rows are numbered across batches: global batch `s` holds rows `s*B .. s*B+B-1`. Row `p` belongs to the source a
fixed pattern names: the weights as small integers `w_k` (3:1, or 0.7:0.3 -> 7:3), summing to `W`, and
smooth weighted round-robin (nginx's) over one period of `W` rows, so every `W` consecutive rows hold exactly
`w_k` rows of source `k`, spread out. A source's `q`-th row is entry `q` of its own endless order (dataset.GlobalOrder:
one fresh permutation of its windows per epoch, its own seed stream), so every source keeps jdp's promises on its
own: each window once per its own epoch, a small heavily weighted source simply runs through more epochs. Nothing
depends on the number of processes or devices; each process reads only its rows.

Changing the weights on resume: the weights in force are a list of segments, each starting at a row with the rows
each source had given by then. A run resumed with other weights adds a segment at the resume step; every source
continues where it stood. The segments travel in each checkpoint's record, so a resume is exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from jdp.data.dataset import Windows, digest
from jdp.errors import ConfigError

__all__ = ["Mixture", "MixtureBatches", "Pattern", "Schedule", "StreamMixture", "integer_weights"]

MAX_PERIOD = 10_000  # rows in one period of the pattern; finer weights are rounded to 1/10,000 (said at start)


def integer_weights(weights: list[float]) -> tuple[int, ...]:
    """The weights as the smallest integers in the same ratio (0.7, 0.3 -> 7, 3), or, when those would make a
    period longer than MAX_PERIOD rows, rounded to shares of MAX_PERIOD (each at least 1)."""
    if not weights or any(not (math.isfinite(w) and w > 0) for w in weights):
        raise ConfigError(f"mixture weights {list(weights)} must all be positive finite numbers")
    fractions = [Fraction(w).limit_denominator(1000) for w in weights]
    lcm = math.lcm(*(f.denominator for f in fractions))
    ints = [int(f * lcm) for f in fractions]
    if all(ints) and sum(ints) // math.gcd(*ints) <= MAX_PERIOD:
        g = math.gcd(*ints)
        return tuple(i // g for i in ints)
    total = sum(weights)
    ints = [max(1, round(w / total * MAX_PERIOD)) for w in weights]
    return tuple(ints)


class Pattern:
    """One period of rows for integer weights: `source[t]` for t in [0, W), and `before[k, t]`, the rows of source k
    among the first t. Smooth weighted round-robin: each row goes to the source furthest behind its share."""

    def __init__(self, weights: tuple[int, ...]):
        self.weights = np.asarray(weights, np.int64)
        self.period = int(self.weights.sum())
        current = np.zeros(len(weights), np.int64)
        self.source = np.empty(self.period, np.int64)
        for t in range(self.period):
            current += self.weights
            k = int(np.argmax(current))  # ties: the first source
            current[k] -= self.period
            self.source[t] = k
        self.before = np.zeros((len(weights), self.period + 1), np.int64)
        for k in range(len(weights)):
            self.before[k, 1:] = np.cumsum(self.source == k)

    def counts(self, rows: int) -> np.ndarray:
        """Rows of each source among the first `rows` rows."""
        whole, part = divmod(int(rows), self.period)
        return whole * self.weights + self.before[:, part]


@dataclass(frozen=True)
class Segment:
    start: int  # the first row it decides
    weights: tuple[int, ...]
    given: tuple[int, ...]  # rows each source had given before `start`

    def to_json(self) -> dict:
        return {"start": self.start, "weights": list(self.weights), "given": list(self.given)}


class Schedule:
    """Which source, and which of its rows, every global row position is: segments of integer weights."""

    def __init__(self, weights: tuple[int, ...], segments: list[Segment] | None = None):
        self.segments = segments or [Segment(0, tuple(weights), (0,) * len(weights))]
        self._patterns = {s.weights: Pattern(s.weights) for s in self.segments}

    @property
    def n(self) -> int:
        return len(self.segments[0].weights)

    def _segment(self, row: int) -> Segment:
        return next(s for s in reversed(self.segments) if s.start <= row)

    def counts(self, rows: int) -> np.ndarray:
        """Rows each source has given among the first `rows` rows (global positions 0 .. rows-1)."""
        seg = self._segment(max(rows - 1, 0)) if rows else self.segments[0]
        return np.asarray(seg.given) + self._patterns[seg.weights].counts(rows - seg.start)

    def rows(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, that source's row number) of each global row position."""
        positions = np.asarray(positions, np.int64)
        sources, within = np.empty(len(positions), np.int64), np.empty(len(positions), np.int64)
        starts = np.asarray([s.start for s in self.segments])
        which = np.searchsorted(starts, positions, side="right") - 1
        for i in np.unique(which):
            seg, sel = self.segments[int(i)], which == i
            pattern = self._patterns[seg.weights]
            whole, part = np.divmod(positions[sel] - seg.start, pattern.period)
            k = pattern.source[part]
            sources[sel] = k
            within[sel] = np.asarray(seg.given)[k] + whole * pattern.weights[k] + pattern.before[k, part]
        return sources, within

    def reweighted(self, weights: tuple[int, ...], row: int) -> Schedule:
        """This schedule up to `row`, then `weights`: every source goes on from the rows it had given."""
        if tuple(weights) == self.segments[-1].weights and row >= self.segments[-1].start:
            return self
        kept = [s for s in self.segments if s.start < row]
        given = tuple(int(c) for c in self.counts(row))
        return Schedule(weights, [*kept, Segment(row, tuple(weights), given)])

    def to_json(self) -> list[dict]:
        return [s.to_json() for s in self.segments]

    @classmethod
    def from_json(cls, saved: list[dict]) -> Schedule:
        segments = [Segment(int(s["start"]), tuple(s["weights"]), tuple(s["given"])) for s in saved]
        return cls(segments[0].weights, segments)


@dataclass
class Source:
    """One source of a mixture: a token stream cut into windows (text; fine-tuning data's is sft.ExampleSource).
    What a mixture asks of a source, whatever its kind: its windows and their rows, its validation batches, its
    account and its fingerprint."""

    label: str
    stream: np.ndarray
    n_docs: int
    n_empty: int
    val: np.ndarray

    def n_windows(self, seq_len: int) -> int:
        from jdp.data.tokens import n_windows

        return n_windows(self.stream, seq_len)

    def rows(self, idx: np.ndarray, seq_len: int) -> dict[str, np.ndarray]:
        from jdp.data.tokens import windows

        return windows(self.stream, idx, seq_len)

    def eval_batches(self, seq_len: int, batch_size: int, rows: slice):
        """Its validation batches, this process's rows; None when it holds no validation window."""
        from jdp.data.tokens import eval_batches

        return eval_batches(self.val, seq_len, batch_size, rows) if len(self.val) > seq_len else None

    @property
    def n_tokens(self) -> int:
        return len(self.stream)

    @property
    def n_val_tokens(self) -> int:
        return len(self.val)

    def describe(self, n_windows: int) -> str:
        return (f"{self.n_docs:,} documents ({self.n_empty} empty, skipped), {len(self.stream):,} tokens = "
                f"{n_windows:,} windows")  # fmt: skip

    def fingerprint(self) -> dict:
        return {"tokens": len(self.stream), "val_tokens": len(self.val), "sha256": digest(self.stream, self.val)}


class Mixture(Windows):
    """What both kinds of mixture share: the sources' labels and the schedule of rows, with what follows from it
    (each source's rows and tokens, the state a checkpoint keeps, a reweighted resume, one validation set per
    source)."""

    labels: list[str]
    weights: tuple[int, ...]
    schedule: Schedule
    seq_len: int
    batch_size: int

    def given(self, step: int) -> np.ndarray:
        """Rows each source has given to the first `step` batches."""
        return self.schedule.counts(step * self.batch_size)

    def shares(self) -> list[float]:
        w = np.asarray(self.schedule.segments[-1].weights, float)
        return list(w / w.sum())

    def state(self) -> dict:
        """What a checkpoint keeps: the schedule (its segments), the same on every process."""
        return {"sources": list(self.labels), "schedule": self.schedule.to_json()}

    def restore(self, saved: dict, step: int) -> str:
        """Continue from a checkpoint at `step` with today's weights; returns what changed ('' when nothing did)."""
        if saved.get("sources") != list(self.labels):
            raise ConfigError(
                f"the checkpoint's mixture has sources {saved.get('sources')}, this run {list(self.labels)}; resume "
                f"with the same data.sources (only their weights may change)"
            )
        schedule = Schedule.from_json(saved["schedule"])
        old = schedule.segments[-1].weights
        self.schedule = schedule.reweighted(self.weights, step * self.batch_size)
        if old == self.weights:
            return ""
        return (
            f"data.sources weights {':'.join(map(str, old))} -> {':'.join(map(str, self.weights))} from step "
            f"{step}: every source goes on where it stood ({self.where(step)})"
        )

    def where(self, step: int) -> str:
        raise NotImplementedError

    def fingerprint(self, data) -> dict[str, dict]:
        """Each source's, by label: its token streams whole (a stream: its files and validation tokens)."""
        if streams := getattr(self, "streams", None):
            return {s.label: st.fingerprint_with(s.val) for s, st in zip(self.sources, streams, strict=True)}
        return {s.label: s.fingerprint() for s in self.sources}

    def eval_sets(self, data) -> list:
        """One validation set per source that has a window of them: (label, its batches)."""

        return [(s.label, batches) for s in self.sources
                if (batches := s.eval_batches(self.seq_len, self.batch_size, data.rows)) is not None]  # fmt: skip


def assemble(sources: np.ndarray, part) -> dict[str, np.ndarray]:
    """A batch whose row i comes from source sources[i]: `part(k, n)` gives the n rows of source k, in row order."""
    out: dict[str, np.ndarray] = {}
    for k in np.unique(sources):
        sel = np.flatnonzero(sources == k)
        for name, values in part(int(k), sel).items():
            if name not in out:
                out[name] = np.empty((len(sources), *values.shape[1:]), values.dtype)
            out[name][sel] = values
    return out


class MixtureBatches(Mixture):
    """The training batches of a mixture: global batch `step` is a pure function of (seed, step, the schedule).

    Row p of the batches goes to the source the schedule names, as that source's q-th row: entry q of its own
    endless order (a fresh permutation of its windows per its own epoch, seed stream k+1)."""

    def __init__(self, sources: list[Source], weights: tuple[int, ...], seq_len: int, batch_size: int, seed: int):
        from jdp.data.dataset import GlobalOrder

        self.sources, self.seq_len, self.batch_size, self.seed = sources, seq_len, batch_size, seed
        self.labels = [s.label for s in sources]
        self.weights = tuple(weights)
        self.schedule = Schedule(self.weights)
        self.sizes = np.asarray([s.n_windows(seq_len) for s in sources], np.int64)
        self.orders = [GlobalOrder(int(n), 1, seed, stream=k + 1) for k, n in enumerate(self.sizes)]
        self.n = int(self.sizes.sum())

    def rows_of(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, window index in it) of each row of global batch `step` (0-based)."""
        sources, within = self.schedule.rows(step * self.batch_size + np.arange(self.batch_size))
        windows = np.empty_like(within)
        for k in np.unique(sources):
            sel = sources == k
            windows[sel] = self.orders[int(k)].at(within[sel])
        return sources, windows

    def batch(self, step: int, rows: slice = slice(None)) -> dict[str, np.ndarray]:
        """This process's rows of global batch `step`: each row from its own source's stream."""
        sources, idx = (a[rows] for a in self.rows_of(step))
        return assemble(sources, lambda k, sel: self.sources[k].rows(idx[sel], self.seq_len))

    def local_batch(self, step: int, rows: slice) -> dict[str, np.ndarray]:
        return self.batch(step, rows)

    def banner(self, data) -> str:
        val = (
            f"val {sum(s.n_val_tokens for s in self.sources):,} tokens"
            if any(s.n_val_tokens for s in self.sources)
            else "no validation"
        )
        return (
            f"mixture of {len(self.sources)} sources, {self.n:,} windows in all | {val} | {data.describe_tokenizer()}"
        )

    def epoch(self, step: int) -> float:
        """Rows trained over all the sources' windows (each source's own epochs: `stats`)."""
        return step * self.batch_size / self.n

    def stats(self, step: int) -> dict[str, float]:
        """metrics.jsonl's per-source numbers after `step` steps: tokens trained and epochs of each source."""
        given, out = self.given(step), {}
        for s, g, n in zip(self.sources, given, self.sizes, strict=True):
            out[f"tokens/{s.label}"] = int(g) * self.seq_len
            out[f"epochs/{s.label}"] = float(g) / float(n)
        return out

    def summary(self, step: int) -> dict:
        """Per source after `step` steps: documents, tokens in its stream, tokens trained, share of the rows (the
        weights' and the one reached), epochs."""
        given, shares = self.given(step), self.shares()
        total = max(int(given.sum()), 1)
        return {
            s.label: {"documents": s.n_docs, "tokens": s.n_tokens, "tokens_trained": int(g) * self.seq_len,
                      "share": share, "share_trained": int(g) / total, "epochs": int(g) / int(n)}
            for s, g, n, share in zip(self.sources, given, self.sizes, shares, strict=True)
        }  # fmt: skip

    def where(self, step: int) -> str:
        return ", ".join(
            f"{s.label} at {g / n:.3f} epochs"
            for s, g, n in zip(self.sources, self.given(step), self.sizes, strict=True)
        )

    def describe_sources(self, steps: int) -> list[str]:
        """One line per source: documents, tokens, windows, share, and its epochs after `steps` steps."""
        return [
            f"{s.label}: {s.describe(int(n))}, share {share:.1%}, {g / n:.3f} epochs in {steps} steps"
            for s, n, share, g in zip(self.sources, self.sizes, self.shares(), self.given(steps), strict=True)
        ]


class StreamMixture(Mixture):
    """A mixture of streamed sources: each process reads its own shards of every source (stream.StreamBatches),
    and the schedule says which source each of its rows of global batch `step` comes from, so each source gives
    this process as many windows as the schedule assigns it, in its stream's order. As for one stream, the batches
    depend on the number of processes, steps come in order, and epochs are per process; the position (every
    source's stream state) is saved beside each checkpoint, the schedule in its record."""

    def __init__(self, streams: list, sources: list[Source], weights: tuple[int, ...], seq_len: int,
                 batch_size: int, rows: slice):  # fmt: skip
        self.streams, self.sources, self.rows = streams, sources, rows
        self.seq_len, self.batch_size = seq_len, batch_size
        self.labels = [s.label for s in sources]
        self.weights = tuple(weights)
        self.schedule = Schedule(self.weights)

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """This process's rows of global batch `step`, each the next window of its scheduled source's stream."""
        sources, _ = self.schedule.rows((step * self.batch_size + np.arange(self.batch_size))[self.rows])
        return assemble(sources, lambda k, sel: self.streams[k].next_windows(len(sel)))

    def local_batch(self, step: int, rows: slice) -> dict[str, np.ndarray]:
        return self.batch(step)  # this process's rows are its own already

    def position(self) -> dict:
        return self.state_dict()

    def load_position(self, position: dict) -> None:
        self.load_state_dict(position)

    def banner(self, data) -> str:
        return (
            f"streaming mixture of {len(self.sources)} sources, each process its own shards of each | "
            f"{data.describe_tokenizer()}"
        )

    def epoch(self, step: int) -> float:
        return float(min(s.epoch_count for s in self.streams))

    def stats(self, step: int) -> dict[str, float]:
        """Per source: tokens trained by every process (the schedule's), epochs this process finished of it."""
        out = {}
        for label, g, s in zip(self.labels, self.given(step), self.streams, strict=True):
            out[f"tokens/{label}"] = int(g) * self.seq_len
            out[f"epochs/{label}"] = float(s.epoch_count)
        return out

    def summary(self, step: int) -> dict:
        given = self.given(step)
        total = max(int(given.sum()), 1)
        return {
            label: {"tokens_trained": int(g) * self.seq_len, "share": share, "share_trained": int(g) / total,
                    "epochs": float(s.epoch_count)}
            for label, g, share, s in zip(self.labels, given, self.shares(), self.streams, strict=True)
        }  # fmt: skip

    def where(self, step: int) -> str:
        return ", ".join(
            f"{label} in its epoch {s.epoch_count}" for label, s in zip(self.labels, self.streams, strict=True)
        )

    def state_dict(self) -> dict:
        return {"streams": [s.state_dict() for s in self.streams]}

    def load_state_dict(self, state: dict) -> None:
        if len(state.get("streams", ())) != len(self.streams):
            raise ConfigError(
                f"the stream position holds {len(state.get('streams', ()))} sources, data.sources has "
                f"{len(self.streams)}; resume with the same sources"
            )
        for stream, saved in zip(self.streams, state["streams"], strict=True):
            stream.load_state_dict(saved)

    def describe_sources(self, steps: int) -> list[str]:
        return [
            f"{label}: streamed, share {share:.1%}" for label, share in zip(self.labels, self.shares(), strict=True)
        ]
