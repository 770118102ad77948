"""The XLA options jdp wants before JAX starts: its gradient collectives' flags, the persistent compilation cache,
and the host allocator setting that keeps XLA's scratch memory (each measured in docs/performance.md)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from jdp.log import logger

__all__ = [
    "CACHE_OFF_ACROSS_PROCESSES", "SCRATCH_LATE", "collective_flags", "keep_scratch_memory", "no_cache_across_processes",
    "platform_problem", "set_xla_flags", "use_compilation_cache",
]

log = logger("jdp.xla")


def collective_flags(bucket_mb: float, combine_cpu_all_reduces: bool = False) -> dict[str, str]:
    """The XLA options jdp wants for its gradient collectives (see set_xla_flags). combine_cpu_all_reduces: the
    strategy's all-reduces are scalars only (zero1), so XLA:CPU may merge them (parallel/strategies/__init__.py)."""
    threshold = int(bucket_mb * 2**20) if bucket_mb > 0 else 2**40
    flags = {
        # GPUs: collectives already run asynchronously by default in this XLA; the latency-hiding scheduler
        # moves each bucket's all-reduce-start as early as its gradients exist, so it overlaps the rest of
        # backward, and a dedicated high-priority stream keeps it from queueing behind compute kernels.
        "xla_gpu_enable_latency_hiding_scheduler": "true",
        "xla_gpu_enable_highest_priority_async_stream": "true",
        # XLA merges neighbouring collectives up to this size: the bucket size, so it keeps jdp's buckets (zero1's
        # reduce-scatters and all-gathers too), and merges the small all-reduces (loss, norms) into one.
        "xla_gpu_all_reduce_combine_threshold_bytes": str(threshold),
        "xla_gpu_reduce_scatter_combine_threshold_bytes": str(threshold),
        "xla_gpu_all_gather_combine_threshold_bytes": str(threshold),
    }
    if not combine_cpu_all_reduces:
        # CPU: XLA would merge every all-reduce of the step into one; keep the buckets as planned. zero1's only
        # all-reduces are scalars (a gradient norm's partial sum per parameter): merged, they are one round trip.
        flags["xla_disable_hlo_passes"] = "cpu-all-reduce-combiner"
    return flags


def set_xla_flags(
    bucket_mb: float = 25.0, environ: dict | None = None, combine_cpu_all_reduces: bool = False
) -> list[str]:
    """Add jdp's collective options to XLA_FLAGS where the user has not set them; returns the ones added.

    XLA reads XLA_FLAGS once, when JAX first touches a device: call this before that (`jdp train` does).
    A flag already in XLA_FLAGS is left exactly as the user set it. No XLA:CPU speed option is added: none
    measured faster on every kind of CPU this project runs on (docs/performance.md), so XLA's defaults stand.
    """
    environ = os.environ if environ is None else environ
    current = environ.get("XLA_FLAGS", "")
    present = set(re.findall(r"--([\w]+)", current))
    wanted = collective_flags(bucket_mb, combine_cpu_all_reduces)
    added = [f"--{k}={v}" for k, v in wanted.items() if k not in present]
    if added:
        environ["XLA_FLAGS"] = " ".join([current, *added]).strip()
    return added


CACHE_OFF_ACROSS_PROCESSES = (
    "off (several processes: JAX keys its entries per process, so only process 0 would read them; docs/performance.md#compile-once)"
)


def no_cache_across_processes() -> None:
    """JAX's persistent compilation cache off in this process of a multi-process job, before anything compiles:
    JAX's key holds the process (process 1 never finds what process 0 wrote, measured on jaxlib 0.10.2-0.12.1), so the
    cache saves a restart no time (every step waits for the process that compiled), and on jaxlib 0.12.1 (CPU,
    gloo) the first step never finishes where process 0 read it from the cache and the others compiled it."""
    import jax

    jax.config.update("jax_enable_compilation_cache", False)


def use_compilation_cache(directory: str | Path) -> str | None:
    """Keep compiled programs in JAX's persistent cache at `directory`, unless JAX_COMPILATION_CACHE_DIR (or
    jax.config) already names one: a restart, a resume or a second run of the same config then loads its
    step instead of compiling it. Call before the first compilation. Returns the directory in use, or None in a
    job of several processes (CACHE_OFF_ACROSS_PROCESSES)."""
    import jax

    if jax.process_count() > 1:
        no_cache_across_processes()
        return None
    if jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    Path(directory).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    if jax.config.jax_compilation_cache_max_size < 0:
        # Bounded; and with a bound JAX takes a file lock around every read and write, so the processes of a
        # job (or two jobs) sharing the directory never read a half-written entry.
        jax.config.update("jax_compilation_cache_max_size", 8 * 2**30)
    return str(directory)


SCRATCH_LATE = "malloc's settings for the scratch memory come after jdp's threads started"
_kept = False  # keep_scratch_memory has changed malloc in this process
_GPU_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin")


def keep_scratch_memory(environ: dict | None = None) -> bool:
    """Keep XLA:CPU's per-step scratch memory mapped from one step to the next; True if this changed malloc.

    XLA:CPU allocates a step's temporaries as one large block from a worker thread. glibc serves a block that
    large from a thread's arena with a fresh mmap and unmaps it when freed, so every step page-faults all of it
    in again (docs/performance.md has the measurement). One arena (the main heap, which has no size cap), no
    mmap and no trimming keep the block between steps, as PyTorch's caching allocators keep theirs; the price
    is that freed host memory goes back to the OS only at exit. Call it before JAX first touches a device
    (`jdp train` does). It does nothing where the C library is not glibc, where a GPU plugin is installed and
    JAX_PLATFORMS does not say cpu (temporaries live on the GPU there), or where the user set malloc options of
    their own (MALLOC_*, GLIBC_TUNABLES). Call it before any thread starts (`jdp train` calls it first); after one
    of jdp's own it warns. A second call does nothing (False).
    """
    import ctypes
    import importlib.util
    import platform

    environ = os.environ if environ is None else environ
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    if any(k.startswith("MALLOC_") for k in environ) or "glibc.malloc" in environ.get("GLIBC_TUNABLES", ""):
        return False
    cpu_only = environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu"
    if not cpu_only and any(importlib.util.find_spec(name) for name in _GPU_PLUGINS):
        return False
    global _kept
    if _kept:
        return False
    import threading

    if ours := sorted(t.name for t in threading.enumerate() if t.name.startswith("jdp-")):
        log.warning(
            f"{SCRATCH_LATE} ({', '.join(ours)}): a thread that has called malloc has an arena of its own, which "
            f"XLA's workers can take, and the scratch memory may then be faulted in again every step (20% slower "
            f"on llama-tiny). Call jdp.job.xla.keep_scratch_memory() before starting threads"
        )
    mallopt = ctypes.CDLL(None).mallopt
    M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8  # <malloc.h>
    _kept = bool(mallopt(M_ARENA_MAX, 1) & mallopt(M_MMAP_MAX, 0) & mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
    return _kept


def platform_problem(error: BaseException, environ=os.environ) -> str | None:
    """What to say when JAX could not start the platform JAX_PLATFORMS names (`cuda` on a CPU-only jaxlib fails
    with a bare AssertionError in JAX 0.10, "Unable to initialize backend" in later ones); None for other errors."""
    platforms = environ.get("JAX_PLATFORMS", "").strip()
    text = str(error)
    if not platforms or not (isinstance(error, AssertionError) or "Unable to initialize backend" in text):
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        jaxlib = f"jaxlib {version('jaxlib')}"
    except PackageNotFoundError:
        jaxlib = "this jaxlib"
    why = f": {text.split(' (set JAX_PLATFORMS')[0]}" if text else ""
    return (f"JAX_PLATFORMS={platforms}: JAX could not start that platform with {jaxlib}{why}; for NVIDIA GPUs "
            f"install the CUDA build (pip install -e \".[cuda12]\"), or unset JAX_PLATFORMS to use the devices this "
            f"machine has")  # fmt: skip
