"""EPL data parallelism against DistributedDataParallel: same model, same backend, 2 processes, same run.

Also the all_reduce of EPL's torch communicator against a bare torch.distributed.all_reduce,
by message size. Target: EPL/DDP step time <= 1.00.
"""

from __future__ import annotations

from typing import Any

import pytest
from tests.helpers.distributed import run_ranks

from benchmarks.harness import Ratio, ResultRow, Section, ms, record, short_mode

pytestmark = pytest.mark.multiprocess

#: Widths of the MLP: about 9.4M parameters.
WIDTHS = (1024, 2048, 2048, 1024, 1024)
BATCH = 32
#: CI (short mode) only catches gross regressions; a full run checks the target with margin for noise.
MAX_RATIO = 1.5 if short_mode() else 1.10
#: Latency-bound all_reduce sizes (< 64 KiB), and every size in short mode, are only checked for gross regressions.
SMALL_MESSAGE_MAX_RATIO = 4.0
DATA_PARALLEL = Section(
    "Data parallelism",
    __file__,
    "Step time of EPL's data parallelism over `DistributedDataParallel`: the same 9.4M-parameter MLP, "
    "batch 32 per replica, SGD, 2 processes on gloo, rank 0's clock. Both send the same bytes per step. "
    "Target <= 1.00.",
)
ALL_REDUCE = Section(
    "all_reduce by message size",
    __file__,
    "Time of one `all_reduce` through EPL's torch communicator over a bare `torch.distributed.all_reduce` "
    "(both gloo, 2 processes), per message size: the inverse of the bandwidth ratio. Under 64 KiB the "
    "collective is latency-bound and a 2-core machine's scheduling dominates.",
)


def mlp() -> Any:
    from torch import nn

    layers: list[nn.Module] = []
    for a, b in zip(WIDTHS, WIDTHS[1:], strict=False):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def race_against_ddp(rounds: int, steps: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    import epl
    from benchmarks.harness import compare

    epl.init()
    torch.manual_seed(0)
    with epl.replicate(device_count=1):
        ours = mlp()
    engine = epl.parallelize(ours, optimizer=lambda p: torch.optim.SGD(p, lr=1e-3), loss_fn=nn.MSELoss())
    torch.manual_seed(0)
    ddp = DistributedDataParallel(mlp())
    ddp_optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    x, y = torch.randn(BATCH, WIDTHS[0]), torch.randn(BATCH, WIDTHS[-1])

    def ddp_step() -> None:
        for _ in range(steps):
            ddp_optimizer.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            ddp_optimizer.step()

    def epl_step() -> None:
        for _ in range(steps):
            engine.step(x, y)

    reducer = engine.context.gradient_reducer
    result = compare(
        "data_parallel_vs_ddp",
        ddp_step,
        epl_step,
        rounds=rounds,
        calls_per_round=1,
        warmup=2,
        sync=dist.barrier,
        save=dist.get_rank() == 0,
    )
    params = sum(p.numel() for p in ours.parameters())
    return {
        "ratio": result.ratio,
        "ddp_ms": result.baseline_s * 1e3 / steps,
        "epl_ms": result.epl_s * 1e3 / steps,
        "parameters": params,
        "epl_bytes_per_step": reducer.bytes_per_step,
        "ddp_bytes_per_step": params * 4,
    }


def all_reduce_bandwidth(sizes: list[int], rounds: int) -> list[dict[str, Any]]:
    import torch
    import torch.distributed as dist

    import epl
    from benchmarks.harness import compare

    env = epl.init()
    communicator = env.communicator
    rows = []
    for numel in sizes:
        ours, theirs = torch.ones(numel), torch.ones(numel)
        result = compare(
            f"all_reduce_{numel * 4}B",
            lambda t=theirs: dist.all_reduce(t),
            lambda t=ours: communicator.all_reduce(t).wait(),
            rounds=rounds,
            calls_per_round=5,
            warmup=2,
            sync=dist.barrier,
            save=False,
        )
        rows.append(
            {
                "bytes": numel * 4,
                "torch_MBps": numel * 4 / result.baseline_s / 1e6,
                "epl_MBps": numel * 4 / result.epl_s / 1e6,
                "ratio": result.ratio,
            }
        )
    return rows


def size_label(size: int) -> str:
    """``size`` bytes in KiB or MiB when a whole number of them."""
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


def test_data_parallel_step_against_ddp() -> None:
    rounds, steps = (3, 2) if short_mode() else (12, 5)
    first, _ = run_ranks(race_against_ddp, 2, rounds, steps, timeout=600)
    row = ResultRow(
        "Data-parallel step, 2 processes",
        "`DistributedDataParallel`",
        time=(Ratio(first["ratio"]),),
        plot="data parallel vs DDP",
    )
    details = [
        f"DDP {ms(first['ddp_ms'])} per step, EPL {ms(first['epl_ms'])}, ratio {first['ratio']:.3f}",
        f"{first['parameters']:,} parameters; bytes sent per step EPL {first['epl_bytes_per_step']:,}, "
        f"DDP {first['ddp_bytes_per_step']:,}",
    ]
    record("data_parallel_vs_ddp", [row], section=DATA_PARALLEL, details=details)
    print(
        f"\nEPL DP {first['epl_ms']:.1f} ms/step, DDP {first['ddp_ms']:.1f} ms/step, ratio {first['ratio']:.3f}; "
        f"{first['parameters']:,} parameters, bytes/step EPL {first['epl_bytes_per_step']:,} "
        f"DDP {first['ddp_bytes_per_step']:,}"
    )
    assert first["epl_bytes_per_step"] == first["ddp_bytes_per_step"]
    assert first["ratio"] < MAX_RATIO


def test_all_reduce_bandwidth_by_message_size() -> None:
    sizes = [1 << 10, 1 << 16, 1 << 20] if short_mode() else [1 << 8, 1 << 12, 1 << 16, 1 << 18, 1 << 20, 1 << 22]
    rows, _ = run_ranks(all_reduce_bandwidth, 2, sizes, 9 if short_mode() else 15, timeout=600)
    record(
        "all_reduce_bandwidth",
        [
            ResultRow(
                f"`all_reduce`, {size_label(row['bytes'])}",
                "`torch.distributed.all_reduce` (gloo)",
                time=(Ratio(row["ratio"]),),
                plot=f"all_reduce {size_label(row['bytes'])} vs torch.distributed",
            )
            for row in rows
        ],
        section=ALL_REDUCE,
        details=[
            f"{size_label(row['bytes'])}: torch.distributed {row['torch_MBps']:.1f} MB/s, "
            f"EPL {row['epl_MBps']:.1f} MB/s, time ratio {row['ratio']:.3f}"
            for row in rows
        ],
    )
    print()
    for row in rows:
        print(
            f"all_reduce {row['bytes']:>10,} B: torch.distributed {row['torch_MBps']:8.1f} MB/s, "
            f"EPL {row['epl_MBps']:8.1f} MB/s, ratio {row['ratio']:.3f}"
        )
    # A collective of under a few milliseconds on a loaded 2-core machine is timed with
    # scheduling noise (seen from 0.8 to 2.5 for the same code at 4 KB and 256 KB in CI runs),
    # so the short (CI) run and sizes under 64 KiB are only held to a bound that catches a
    # gross regression; a full run holds bandwidth sizes to the target with a margin.
    for row in rows:
        tight = not short_mode() and row["bytes"] >= 1 << 16
        bound = MAX_RATIO + 0.5 if tight else SMALL_MESSAGE_MAX_RATIO
        assert row["ratio"] < bound, row
