"""Program inspection: the collectives of a compiled step, read from its HLO text, and the `jdp allreduce` report."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import jax

from jdp import parallel
from jdp.build import batch_spec, build
from jdp.config import Config, ConfigError, validate
from jdp.models.common import lm_loss
from jdp.optim import whole_matrices
from jdp.parallel import strategies
from jdp.parallel.buckets import bucket_plan

__all__ = [
    "KINDS",
    "Collective",
    "all_reduce_report",
    "all_reduces",
    "collectives",
    "compiled_text",
    "compression_report",
]


def compiled_text(step_fn, *args) -> str:
    """The optimized HLO text of a jitted step for these arguments (for inspecting collectives)."""
    return step_fn.lower(*args).compile().as_text()


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4}
_DTYPE_BYTES.update({"f64": 8, "s64": 8, "u64": 8})


@dataclass
class Collective:
    kind: str  # all-reduce, reduce-scatter or all-gather
    name: str
    computation: str  # the HLO computation it sits in
    in_loop: bool  # inside a while-loop body or condition: it would run once per iteration
    shapes: list[str]  # its result's
    bytes: int  # the whole buffer it covers: for a reduce-scatter its input, the result times the group size


KINDS = ("all-reduce", "reduce-scatter", "all-gather")


def collectives(hlo_text: str) -> list[Collective]:
    """Every all-reduce, reduce-scatter and all-gather in optimized HLO text, with bytes and loop placement."""
    loop_comps = set(re.findall(r"(?:body|condition)=%?([\w.\-]+)", hlo_text))
    found, computation = [], ""
    for line in hlo_text.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if header and not line.startswith(" "):
            computation = header.group(1)
            continue
        m = re.match(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) (all-reduce|reduce-scatter|all-gather)(?:-start)?\(", line)
        if m:
            shapes = re.findall(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\]", m.group(2))
            nbytes = sum(_DTYPE_BYTES[t] * math.prod(int(d) for d in dims.split(",") if d) for t, dims in shapes)
            if m.group(3) == "reduce-scatter":
                nbytes *= _group_size(line)
            found.append(
                Collective(
                    m.group(3), m.group(1), computation, computation in loop_comps,
                    [f"{t}[{d}]" for t, d in shapes], nbytes,
                )
            )  # fmt: skip
    return found


def _group_size(line: str) -> int:
    """Devices in each replica group of a collective: `mesh['data'=4]`, `mesh['replica'=2,'shard'=2] {'shard'}`
    (over the axes named in braces) or `{{0,1,2,3}}`."""
    if m := re.search(r"replica_groups=mesh\[([^\]]*)\](?:\s*\{([^}]*)\})?", line):
        sizes = dict(re.findall(r"'?([\w]+)'?=(\d+)", m.group(1)))
        over = re.findall(r"'?([\w]+)'?", m.group(2)) if m.group(2) else list(sizes)
        return math.prod(int(sizes[a]) for a in over)
    if m := re.search(r"replica_groups=\{\{([\d,]*)\}", line):
        return len(m.group(1).split(","))
    if m := re.search(r"replica_groups=\[(\d+),(\d+)\]", line):  # iota form [groups,size]
        return int(m.group(2))
    raise ValueError(f"no replica groups in {line[:200]}")


def all_reduces(hlo_text: str) -> list[Collective]:
    """Every all-reduce in optimized HLO text, with its bytes and whether it sits inside a loop."""
    return [c for c in collectives(hlo_text) if c.kind == "all-reduce"]


def _planned(name: str) -> strategies.Strategy:
    """The strategy, refused where its gradients travel by no collective (nothing to report)."""
    if not (s := strategies.get(name)).planned:
        planned = " or ".join(k for k, v in strategies.REGISTRY.items() if v.planned)
        raise ConfigError(
            f"the collectives report is for parallel.strategy={planned}, whose gradients travel by collectives; "
            f"{name} is {s.summary}"
        )
    return s


def all_reduce_report(cfg: Config) -> tuple[str, dict]:
    """Compile the configured train step on this job's devices and list its collectives (no data, no run): the
    printable table and the numbers (count and bytes of each kind, and the padded parameter bytes they add up to).
    ddp: the gradient all-reduces; zero1: the gradient reduce-scatters and the parameter all-gathers."""
    strategy, s, p = cfg.parallel.strategy, _planned(cfg.parallel.strategy), cfg.parallel
    mesh = parallel.mesh_for(cfg.parallel)
    n = mesh.devices.size
    derived = validate(cfg, n, jax.process_count())
    graphdef, state, train_step, n_params, *_ = build(cfg, mesh)
    spec = batch_spec(cfg, mesh)
    micro = {k: jax.ShapeDtypeStruct((derived.micro_batch, *v.shape[1:]), v.dtype) for k, v in spec.items()}
    layout = s.steps().layout(mesh)  # a split layout pads every gradient and parameter to a multiple of its shards
    # (layout.shards: the multiple each padded leaf has; 1: whole copies)
    buckets, padded, gathered = _planned_collectives(s, graphdef, state, micro, p, layout.shards or 1)
    shapes = jax.tree.leaves(state.param_shapes())
    grad_kind = s.gradients
    lowered = train_step.lower(state, spec)
    emitted_found = collectives(lowered.as_text(dialect="hlo"))  # the program before XLA's passes
    emitted = _match(emitted_found, grad_kind, buckets, padded)
    found = collectives(lowered.compile().as_text())
    grads = _match(found, grad_kind, buckets, padded)
    gathers = _match(found, "all-gather", *gathered) if s.gathers_parameters else {}
    base = _base_gathers(s, graphdef, state, p, [a for a in found if id(a) not in gathers])
    mats, whole = _whole_matrices(cfg, state, layout, [a for a in found if id(a) not in gathers and id(a) not in base])
    param_bytes, padded_bytes, padding = layout.param_bytes(state)  # as the strategy's layout pads them
    lines = [
        f"collectives of the compiled train step: parallel.strategy={strategy}, {n} x {jax.devices()[0].device_kind}, "
        f"parallel.bucket_mb={p.bucket_mb:g}, parallel.reduce_dtype={p.reduce_dtype}, "
        f"train.grad_accum={cfg.train.grad_accum}",
        f"{'#':>3}  {'kind':<14} {'bytes':>13}  {'result':<18} {'in a loop':<9}  contents",
    ]
    lines += _rows(found, grads, gathers, n_leaves=len(shapes), matrices=whole, base=base)
    grad_bytes = sum(a.bytes for a in found if id(a) in grads)
    gather_bytes = sum(a.bytes for a in found if id(a) in gathers)
    emitted_bytes = sum(a.bytes for a in emitted_found if id(a) in emitted)
    others = [a for a in found if id(a) not in grads and id(a) not in gathers and id(a) not in whole and id(a) not in base]
    lines.append(
        f"gradients: {len(grads)} {grad_kind}(s), {grad_bytes:,} bytes in all = {grad_bytes / param_bytes:.2f} x "
        f"the parameter bytes ({param_bytes:,} bytes, {n_params:,} parameters{padding})"
    )
    if s.gathers_parameters:
        lines.append(f"parameters: {len(gathers)} all-gather(s), {gather_bytes:,} bytes in all")
    if base:
        lines.append(f"the frozen base (LoRA's, in rows): {len(base)} all-gather(s), {_bytes(found, base):,} bytes in all")
    if mats:
        lines.append(f"Muon's matrices: {len(whole)} all-gather(s) of {len(mats)} matrices (one loop per shape)")
    lines.append(f"other collectives: {len(others)}, {sum(a.bytes for a in others):,} bytes")
    if emitted_bytes != grad_bytes:
        lines.append(
            f"as jdp emits them the gradients are {len(emitted)} {grad_kind}(s) of {emitted_bytes:,} bytes; "
            f"XLA on {jax.devices()[0].platform} changed that (CPUs have no bfloat16 all-reduce, so XLA "
            f"promotes it to float32 there; GPUs keep it)"
        )
    if n == 1:
        lines.append("one device: XLA removes every collective; add --devices N to see the N-device program")
    numbers = {
        "strategy": strategy,
        "devices": n,
        "gradient_collective": grad_kind,
        "gradient_all_reduces": len(grads) if grad_kind == "all-reduce" else 0,
        "gradient_reduce_scatters": len(grads) if grad_kind == "reduce-scatter" else 0,
        "gradient_bytes": [a.bytes for a in found if id(a) in grads],
        "gradient_bytes_total": grad_bytes,
        "parameter_all_gathers": len(gathers),
        "parameter_gather_bytes_total": gather_bytes,
        "base_all_gathers": len(base),
        "muon_matrices": len(mats),
        "muon_all_gathers": len(whole),
        "emitted_gradient_collectives": len(emitted),
        "emitted_gradient_bytes_total": emitted_bytes,
        "parameter_bytes": param_bytes,
        "padded_parameter_bytes": padded_bytes,
        "planned_bucket_bytes": [e * jax.numpy.dtype(p.reduce_dtype).itemsize for e in padded],
        "other_all_reduces": sum(a.kind == "all-reduce" for a in others),
        "other_collectives": len(others),
        "other_bytes": [a.bytes for a in others],
        "in_loop": sum(a.in_loop for a in found),
    }
    return "\n".join(lines), numbers


def _bytes(found: list, matched: dict) -> int:
    return sum(a.bytes for a in found if id(a) in matched)


def _base_gathers(s: strategies.Strategy, graphdef, state, p, found: list) -> dict:
    """A frozen base's all-gathers (LoRA's under fsdp and hsdp: the strategy's report_base), matched among `found`:
    id(collective) -> its unit's base."""
    planned = getattr(s.steps(), "report_base", lambda *a, **k: [])(graphdef, state, **s.options_of(p))
    return _match(found, "all-gather", planned, [u.elements for u in planned]) if planned else {}


def _whole_matrices(cfg: Config, state, layout, found: list) -> tuple[list, dict]:
    """Muon under a split layout: each of its matrices all-gathered whole for Newton-Schulz (jdp/muon.py), matched
    among `found` by element count. (the matrices, id(collective) -> the matrix it carries)."""
    shapes = jax.tree.leaves(state.param_shapes())
    wanted = whole_matrices(cfg.optim, state.param_shapes()) if layout.shards else [False] * len(shapes)
    names = parallel.param_names(state.params)
    mats = [(_Named([name]), math.prod(layout.shape(x))) for name, x, w in zip(names, shapes, wanted, strict=True) if w]
    return mats, (_match(found, "all-gather", *zip(*mats, strict=True)) if mats else {})


def _planned_collectives(s: strategies.Strategy, graphdef, state, micro, p, pad: int):
    """(the gradients' buckets, their padded elements, (what the parameters' all-gathers carry, their elements)):
    jdp's buckets for ddp and zero1 (zero1 gathers the same buckets); for fsdp and hsdp their units (a
    reduce-scatter per unit, an all-gather per unit and use: parallel/strategies/fsdp.py's report_units)."""
    if hasattr(s.steps(), "report_units"):
        scatters, gathers = s.steps().report_units(graphdef, state, **s.options_of(p))
        return scatters, [u.elements for u in scatters], (gathers, [u.elements for u in gathers])
    buckets = bucket_plan(graphdef, lm_loss, state.params, state.rest, micro, p.bucket_mb, p.reduce_dtype)
    shapes = jax.tree.leaves(state.params)
    padded = [sum(shapes[k].size + -shapes[k].size % pad for k in b.leaves) for b in buckets]
    return buckets, padded, (buckets, padded)


def compression_report(cfg: Config) -> tuple[str, dict]:
    """The bytes a compressed step really all-reduces (from the compiled program after the warm-up), against the
    same step without compression and the hook's own prediction (PowerSGD: r(m + n) per m x n matrix)."""
    import dataclasses

    mesh = parallel.mesh_for(cfg.parallel)
    n = mesh.devices.size
    validate(cfg, n, jax.process_count())
    spec = batch_spec(cfg, mesh)
    p = cfg.parallel
    compressed = dataclasses.replace(cfg, parallel=dataclasses.replace(p, powersgd_warmup=0))  # no warm-up branch
    plain = dataclasses.replace(cfg, parallel=dataclasses.replace(p, compression="none"))
    totals, numbers = {}, {"devices": n, "compression": p.compression, "rank": p.powersgd_rank}
    for name, c in (("compressed", compressed), ("plain", plain)):
        built = build(c, mesh)
        found = collectives(built.train_step.lower(built.state, spec).compile().as_text())
        totals[name] = [a for a in found if a.kind == "all-reduce"]
        if name == "compressed":
            named = [(n, tuple(x.shape)) for n, x in
                     zip(parallel.param_names(built.state.params), jax.tree.leaves(built.state.params), strict=True)]  # fmt: skip
            hook = built.comm_hook
    small = 4 * 2  # the loss and token count
    predicted = 4 * hook.wire_elements(named) + small if p.reduce_dtype == "float32" else None
    sent, whole = (sum(a.bytes for a in totals[k]) for k in ("compressed", "plain"))
    packed = [s for n, s in named if hook.compresses(n, s)]
    lines = [
        f"all-reduces of the compiled train step with parallel.compression={p.compression} (rank {p.powersgd_rank}), "
        f"{n} x {jax.devices()[0].device_kind}, parallel.bucket_mb={p.bucket_mb:g}",
        f"{'#':>3}  {'kind':<14} {'bytes':>13}  {'result':<18} {'in a loop':<9}  contents",
    ]
    lines += _rows(totals["compressed"], {}, {}, "gradients: PowerSGD factors P or Q, or uncompressed tensors")
    lines += [
        f"after the warm-up: {sent:,} bytes per step in {len(totals['compressed'])} all-reduces; without compression "
        f"{whole:,} in {len(totals['plain'])}: {whole / max(sent, 1):.1f} x fewer bytes",
        f"{len(packed)} of {len(named)} gradients are compressed (each m x n matrix sends r(m + n) numbers instead of "
        f"mn); the other {len(named) - len(packed)} (1-D, too small to gain {p.powersgd_min_ratio:g} x, or named in "
        f"parallel.powersgd_uncompressed) travel whole",
        f"predicted from the shapes: {predicted:,} bytes" if predicted is not None else
        "predicted bytes: for parallel.reduce_dtype=float32 only",
        f"the first {p.powersgd_warmup} steps (parallel.powersgd_warmup) all-reduce everything: {whole:,} bytes per step",
    ]  # fmt: skip
    numbers.update({"bytes_per_step": sent, "bytes_per_step_uncompressed": whole, "predicted_bytes": predicted,
                    "all_reduces": len(totals["compressed"]), "compressed_gradients": len(packed),
                    "gradients": len(named), "warmup_steps": p.powersgd_warmup})  # fmt: skip
    return "\n".join(lines), numbers


@dataclass(frozen=True)
class _Named:
    """What a collective carries, where it is not a bucket: the parameters it names."""

    names: list


def _rows(
    found: list, grads: dict, gathers: dict, unplanned: str = "not one of jdp's gradient buckets", n_leaves: int = 0,
    matrices: dict | None = None, base: dict | None = None,
) -> list[str]:  # fmt: skip
    """One line per collective: kind, bytes, result shape, whether in a loop, and what it carries; the scalar
    all-reduces of the norms share one line (n_leaves: the number of parameter arrays, to count them by)."""
    # zero1: jit computes each global norm (grad_norm, and clipping's) from the gradient slices: one partial sum
    # of squares per parameter and norm, each a scalar all-reduce (XLA may merge them into one, a tuple).
    norms = [a for a in found if a.kind == "all-reduce" and id(a) not in grads and id(a) not in gathers
             and all(s.endswith("[]") for s in a.shapes)]  # fmt: skip
    rows = []
    for a in found:
        if norms and a is norms[0]:
            shapes = [s for c in norms for s in c.shapes]
            k = len(shapes)
            per = f" ({n_leaves} parameters x {k // n_leaves})" if n_leaves and k % n_leaves == 0 else ""
            how = "in one all-reduce" if len(norms) == 1 else f"in {len(norms)} all-reduces"
            what = f"gradient norms: {k} partial sums of squares {how}, one per parameter and norm{per}"
            rows.append(_row(len(rows) + 1, a.kind, sum(c.bytes for c in norms), shapes,
                             any(c.in_loop for c in norms), what))  # fmt: skip
        elif base and id(a) in base:
            b = base[id(a)]
            more = f" + {len(b.names) - 3} more" if len(b.names) > 3 else ""
            rows.append(_row(len(rows) + 1, a.kind, a.bytes, a.shapes, a.in_loop,
                             f"frozen base: {', '.join(b.names[:3])}{more}"))  # fmt: skip
        elif matrices and id(a) in matrices:
            what = f"Muon: the whole matrix for Newton-Schulz: {matrices[id(a)].names[0]}"
            rows.append(_row(len(rows) + 1, a.kind, a.bytes, a.shapes, a.in_loop, what))
        elif not any(a is c for c in norms):
            b = grads.get(id(a)) or gathers.get(id(a))
            more = f" + {len(b.names) - 3} more" if b and len(b.names) > 3 else ""
            what = f"{'gradients' if id(a) in grads else 'parameters'}: {', '.join(b.names[:3])}{more}" if b else ""
            what = what or (unplanned if a.bytes > 8 else "loss and token count")
            rows.append(_row(len(rows) + 1, a.kind, a.bytes, a.shapes, a.in_loop, what))
    return rows


def _row(i: int, kind: str, nbytes: int, shapes: list[str], in_loop: bool, what: str) -> str:
    """One line of the table, in the header's columns."""
    return f"{i:>3}  {kind:<14} {nbytes:>13,}  {_result(shapes):<18} {'yes' if in_loop else 'no':<9}  {what}"


def _result(shapes: list[str], width: int = 18) -> str:
    """A collective's result shapes in at most `width` characters: `f32[2]`, or `72 x f32[]` for a tuple."""
    counts = {s: shapes.count(s) for s in shapes}  # in order of first appearance
    text = " ".join(s if k == 1 else f"{k} x {s}" for s, k in counts.items())
    return text if len(text) <= width else f"{len(shapes)} arrays"


def _match(found: list, kind: str, buckets: list, elements: list[int]) -> dict:
    """Which collectives of `kind` carry a bucket: id(collective) -> its planned bucket, matched by element count
    (`elements[i]`, padded under zero1: for a reduce-scatter, its result's elements times the group)."""
    unused = list(zip(buckets, elements, strict=True))
    out = {}
    for a in found:
        if a.kind != kind or len(a.shapes) != 1:
            continue
        count = a.bytes // _DTYPE_BYTES[a.shapes[0].split("[")[0]]
        match = next((pair for pair in unused if pair[1] == count), None)
        if match is not None:
            unused.remove(match)
            out[id(a)] = match[0]
    return out
