"""Program inspection: the all-reduces of a compiled step, read from its HLO text, and the `jdp allreduce` report."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass


def compiled_text(step_fn, *args) -> str:
    """The optimized HLO text of a jitted step for these arguments (for inspecting collectives)."""
    return step_fn.lower(*args).compile().as_text()


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4}
_DTYPE_BYTES.update({"f64": 8, "s64": 8, "u64": 8})


@dataclass
class AllReduce:
    name: str
    computation: str  # the HLO computation it sits in
    in_loop: bool  # inside a while-loop body or condition: it would run once per iteration
    shapes: list[str]
    bytes: int


def all_reduces(hlo_text: str) -> list[AllReduce]:
    """Every all-reduce in optimized HLO text, with its bytes and whether it sits inside a loop."""
    loop_comps = set(re.findall(r"(?:body|condition)=%?([\w.\-]+)", hlo_text))
    found, computation = [], ""
    for line in hlo_text.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if header and not line.startswith(" "):
            computation = header.group(1)
            continue
        m = re.match(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) all-reduce(?:-start)?\(", line)
        if m:
            shapes = re.findall(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\]", m.group(2))
            nbytes = sum(_DTYPE_BYTES[t] * math.prod(int(d) for d in dims.split(",") if d) for t, dims in shapes)
            found.append(
                AllReduce(m.group(1), computation, computation in loop_comps, [f"{t}[{d}]" for t, d in shapes], nbytes)
            )
    return found
