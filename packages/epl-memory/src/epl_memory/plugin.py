"""epl-memory's hooks: the techniques switched on by the manual's memory config keys."""

from __future__ import annotations

from typing import TYPE_CHECKING

from epl.plugins import hookimpl

if TYPE_CHECKING:
    import torch
    from torch import nn

    from epl.engine.extensions import ModelTransform, OptimizerWrapper, ParallelContext

PLUGIN = "epl-memory"

#: Keys this package declares in the core's catalogue but does not implement yet, with their "off" value.
NOT_YET = {"offload.level": "", "amp.level": ""}
#: ZeRO levels built so far.
ZERO_LEVELS = ("", "v0")


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


class ZeroStatePartition:
    """Optimizer wrapper (``zero.level = v0``): each copy keeps the optimizer state of its partition only."""

    name = "zero_v0"
    order = 100

    def __call__(self, optimizer: torch.optim.Optimizer, context: ParallelContext) -> torch.optim.Optimizer:
        """Rebuild ``optimizer`` over this device's partition of every group of parameter copies."""
        from epl.comm.partition import copy_communicators
        from epl.placement.copies import copies_of_tensors
        from epl_memory.zero import Partition, ZeroOptimizer, balanced_partition

        communicators = copy_communicators(context)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        partitions = [
            Partition(communicators[copies.devices], balanced_partition(members, len(copies.devices)))
            for copies, members in copies_of_tensors(context, params).items()
            if len(copies.devices) > 1
        ]
        return ZeroOptimizer(optimizer, partitions)


class ApplyGroups:
    """Optimizer wrapper (``optimizer.num_apply_group = k``): the update applied in k groups of parameters."""

    name = "apply_groups"
    order = 110  # after ZeRO: with it, the groups split this device's partition

    def __call__(self, optimizer: torch.optim.Optimizer, context: ParallelContext) -> torch.optim.Optimizer:
        """Make the optimizer (ZeRO's partition optimizer, if any) step in groups; return ``optimizer``."""
        from epl_memory.apply_groups import apply_in_groups
        from epl_memory.zero import ZeroOptimizer

        inner = optimizer.local if isinstance(optimizer, ZeroOptimizer) else optimizer
        apply_in_groups(inner, context.config["optimizer.num_apply_group"])
        return optimizer


@hookimpl
def epl_optimizer_wrappers(context: ParallelContext) -> list[OptimizerWrapper] | None:
    """ZeRO v0 (when there is more than one copy to partition over) and apply groups, as configured."""
    wrappers: list[OptimizerWrapper] = []
    if context.config["zero.level"] == "v0" and not context.plan.local:
        wrappers.append(ZeroStatePartition())
    if context.config["optimizer.num_apply_group"] > 1:
        wrappers.append(ApplyGroups())
    return wrappers or None


@hookimpl
def epl_model_transforms(context: ParallelContext) -> list[ModelTransform] | None:
    """Gradient checkpointing when ``gradient_checkpoint.type`` is set; a clear error for what is not built yet.

    (The checks run here, the first memory hook ``epl.parallelize`` calls.)
    """
    from epl.errors import ConfigError

    config = context.config
    if config["zero.level"] not in ZERO_LEVELS:
        raise ConfigError(
            f"Config key 'zero.level' = {config['zero.level']!r}: epl-memory {_version()} implements v0 "
            "(optimizer states partitioned) only so far. Use 'v0', or leave zero.level unset."
        )
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
