"""The core's own defaults, registered as the ``epl-core`` plugin through the same hooks as any plugin.

Answers to *firstresult* hooks are ``trylast`` so that any installed plugin overrides them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from epl.plugins.marker import hookimpl

if TYPE_CHECKING:
    import click
    from torch import nn

    from epl.cluster import Cluster
    from epl.comm.protocol import Communicator
    from epl.config import Config, ConfigKey
    from epl.engine.extensions import ModelTransform, ParallelContext, StepRunner
    from epl.strategy.split_rule import SplitRule


@hookimpl
def epl_config_keys() -> Sequence[ConfigKey]:
    """Every key of the manual's configuration chapter."""
    from epl.config.catalogue import MANUAL_KEYS

    return MANUAL_KEYS


@hookimpl(trylast=True)
def epl_make_communicator(cluster: Cluster, config: Config) -> Communicator | None:
    """The single-process communicator; joining several processes is left to epl-comm."""
    from epl.comm.local import LocalCommunicator

    return LocalCommunicator() if cluster.world_size == 1 else None


@hookimpl
def epl_split_rules() -> dict[type[nn.Module], SplitRule]:
    """nn.Linear (column/row parallel), nn.Embedding (vocabulary parallel), epl.nn.Experts (expert parallel), norms."""
    from epl.sharding.rules import BUILTIN_RULES

    return dict(BUILTIN_RULES)


@hookimpl
def epl_model_transforms(context: ParallelContext) -> list[ModelTransform] | None:
    """Shard the split TaskGraphs by their rules (in a one-process run: only check that every module has one)."""
    from epl.sharding.transform import ShardSplitTaskGraphs

    return [ShardSplitTaskGraphs()] if any(tg.strategy.kind == "split" for tg in context.taskgraphs) else None


@hookimpl(trylast=True)
def epl_make_step_runner(context: ParallelContext) -> StepRunner | None:
    """The local runner for one-stage plans; pipelines are left to epl-pipeline."""
    from epl.engine.local_runner import LocalStepRunner

    return LocalStepRunner.from_context(context) if context.plan.num_stages == 1 else None


@hookimpl
def epl_cli_commands(cli: click.Group) -> None:
    """``epl config``, ``epl plan`` and ``epl plugins``."""
    from epl.cli.config_command import config_command
    from epl.cli.plan_command import plan_command
    from epl.cli.plugins_command import plugins_command

    for command in (config_command, plan_command, plugins_command):
        cli.add_command(command)
