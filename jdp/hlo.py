"""Program inspection: the all-reduces of a compiled step, read from its HLO text, and the `jdp allreduce` report."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import jax

from jdp import parallel
from jdp.buckets import bucket_plan
from jdp.build import batch_spec, build
from jdp.config import Config, ConfigError, validate
from jdp.model import lm_loss


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


def all_reduce_report(cfg: Config) -> tuple[str, dict]:
    """Compile the configured train step on this job's devices and list its all-reduces (no data, no run).

    Returns the printable table and the numbers: gradient all-reduces (count, bytes each, total) and
    the parameter bytes they must add up to.
    """
    if cfg.parallel.strategy != "ddp":
        raise ConfigError("the all-reduce report is for parallel.strategy=ddp (dp gathers to a master instead)")
    mesh = parallel.make_mesh()
    derived = validate(cfg, mesh.devices.size, jax.process_count())
    graphdef, state, train_step, n_params = build(cfg, mesh)
    spec = batch_spec(cfg, mesh)
    micro = {k: jax.ShapeDtypeStruct((derived.micro_batch, *v.shape[1:]), v.dtype) for k, v in spec.items()}
    p = cfg.parallel
    buckets = bucket_plan(graphdef, lm_loss, state.params, state.rest, micro, p.bucket_mb, p.reduce_dtype)
    lowered = train_step.lower(state, spec)
    emitted_found = all_reduces(lowered.as_text(dialect="hlo"))  # the program before XLA's passes
    emitted = _gradient_all_reduces(emitted_found, buckets)
    found = all_reduces(lowered.compile().as_text())
    grads = _gradient_all_reduces(found, buckets)
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.params))
    lines = [
        f"all-reduces of the compiled train step: {mesh.devices.size} x {jax.devices()[0].device_kind}, "
        f"parallel.bucket_mb={p.bucket_mb:g}, parallel.reduce_dtype={p.reduce_dtype}, "
        f"train.grad_accum={cfg.train.grad_accum}",
        f"{'#':>3}  {'bytes':>13}  {'operand':<18} {'in a loop':<9}  contents",
    ]
    for i, a in enumerate(found, 1):
        b = grads.get(id(a))
        more = f" + {len(b.names) - 3} more" if b and len(b.names) > 3 else ""
        what = f"gradients: {', '.join(b.names[:3])}{more}" if b else "loss and token count"
        lines.append(f"{i:>3}  {a.bytes:>13,}  {' '.join(a.shapes):<18} {'yes' if a.in_loop else 'no':<9}  {what}")
    grad_bytes = sum(a.bytes for a in found if id(a) in grads)
    emitted_bytes = sum(a.bytes for a in emitted_found if id(a) in emitted)
    others = [a for a in found if id(a) not in grads]
    lines.append(
        f"gradients: {len(grads)} all-reduce(s), {grad_bytes:,} bytes in all = {grad_bytes / param_bytes:.2f} x the "
        f"parameter bytes ({param_bytes:,} bytes, {n_params:,} parameters); other all-reduces: {len(others)}, "
        f"{sum(a.bytes for a in others):,} bytes"
    )
    if emitted_bytes != grad_bytes:
        lines.append(
            f"as jdp emits them the gradients are {len(emitted)} all-reduce(s) of {emitted_bytes:,} bytes; "
            f"XLA on {jax.devices()[0].platform} changed that (CPUs have no bfloat16 all-reduce, so XLA "
            f"promotes it to float32 there; GPUs keep it)"
        )
    if mesh.devices.size == 1:
        lines.append("one device: XLA removes every all-reduce; add --devices N to see the N-device program")
    numbers = {
        "devices": mesh.devices.size,
        "gradient_all_reduces": len(grads),
        "gradient_bytes": [a.bytes for a in found if id(a) in grads],
        "gradient_bytes_total": grad_bytes,
        "emitted_gradient_all_reduces": len(emitted),
        "emitted_gradient_bytes_total": emitted_bytes,
        "parameter_bytes": param_bytes,
        "planned_bucket_bytes": [b.nbytes for b in buckets],
        "other_all_reduces": len(others),
        "in_loop": sum(a.in_loop for a in found),
    }
    return "\n".join(lines), numbers


def _gradient_all_reduces(found: list, buckets: list) -> dict:
    """Which all-reduces carry gradients: id(all-reduce) -> its planned bucket, matched by element count."""
    unused = list(buckets)
    out = {}
    for a in found:
        if len(a.shapes) != 1:
            continue
        match = next((b for b in unused if b.elements == _elements(a.shapes[0])), None)
        if match is not None:
            unused.remove(match)
            out[id(a)] = match
    return out


def _elements(shape: str) -> int:
    dims = shape[shape.index("[") + 1 : -1]
    return math.prod(int(d) for d in dims.split(",") if d)
