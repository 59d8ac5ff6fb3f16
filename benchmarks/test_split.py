"""EPL's tensor parallelism (``epl.split``) against PyTorch's own, on 2 processes in the same run.

**Step time.** A Megatron MLP block, ``Linear(D, 4D) -> ReLU -> Linear(4D, D)``
(D = 512), built from seed 0 once in an ``epl.split(2)`` scope (EPL makes the first
Linear column-parallel and the second row-parallel) and once as a plain module
sharded by ``torch.distributed.tensor.parallel.parallelize_module`` with
``ColwiseParallel()`` and ``RowwiseParallel()`` on a 1-D CPU device mesh of the 2
processes. Both train on the same replica batch (64 samples, whole on every rank),
with ``MSELoss`` and SGD, one thread per process, gloo. The input requires its
gradient, as it would after an earlier layer, so both sides do the same work: half of
each weight per rank, one all-reduce of the [64, D] output forward and one of the
[64, D] input gradient backward, and no other collective (counted with the
profiler, asserted on both sides: a split-only replica has no loss to average; EPL adds, in its first steps
and every 50th, one all-gather of a few numbers: its check that both ranks were given the same batch; and every
step one all-gather of two numbers a rank: whether its loss and gradients were finite). Before
timing, both sides' first two steps must give the same losses and input gradients,
and the same local weight shards after (float32 tolerance). Timed in alternating
rounds (rank 0's clock); ratio = EPL / torch median step time. Target: <= 1.00.

**Memory of the parallel cross-entropy.** Logits of 256 rows over 32768 classes,
sharded by class over the 2 processes (16384 classes each, 16 MiB per shard).
EPL's ``sharded_cross_entropy`` (reduces a per-row max and sum of exponentials;
never forms the whole logits) against what one writes without it: all-gather the
class shards into the whole [256, 32768] logits (backward: keep this rank's slice of
the gradient), then ``F.cross_entropy``. Each side's forward + backward runs under
:func:`peak_allocated_bytes`, which reads the CPU allocator's own running total (see
there for what it counts). Both peak at three buffers of their logits' width: the
gathered side at the saved log-softmax, its gradient and the log-softmax backward's
output (3 x 32 MiB); EPL at its saved softmax, the clone its backward makes of it and
the gradient (3 x 16 MiB). Expected ratio EPL / gathered: 1/2 on 2 devices; asserted
< 0.75. Both sides' losses and gradients are checked against the unsharded
``F.cross_entropy`` first, and both are timed too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
from tests.helpers.distributed import run_ranks

from benchmarks.collectives import collectives_of, less_batch_check
from benchmarks.harness import MIB, Ratio, ResultRow, Section, mib, ms, record, record_step_race, short_mode
from epl_memory.measure import peak_allocated_bytes

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

pytestmark = pytest.mark.multiprocess

#: The MLP block: D -> 4D -> D.
WIDTH = 512
#: Samples per step (the replica batch, whole on every rank).
BATCH = 64
LR = 0.01
#: CI (short mode) only catches gross regressions; a full run checks the target with margin for noise.
MAX_RATIO = 2.0 if short_mode() else 1.25
#: The parallel cross-entropy's problem: rows x classes (float32 logits of 32 MiB whole).
CE_ROWS = 256
CE_CLASSES = 32768
#: EPL's peak bytes over the gathered version's: about 1/2 expected on 2 devices.
MAX_MEMORY_RATIO = 0.75
SPLIT_MLP = Section(
    "Tensor parallelism (split)",
    __file__,
    "Step time of a Megatron MLP block (512-2048-512) split over 2 processes by `epl.split(2)`, over the "
    "same block sharded by DTensor's `parallelize_module` with `ColwiseParallel` / `RowwiseParallel`; "
    "the same collectives on both sides (checked). Target <= 1.00.",
)
CROSS_ENTROPY = Section(
    "Parallel cross-entropy",
    __file__,
    "EPL's `sharded_cross_entropy` over logits sharded by class on 2 processes, against all-gathering the "
    "logits and calling `F.cross_entropy`: peak bytes allocated by forward + backward (the larger of the "
    "two ranks; about 1/2 expected on 2 devices, asserted < 0.75) and time.",
)


def mlp() -> torch.nn.Sequential:
    """The MLP block from seed 0 (the same weights on every rank and on both sides)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.ReLU(), nn.Linear(4 * WIDTH, WIDTH))


def race_against_dtensor(rounds: int, steps: int) -> dict[str, Any]:
    """On this rank: check that EPL and DTensor take the same steps, then time them against each other."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import epl
    from benchmarks.harness import race_steps

    epl.init(epl.Config({}))
    with epl.split(2):
        ours = mlp()
    engine = epl.parallelize(ours, optimizer=lambda p: torch.optim.SGD(p, lr=LR), loss_fn=nn.MSELoss())

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    theirs = parallelize_module(mlp(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    optimizer = torch.optim.SGD(theirs.parameters(), lr=LR)

    generator = torch.Generator().manual_seed(1)
    # The input requires its gradient, as it would after an earlier layer: both sides then
    # all-reduce it backward (the column-parallel layer's input gradient is partial per rank).
    x = torch.randn(BATCH, WIDTH, generator=generator).requires_grad_()
    y = torch.randn(BATCH, WIDTH, generator=generator)

    def torch_step() -> torch.Tensor:
        x.grad = None
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(theirs(x), y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    def epl_step() -> torch.Tensor:
        x.grad = None
        return engine.step(x, y)

    # Same step on both sides: the same local shards before; the same loss and input gradient
    # for two steps (the second also checks the first update); the same shards after.
    mine = list(engine.parameters())
    local = [p.to_local() for p in theirs.parameters()]
    assert [p.shape for p in mine] == [p.shape for p in local], "EPL and DTensor shard the layers differently"
    for a, b in zip(mine, local, strict=True):
        assert torch.equal(a, b), "EPL's shards and DTensor's start from different weights"
    for _ in range(2):
        ours_loss = epl_step()
        ours_grad = x.grad.clone()
        torch.testing.assert_close(ours_loss, torch_step(), msg="EPL and DTensor computed different losses")
        torch.testing.assert_close(ours_grad, x.grad, msg="EPL and DTensor computed different input gradients")
    for a, b in zip(mine, (p.to_local() for p in theirs.parameters()), strict=True):
        torch.testing.assert_close(a, b, msg="EPL and DTensor took different training steps")
    collectives = {"epl": collectives_of(epl_step).counts, "torch": collectives_of(torch_step).counts}
    for side, counts in collectives.items():
        # The same communication on both sides: one all-reduce of the [BATCH, WIDTH] output
        # forward, one of the input gradient backward, nothing else; EPL adds its batch check (five numbers) and
        # its check of non-finite steps (two numbers).
        model_collectives, checks = less_batch_check(counts)
        assert model_collectives == {f"allreduce {[BATCH, WIDTH]}": 2}, (side, counts)
        assert checks <= (2 if side == "epl" else 0), (side, counts)

    return {
        **race_steps("split_mlp_vs_dtensor", torch_step, epl_step, rounds=rounds, steps=steps, warmup=2),
        "epl_collectives_per_step": collectives["epl"],
        "torch_collectives_per_step": collectives["torch"],
    }


def race_cross_entropy(rounds: int) -> dict[str, Any]:
    """On this rank: EPL's parallel cross-entropy against gathering the logits, for memory and time."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import epl
    from benchmarks.harness import compare
    from epl.interfaces.shard_group import ShardGroup
    from epl.sharding.cross_entropy import sharded_cross_entropy

    env = epl.init(epl.Config({}))
    group = ShardGroup(env.communicator)
    rank, world = dist.get_rank(), dist.get_world_size()
    shard = CE_CLASSES // world
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    generator = torch.Generator().manual_seed(0)
    whole = torch.randn(CE_ROWS, CE_CLASSES, generator=generator)
    targets = torch.randint(0, CE_CLASSES, (CE_ROWS,), generator=generator)
    logits = whole[:, rank * shard : (rank + 1) * shard].clone().requires_grad_()

    class GatherClasses(torch.autograd.Function):
        """All-gather the class shards into the whole logits; backward keeps this rank's slice of the gradient."""

        @staticmethod
        def forward(ctx: Any, piece: torch.Tensor) -> torch.Tensor:
            rows, columns = piece.shape
            gathered = piece.new_empty((world * rows, columns))  # every rank's piece, stacked by rows
            all_gather(gathered, piece.contiguous())
            return gathered.view(world, rows, columns).permute(1, 0, 2).reshape(rows, world * columns)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            return grad[:, rank * shard : (rank + 1) * shard].contiguous()

    def gathered_loss() -> torch.Tensor:
        return F.cross_entropy(GatherClasses.apply(logits), targets)

    def epl_loss() -> torch.Tensor:
        return sharded_cross_entropy(logits, targets, group, num_classes=CE_CLASSES)

    def forward_backward(loss_fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            logits.grad = None
            loss_fn().backward()

        return run

    gathered, sharded = forward_backward(gathered_loss), forward_backward(epl_loss)

    # Both give the unsharded loss and this rank's slice of its gradient.
    reference = whole.clone().requires_grad_()
    expected = F.cross_entropy(reference, targets)
    expected.backward()
    for name, loss_fn in (("gathered", gathered_loss), ("epl", epl_loss)):
        logits.grad = None
        loss = loss_fn()
        torch.testing.assert_close(loss, expected, msg=f"{name}: a different loss")
        loss.backward()
        torch.testing.assert_close(
            logits.grad, reference.grad[:, rank * shard : (rank + 1) * shard], msg=f"{name}: a different gradient"
        )
    del reference, expected
    logits.grad = None

    peaks = {}
    for name, fn in (("gathered", gathered), ("epl", sharded)):
        dist.barrier()
        logits.grad = None
        peaks[name] = peak_allocated_bytes(fn)
    result = compare(
        "split_cross_entropy_vs_gathered",
        gathered,
        sharded,
        rounds=rounds,
        calls_per_round=2,
        warmup=2,
        sync=dist.barrier,
        save=False,
    )
    return {
        "memory_ratio": peaks["epl"] / peaks["gathered"],
        "epl_peak_bytes": peaks["epl"],
        "gathered_peak_bytes": peaks["gathered"],
        "logits_shard_bytes": logits.numel() * logits.element_size(),
        "time_ratio": result.ratio,
        "gathered_ms": result.baseline_s * 1e3,
        "epl_ms": result.epl_s * 1e3,
        "rounds": rounds,
    }


def test_split_mlp_against_dtensor() -> None:
    """Column- then row-parallel MLP block on 2 processes: EPL's ``epl.split`` against DTensor's parallelize_module."""
    rounds, steps = (5, 5) if short_mode() else (21, 20)
    first, _ = run_ranks(race_against_dtensor, 2, rounds, steps, timeout=600)
    record_step_race(
        "split_mlp_vs_dtensor",
        first,
        feature="Tensor-parallel MLP block (`epl.split`), 2 processes",
        against="DTensor `parallelize_module` (Colwise/Rowwise)",
        plot="split MLP vs DTensor",
        section=SPLIT_MLP,
        detail=(
            f"MLP {WIDTH}-{4 * WIDTH}-{WIDTH}, batch {BATCH}: DTensor {ms(first['torch_ms'])}, EPL "
            f"{ms(first['epl_ms'])} per step, ratio {first['ratio']:.3f}; collectives per step EPL "
            f"{first['epl_collectives_per_step']}, DTensor {first['torch_collectives_per_step']}"
        ),
        max_ratio=MAX_RATIO,
        printed=(
            f"split MLP {WIDTH}-{4 * WIDTH}-{WIDTH}, batch {BATCH}, 2 processes: "
            f"DTensor {first['torch_ms']:.2f} ms/step, EPL {first['epl_ms']:.2f} ms/step, ratio {first['ratio']:.3f} "
            f"({first['rounds']} rounds x {first['steps']} steps); collectives per step: "
            f"DTensor {first['torch_collectives_per_step']}, EPL {first['epl_collectives_per_step']}"
        ),
    )


def test_sharded_cross_entropy_memory() -> None:
    """EPL's parallel cross-entropy against all-gathering the logits: peak memory (asserted) and time."""
    rounds = 5 if short_mode() else 21
    ranks = run_ranks(race_cross_entropy, 2, rounds, timeout=600)
    first = ranks[0]
    row = ResultRow(
        "Parallel cross-entropy, 2 processes",
        "all-gathered logits + `F.cross_entropy`",
        time=(Ratio(first["time_ratio"]),),
        memory=(Ratio(max(r["memory_ratio"] for r in ranks), "peak"),),
        plot="parallel cross-entropy vs all-gathered logits",
    )
    detail = (
        f"{CE_ROWS} rows x {CE_CLASSES} classes: peak allocated EPL {mib(first['epl_peak_bytes'])}, "
        f"gathered {mib(first['gathered_peak_bytes'])} (logits shard {mib(first['logits_shard_bytes'])}); "
        f"time EPL {ms(first['epl_ms'])}, gathered {ms(first['gathered_ms'])}"
    )
    record("split_cross_entropy_vs_gathered", [row], section=CROSS_ENTROPY, details=[detail])
    print(
        f"\ncross-entropy {CE_ROWS} x {CE_CLASSES} classes on 2 processes, forward + backward: peak allocated "
        f"gathered {first['gathered_peak_bytes'] / MIB:.1f} MiB, EPL {first['epl_peak_bytes'] / MIB:.1f} MiB "
        f"(logits shard {first['logits_shard_bytes'] / MIB:.1f} MiB), ratio {first['memory_ratio']:.3f}; "
        f"time gathered {first['gathered_ms']:.2f} ms, EPL {first['epl_ms']:.2f} ms, ratio {first['time_ratio']:.3f}"
    )
    for r in ranks:
        # The meter saw the big buffers: the gathered side holds at least the whole logits twice.
        assert r["gathered_peak_bytes"] >= 2 * 2 * r["logits_shard_bytes"], r
        assert r["memory_ratio"] < MAX_MEMORY_RATIO, r
