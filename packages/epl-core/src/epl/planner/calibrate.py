"""``epl calibrate``: measure this machine's GEMM throughput and collective bandwidth, as a planner device profile.

- **GEMM**: square matrix products of ``size`` in the chosen dtype on the local device (the GPU when there is
  one), timed for about ``seconds`` after a warm-up; FLOP/s = ``2·n³`` per product.
- **Collectives**: two processes on this machine (loopback only; NCCL on two GPUs, else gloo) all-reduce a
  64 MiB tensor; the bus bandwidth is ``2(n-1)/n`` of the bytes over the time, as nccl-tests report it. Every
  wait has a timeout.

Given ``base`` (a named profile, the device this machine has), the result keeps the datasheet's peak and sets
the efficiency to the measured fraction of it and the bandwidth inside a node to the measured one. Without it,
the measured throughput is the profile's peak (efficiency 1.0), which is what a CPU has.
"""

from __future__ import annotations

import datetime
import os
import time
from dataclasses import replace
from typing import Any

import torch

from epl.errors import EplError
from epl.planner.devices import PROFILES, DeviceProfile

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
COLLECTIVE_BYTES = 64 * 2**20
TIMEOUT_S = 120


def gemm_flops(dtype: str = "fp32", size: int = 2048, seconds: float = 1.0, device: str | None = None) -> float:
    """FLOP/s of ``size`` x ``size`` products in ``dtype`` on ``device`` (the GPU if any, else the CPU)."""
    where = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    a = torch.randn(size, size, device=where).to(_DTYPES[dtype])
    b = torch.randn(size, size, device=where).to(_DTYPES[dtype])
    torch.matmul(a, b)
    _sync(where)
    products, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds or products < 3:
        torch.matmul(a, b)
        products += 1
        if products % 8 == 0:
            _sync(where)
    _sync(where)
    return 2 * size**3 * products / (time.perf_counter() - start)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _all_reduce_rank(rank: int, port: int, rounds: int, results: Any) -> None:
    import torch.distributed as dist

    use_nccl = torch.cuda.device_count() >= 2
    device = torch.device("cuda", rank) if use_nccl else torch.device("cpu")
    dist.init_process_group(
        "nccl" if use_nccl else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )  # fmt: skip
    try:
        tensor = torch.ones(COLLECTIVE_BYTES // 4, device=device)
        dist.all_reduce(tensor)
        _sync(device)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(rounds):
            dist.all_reduce(tensor)
        _sync(device)
        elapsed = time.perf_counter() - start
        if rank == 0:
            results.put(rounds * COLLECTIVE_BYTES / elapsed)  # algorithm bandwidth; bus = x 2(n-1)/n = x 1
    finally:
        dist.destroy_process_group()


def all_reduce_bandwidth(rounds: int = 5) -> float:
    """Bus bandwidth (bytes/s) of an all-reduce between two processes on this machine."""
    import torch.multiprocessing as mp

    from epl.ports import free_port

    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=_all_reduce_rank, args=(r, port, rounds, results)) for r in range(2)]
    for process in processes:
        process.start()
    try:
        bandwidth = results.get(timeout=TIMEOUT_S)
    except Exception as exc:  # queue.Empty, or a rank died
        raise EplError(
            f"The all-reduce between two local processes did not finish within {TIMEOUT_S} s; exit codes "
            f"{[p.exitcode for p in processes]}."
        ) from exc
    finally:
        for process in processes:
            process.join(timeout=TIMEOUT_S)
            if process.is_alive():
                process.kill()
    return float(bandwidth)


def calibrate(dtype: str = "fp32", base: str | None = None, seconds: float = 1.0, size: int = 2048) -> DeviceProfile:
    """A profile of this machine: measured GEMM FLOP/s and all-reduce bandwidth (see the module's documentation)."""
    flops = gemm_flops(dtype, size, seconds)
    bandwidth = all_reduce_bandwidth()
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    measured = f"epl calibrate on {os.uname().nodename}, {when}"
    if base is not None:
        if base not in PROFILES:
            raise EplError(f"--base {base!r} is not a device profile: one of {', '.join(PROFILES)}.")
        named = PROFILES[base]
        sources = {**named.sources, "efficiency": f"{measured}: {size}^2 {dtype} GEMMs", "intra_node": measured}
        return replace(named, efficiency=flops / named.peak(dtype), intra_node_bandwidth=bandwidth, sources=sources)
    memory = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else _host_memory()
    return DeviceProfile(
        name=f"calibrated-{os.uname().nodename}",
        flops={dtype: flops},
        memory_bytes=memory,
        intra_node_bandwidth=bandwidth,
        inter_node_bandwidth=bandwidth,
        efficiency=1.0,
        sources={"flops": f"{measured}: {size}^2 {dtype} GEMMs", "intra_node": measured,
                 "inter_node": "not measured (one machine): the same as inside it", "memory": "this machine"},
    )  # fmt: skip


def _host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
