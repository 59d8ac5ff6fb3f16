"""``epl calibrate``: measure this machine's GEMM throughput and collective bandwidth, as a planner device profile.

- **GEMM**: square matrix products of ``size`` in the chosen dtype on the local device (the GPU when there is
  one), timed for about ``seconds`` after a warm-up; FLOP/s = ``2·n³`` per product. Measured in two processes at
  once, as training runs (on a CPU they share its caches and memory bandwidth; 3% slower than one alone here),
  except with one GPU, which only one process uses.
- **Collectives**: two processes on this machine (loopback only; NCCL on two GPUs, else gloo) all-reduce a
  64 MiB tensor; the bus bandwidth is ``2(n-1)/n`` of the bytes over the time, as nccl-tests report it. Every
  wait has a timeout. Also timed there: a 1 MiB all-reduce, whose time beyond its bytes at that bandwidth is a
  collective's latency (the alpha of the alpha-beta model, fitted on two sizes), and the 64 MiB all-reduce started
  while matrix products of about its duration run (the fraction of it that hides: ``overlap``).
- **Host overheads** (CPU only; a GPU's kernels outlast their launches): a tiny transformers Llama's forward and
  backward at 1 and 3 layers, whose time is module calls and dispatch, not arithmetic: the time per block, and
  per micro-batch besides.
- **Optimizer**: torch's Adam stepping 4M parameters in 64 tensors, as a rate of the bytes the planner counts for
  it.
- **Memory bandwidth**: what an RMSNorm, a gated activation and a residual add over a float32 tensor move forward
  and backward (the passes :mod:`epl.planner.memory_traffic` counts) over their time: the bandwidth eager
  elementwise kernels reach, which is below the streaming figure of a datasheet.

Given ``base`` (a named profile, the device this machine has), the result keeps the datasheet's peak and sets
the efficiency to the measured fraction of it and the bandwidth inside a node to the measured one. Without it,
the measured throughput is the profile's peak (efficiency 1.0), which is what a CPU has.
"""

from __future__ import annotations

import datetime
import os
import statistics
import time
from dataclasses import replace
from typing import Any

import torch

from epl.errors import EplError
from epl.planner import memory_traffic
from epl.planner.devices import PROFILES, DeviceProfile, host_memory

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
COLLECTIVE_BYTES = 64 * 2**20
TIMEOUT_S = 120
LATENCY_ROUNDS = 20
REPEATS = 3
LATENCY_BYTES = 2**20


def gemm_flops(dtype: str = "fp32", size: int = 2048, seconds: float = 1.0, device: str | None = None) -> float:
    """FLOP/s of ``size`` x ``size`` products in ``dtype`` on ``device`` (the GPU if any, else the CPU)."""
    where = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    a = torch.randn(size, size, device=where).to(_DTYPES[dtype])
    b = torch.randn(size, size, device=where).to(_DTYPES[dtype])
    return 2 * size**3 * _rounds_per_second(lambda: torch.matmul(a, b), seconds, where)


def _rounds_per_second(work: Any, seconds: float, device: torch.device) -> float:
    """How many times a second ``work`` runs on ``device``: once to warm up, then for about ``seconds`` (at least 3
    rounds), synchronizing every 8 so that a GPU's queue stays short."""
    work()
    _sync(device)
    rounds, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds or rounds < 3:
        work()
        rounds += 1
        if rounds % 8 == 0:
            _sync(device)
    _sync(device)
    return rounds / (time.perf_counter() - start)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory_bandwidth(seconds: float = 0.5, rows: int = 2048, width: int = 1024, device: str | None = None) -> float:
    """Bytes/s the memory-bound work of a block moves, as PyTorch's eager kernels run it: an RMSNorm, a gated
    activation and a residual add over a ``rows`` x ``width`` float32 tensor, forward and backward, timed, over
    the bytes :mod:`epl.planner.memory_traffic` counts for them (its passes of a norm, a gated activation and a
    residual add, forward and backward)."""
    where = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    x = torch.randn(rows, width, device=where, requires_grad=True)
    weight = torch.ones(width, device=where, requires_grad=True)

    def block() -> None:
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight
        (torch.nn.functional.silu(normed) * normed + x).sum().backward()

    counted = memory_traffic
    passes = counted.NORM_PASSES + counted.ACTIVATION_PASSES + counted.GATE_PASSES + counted.RESIDUAL_PASSES
    passes *= counted.FORWARD_AND_BACKWARD
    return passes * rows * width * 4 * _rounds_per_second(block, seconds, where)


def host_overheads(rounds: int = 30) -> tuple[float, float]:
    """Seconds per block, and per micro-batch besides its blocks, of a tiny transformers Llama's forward and backward
    (16 tokens, width 64: host time, not arithmetic), from models of 1 and 3 layers; (0, 0) without transformers."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        return 0.0, 0.0

    def median_seconds(layers: int) -> float:
        config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=2,
                             num_key_value_heads=1, vocab_size=64, max_position_embeddings=16)  # fmt: skip
        model = LlamaForCausalLM(config)
        tokens = torch.randint(0, 64, (1, 16))
        times = []
        for round_ in range(rounds + 5):
            start = time.perf_counter()
            model(input_ids=tokens, labels=tokens).loss.backward()
            if round_ >= 5:
                times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    one, three = median_seconds(1), median_seconds(3)
    block = max(0.0, (three - one) / 2)
    return block, max(0.0, one - block)


def optimizer_bandwidth(parameters: int = 2**22, tensors: int = 64, steps: int = 5) -> float:
    """The rate of torch's Adam step (foreach, on the local device) in the bytes
    :func:`epl.planner.memory_traffic.optimizer_bytes` counts for it."""
    where = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    params = [torch.nn.Parameter(torch.randn(parameters // tensors, device=where)) for _ in range(tensors)]
    for param in params:
        param.grad = torch.randn_like(param)
    adam = torch.optim.Adam(params, lr=1e-4)
    adam.step()
    seconds = _timed(lambda: [adam.step() for _ in range(steps)], where) / steps
    return memory_traffic.optimizer_bytes(parameters, 2) / seconds


def _collectives_rank(rank: int, port: int, rounds: int, gemm: tuple[str, int, float] | None, results: Any) -> None:
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
        alone = _timed(lambda: [dist.all_reduce(tensor) for _ in range(rounds)], device) / rounds
        small = torch.ones(LATENCY_BYTES // 4, device=device)
        latencies, hidden = [], []
        a = torch.randn(512, 512, device=device)
        products = max(1, int(alone * 8 / _timed(lambda: [torch.matmul(a, a) for _ in range(8)], device)))

        def both() -> None:
            work = dist.all_reduce(tensor, async_op=True)
            for _ in range(products):
                torch.matmul(a, a)
            work.wait()

        for _ in range(REPEATS):  # each figure the median of REPEATS measurements: a busy machine moves them
            dist.barrier()
            small_time = _timed(lambda: [dist.all_reduce(small) for _ in range(LATENCY_ROUNDS)], device)
            # the alpha of alpha-beta, from 2 sizes
            latencies.append(max(0.0, small_time / LATENCY_ROUNDS - LATENCY_BYTES * alone / COLLECTIVE_BYTES))
            compute = _timed(lambda: [torch.matmul(a, a) for _ in range(products)], device)
            dist.barrier()
            together = _timed(both, device)
            hidden.append((alone + compute - together) / min(alone, compute))
        latency, overlap = statistics.median(latencies), min(1.0, max(0.0, statistics.median(hidden)))
        dist.barrier()
        concurrent = gemm_flops(*gemm, device=str(device)) if gemm else None  # both ranks at once, as in training
        if rank == 0:
            results.put({"bandwidth": COLLECTIVE_BYTES / alone, "latency": latency, "overlap": overlap,
                         "concurrent_flops": concurrent})  # fmt: skip
    finally:
        dist.destroy_process_group()


def _first_result(results: Any, processes: list[Any]) -> Any:
    """What a rank put on ``results``; raises ``queue.Empty`` after :data:`TIMEOUT_S`, or once every rank exited."""
    import queue

    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            return results.get(timeout=1.0)
        except queue.Empty:
            if not any(process.is_alive() for process in processes):
                break
    raise queue.Empty


def _timed(work: Any, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    work()
    _sync(device)
    return time.perf_counter() - start


def collectives(rounds: int = 5, gemm: tuple[str, int, float] | None = ("fp32", 512, 0.5)) -> dict[str, Any]:
    """Between two processes on this machine: the GEMM FLOP/s of ``gemm`` (dtype, size, seconds) while both
    compute at once (on a CPU, or on one GPU each; None: not measured), an all-reduce's bus bandwidth (bytes/s),
    its latency (s), and the fraction of an all-reduce that hides behind matrix products running meanwhile."""
    import torch.multiprocessing as mp

    from epl.ports import free_port

    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=_collectives_rank, args=(r, port, rounds, gemm, results)) for r in range(2)]
    for process in processes:
        process.start()
    try:
        measured = _first_result(results, processes)
    except Exception as exc:  # queue.Empty, or a rank died
        raise EplError(
            f"The collectives between two local processes did not finish within {TIMEOUT_S} s; exit codes "
            f"{[p.exitcode for p in processes]}."
        ) from exc
    finally:
        for process in processes:
            process.join(timeout=TIMEOUT_S)
            if process.is_alive():
                process.kill()
    return dict(measured)


def calibrate(dtype: str = "fp32", base: str | None = None, seconds: float = 1.0, size: int = 2048) -> DeviceProfile:
    """A profile of this machine: measured GEMM FLOP/s and all-reduce bandwidth (see the module's documentation)."""
    one_gpu = torch.cuda.device_count() == 1  # the two ranks would share no GPU: their GEMMs would run on the CPU
    measured_collectives = collectives(gemm=None if one_gpu else (dtype, size, seconds))
    flops = gemm_flops(dtype, size, seconds) if one_gpu else measured_collectives["concurrent_flops"]
    bandwidth = measured_collectives["bandwidth"]
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    measured = f"epl calibrate on {os.uname().nodename}, {when}"
    block_overhead, micro_batch_overhead = (0.0, 0.0) if torch.cuda.is_available() else host_overheads()
    local = {
        "block_overhead_s": block_overhead,
        "micro_batch_overhead_s": micro_batch_overhead,
        "memory_bandwidth": memory_bandwidth(seconds / 2),
        "optimizer_bandwidth": optimizer_bandwidth(),
        "collective_latency_s": measured_collectives["latency"],
        "overlap": measured_collectives["overlap"],
    }
    local_sources = {key: measured for key in local}
    if base is not None:
        if base not in PROFILES:
            raise EplError(f"--base {base!r} is not a device profile: one of {', '.join(PROFILES)}.")
        named = PROFILES[base]
        sources = {**named.sources, "efficiency": f"{measured}: {size}^2 {dtype} GEMMs", "intra_node": measured,
                   **local_sources}  # fmt: skip
        return replace(
            named, efficiency=flops / named.peak(dtype), intra_node_bandwidth=bandwidth, sources=sources, **local
        )
    memory = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else host_memory()
    return DeviceProfile(
        name=f"calibrated-{os.uname().nodename}",
        flops={dtype: flops},
        memory_bytes=memory,
        intra_node_bandwidth=bandwidth,
        inter_node_bandwidth=bandwidth,
        efficiency=1.0,
        **local,
        sources={"flops": f"{measured}: {size}^2 {dtype} GEMMs", "intra_node": measured,
                 "inter_node": "not measured (one machine): the same as inside it", "memory": "this machine",
                 **local_sources},
    )  # fmt: skip
