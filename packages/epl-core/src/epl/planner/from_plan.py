"""The planner's :class:`~epl.planner.layout.Layout` of what a script asks for: its Plan and its config."""

from __future__ import annotations

from typing import cast

from epl.config import Config
from epl.config.settings import CoreSettings
from epl.errors import EplError
from epl.interfaces.facts import MemoryTechniques, PipelineChoices
from epl.placement.plan import Plan
from epl.planner.layout import EPL_SCHEDULES, PLANNER_CHECKPOINTING, Layout, Schedule, ZeroLevel
from epl.plugins.facts import config_facts

#: epl-pipeline's schedule names (``pipeline.strategy``) -> the planner's: the one table read backwards.
PLANNER_SCHEDULES: dict[str, Schedule] = {strategy: schedule for schedule, strategy in EPL_SCHEDULES.items()}


def layout_of(plan: Plan, config: Config, global_batch: int) -> Layout:
    """The layout the script's Plan and config make, for ``global_batch`` sequences per step."""
    tensor = max((tg.device_count for tg in plan.taskgraphs if tg.strategy == "split"), default=1)
    pipeline = plan.pipeline_size
    context = plan.context_degree
    data = plan.world_size // (tensor * pipeline * context)
    micro_batches = plan.num_micro_batch
    if global_batch % (data * micro_batches):
        raise EplError(
            f"--global-batch-size {global_batch} does not divide into {data} data-parallel replicas x "
            f"{micro_batches} micro-batches: give a multiple of {data * micro_batches}."
        )
    memory = config_facts(config, MemoryTechniques)
    zero = cast(ZeroLevel, memory.zero or "none")  # Layout refuses a level it does not know
    checkpoint = PLANNER_CHECKPOINTING.get(memory.recompute, "none")  # "collection": none the planner knows
    schedule = PLANNER_SCHEDULES.get(config_facts(config, PipelineChoices).schedule, "1F1B")
    return Layout(
        data=data,
        tensor=tensor,
        pipeline=pipeline,
        micro_batches=micro_batches,
        micro_batch_size=global_batch // (data * micro_batches),
        zero=zero,
        gradient_checkpoint=checkpoint,
        schedule=schedule,
        virtual_stages=plan.stages_per_rank,
        sequence_parallel=CoreSettings.from_config(config).split.sequence_parallel and tensor > 1,
        context=context,
    )


def precision_of(config: Config) -> tuple[str, bool]:
    """The planner's compute dtype for ``config`` and whether it is autocast's over float32 weights
    (:attr:`epl.planner.Workload.autocast`): ``amp.level`` runs autocast, in bf16 as the planner prices it, over the
    model's float32 weights, unless ZeRO gathers them in bf16 or fp16 (``zero.param_dtype``), which is bf16
    weights with float32 masters; neither is float32."""
    memory = config_facts(config, MemoryTechniques)
    low = memory.parameter_dtype in ("bfloat16", "float16")
    if memory.mixed_precision or low:
        return "bf16", memory.mixed_precision and not low
    return "fp32", False
