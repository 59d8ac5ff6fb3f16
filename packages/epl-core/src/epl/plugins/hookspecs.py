"""The hooks through which plugins extend EPL.

Every hook is named ``epl_<verb>_<object>`` and documented with when it is called,
what it receives, and what its return value means. Hooks marked *firstresult*
stop at the first implementation that returns something other than None; the
core's own implementation of such a hook is ``trylast`` so any plugin can
override it. Types are imported only for type checking: this module imports
nothing at run time but pluggy.

Implement a hook in a module or class with ``@epl.hookimpl`` and expose it
through the ``epl`` entry-point group, named after your distribution::

    [project.entry-points.epl]
    epl-something = "epl_something.plugin"
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import click
    from torch import nn

    from epl.annotations.taskgraph import TaskGraph
    from epl.config import Config
    from epl.interfaces.cluster import Cluster
    from epl.interfaces.communicator import Communicator
    from epl.interfaces.config_key import ConfigKey
    from epl.interfaces.schedule import ScheduleGenerator
    from epl.interfaces.split_rule import SplitRule
    from epl.placement.memory_estimate import MemoryEstimate, ShardShapes
    from epl.placement.plan import Plan
    from epl.placement.plan_memory import MemoryEstimateContext
    from epl.plugins.context import (
        GradientReducer,
        LossScaler,
        ModelTransform,
        OptimizerWrapper,
        ParallelContext,
        StepRunner,
    )

hookspec = pluggy.HookspecMarker("epl")

# --------------------------------------------------------------------------------
# Configuration: called when the plugin manager builds the config schema, before
# any epl.Config is validated.
# --------------------------------------------------------------------------------


@hookspec
def epl_config_keys() -> Sequence[ConfigKey] | None:
    """Declare the config keys this plugin owns.

    Called once per plugin manager, when the first :class:`epl.Config` is built.
    Return the keys (name, types, default, doc, allowed values); the manager records
    this plugin as their ``provided_by``. A key declared by two plugins is an error.
    Return None to declare nothing. The core keeps only a table from key prefix to
    distribution (``epl.config.KEY_OWNERS``), so that a key of a package that is not
    installed fails at ``epl.init`` naming the package to install.
    """


@hookspec
def epl_config_facts(config: Config) -> Sequence[object] | None:
    """Turn this plugin's keys into the typed records other packages read (``epl.interfaces.facts``).

    Called once per :class:`epl.Config`, on first use of :func:`epl.plugin_api.config_facts`. Return an instance of
    each record this plugin owns, built from its own keys of ``config``; None for none. A package never reads
    another package's keys: it reads these records, which hold their defaults when the owner is not installed.
    """


# --------------------------------------------------------------------------------
# Initialisation: called by epl.init after the cluster is read from the environment.
# --------------------------------------------------------------------------------


@hookspec(firstresult=True)
def epl_make_communicator(cluster: Cluster, config: Config) -> Communicator | None:
    """Build the communicator that joins the processes of ``cluster``.

    Called once by ``epl.init``. *firstresult*: the first non-None result is used.
    Return None to leave the choice to another plugin. The core answers last with
    a single-process communicator when ``cluster.world_size == 1``.

    :param cluster: ranks, world size and device of this process.
    :param config: the validated config (e.g. ``communication.*`` keys).
    """


# --------------------------------------------------------------------------------
# Parallelisation: called by epl.parallelize, in this order:
#   1. epl_model_transforms   (after placement, before the optimizer is built)
#   2. epl_optimizer_wrappers (after the optimizer is built over local parameters)
#   3. epl_make_gradient_reducer (data-parallel gradient reduction, used by the runner)
#   4. epl_make_loss_scaler   (mixed-precision loss scaling, used by the runner)
#   5. epl_make_step_runner   (what Engine.step runs)
# --------------------------------------------------------------------------------


@hookspec
def epl_model_transforms(context: ParallelContext) -> Sequence[ModelTransform] | None:
    """Offer transforms of this rank's model (checkpointing, casting, sharding, sync hooks).

    Called once per ``epl.parallelize``. Return the transforms that apply to
    ``context`` (read its config and plan), or None. All transforms of all
    plugins run in the order of their ``phase`` (:class:`epl.plugin_api.TransformPhase`),
    then of their ``name``, each receiving the previous result.
    """


@hookspec
def epl_optimizer_wrappers(context: ParallelContext) -> Sequence[OptimizerWrapper] | None:
    """Offer wrappers of the optimizer (ZeRO partitioning, apply groups, loss scaling).

    Called once per ``epl.parallelize`` after the optimizer is built over the
    parameters this rank holds. Return the wrappers that apply, or None. They
    apply in the order of their ``phase`` (:class:`epl.plugin_api.WrapperPhase`), then of
    their ``name``, each wrapping the previous result.
    """


@hookspec(firstresult=True)
def epl_partition_model(
    model: nn.Module, taskgraphs: list[TaskGraph], config: Config, example_inputs: Any
) -> list[TaskGraph] | None:
    """Replace the annotated TaskGraphs of ``model`` by an automatic partition (``auto.auto_parallel``).

    Called by ``epl.parallelize`` and ``epl.plan`` before the Plan is built, with the
    TaskGraphs the annotations captured and the ``example_inputs`` given to ``epl.parallelize``
    (None when not given, and in ``epl.plan``). *firstresult*. Return None to keep them.
    """


@hookspec(firstresult=True)
def epl_make_gradient_reducer(context: ParallelContext) -> GradientReducer | None:
    """Build what reduces gradients over the copies of this rank's parameters.

    Called once per ``epl.parallelize``, after the optimizer wrappers and before the
    step runner, which calls ``finish`` on it every step. *firstresult*. Return None
    when nothing needs reducing (the core has no implementation: one process, one copy).
    """


@hookspec(firstresult=True)
def epl_make_loss_scaler(context: ParallelContext) -> LossScaler | None:
    """Build what scales the loss before backward and skips steps with non-finite gradients (AMP).

    Called once per ``epl.parallelize``, after the optimizer wrappers and the gradient
    reducer, before the step runner; the result is stored on ``context.loss_scaler`` and
    the runner uses it every step, in the order of :class:`epl.runtime.update.StepUpdate`
    (the update is skipped when ``update`` says so, or, with ``found_nonfinite`` and
    ``record``, when the runner's check of non-finite steps says so).
    *firstresult*. Return None for no loss scaling (the core has no implementation).
    """


@hookspec(firstresult=True)
def epl_make_step_runner(context: ParallelContext) -> StepRunner | None:
    """Build what runs one training step (forward, backward, optimizer) for this rank.

    Called once per ``epl.parallelize``, after the transforms, wrappers, gradient reducer
    (``context.gradient_reducer``) and loss scaler (``context.loss_scaler``). *firstresult*.
    Return None when the plan is not yours (e.g. a pipeline plugin returns None for a
    one-stage plan). The core answers last with the local runner (micro-batches as
    gradient accumulation) for one-stage plans. A runner that skips non-finite steps as the
    core's do holds a ``NonFiniteCheck`` as ``nonfinite`` (``Engine.step`` reads its outcome).
    """


# --------------------------------------------------------------------------------
# Planning: called by epl.plan and `epl plan`, which run nothing.
# --------------------------------------------------------------------------------


@hookspec(firstresult=True)
def epl_estimate_shards(
    model: nn.Module, taskgraphs: list[TaskGraph], plan: Plan, split_rules: Mapping[type[nn.Module], SplitRule]
) -> ShardShapes | None:
    """Work out what each device of the split TaskGraphs would hold, without the devices.

    Called by ``epl.plan`` and ``epl plan`` (at most once per estimate) when the model has split
    TaskGraphs, also for a one-process Plan (``plan.local``: only built, so that it can refuse
    what the run refuses). *firstresult*. The core answers last by running ``split_rules`` on
    ``meta`` copies of the modules (nothing is allocated). Return None to leave it to another
    plugin. An :class:`~epl.errors.EplError` raised here or by ``pieces`` fails the Plan (raise
    the run's error: a module no rule covers, sizes that do not divide); with no answer, or
    when ``pieces`` raises anything else, each parameter is estimated as sharded along
    dimension 0 and the Plan says so. ``Plan.taskgraphs[i].shards`` shows the pieces.

    :param model: the annotated model (whole, on its own device).
    :param taskgraphs: the split TaskGraphs of ``model``.
    :param plan: the Plan being estimated.
    :param split_rules: every registered split rule by module type.
    """


@hookspec
def epl_adjust_memory_estimate(estimate: MemoryEstimate, context: MemoryEstimateContext) -> MemoryEstimate | None:
    """Adjust one rank's memory estimate for what this plugin changes (ZeRO partitions, offload).

    Called by ``epl.plan`` and ``epl plan`` once per rank of the Plan, after the core
    estimated the plain bytes: the parameters the rank holds (split TaskGraphs sharded
    by their rules), their gradients, the optimizer's states (see
    :mod:`epl.placement.plan_memory`). Not *firstresult*: every implementation is applied
    in turn (in pluggy's call order), each receiving the previous one's estimate.
    Return a new estimate (``dataclasses.replace``; add a note saying what changed),
    or None to leave it as it is.

    :param estimate: the rank's estimate so far.
    :param context: the Plan, the config, the rank, the tensors it holds (with the
        optimizer's state of each) and ``context.copies(tensor)``.
    """


# --------------------------------------------------------------------------------
# Registries: collected from every plugin; a name or type registered twice is an error.
# --------------------------------------------------------------------------------


@hookspec
def epl_pipeline_schedules() -> Mapping[str, ScheduleGenerator] | None:
    """Register pipeline schedules by name (the values of ``pipeline.strategy``).

    Called when a pipeline is built or a schedule is drawn. A schedule generator
    turns (stages, micro-batches) into per-stage action lists; one executor runs
    every schedule. Return None to register none.
    """


@hookspec
def epl_split_rules() -> Mapping[type[nn.Module], SplitRule] | None:
    """Register how modules of a type are sharded under ``epl.split``.

    Called when a split TaskGraph is parallelized. Keys are module classes; the
    most specific class in a module's MRO wins. Return None to register none.
    """


# --------------------------------------------------------------------------------
# Command line: called when the `epl` command starts.
# --------------------------------------------------------------------------------


@hookspec
def epl_cli_commands(cli: click.Group) -> None:
    """Add subcommands to the ``epl`` click group (``cli.add_command(...)``).

    Called once when the ``epl`` command starts, before arguments are parsed.
    """
