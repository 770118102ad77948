"""Hardware datasheets: GPU peak FLOP/s and memory, and the bus bandwidths of the links between GPUs.

Plain tables (no JAX): MFU (metrics.py) and the planner (plan.py) read them, and the command line names them in
its help.
"""

from __future__ import annotations

from dataclasses import dataclass

from jdp.errors import ConfigError

__all__ = [
    "DEFAULT_MFU",
    "GPUS",
    "GPU_PEAK_FLOPS",
    "INTERCONNECTS",
    "ISA_FLAGS",
    "Gpu",
    "Interconnect",
    "gpu_spec",
    "host_description",
    "link_for",
]

DEFAULT_MFU = 0.5  # what `jdp plan` assumes: a well-tuned dense transformer step reaches 40-60% of the datasheet peak

# Dense (not sparse) peak FLOP/s per device from the vendors' datasheets, by compute dtype. float32 matmuls
# on these GPUs run on tensor cores as TF32 by XLA's default precision, so the TF32 peak is listed.
GPU_PEAK_FLOPS = {
    "B200": {"bfloat16": 2250e12, "float16": 2250e12, "float32": 1100e12},
    "H200": {"bfloat16": 989e12, "float16": 989e12, "float32": 494e12},
    "H100": {"bfloat16": 989e12, "float16": 989e12, "float32": 494e12},  # SXM; PCIe is lower
    "A100": {"bfloat16": 312e12, "float16": 312e12, "float32": 156e12},
    "L40S": {"bfloat16": 362e12, "float16": 362e12, "float32": 183e12},
    "L4": {"bfloat16": 121e12, "float16": 121e12, "float32": 60e12},
    "A10": {"bfloat16": 125e12, "float16": 125e12, "float32": 62.5e12},
    "V100": {"float16": 125e12, "float32": 15.7e12},
}


@dataclass(frozen=True)
class Interconnect:
    busbw_gbs: float  # achievable all-reduce bus bandwidth per GPU, GB/s, in nccl-tests' "busbw" sense
    latency_us: float  # fixed cost of one all-reduce (one bucket), whatever its size
    about: str


# Achievable (not line-rate) bus bandwidths of large all-reduces, from nccl-tests reports: busbw is defined so
# that a ring all-reduce of S bytes over N GPUs takes 2 (N-1)/N x S / busbw. The latencies are rough orders of
# magnitude of a small all-reduce at that scale.
#
# Across nodes NCCL runs several rings at once, one per NIC, and each ring crosses each node boundary once, so
# a ring over many 8-GPU nodes gets about the node's total NIC bandwidth (nccl-tests#119: 4 x 200 Gb/s NICs
# per 8 A100s reached 86-96 of 100 GB/s). The network entries are therefore per node, for one NIC per GPU
# (the DGX/HGX layout), and a ring over several nodes runs at the slower of them and the link inside the node.
INTERCONNECTS = {
    # NVLink 5, 900 GB/s per direction. NCCL's ring search reports maxBw 721.8 on 8 B200s (nccl#1807);
    # NVLink SHARP reaches ~830 there.
    "nvlink5": Interconnect(720, 10, "B200 NVLink 5, 8-GPU NVSwitch node"),
    # NVLink 4, 450 GB/s per direction: rings reach ~370 GB/s (nccl#1374); NVLink SHARP ~480 (nccl-tests#290).
    "nvlink4": Interconnect(370, 10, "H100/H200 SXM NVLink 4, 8-GPU NVSwitch node"),
    # NVLink 3, 300 GB/s per direction: 232.5 GB/s on 8 A100s (nccl-tests#175), ~200 in #149.
    "nvlink3": Interconnect(230, 10, "A100 SXM NVLink 3, 8-GPU NVSwitch node"),
    # PCIe Gen5 x16, 64 GB/s per direction: assumed, like pcie4, half the link.
    "pcie5": Interconnect(32, 15, "PCIe Gen5 x16, no NVLink"),
    # PCIe Gen4 x16, 32 GB/s per direction; GPUs talking through the CPU reach about half (~17 in nccl-tests#128).
    "pcie4": Interconnect(16, 15, "PCIe Gen4 x16, no NVLink (L4, L40S, A10 servers)"),
    # ~46 GB/s per 400 Gb/s NDR NIC (46-48 per NVIDIA, nccl-tests#290), x 8 NICs per node.
    "ib-ndr": Interconnect(368, 30, "8 x 400 Gb/s InfiniBand NDR per 8-GPU node (DGX/HGX H100, H200, B200)"),
    # ~23 GB/s per 200 Gb/s HDR NIC (nccl-tests#119, #175), x 8 NICs per node.
    "ib-hdr": Interconnect(184, 30, "8 x 200 Gb/s InfiniBand HDR per 8-GPU node (DGX A100)"),
    # 12.2 GB/s is "as good as you can get" from one 100 Gb/s NIC (nccl-tests#29).
    "ethernet-100g": Interconnect(11, 50, "one 100 Gb/s Ethernet NIC per node"),
}


@dataclass(frozen=True)
class Gpu:
    name: str  # its key in jdp.metrics.GPU_PEAK_FLOPS, the datasheet peaks jdp's MFU uses
    memory_gb: float  # datasheet memory, GB (1e9 bytes)
    intra: str  # the link inside a node (an INTERCONNECTS name)
    inter: str  # the network between nodes
    per_node: int = 8

    def peak_flops(self, dtype: str) -> float:
        table = GPU_PEAK_FLOPS[self.name]
        if dtype not in table:
            raise ConfigError(f"no {dtype} peak for {self.name} (known: {', '.join(table)}); change model.dtype")
        return table[dtype]


GPUS = {
    g.name: g
    for g in [
        Gpu("H100", 80, "nvlink4", "ib-ndr"),  # SXM
        Gpu("H200", 141, "nvlink4", "ib-ndr"),
        Gpu("B200", 180, "nvlink5", "ib-ndr"),
        Gpu("A100", 80, "nvlink3", "ib-hdr"),  # SXM, 80 GB
        Gpu("L40S", 48, "pcie4", "ethernet-100g"),
        Gpu("L4", 24, "pcie4", "ethernet-100g"),
        Gpu("A10", 24, "pcie4", "ethernet-100g"),
    ]
}


def gpu_spec(name: str) -> Gpu:
    if name not in GPUS:
        raise ConfigError(f"unknown GPU {name!r}; known GPUs: {', '.join(GPUS)}")
    return GPUS[name]


def link_for(gpu: Gpu, n: int, interconnect: str | None = None, bandwidth_gbs: float | None = None):
    """(name, bus bandwidth in bytes/s, latency in s per all-reduce) of the ring over n GPUs.

    --bandwidth is a bare number: no latency. --interconnect applies to every N.
    """
    if bandwidth_gbs is not None:
        return f"{bandwidth_gbs:g} GB/s", bandwidth_gbs * 1e9, 0.0
    if interconnect is not None:
        if interconnect not in INTERCONNECTS:
            raise ConfigError(f"unknown interconnect {interconnect!r}; known interconnects: {', '.join(INTERCONNECTS)}")
        link = INTERCONNECTS[interconnect]
        return interconnect, link.busbw_gbs * 1e9, link.latency_us * 1e-6
    intra = INTERCONNECTS[gpu.intra]
    if n <= gpu.per_node:
        return gpu.intra, intra.busbw_gbs * 1e9, intra.latency_us * 1e-6
    inter = INTERCONNECTS[gpu.inter]  # the ring's bandwidth is its slowest link
    return gpu.inter, min(intra.busbw_gbs, inter.busbw_gbs) * 1e9, max(intra.latency_us, inter.latency_us) * 1e-6


ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx_vnni", "amx_tile", "amx_bf16", "asimd", "sve")  # what XLA:CPU uses


def host_description() -> dict:
    """This machine as a benchmark or a speed note should name it: CPU model and vector ISA, cores, and the
    Python and JAX versions (read from package metadata: no JAX import)."""
    import os
    import platform
    from importlib import metadata

    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass

    def version(package: str) -> str | None:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return None

    flags = set(fields.get("flags", fields.get("Features", "")).split())
    return {
        "cpu": fields.get("model name") or platform.processor() or platform.machine(),
        "cpu_family_model": f"{fields.get('vendor_id', '?')} family {fields.get('cpu family', '?')} model "
        f"{fields.get('model', '?')}",
        "isa": [f for f in ISA_FLAGS if f in flags],
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "python": platform.python_version(),
        "jax": version("jax"),
        "jaxlib": version("jaxlib"),
    }
