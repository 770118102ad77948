"""Where a train step's time goes, jdp beside a compiled PyTorch loop: jdp's jitted step under jax's profiler and
scripts/bench_torch.py's `torch.compile`d step (the same model, batch and AdamW) under torch's profiler, each split
the same way: forward, backward and update, each into matrix multiplies, attention's, layout (transposes and
copies) and the rest (fused elementwise work, norms, softmax, the loss, the optimizer's arithmetic).

    python scripts/profile_step.py llama-tiny                  # both sides on every core of this machine
    python scripts/profile_step.py llama-tiny --cores 1        # both pinned to one core: the parts add up to the step
    python scripts/profile_step.py llama-tiny --side jdp --out runs/prof   # one side; keeps jax's trace for xprof

Each side runs in a process of its own, pinned to the first `--cores` cores, on random tokens, timing `--steps`
steps after 3 untimed ones. It prints ms per step per part and what runs the matrix multiplies (XLA's thunks:
YNNPACK fusions, Eigen dots, oneDNN calls; torch: its BLAS), and writes OUT/profile.json. On one core the parts of
a side add up to its step; on several, XLA runs independent operations on different cores at once, so its parts
are thread time and add up to more than the step (the line `busy` says how much more). The split is by the name
each framework gives an operation: jax's `jvp(...)` (forward), `transpose(jvp(...))` (backward) and the rest
(update, with the gradient norm); torch's `record_function` phases in bench_torch.py. Needs torch
(`pip install -e ".[bench]"`).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PHASES = ("forward", "backward", "update")
KINDS = ("matmul", "attention", "layout", "other")


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", nargs="?", default="llama-tiny")
    ap.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)), help="pin each side to this many")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--side", choices=["jdp", "torch", "both"], default="both")
    ap.add_argument("--out", type=Path, help="keep profile.json (and jax's trace) here")
    return ap.parse_args()


def pin(cores: int) -> None:
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:cores])


# --- jdp: jax's profiler -------------------------------------------------------------------------------------------


def hlo_kinds(text: str) -> dict[str, tuple[str, str, str]]:
    """Every instruction of a compiled HLO module: name -> (phase, kind, library). A fusion counts as a matmul
    when its fused computation holds a dot; the phase is read from the op_name jax gives it."""
    bodies: dict[str, str] = {}
    for m in re.finditer(r"^(?:ENTRY )?%?([\w.-]+) [^\n]*\{\n(.*?)^\}", text, re.S | re.M):
        bodies[m.group(1)] = m.group(2)
    out = {}
    for line in text.splitlines():
        m = re.match(r"\s+(?:ROOT )?%?([\w.-]+) = \S+ (\w[\w-]*)\(", line)
        if not m:
            continue
        name, opcode = m.groups()
        calls = re.search(r"calls=%?([\w.-]+)", line)
        body = bodies.get(calls.group(1), "") if calls else ""
        op_name = found.group(1) if (found := re.search(r'op_name="([^"]*)"', line)) else ""
        dot = opcode == "dot" or " dot(" in body or "onednn" in line and "matmul" in line.lower()
        library = ("YNNPACK" if "__ynn" in line else "oneDNN" if "onednn" in line.lower() else "Eigen") if dot else ""
        phase = "backward" if "transpose(jvp" in op_name else "forward" if "jvp(" in op_name else "update"
        if dot:
            kind = "attention" if re.search(r"\w+,\w+->\w+", op_name) else "matmul"  # jdp's attention einsums
        elif opcode in ("copy", "transpose") or op_name.endswith(("/transpose", "/copy")):
            kind = "layout"
        else:
            kind = "other"
        out[name] = (phase, kind, library)
    return out


def profile_jdp(args: argparse.Namespace, out: Path) -> dict:
    from step_time import compiled_step  # this script's neighbour: the step as `jdp train` builds it

    step, state, batch, _ = compiled_step(args.config, [])
    import jax

    hlo = step.lower(state, batch).compile().as_text()
    (out / "jdp-step.hlo.txt").write_text(hlo)  # the thunks' names are its instructions'
    kinds = hlo_kinds(hlo)
    for _ in range(3):
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    trace = out / "jax-trace"
    jax.profiler.start_trace(str(trace))
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(args.steps):
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    jax.profiler.stop_trace()
    data = jax.profiler.ProfileData.from_file(str(max(trace.rglob("*.xplane.pb"), key=os.path.getmtime)))
    parts, libraries, unknown = collections.Counter(), collections.Counter(), collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            if not line.name.startswith("tf_XLAEigen"):  # XLA:CPU's worker threads run the thunks
                continue
            for ev in line.events:
                if ev.name not in kinds:
                    unknown[ev.name] += ev.duration_ns
                    continue
                phase, kind, library = kinds[ev.name]
                parts[f"{phase}/{kind}"] += ev.duration_ns / 1e6 / args.steps
                if library:
                    libraries[library] += ev.duration_ns / 1e6 / args.steps
    unknown.pop("ThunkExecutor::Execute", None)
    return dict(side="jdp (XLA)", ms_per_step=wall / args.steps * 1e3, cores_busy=cpu / wall, parts=dict(parts),
                matmul_by=dict(libraries),
                unattributed_ms=sum(unknown.values()) / 1e6 / args.steps, versions=f"jax {jax.__version__}")  # fmt: skip


# --- torch: its profiler -------------------------------------------------------------------------------------------

MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "mkldnn", "aten::_mkl")
LAYOUT = ("aten::copy_", "aten::clone", "aten::contiguous", "aten::transpose", "aten::permute", "aten::t")


def profile_torch(args: argparse.Namespace, out: Path) -> dict:
    import bench_torch  # this script's neighbour, as step_time is
    import torch

    targs = bench_torch.parse_args(["--config", args.config, "--compile"])
    torch.set_num_threads(args.cores)
    torch.manual_seed(0)
    model = bench_torch.build(targs)
    n = 3 + args.steps
    tokens = torch.randint(0, targs.vocab_size, (n, targs.global_batch, targs.seq_len + 1))
    step = bench_torch.make_step(model, torch.compile(model), tokens, targs)
    for i in range(3):
        step(i)
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    with prof:
        start, cpu = time.perf_counter(), time.process_time()
        for i in range(3, n):
            step(i)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    parts, libraries = collections.Counter(), collections.Counter()
    for ev in prof.events():
        chain, parent = [ev.name], ev.cpu_parent
        while parent is not None:
            chain.append(parent.name)
            parent = parent.cpu_parent
        phase = next((c for c in chain if c in PHASES), None)
        if phase is None:
            continue
        ms = ev.self_cpu_time_total / 1e3 / args.steps
        if any("scaled_dot_product" in c for c in chain):
            kind = "attention"
        elif ev.name.startswith(MATMULS):
            kind = "matmul"
            libraries["oneDNN" if "mkldnn" in ev.name else "MKL/BLAS (aten::mm)"] += ms
        elif ev.name in LAYOUT:
            kind = "layout"
        else:
            kind = "other"
        if ev.name not in PHASES:
            parts[f"{phase}/{kind}"] += ms
    blas = re.search(r"BLAS_INFO=(\w+)", torch.__config__.show())
    prof.export_chrome_trace(str(out / "torch-trace.json"))
    return dict(side="torch.compile", ms_per_step=wall / args.steps * 1e3, cores_busy=cpu / wall, parts=dict(parts),
                matmul_by=dict(libraries),
                versions=f"torch {torch.__version__}, BLAS {blas.group(1) if blas else '?'}")  # fmt: skip


# --- the two side by side ------------------------------------------------------------------------------------------


def table(results: list[dict], cores: int) -> str:
    rows = [f"{'ms per step':<22}" + "".join(f"{r['side']:>16}" for r in results)]
    for phase in PHASES:
        for kind in KINDS:
            key = f"{phase}/{kind}"
            rows.append(f"  {key:<20}" + "".join(f"{r['parts'].get(key, 0.0):>16.1f}" for r in results))
    rows.append(f"  {'busy (sum)':<20}" + "".join(f"{sum(r['parts'].values()):>16.1f}" for r in results))
    rows.append(f"{'step (wall)':<22}" + "".join(f"{r['ms_per_step']:>16.1f}" for r in results))
    rows.append(f"{'cores busy (cpu/wall)':<22}" + "".join(f"{r['cores_busy']:>16.2f}" for r in results))
    for r in results:
        by = ", ".join(f"{k} {v:.1f} ms" for k, v in sorted(r["matmul_by"].items(), key=lambda kv: -kv[1]))
        rows.append(f"{r['side']}: matmuls run by {by or '-'}; {r['versions']}")
    return f"{cores} core(s)\n" + "\n".join(rows)


def main() -> None:
    args = parse()
    out = args.out or Path(tempfile.mkdtemp(prefix="jdp-profile-"))
    out.mkdir(parents=True, exist_ok=True)
    if args.side != "both":
        pin(args.cores)
        result = (profile_jdp if args.side == "jdp" else profile_torch)(args, out)
        (out / f"{args.side}.json").write_text(json.dumps(result))
        return
    results = []
    for side in ("jdp", "torch"):
        cmd = [sys.executable, __file__, args.config, "--side", side, "--cores", str(args.cores),
               "--steps", str(args.steps), "--out", str(out)]  # fmt: skip
        subprocess.run(cmd, check=True)
        results.append(json.loads((out / f"{side}.json").read_text()))
    (out / "profile.json").write_text(json.dumps(dict(config=args.config, cores=args.cores, sides=results), indent=1))
    print(table(results, args.cores))
    print(f"wrote {out / 'profile.json'}")


if __name__ == "__main__":
    main()
