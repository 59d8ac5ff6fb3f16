"""epl-memory's hooks: the techniques switched on by the manual's memory config keys."""

from __future__ import annotations

from typing import TYPE_CHECKING

from epl.plugins import hookimpl

if TYPE_CHECKING:
    from torch import nn

    from epl.engine.extensions import ModelTransform, ParallelContext

PLUGIN = "epl-memory"

#: Keys this package declares in the core's catalogue but does not implement yet, with their "off" value.
NOT_YET = {"zero.level": "", "offload.level": "", "amp.level": "", "optimizer.num_apply_group": 1}


class GradientCheckpointing:
    """Model transform: recompute the activations ``gradient_checkpoint.type`` chooses."""

    name = "gradient_checkpointing"
    order = 100  # after placement, sharding and the initial broadcast: it changes no tensor

    def __call__(self, model: nn.Module, context: ParallelContext) -> nn.Module:
        """Checkpoint the chosen modules of ``model`` in place; return it."""
        from epl_memory.checkpointing import GradientCheck, apply_plan, plan_auto, plan_collection

        config = context.config
        end = config["gradient_checkpoint.end_taskgraph"]
        owner = {id(t): tg.index for tg in context.taskgraphs for t in tg.tensors}
        owner.update({key: taskgraph for key, (taskgraph, _) in context.split_tensors.items()})

        def allowed(module: nn.Module) -> bool:
            indices = [owner.get(id(t), 0) for t in [*module.parameters(), *module.buffers()]]
            return end < 0 or all(index <= end for index in indices)

        choose = plan_auto if config["gradient_checkpoint.type"] == "auto" else plan_collection
        plan = choose(model, allowed)
        check = GradientCheck() if config["gradient_checkpoint.check_gradients"] else None
        apply_plan(model, plan, check)
        context.extras[PLUGIN] = {"checkpoint_plan": plan, "gradient_check": check}
        return model


@hookimpl
def epl_model_transforms(context: ParallelContext) -> list[ModelTransform] | None:
    """Gradient checkpointing when ``gradient_checkpoint.type`` is set; a clear error for what is not built yet."""
    from epl.errors import ConfigError

    config = context.config
    for key, off in NOT_YET.items():
        if config[key] != off:
            raise ConfigError(
                f"Config key {key!r} = {config[key]!r}: epl-memory {_version()} does not implement it yet "
                f"(gradient checkpointing is). Leave {key} at {off!r} for now."
            )
    return [GradientCheckpointing()] if config["gradient_checkpoint.type"] else None


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(PLUGIN)
    except PackageNotFoundError:
        return "(source tree)"
