"""The plugin API: everything an EPL plugin may import from epl-core, in one module.

epl-comm, epl-memory, epl-pipeline, epl-launch and third-party plugins import from here
and from nowhere deeper in ``epl`` (a test enforces it for the packages of this repository).
Names are imported on first use, so that a plugin that only needs ``hookimpl`` (like
epl-launch's ``epl launch``) does not import PyTorch.

What is here, by what a plugin does with it:

* declare hooks and config keys: :data:`hookimpl`, :class:`ConfigKey`, :class:`Config`; read the core's keys:
  :class:`CoreSettings` (its frozen, typed view of them, ``CoreSettings.from_config(config)``), and
  :class:`ConfigView`, the base of such a view of a plugin's own keys;
* extend ``epl.parallelize``: :class:`ParallelContext` and the protocols hooks return
  (:class:`ModelTransform` with its :class:`TransformPhase`, :class:`OptimizerWrapper` with its
  :class:`WrapperPhase`, :class:`GradientReducer`, :class:`LossScaler`, :class:`StepRunner`),
  the core's :class:`LocalStepRunner` to build on, :class:`StepUpdate` (the order of what comes around a runner's
  forwards and backwards: reduction, clipping, loss scale, update), and the helpers runners share
  (:func:`micro_batches`, :func:`split_batch`, :func:`batch_size`, :func:`to_device`, :func:`as_arguments`,
  :func:`call_model`, :func:`compute_loss`, :func:`example_input`, :func:`tensors_in`, :func:`forked_rng`,
  :func:`shapes_only`, :func:`meta_copy`, :func:`inside`, :func:`step_or_skip` with the
  :class:`NonFiniteCheck` it takes (every rank skips a step whose loss or gradients are not finite),
  :func:`clip_grad_norm`,
  :func:`repeated_blocks` (a transformer's layers, for per-block techniques));
* communicate: :class:`Communicator` (the protocol a communicator implements), :class:`Work`,
  :class:`CompletedWork`, :class:`ReduceOp`, :func:`broadcast_tensors`, :func:`communicators_for`,
  :class:`Cluster`, :func:`free_port`, :func:`slurm_step` (a Slurm task's place, for launchers),
  :data:`LAUNCH_TERMINAL_VARIABLE` (a launcher tells its ranks their output reaches a terminal);
* the data: :func:`data_position` (where this rank's ``epl.io`` sampler is, for checks across ranks);
* data parallelism over copies: :class:`Copies`, :func:`copies_of`, :func:`every_copy_group`;
* pipelines: :class:`Action`, :class:`ActionKind`, :data:`Schedule`, :class:`ScheduleGenerator`,
  :class:`PipelinePlacement` (what the pipeline plugin tells the others of this rank's stages),
  :class:`TaskGraph`, :func:`replicate` and :func:`split` (to build TaskGraphs of a partition),
  :func:`holders_of`, :class:`Plan`;
* split rules: :class:`ShardContext`, :class:`ShardGroup`, :data:`ShardRole`, :class:`SplitRule`, and a split
  piece's spec (:class:`ShardSpec`, :func:`shard_spec`, :func:`set_shard_spec`: a transform that replaces a split
  parameter sets its spec on the new one);
* memory estimates: :class:`MemoryEstimate`, :class:`MemoryEstimateContext`, :class:`EstimatedTensor`,
  :class:`ShardShapes`, :func:`group_options`;
* errors: every class of :mod:`epl.errors`;
* the process's plugin manager: :func:`get_plugin_manager` (e.g. to list schedules in a CLI command).

The hooks themselves are documented in ``epl/plugins/hookspecs.py``; docs/plugins.md shows a
whole plugin package (``examples/plugin``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from epl.lazy import lazy_exports

if TYPE_CHECKING:  # the names for type checkers; tests/core/test_layers.py keeps them equal to _EXPORTS
    from epl.annotations.strategies import Strategy, replicate, split
    from epl.annotations.taskgraph import TaskGraph, holders_of
    from epl.builtin.local_runner import ForwardContext, LocalStepRunner, inside
    from epl.compiling.blocks import repeated_blocks
    from epl.config import Config
    from epl.config.settings import CoreSettings
    from epl.config.view import ConfigView
    from epl.errors import (
        AnnotationError,
        BatchError,
        ClusterError,
        ConfigError,
        EplError,
        MissingPluginError,
        NotInitializedError,
        PlacementError,
        PluginError,
    )
    from epl.interfaces.cluster import Cluster
    from epl.interfaces.collectives import broadcast_tensors, communicators_for
    from epl.interfaces.communicator import Communicator, CompletedWork, ReduceOp, Work
    from epl.interfaces.config_key import ConfigKey
    from epl.interfaces.facts import Communication, MemoryTechniques, PipelineChoices
    from epl.interfaces.nonfinite_verdict import NonFiniteVerdict
    from epl.interfaces.optimizer_groups import group_options
    from epl.interfaces.phases import TransformPhase, WrapperPhase
    from epl.interfaces.pipeline_placement import PipelinePlacement
    from epl.interfaces.schedule import Action, ActionKind, Schedule, ScheduleGenerator
    from epl.interfaces.shard_group import ShardGroup, shard_sizes, shard_slice
    from epl.interfaces.slurm import slurm_step
    from epl.interfaces.split_rule import ShardContext, ShardRole, SplitRule
    from epl.io import data_position
    from epl.materialize.streaming import shapes_only
    from epl.placement.copies import Copies, copies_of, every_copy_group
    from epl.placement.memory_estimate import EstimatedTensor, MemoryEstimate, ShardPieces, ShardShapes
    from epl.placement.plan import Plan
    from epl.placement.plan_memory import MemoryEstimateContext
    from epl.plugins import get_plugin_manager, hookimpl
    from epl.plugins.capabilities import (
        ChecksNonFiniteSteps,
        ClippingRunner,
        CountsSkippedSteps,
        EvaluatingRunner,
        FoldingLossScaler,
        MeasurableRunner,
        PredictingRunner,
        SharingRunner,
    )
    from epl.plugins.context import (
        GradientReducer,
        LossFn,
        LossScaler,
        ModelTransform,
        OptimizerWrapper,
        ParallelContext,
        StepRunner,
    )
    from epl.plugins.facts import config_facts
    from epl.ports import free_port
    from epl.progress.bar import LAUNCH_TERMINAL_VARIABLE
    from epl.runtime.batch import as_arguments, batch_size, call_model, micro_batches, split_batch, to_device
    from epl.runtime.loss import compute_loss
    from epl.runtime.nonfinite import NonFiniteCheck
    from epl.runtime.update import StepUpdate, step_or_skip
    from epl.sharding.collectives import gradient_summed_over_shards
    from epl.sharding.data_shards import (
        MicroBatchListener,
        data_shards,
        defer_reads_until_settled,
        listen_to_micro_batches,
        listen_to_step_ends,
        local_tensor,
        mark_data_sharded,
        reduce_at_last_micro_batch,
        settle_pending_update,
        step_end_listeners,
    )
    from epl.sharding.dataflow import example_input, forked_rng, tensors_in
    from epl.sharding.meta import meta_copy
    from epl.sharding.norms import clip_grad_norm
    from epl.sharding.parameters import ShardSpec, set_shard_spec, shard_spec
    from epl.torch_private import (
        amp_unscale_,
        current_graph_task_id,
        engine_run_backward,
        functorch_transforms_active,
        has_torch_function,
        queue_backward_callback,
        reduce_sharded_gradients_now,
        tree_leaves,
    )

#: Public name -> the module of epl-core it lives in.
_EXPORTS: dict[str, str] = {
    # hooks and config
    "hookimpl": "epl.plugins",
    "get_plugin_manager": "epl.plugins",
    "Config": "epl.config",
    "ConfigKey": "epl.interfaces.config_key",
    "CoreSettings": "epl.config.settings",
    "ConfigView": "epl.config.view",
    # extending epl.parallelize
    "ParallelContext": "epl.plugins.context",
    "ModelTransform": "epl.plugins.context",
    "OptimizerWrapper": "epl.plugins.context",
    "GradientReducer": "epl.plugins.context",
    "LossScaler": "epl.plugins.context",
    "StepRunner": "epl.plugins.context",
    "LossFn": "epl.plugins.context",
    "TransformPhase": "epl.interfaces.phases",
    "WrapperPhase": "epl.interfaces.phases",
    "LocalStepRunner": "epl.builtin.local_runner",
    "ForwardContext": "epl.builtin.local_runner",
    "inside": "epl.builtin.local_runner",
    "step_or_skip": "epl.runtime.update",
    "StepUpdate": "epl.runtime.update",
    "NonFiniteCheck": "epl.runtime.nonfinite",
    "NonFiniteVerdict": "epl.interfaces.nonfinite_verdict",
    "micro_batches": "epl.runtime.batch",
    "clip_grad_norm": "epl.sharding.norms",
    "local_tensor": "epl.sharding.data_shards",
    "gradient_summed_over_shards": "epl.sharding.collectives",
    "mark_data_sharded": "epl.sharding.data_shards",
    "data_shards": "epl.sharding.data_shards",
    "reduce_at_last_micro_batch": "epl.sharding.data_shards",
    "listen_to_micro_batches": "epl.sharding.data_shards",
    "MicroBatchListener": "epl.sharding.data_shards",
    "listen_to_step_ends": "epl.sharding.data_shards",
    "Communication": "epl.interfaces.facts",
    "MemoryTechniques": "epl.interfaces.facts",
    "PipelineChoices": "epl.interfaces.facts",
    "PipelinePlacement": "epl.interfaces.pipeline_placement",
    "config_facts": "epl.plugins.facts",
    "ChecksNonFiniteSteps": "epl.plugins.capabilities",
    "ClippingRunner": "epl.plugins.capabilities",
    "CountsSkippedSteps": "epl.plugins.capabilities",
    "EvaluatingRunner": "epl.plugins.capabilities",
    "FoldingLossScaler": "epl.plugins.capabilities",
    "MeasurableRunner": "epl.plugins.capabilities",
    "PredictingRunner": "epl.plugins.capabilities",
    "SharingRunner": "epl.plugins.capabilities",
    "defer_reads_until_settled": "epl.sharding.data_shards",
    "settle_pending_update": "epl.sharding.data_shards",
    "step_end_listeners": "epl.sharding.data_shards",
    "split_batch": "epl.runtime.batch",
    "batch_size": "epl.runtime.batch",
    "to_device": "epl.runtime.batch",
    "compute_loss": "epl.runtime.loss",
    "as_arguments": "epl.runtime.batch",
    "call_model": "epl.runtime.batch",
    "example_input": "epl.sharding.dataflow",
    "tensors_in": "epl.sharding.dataflow",
    "forked_rng": "epl.sharding.dataflow",
    "shapes_only": "epl.materialize.streaming",
    "repeated_blocks": "epl.compiling.blocks",
    "meta_copy": "epl.sharding.meta",
    # communication
    "Communicator": "epl.interfaces.communicator",
    "CompletedWork": "epl.interfaces.communicator",
    "ReduceOp": "epl.interfaces.communicator",
    "Work": "epl.interfaces.communicator",
    "broadcast_tensors": "epl.interfaces.collectives",
    "communicators_for": "epl.interfaces.collectives",
    "Cluster": "epl.interfaces.cluster",
    "data_position": "epl.io",
    "free_port": "epl.ports",
    "slurm_step": "epl.interfaces.slurm",
    "LAUNCH_TERMINAL_VARIABLE": "epl.progress.bar",
    # copies of tensors (data parallelism)
    "Copies": "epl.placement.copies",
    "copies_of": "epl.placement.copies",
    "every_copy_group": "epl.placement.copies",
    # pipelines and partitions
    "Action": "epl.interfaces.schedule",
    "ActionKind": "epl.interfaces.schedule",
    "Schedule": "epl.interfaces.schedule",
    "ScheduleGenerator": "epl.interfaces.schedule",
    "TaskGraph": "epl.annotations.taskgraph",
    "holders_of": "epl.annotations.taskgraph",
    "Strategy": "epl.annotations.strategies",
    "replicate": "epl.annotations.strategies",
    "split": "epl.annotations.strategies",
    "Plan": "epl.placement.plan",
    # split rules
    "ShardContext": "epl.interfaces.split_rule",
    "ShardRole": "epl.interfaces.split_rule",
    "SplitRule": "epl.interfaces.split_rule",
    "ShardGroup": "epl.interfaces.shard_group",
    "shard_sizes": "epl.interfaces.shard_group",
    "shard_slice": "epl.interfaces.shard_group",
    "ShardSpec": "epl.sharding.parameters",
    "shard_spec": "epl.sharding.parameters",
    "set_shard_spec": "epl.sharding.parameters",
    # private torch APIs, in one place (epl.torch_private)
    "amp_unscale_": "epl.torch_private",
    "current_graph_task_id": "epl.torch_private",
    "engine_run_backward": "epl.torch_private",
    "functorch_transforms_active": "epl.torch_private",
    "has_torch_function": "epl.torch_private",
    "queue_backward_callback": "epl.torch_private",
    "reduce_sharded_gradients_now": "epl.torch_private",
    "tree_leaves": "epl.torch_private",
    # memory estimates
    "MemoryEstimate": "epl.placement.memory_estimate",
    "EstimatedTensor": "epl.placement.memory_estimate",
    "ShardPieces": "epl.placement.memory_estimate",
    "ShardShapes": "epl.placement.memory_estimate",
    "MemoryEstimateContext": "epl.placement.plan_memory",
    "group_options": "epl.interfaces.optimizer_groups",
    # errors
    "AnnotationError": "epl.errors",
    "BatchError": "epl.errors",
    "ClusterError": "epl.errors",
    "ConfigError": "epl.errors",
    "EplError": "epl.errors",
    "MissingPluginError": "epl.errors",
    "NotInitializedError": "epl.errors",
    "PlacementError": "epl.errors",
    "PluginError": "epl.errors",
}

# A list type checkers read (they take only these names as re-exported); tests/core/test_layers.py keeps it equal
# to sorted(_EXPORTS).
__all__ = [
    "Action",
    "ActionKind",
    "AnnotationError",
    "BatchError",
    "ChecksNonFiniteSteps",
    "ClippingRunner",
    "Cluster",
    "ClusterError",
    "Communication",
    "Communicator",
    "CompletedWork",
    "Config",
    "ConfigError",
    "ConfigKey",
    "ConfigView",
    "Copies",
    "CoreSettings",
    "CountsSkippedSteps",
    "EplError",
    "EstimatedTensor",
    "EvaluatingRunner",
    "FoldingLossScaler",
    "ForwardContext",
    "GradientReducer",
    "LAUNCH_TERMINAL_VARIABLE",
    "LocalStepRunner",
    "LossFn",
    "LossScaler",
    "MeasurableRunner",
    "MemoryEstimate",
    "MemoryEstimateContext",
    "MemoryTechniques",
    "MicroBatchListener",
    "MissingPluginError",
    "ModelTransform",
    "NonFiniteCheck",
    "NonFiniteVerdict",
    "NotInitializedError",
    "OptimizerWrapper",
    "ParallelContext",
    "PipelineChoices",
    "PipelinePlacement",
    "PlacementError",
    "Plan",
    "PluginError",
    "PredictingRunner",
    "ReduceOp",
    "Schedule",
    "ScheduleGenerator",
    "ShardContext",
    "ShardGroup",
    "ShardPieces",
    "ShardRole",
    "ShardShapes",
    "ShardSpec",
    "SharingRunner",
    "SplitRule",
    "StepRunner",
    "StepUpdate",
    "Strategy",
    "TaskGraph",
    "TransformPhase",
    "Work",
    "WrapperPhase",
    "amp_unscale_",
    "as_arguments",
    "batch_size",
    "broadcast_tensors",
    "call_model",
    "clip_grad_norm",
    "communicators_for",
    "compute_loss",
    "config_facts",
    "copies_of",
    "current_graph_task_id",
    "data_position",
    "data_shards",
    "defer_reads_until_settled",
    "engine_run_backward",
    "every_copy_group",
    "example_input",
    "forked_rng",
    "free_port",
    "functorch_transforms_active",
    "get_plugin_manager",
    "gradient_summed_over_shards",
    "group_options",
    "has_torch_function",
    "holders_of",
    "hookimpl",
    "inside",
    "listen_to_micro_batches",
    "listen_to_step_ends",
    "local_tensor",
    "mark_data_sharded",
    "meta_copy",
    "micro_batches",
    "queue_backward_callback",
    "reduce_at_last_micro_batch",
    "reduce_sharded_gradients_now",
    "repeated_blocks",
    "replicate",
    "set_shard_spec",
    "settle_pending_update",
    "shapes_only",
    "shard_sizes",
    "shard_slice",
    "shard_spec",
    "slurm_step",
    "split",
    "split_batch",
    "step_end_listeners",
    "step_or_skip",
    "tensors_in",
    "to_device",
    "tree_leaves",
]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
