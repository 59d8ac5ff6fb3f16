"""epl-pipeline's hooks: the schedules, the stage transform and the pipeline runner."""

from __future__ import annotations

from typing import TYPE_CHECKING

from epl.plugins import hookimpl

if TYPE_CHECKING:
    import click
    from torch import nn

    from epl.engine.extensions import ModelTransform, ParallelContext, StepRunner
    from epl.schedule import ScheduleGenerator

PLUGIN = "epl-pipeline"


@hookimpl
def epl_pipeline_schedules() -> dict[str, ScheduleGenerator]:
    """``PreferForward`` (GPipe) and ``PreferBackward`` (1F1B)."""
    from epl_pipeline.schedules import SCHEDULES

    return dict(SCHEDULES)


@hookimpl
def epl_cli_commands(cli: click.Group) -> None:
    """Add ``epl schedule``."""
    from epl_pipeline.command import schedule_command

    cli.add_command(schedule_command)


def _pipelined(context: ParallelContext) -> bool:
    return not context.plan.local and context.plan.num_stages > 1


class KeepLocalStage:
    """Model transform: replace the other stages' modules by proxies (this rank keeps only its stage)."""

    name = "keep_local_stage"
    order = -200  # before the initial broadcast and the optimizer: only local tensors remain

    def __call__(self, model: nn.Module, context: ParallelContext) -> nn.Module:
        """Swap remote stage roots for proxies wired to this rank's runner."""
        from epl.errors import PlacementError
        from epl_pipeline.stages import StageProxy, replace_module, stage_roots

        plan = context.plan
        if any(tg.device_count != 1 or tg.strategy != "replicate" for tg in plan.taskgraphs):
            raise PlacementError("This version pipelines replicate(device_count=1) stages only.")
        stage = plan.taskgraphs_on(context.cluster.rank)[0]
        wiring = context.extras.setdefault(PLUGIN, {})
        wiring["stage"] = stage
        for name, owner in stage_roots(model, context.taskgraphs).items():
            if owner != stage:
                proxy = StageProxy(
                    owner, lambda s: wiring["runner"].receive(s), lambda x: wiring["runner"].send(x), stage
                )
                replace_module(model, name, proxy)
        return model


@hookimpl
def epl_model_transforms(context: ParallelContext) -> list[ModelTransform] | None:
    """Keep only this rank's stage when the plan is a pipeline."""
    return [KeepLocalStage()] if _pipelined(context) else None


@hookimpl
def epl_make_step_runner(context: ParallelContext) -> StepRunner | None:
    """The pipeline executor, running the schedule named by ``pipeline.strategy``."""
    if not _pipelined(context):
        return None
    from epl.errors import EplError
    from epl_pipeline.runner import PipelineStepRunner
    from epl_pipeline.schedules import SCHEDULES

    if context.config["optimizer.max_grad_norm"] is not None:
        raise EplError(
            "optimizer.max_grad_norm is not supported with pipelines yet; clip in the model or leave it unset."
        )
    plan, rank = context.plan, context.cluster.rank
    replica = plan.replica_of(rank)
    stage = context.extras[PLUGIN]["stage"]
    stages = plan.num_stages
    world = context.communicator
    replica_group = world.split([list(plan.devices_of_replica(r)) for r in range(plan.num_replicas)])
    last_device = plan.devices(stages - 1, replica)[0]
    runner = PipelineStepRunner(
        model=context.model,
        optimizer=context.optimizer,
        loss_fn=context.loss_fn,
        schedule=SCHEDULES[context.config["pipeline.strategy"]](stages, plan.num_micro_batch),
        stage=stage,
        num_stages=stages,
        num_micro_batch=plan.num_micro_batch,
        world=world,
        previous_rank=plan.devices(stage - 1, replica)[0] if stage > 0 else None,
        next_rank=plan.devices(stage + 1, replica)[0] if stage < stages - 1 else None,
        replica=replica_group,
        last_stage_member=replica_group.ranks.index(last_device),
        device=context.cluster.device,
        gradient_reducer=context.gradient_reducer,
    )
    context.extras[PLUGIN]["runner"] = runner
    return runner
