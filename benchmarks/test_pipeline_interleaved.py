"""Interleaved 1F1B: EPL against torch.distributed.pipelining's, and against EPL's own 1F1B, in one run.

**The model.** The MLP of ``benchmarks/test_pipeline.py`` (8 Linear layers of width 512, a
ReLU between each two), batch 256 in ``M = 8`` micro-batches, SGD, on ``P = 2`` processes.

**EPL, interleaved.** The MLP in 4 ``epl.replicate(device_count=1)`` stages of 2 layers,
``pipeline.stages_per_rank = 2`` (stages 0 and 2 on rank 0, 1 and 3 on rank 1),
``pipeline.strategy = "Interleaved1F1B"``.

**PyTorch, interleaved.** The same 4 stages built by hand as ``PipelineStage`` s, two per rank,
under ``ScheduleInterleaved1F1B`` (``scale_grads=True``).

**EPL, 1F1B.** The same MLP in 2 stages of 4 layers (one per rank), ``PreferBackward``: the
same P and M, so the step times and the measured bubbles show what interleaving buys.

**Same step first.** EPL's interleaved run and torch's start from the same weights and hold
the same weights after one step (float32 tolerance). Then the step times in alternating
rounds (rank 0's clock): EPL 1F1B against torch's ``Schedule1F1B``, then EPL interleaved
against torch's interleaved. Ratios: EPL interleaved / torch interleaved (target <= 1.00) and
EPL interleaved / EPL 1F1B (below 1 when the smaller bubble outweighs twice the messages;
timed in the two phases). Measured bubbles come from the last step's recorded timeline.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import pytest
from tests.helpers.distributed import run_ranks

from benchmarks.harness import Ratio, ResultRow, Section, ms, race_steps, record, short_mode
from benchmarks.test_pipeline import LR, MICRO, WIDTH, epl_model, torch_stage_module

if TYPE_CHECKING:
    import torch

    import epl

pytestmark = pytest.mark.multiprocess

RANKS, STAGES_PER_RANK = 2, 2
#: Samples per step: 4 times the pipeline benchmark's, so that a stage chunk (2 layers) computes for longer than
#: a message between processes takes.
BATCH = 1024
STAGES = RANKS * STAGES_PER_RANK
MAX_RATIO = 2.0 if short_mode() else 1.25
SECTION = Section(
    "Interleaved 1F1B",
    __file__,
    f"Step time of EPL's `Interleaved1F1B` ({STAGES} stages, {STAGES_PER_RANK} per rank, on {RANKS} processes; "
    f"the 8-layer MLP of the pipeline benchmark, batch {BATCH} in {MICRO} micro-batches) over "
    "`torch.distributed.pipelining`'s `ScheduleInterleaved1F1B` on the same stages, after checking both take the "
    f"same step; and over EPL's 1F1B with the same {RANKS} processes and micro-batches. Target <= 1.00 against "
    "torch; against 1F1B the measured bubbles say what interleaving saves.",
)


class TorchPipeline:
    """This rank's stages (``rank``, ``rank + P``, ...) under torch's ``Schedule1F1B`` (one stage per rank) or
    ``ScheduleInterleaved1F1B`` (several), with their SGD optimizer."""

    def __init__(self, rank: int, per_rank: int, x: torch.Tensor, y: torch.Tensor) -> None:
        import torch
        from torch import nn
        from torch.distributed import pipelining

        num_stages = RANKS * per_rank
        mine = [rank + k * RANKS for k in range(per_rank)]
        self.modules = [torch_stage_module(stage, num_stages) for stage in mine]
        example = torch.empty(BATCH // MICRO, WIDTH, requires_grad=True)
        stages = [
            pipelining.PipelineStage(
                module, stage, num_stages, torch.device("cpu"), input_args=example, output_args=example
            )
            for module, stage in zip(self.modules, mine, strict=True)
        ]
        loss = nn.MSELoss()
        if per_rank == 1:
            self.schedule = pipelining.Schedule1F1B(stages[0], MICRO, loss_fn=loss, scale_grads=True)
        else:
            self.schedule = pipelining.ScheduleInterleaved1F1B(stages, MICRO, loss_fn=loss, scale_grads=True)
        self.parameters = [p for module in self.modules for p in module.parameters()]
        self.optimizer = torch.optim.SGD(self.parameters, lr=LR)
        self.first = rank == 0
        self.x, self.y = x, y

    def step(self) -> None:
        """One training step: the schedule's forwards and backwards on this rank's stages, then SGD."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.first:
            self.schedule.step(self.x, return_outputs=False)
        else:  # the last rank holds the last stage
            self.schedule.step(target=self.y, losses=[], return_outputs=False)
        self.optimizer.step()


def epl_engine(stages: int, **config: Any) -> epl.Engine:
    """The MLP in ``stages`` stages under EPL, SGD, MSE, ``MICRO`` micro-batches and ``config``."""
    import torch
    from torch import nn

    import epl

    epl.init(epl.Config({"pipeline.num_micro_batch": MICRO, **config}))
    engine = epl.parallelize(epl_model(stages), optimizer=lambda p: torch.optim.SGD(p, lr=LR), loss_fn=nn.MSELoss())
    assert engine.num_replicas == 1 and engine.plan.num_stages == stages
    return engine


def check_same_step(engine: epl.Engine, theirs: TorchPipeline) -> None:
    """Both sides hold the same two stages' weights, before and after one step on the same batch."""
    import torch

    ours = list(engine.parameters())  # stage r's, then stage r + P's (the model's order)
    assert len(ours) == len(theirs.parameters)
    for a, b in zip(ours, theirs.parameters, strict=True):
        assert torch.equal(a, b), "EPL's stages and the hand-built stages start from different weights"
    engine.step(theirs.x, theirs.y)
    theirs.step()
    for a, b in zip(ours, theirs.parameters, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg="EPL and torch took different training steps")


def measured_bubble(engine: epl.Engine) -> float:
    """The idle fraction of the last step, over the ranks along the pipeline."""
    from epl_pipeline.recording import gather_timeline
    from epl_pipeline.schedules import bubble

    return bubble(gather_timeline(engine), RANKS)[1]


def race(rounds: int, steps: int) -> dict[str, Any]:
    """On this rank: EPL 1F1B against torch's, then EPL interleaved against torch's; timings and bubbles.

    Each EPL engine is raced while it is the current one (an ``epl.init`` starts the next), so
    the two EPL schedules are timed in two phases, each against torch's counterpart beside it.
    """
    import functools

    import torch

    rank = int(os.environ["RANK"])
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, WIDTH, generator=generator)
    y = torch.randn(BATCH, WIDTH, generator=generator)
    plain = epl_engine(RANKS, **{"pipeline.strategy": "PreferBackward"})
    plain_torch = TorchPipeline(rank, 1, x, y)
    check_same_step(plain, plain_torch)
    one_f_one_b = race_steps(
        "pipeline_1f1b", plain_torch.step, functools.partial(plain.step, x, y), rounds=rounds, steps=steps
    )
    one_f_one_b["bubble"] = measured_bubble(plain)
    config = {"pipeline.stages_per_rank": STAGES_PER_RANK, "pipeline.strategy": "Interleaved1F1B"}
    interleaved = epl_engine(STAGES, **config)
    theirs = TorchPipeline(rank, STAGES_PER_RANK, x, y)
    check_same_step(interleaved, theirs)
    ours = functools.partial(interleaved.step, x, y)
    result = race_steps("pipeline_interleaved", theirs.step, ours, rounds=rounds, steps=steps)
    result["bubble"] = measured_bubble(interleaved)
    return {"interleaved": result, "1f1b": one_f_one_b}


def test_interleaved_1f1b_against_torch_and_against_1f1b() -> None:
    """EPL's Interleaved1F1B over torch's, and its step time and bubble beside EPL's 1F1B."""
    rounds, steps = (3, 2) if short_mode() else (15, 4)
    figures = run_ranks(race, RANKS, rounds, steps, timeout=600)[0]
    interleaved, plain = figures["interleaved"], figures["1f1b"]
    theory = {
        "interleaved": (RANKS - 1) / (STAGES_PER_RANK * MICRO + RANKS - 1),
        "1f1b": (RANKS - 1) / (MICRO + RANKS - 1),
    }
    speedup = interleaved["epl_ms"] / plain["epl_ms"]
    details = [
        f"Interleaved1F1B ({STAGES} stages, {STAGES_PER_RANK} per rank): torch ScheduleInterleaved1F1B "
        f"{ms(interleaved['torch_ms'])}, EPL {ms(interleaved['epl_ms'])} per step, ratio {interleaved['ratio']:.3f}; "
        f"EPL measured bubble {interleaved['bubble']:.3f} (theory {theory['interleaved']:.3f})",
        f"1F1B ({RANKS} stages, same ranks and micro-batches): torch Schedule1F1B {ms(plain['torch_ms'])}, EPL "
        f"{ms(plain['epl_ms'])} per step, ratio {plain['ratio']:.3f}; EPL measured bubble {plain['bubble']:.3f} "
        f"(theory {theory['1f1b']:.3f})",
        f"EPL interleaved / EPL 1F1B step time {speedup:.3f} (timed in two phases, {rounds} rounds x {steps} steps "
        f"each; torch's own: {interleaved['torch_ms'] / plain['torch_ms']:.3f})",
    ]
    print("\n" + "\n".join(details))
    rows = [
        ResultRow(
            f"Pipeline Interleaved1F1B, {STAGES} stages on {RANKS} ranks",
            "torch.distributed.pipelining `ScheduleInterleaved1F1B`",
            time=(Ratio(interleaved["ratio"]),),
            plot="Interleaved1F1B vs torch ScheduleInterleaved1F1B",
        ),
        ResultRow(
            f"Pipeline Interleaved1F1B, {STAGES} stages on {RANKS} ranks",
            f"EPL 1F1B, {RANKS} stages (same ranks, same micro-batches; bubble "
            f"{interleaved['bubble']:.3f} vs {plain['bubble']:.3f})",
            time=(Ratio(speedup),),
            plot="Interleaved1F1B vs EPL 1F1B",
        ),
    ]
    record("pipeline_interleaved", rows, section=SECTION, details=details)
    assert interleaved["ratio"] < MAX_RATIO, figures
    assert 0 <= interleaved["bubble"] < 1 and 0 <= plain["bubble"] < 1
