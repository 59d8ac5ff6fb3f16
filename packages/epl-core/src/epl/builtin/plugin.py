"""The core's own defaults, registered as the ``epl-core`` plugin through the same hooks as any plugin.

Answers to *firstresult* hooks are ``trylast`` so that any installed plugin overrides them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from epl.plugins.marker import hookimpl

if TYPE_CHECKING:
    import click
    from torch import nn

    from epl.annotations.taskgraph import TaskGraph
    from epl.config import Config
    from epl.interfaces.cluster import Cluster
    from epl.interfaces.communicator import Communicator
    from epl.interfaces.config_key import ConfigKey
    from epl.interfaces.split_rule import SplitRule
    from epl.placement.memory_estimate import ShardShapes
    from epl.placement.plan import Plan
    from epl.plugins.context import ModelTransform, ParallelContext, StepRunner


@hookimpl
def epl_config_keys() -> Sequence[ConfigKey]:
    """The keys the core implements (the plugins declare theirs)."""
    from epl.config.catalogue import CORE_KEYS

    return CORE_KEYS


@hookimpl(trylast=True)
def epl_make_communicator(cluster: Cluster, config: Config) -> Communicator | None:
    """The single-process communicator; joining several processes is left to epl-comm."""
    from epl.builtin.local_communicator import LocalCommunicator

    return LocalCommunicator() if cluster.world_size == 1 else None


@hookimpl
def epl_split_rules() -> dict[type[nn.Module], SplitRule]:
    """nn.Linear (column/row parallel), nn.Embedding (vocabulary parallel), epl.nn.Experts (expert parallel), norms."""
    from epl.sharding.rules import BUILTIN_RULES

    return dict(BUILTIN_RULES)


@hookimpl
def epl_model_transforms(context: ParallelContext) -> list[ModelTransform] | None:
    """Decide the split TaskGraphs' layout on the whole model, then shard them by their rules (in a one-process
    run: only check that every module has one); give a model built on meta the values this rank keeps; spread
    each sequence over the context devices (``context.degree``); train linears in float8 (``float8.enabled``);
    compile the repeated blocks (``compile.enabled``)."""
    from epl.builtin.context_transform import ProveContextParallel, SpreadSequences
    from epl.builtin.materialize_transform import MaterializeKept
    from epl.builtin.split_transform import DecideSplitLayout, ShardSplitTaskGraphs
    from epl.config.settings import CoreSettings

    transforms: list[ModelTransform] = []
    if any(tg.strategy.kind == "split" for tg in context.taskgraphs):
        transforms += [DecideSplitLayout(), ShardSplitTaskGraphs()]
    if CoreSettings.from_config(context.config).float8.enabled:
        from epl.builtin.float8_transform import ChooseFloat8Linears, ConvertToFloat8

        transforms += [ChooseFloat8Linears(), ConvertToFloat8()]
    if context.lazy_init is not None:
        transforms.append(MaterializeKept())
    if context.plan.context_degree > 1 and not context.plan.local:
        transforms += [ProveContextParallel(), SpreadSequences()]
    if CoreSettings.from_config(context.config).compile.enabled:
        from epl.builtin.compile_transform import CompileBlocks

        transforms.append(CompileBlocks())
    return transforms or None


@hookimpl(trylast=True)
def epl_estimate_shards(
    model: nn.Module, taskgraphs: list[TaskGraph], plan: Plan, split_rules: Mapping[type[nn.Module], SplitRule]
) -> ShardShapes | None:
    """The split rules run on ``meta`` copies of the modules (``epl.builtin.shard_estimates``)."""
    from epl.builtin.shard_estimates import RuleShardShapes

    return RuleShardShapes(model, taskgraphs, plan, split_rules)


@hookimpl(trylast=True)
def epl_make_step_runner(context: ParallelContext) -> StepRunner | None:
    """The local runner for one-stage plans; pipelines are left to epl-pipeline."""
    from epl.builtin.local_runner import LocalStepRunner

    return LocalStepRunner.from_context(context) if context.plan.num_stages == 1 else None


@hookimpl
def epl_cli_commands(cli: click.Group) -> None:
    """``epl config``, ``epl plan``, ``epl calibrate`` and ``epl plugins``."""
    from epl.cli.calibrate_command import calibrate_command
    from epl.cli.config_command import config_command
    from epl.cli.plan_command import plan_command
    from epl.cli.plugins_command import plugins_command

    for command in (config_command, plan_command, calibrate_command, plugins_command):
        cli.add_command(command)
