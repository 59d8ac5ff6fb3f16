"""Device profiles for the planner: peak FLOPs, memory and bandwidths of the GPUs people train on.

Figures are the vendors' datasheet numbers for dense math (no structured sparsity) and one GPU of the usual
server, except memory: ``memory_bytes`` is what torch reports (``torch.cuda.get_device_properties().total_memory``)
where that is known (:data:`REPORTED_MIB`), since a datasheet's "80 GB" or "141 GB" is neither GB nor GiB of usable
memory (SXM boards in HGX/DGX systems, one 400 Gb/s or 200 Gb/s NIC per GPU). Bandwidths are bytes per second in
one direction. ``efficiency`` is the fraction of peak a large bf16 GEMM reaches in training, the one number the
planner fits (``epl calibrate`` measures it on the local machine); the defaults are first guesses until fitted.
``memory_bandwidth`` (the datasheet's HBM figure) times the memory-bound work of a step (norms, residual adds,
activations, the loss, the optimizer's update: :mod:`epl.planner.memory_traffic`). ``collective_latency_s`` is
what one collective costs besides its bytes (NCCL's small-message latency inside a node, about 10-30 us;
``epl calibrate`` measures it), and ``overlap`` the fraction of a backward's time data-parallel communication
can hide behind (1.0 on GPUs, where NCCL runs on its own streams; a CPU whose cores all compute hides little,
and ``epl calibrate`` measures it). ``optimizer_bandwidth``, when set, is the rate of the optimizer's update in
the bytes :mod:`epl.planner.memory_traffic` counts for it (``epl calibrate`` times torch's Adam; 0 uses the
memory bandwidth). ``block_overhead_s`` and ``micro_batch_overhead_s`` are host time that does not
overlap the device's work, per block and per micro-batch (module calls, kernel dispatch, masks, the loss's
bookkeeping): all of it on a CPU, where ``epl calibrate`` measures them; about none on a GPU, whose kernels for a
training micro-batch outlast their launches.
Any profile can be overridden from a JSON file: :func:`device_profile` takes a name or a path.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from epl.errors import EplError

TERA = 10**12
GB = 10**9


@dataclass(frozen=True)
class DeviceProfile:
    """One device's peak FLOP rates by dtype (FLOP/s), memory (bytes), bandwidths (bytes/s, one direction) inside a
    node and between nodes, the fraction of peak training GEMMs reach, its memory bandwidth, a collective's
    latency, how much communication hides behind compute, and where each figure comes from."""

    name: str
    flops: dict[str, float]
    memory_bytes: int
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    efficiency: float = 0.5
    memory_bandwidth: float = 2000 * GB
    collective_latency_s: float = 20e-6
    overlap: float = 1.0
    optimizer_bandwidth: float = 0.0
    block_overhead_s: float = 0.0
    micro_batch_overhead_s: float = 0.0
    sources: dict[str, str] = field(default_factory=dict)

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype`` (``bf16``, ``fp16``, ``fp32``)."""
        if dtype not in self.flops:
            raise EplError(
                f"The device profile {self.name!r} gives no peak for {dtype!r}; it has {sorted(self.flops)}."
            )
        return self.flops[dtype]

    def to_dict(self) -> dict[str, Any]:
        """The profile as JSON data (what :func:`load_profile` reads)."""
        return asdict(self)


MIB = 2**20
#: Memory as torch reports it on each device, in MiB (``total_memory``, the smallest figure seen across driver
#: versions): H100 SXM 80GB 81,082 (79.2 GiB), H200 143,156 (139.8 GiB), B200 182,631 (178.4 GiB), A100 80GB
#: 81,038 and A100 40GB 40,536. The datasheets' "141 GB" and "180 GB" are 7% more than these.
REPORTED_MIB = {"h100-sxm": 81082, "h200": 143156, "b200": 182631, "a100-80gb": 81038, "a100-40gb": 40536}
_REPORTED = "total_memory as torch reports it on this device (REPORTED_MIB)"
_UNCHECKED = " (the datasheet's; not checked against torch's report)"
_NVIDIA = "NVIDIA {} datasheet (dense Tensor Core figures, no sparsity)"
_NVLINK3 = {"intra_node": "NVLink 3: 600 GB/s per GPU both ways", "inter_node": "HDR InfiniBand 200 Gb/s per GPU"}
_NVLINK4 = {"intra_node": "NVLink 4: 900 GB/s per GPU both ways", "inter_node": "NDR InfiniBand 400 Gb/s per GPU"}
PROFILES: dict[str, DeviceProfile] = {
    "a100-40gb": DeviceProfile(
        "a100-40gb", {"bf16": 312 * TERA, "fp16": 312 * TERA, "fp32": 19.5 * TERA}, REPORTED_MIB["a100-40gb"] * MIB,
        intra_node_bandwidth=300 * GB, inter_node_bandwidth=25 * GB, memory_bandwidth=1555 * GB,
        sources={"memory_bandwidth": _NVIDIA.format("A100"),
                 "flops": _NVIDIA.format("A100"), "memory": _REPORTED,
                 **_NVLINK3},
    ),
    "a100-80gb": DeviceProfile(
        "a100-80gb", {"bf16": 312 * TERA, "fp16": 312 * TERA, "fp32": 19.5 * TERA}, REPORTED_MIB["a100-80gb"] * MIB,
        intra_node_bandwidth=300 * GB, inter_node_bandwidth=25 * GB, memory_bandwidth=2039 * GB,
        sources={"memory_bandwidth": _NVIDIA.format("A100 80GB"),
                 "flops": _NVIDIA.format("A100"), "memory": _REPORTED,
                 **_NVLINK3},
    ),
    "h100-sxm": DeviceProfile(
        "h100-sxm", {"bf16": 989 * TERA, "fp16": 989 * TERA, "fp32": 67 * TERA}, REPORTED_MIB["h100-sxm"] * MIB,
        intra_node_bandwidth=450 * GB, inter_node_bandwidth=50 * GB, memory_bandwidth=3350 * GB,
        sources={"memory_bandwidth": _NVIDIA.format("H100 SXM"),
                 "flops": _NVIDIA.format("H100 SXM"), "memory": _REPORTED,
                 **_NVLINK4},
    ),
    "h100-pcie": DeviceProfile(
        "h100-pcie", {"bf16": 756 * TERA, "fp16": 756 * TERA, "fp32": 51 * TERA}, 80 * 2**30,
        intra_node_bandwidth=64 * GB, inter_node_bandwidth=25 * GB, memory_bandwidth=2000 * GB,
        sources={"memory_bandwidth": _NVIDIA.format("H100 PCIe"),
                 "flops": _NVIDIA.format("H100 PCIe"), "memory": _NVIDIA.format("H100 PCIe") + _UNCHECKED,
                 "intra_node": "PCIe Gen5 x16: 64 GB/s per direction (no NVLink bridge)",
                 "inter_node": "200 Gb/s NIC per GPU"},
    ),
    "h200": DeviceProfile(
        "h200", {"bf16": 989 * TERA, "fp16": 989 * TERA, "fp32": 67 * TERA}, REPORTED_MIB["h200"] * MIB,
        intra_node_bandwidth=450 * GB, inter_node_bandwidth=50 * GB, memory_bandwidth=4800 * GB,
        sources={"memory_bandwidth": _NVIDIA.format("H200 SXM"),
                 "flops": _NVIDIA.format("H200 SXM"), "memory": _REPORTED,
                 **_NVLINK4},
    ),
    "b200": DeviceProfile(
        "b200", {"bf16": 2250 * TERA, "fp16": 2250 * TERA, "fp32": 80 * TERA}, REPORTED_MIB["b200"] * MIB,
        intra_node_bandwidth=900 * GB, inter_node_bandwidth=50 * GB, memory_bandwidth=8000 * GB,
        sources={"memory_bandwidth": _NVIDIA.format("HGX B200"),
                 "flops": _NVIDIA.format("HGX B200") + ": 36 PFLOPS sparse bf16 per 8 GPUs",
                 "memory": _REPORTED,
                 "intra_node": "NVLink 5: 1.8 TB/s per GPU, both directions",
                 "inter_node": _NVLINK4["inter_node"]},
    ),
    "l40s": DeviceProfile(
        "l40s", {"bf16": 362 * TERA, "fp16": 362 * TERA, "fp32": 91.6 * TERA}, 48 * GB,
        intra_node_bandwidth=32 * GB, inter_node_bandwidth=25 * GB, memory_bandwidth=864 * GB,
        sources={"memory_bandwidth": _NVIDIA.format("L40S"),
                 "flops": _NVIDIA.format("L40S"), "memory": _NVIDIA.format("L40S") + _UNCHECKED,
                 "intra_node": "PCIe Gen4 x16: 32 GB/s per direction (no NVLink)",
                 "inter_node": "200 Gb/s NIC per GPU"},
    ),
}  # fmt: skip


def host_memory() -> int:
    """Bytes of this host's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device_profile(name_or_path: str) -> DeviceProfile:
    """The named profile (:data:`PROFILES`), or the one a JSON file at ``name_or_path`` gives
    (:func:`load_profile`)."""
    if name_or_path in PROFILES:
        return PROFILES[name_or_path]
    path = Path(name_or_path)
    if path.suffix == ".json" or path.exists():
        return load_profile(path)
    raise EplError(
        f"Unknown device {name_or_path!r}: name one of {', '.join(PROFILES)}, or give a JSON file of a profile "
        "(`epl calibrate` writes one)."
    )


def load_profile(path: str | Path) -> DeviceProfile:
    """A profile from a JSON file: a whole profile, or ``{"base": NAME, ...}`` overriding some fields of a named one."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise EplError(f"Cannot read the device profile {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise EplError(f"The device profile {path} must be a JSON object.")
    base = data.pop("base", None)
    try:
        if base is not None:
            if base not in PROFILES:
                raise EplError(
                    f"The device profile {path} is based on {base!r}, which is not one of {', '.join(PROFILES)}."
                )
            return replace(PROFILES[base], **data)
        return DeviceProfile(**data)
    except TypeError as exc:
        raise EplError(f"The device profile {path} has fields DeviceProfile does not: {exc}") from exc
