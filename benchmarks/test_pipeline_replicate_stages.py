"""Data parallelism inside pipeline stages: EPL's ``replicate(2)`` stages against PyTorch's own parts, on 4 processes.

**The model.** Two stages of two MLP blocks each (``Linear(D, 4D) -> ReLU -> Linear(4D, D)``,
a ReLU between the blocks; D = 512), float32, 128 samples a step in 4 micro-batches,
``MSELoss``, SGD.

**EPL.** ``with epl.replicate(2, name="stage_s")`` around each stage: 2 stages on 4 processes
(devices 0, 1 run stage 0, devices 2, 3 stage 1), each device half of every micro-batch,
1F1B (``PreferBackward``); each stage's gradients averaged over its 2 devices.

**PyTorch.** The same stages built from the same seed, each wrapped in
``DistributedDataParallel`` over the ``dp`` dimension of a 2 x 2 device mesh and run as
``torch.distributed.pipelining.PipelineStage`` s over its ``pp`` dimension under
``Schedule1F1B`` (``scale_grads=True``); data-parallel rank q takes the rows EPL's device q
runs (its half of every micro-batch).

**Same step first.** Both sides start from the same weights and hold the same weights after
one step (float32 tolerance). Then the step time in alternating rounds (rank 0's clock);
ratio = EPL / PyTorch. Target: <= 1.00.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
from tests.helpers.distributed import run_ranks

from benchmarks.harness import Section, record_step_race, short_mode, step_times
from benchmarks.test_pipeline_3d import MICRO, STAGES, WIDTH, TorchStages, epl_engine, stage_module

if TYPE_CHECKING:
    import torch

pytestmark = pytest.mark.multiprocess

BATCH, COPIES = 128, 2
#: CI (short mode) only catches gross regressions; a full run checks the target with margin for noise.
MAX_RATIO = 2.0 if short_mode() else 1.25
SECTION = Section(
    "Data parallelism inside pipeline stages (replicate stages)",
    __file__,
    f"Step time of 2 pipeline stages x `epl.replicate(2)` on 4 processes (two MLP blocks {WIDTH}-{4 * WIDTH}-{WIDTH} "
    f"per stage, {BATCH} samples in {MICRO} micro-batches, 1F1B, SGD), over the same stages wrapped in "
    "`DistributedDataParallel` on the `dp` dimension of a 2 x 2 mesh and run by `torch.distributed.pipelining` "
    "(`Schedule1F1B`) on its `pp` dimension, after checking both take the same step. Target <= 1.00.",
)


class TorchPipelineDataParallel(TorchStages):
    """The PyTorch side: this rank's stage in DDP over ``dp``, in a pipelining schedule over ``pp`` (DDP averages)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.nn.parallel import DistributedDataParallel

        mesh = init_device_mesh("cpu", (STAGES, COPIES), mesh_dim_names=("pp", "dp"))
        stage_index, copy = divmod(dist.get_rank(), COPIES)
        torch.manual_seed(0)
        built = [stage_module(stage) for stage in range(STAGES)]
        module = DistributedDataParallel(built[stage_index], process_group=mesh["dp"].get_group())
        # EPL's device q runs half q of every micro-batch: the same rows, as this copy's batch.
        x, y = (torch.cat([m.chunk(COPIES)[copy] for m in t.chunk(MICRO)]) for t in (x, y))
        super().__init__(module, stage_index, BATCH // MICRO // COPIES, mesh["pp"].get_group(), x, y)


def race(rounds: int, steps: int) -> dict[str, Any]:
    """On this rank: check that EPL and PyTorch take the same step, then time them against each other."""
    import torch

    from benchmarks.harness import race_steps

    generator = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, WIDTH, generator=generator)
    y = torch.randn(BATCH, WIDTH, generator=generator)
    engine = epl_engine("replicate", COPIES)
    theirs = TorchPipelineDataParallel(x, y)
    ours = list(engine.parameters())
    for a, b in zip(ours, theirs.module.parameters(), strict=True):
        assert torch.equal(a, b), "EPL and PyTorch start from different weights"
    engine.step(x, y)
    theirs.step()
    for a, b in zip(ours, theirs.module.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg="EPL and PyTorch took different steps")

    return race_steps("pipeline_replicate_stages", theirs.step, lambda: engine.step(x, y), rounds=rounds, steps=steps)


def test_replicate_stages_against_ddp_in_torch_pipelining() -> None:
    """DP 2 inside each of 2 stages on 4 processes: EPL's replicate stages against DDP inside
    torch.distributed.pipelining stages."""
    rounds, steps = (3, 1) if short_mode() else (15, 3)
    first, *_ = run_ranks(race, STAGES * COPIES, rounds, steps, timeout=900)
    record_step_race(
        "pipeline_replicate_stages_vs_torch",
        first,
        feature="Replicate stages (`epl.replicate(2)` x pipeline, 1F1B), 4 processes",
        against="DDP inside `torch.distributed.pipelining` stages",
        plot="DP 2 x PP 2 vs DDP + pipelining",
        section=SECTION,
        detail=f"2 stages x replicate(2), {BATCH} samples in {MICRO} micro-batches: {step_times(first)}",
        max_ratio=MAX_RATIO,
    )
