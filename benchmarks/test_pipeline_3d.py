"""Tensor parallelism inside pipeline stages: EPL's split stages against PyTorch's own parts, on 4 processes.

**The model.** Two stages of two Megatron MLP blocks each (``Linear(D, 4D) -> ReLU ->
Linear(4D, D)``, a ReLU between the blocks; D = 512), float32, 64 samples a step in 4
micro-batches, ``MSELoss``, SGD.

**EPL.** ``with epl.split(2, name="stage_s")`` around each stage: 2 stages x 2 shards on
4 processes (devices 0, 1 run stage 0, devices 2, 3 stage 1), 1F1B (``PreferBackward``).

**PyTorch.** The same stages built from the same seed, each sharded by DTensor's
``parallelize_module`` (``ColwiseParallel`` / ``RowwiseParallel``) over the ``tp`` dimension
of a 2 x 2 device mesh, and run as ``torch.distributed.pipelining.PipelineStage`` s over
its ``pp`` dimension under ``Schedule1F1B`` (``scale_grads=True``: the gradient of the mean
micro-batch loss, as EPL).

**Same step first.** Both sides start from the same local shards and hold the same
shards after one step (float32 tolerance). Then the step time in alternating rounds
(rank 0's clock); ratio = EPL / PyTorch. Target: <= 1.00.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
from tests.helpers.distributed import run_ranks

from benchmarks.harness import Section, record_step_race, short_mode, step_times

if TYPE_CHECKING:
    import torch
    from torch import nn

pytestmark = pytest.mark.multiprocess

WIDTH, BATCH, MICRO, STAGES, SHARDS = 512, 64, 4, 2, 2
LR = 0.01
#: CI (short mode) only catches gross regressions; a full run checks the target with margin for noise.
MAX_RATIO = 2.0 if short_mode() else 1.25
SECTION = Section(
    "Tensor x pipeline parallelism (split stages)",
    __file__,
    f"Step time of 2 pipeline stages x `epl.split(2)` on 4 processes (two MLP blocks {WIDTH}-{4 * WIDTH}-{WIDTH} "
    f"per stage, {BATCH} samples in {MICRO} micro-batches, 1F1B, SGD), over the same stages sharded by DTensor's "
    "`parallelize_module` (Colwise/Rowwise) on the `tp` dimension of a 2 x 2 mesh and run by "
    "`torch.distributed.pipelining` (`Schedule1F1B`) on its `pp` dimension, after checking both take the same "
    "step. Target <= 1.00.",
)


def stage_module(stage: int) -> nn.Sequential:
    """Stage ``stage``: two MLP blocks, a ReLU between them (the model's last layer has none after it)."""
    from torch import nn

    return nn.Sequential(
        nn.Linear(WIDTH, 4 * WIDTH),
        nn.ReLU(),
        nn.Linear(4 * WIDTH, WIDTH),
        nn.ReLU(),
        nn.Linear(WIDTH, 4 * WIDTH),
        nn.ReLU(),
        nn.Linear(4 * WIDTH, WIDTH),
    )


def built_stages() -> list[nn.Sequential]:
    """Both stages from seed 0, in order (the same weights on both sides)."""
    import torch

    torch.manual_seed(0)
    return [stage_module(stage) for stage in range(STAGES)]


def epl_engine(strategy: str = "split", devices: int = SHARDS) -> Any:
    """The EPL side: each stage under its own ``epl.split(2)`` scope (or another ``strategy`` over ``devices``)."""
    import torch
    from torch import nn

    import epl

    epl.init(epl.Config({"pipeline.num_micro_batch": MICRO, "pipeline.strategy": "PreferBackward"}))
    torch.manual_seed(0)
    stages = []
    for stage in range(STAGES):
        with getattr(epl, strategy)(devices, name=f"stage_{stage}"):
            stages.append(stage_module(stage))
    return epl.parallelize(nn.Sequential(*stages), optimizer=lambda p: torch.optim.SGD(p, lr=LR), loss_fn=nn.MSELoss())


class TorchStages:
    """What the PyTorch sides share: this rank's stage ``module`` (index ``stage_index``) as a
    ``torch.distributed.pipelining`` stage over ``pp_group``, run by ``Schedule1F1B`` on ``x``/``y`` with SGD."""

    def __init__(
        self, module: torch.nn.Module, stage_index: int, rows: int, pp_group: Any, x: torch.Tensor, y: torch.Tensor
    ) -> None:
        import torch
        from torch import nn
        from torch.distributed import pipelining

        self.module, self.stage_index = module, stage_index
        # The examples must require grad: torch takes "no gradient flows back through this output" from them.
        example = torch.empty(rows, WIDTH, requires_grad=True)
        stage = pipelining.PipelineStage(
            module, stage_index, STAGES, torch.device("cpu"), input_args=example, output_args=example, group=pp_group
        )
        self.schedule = pipelining.Schedule1F1B(stage, MICRO, loss_fn=nn.MSELoss(), scale_grads=True)
        self.optimizer = torch.optim.SGD(module.parameters(), lr=LR)
        self.x, self.y = x, y

    def step(self) -> None:
        """One training step: the schedule's forwards and backwards of this stage, then SGD."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.stage_index == 0:
            self.schedule.step(self.x, return_outputs=False)
        else:
            self.schedule.step(target=self.y, losses=[], return_outputs=False)
        self.optimizer.step()


class TorchThreeD(TorchStages):
    """The PyTorch side: this rank's stage, DTensor tensor parallel, in a torch.distributed.pipelining schedule."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (STAGES, SHARDS), mesh_dim_names=("pp", "tp"))
        stage_index = dist.get_rank() // SHARDS
        plan = {"0": ColwiseParallel(), "2": RowwiseParallel(), "4": ColwiseParallel(), "6": RowwiseParallel()}
        module = parallelize_module(built_stages()[stage_index], mesh["tp"], plan)
        super().__init__(module, stage_index, BATCH // MICRO, mesh["pp"].get_group(), x, y)

    def local_parameters(self) -> list[torch.Tensor]:
        """This rank's shards, in the module's order."""
        from torch.distributed.tensor import DTensor

        return [p.to_local() if isinstance(p, DTensor) else p for p in self.module.parameters()]


def race(rounds: int, steps: int) -> dict[str, Any]:
    """On this rank: check that EPL and PyTorch take the same step, then time them against each other."""
    import torch

    from benchmarks.harness import race_steps

    generator = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, WIDTH, generator=generator)
    y = torch.randn(BATCH, WIDTH, generator=generator)
    engine = epl_engine()
    theirs = TorchThreeD(x, y)
    ours = list(engine.parameters())
    assert [p.shape for p in ours] == [p.shape for p in theirs.local_parameters()], "different shards"
    for a, b in zip(ours, theirs.local_parameters(), strict=True):
        assert torch.equal(a, b), "EPL's shards and PyTorch's start from different weights"
    engine.step(x, y)
    theirs.step()
    for a, b in zip(ours, theirs.local_parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg="EPL and PyTorch took different steps")

    return race_steps("pipeline_3d", theirs.step, lambda: engine.step(x, y), rounds=rounds, steps=steps)


def test_split_stages_against_dtensor_in_torch_pipelining() -> None:
    """TP 2 x PP 2 on 4 processes: EPL's split stages against DTensor inside torch.distributed.pipelining stages."""
    rounds, steps = (3, 1) if short_mode() else (15, 3)
    first, *_ = run_ranks(race, STAGES * SHARDS, rounds, steps, timeout=900)
    record_step_race(
        "pipeline_3d_vs_torch",
        first,
        feature="Split stages (`epl.split` x pipeline, 1F1B), 4 processes",
        against="DTensor inside `torch.distributed.pipelining` stages",
        plot="TP 2 x PP 2 vs DTensor + pipelining",
        section=SECTION,
        detail=f"2 stages x split(2), {BATCH} samples in {MICRO} micro-batches: {step_times(first)}",
        max_ratio=MAX_RATIO,
    )
