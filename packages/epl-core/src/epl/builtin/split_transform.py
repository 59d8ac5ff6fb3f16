"""The model transform that replaces each module of a split TaskGraph by this device's shard of it."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

from epl.annotations.taskgraph import TaskGraph
from epl.errors import AnnotationError, ConfigError, PlacementError
from epl.interfaces.collectives import broadcast_tensors, communicators_for
from epl.interfaces.phases import TransformPhase
from epl.interfaces.shard_group import ShardGroup
from epl.interfaces.split_rule import ShardContext, SplitRule
from epl.plugins.context import ParallelContext
from epl.sharding.cross_entropy import ShardedCrossEntropyLoss
from epl.sharding.layout import assign_roles
from epl.sharding.linear import shard_linear
from epl.sharding.parameters import is_sharded
from epl.sharding.rules import rule_for


@dataclass(frozen=True)
class SplitTarget:
    """A module of a split TaskGraph that owns tensors, with its name in the model and the rule that shards it."""

    name: str
    module: nn.Module
    rule: SplitRule


class ShardSplitTaskGraphs:
    """Model transform: shard the modules of every split TaskGraph this rank runs, by their split rules.

    In a one-process run the rules are only looked up, so a module without one fails
    on the laptop too. When the model's output is a split classifier and the loss is
    ``nn.CrossEntropyLoss``, the loss is replaced by the parallel cross-entropy.
    """

    name = "shard_split_taskgraphs"
    phase = TransformPhase.SHARD

    def __call__(self, model: nn.Module, context: ParallelContext) -> nn.Module:
        """Return ``model`` with this rank's shards in place of the split modules."""
        split = [tg for tg in context.taskgraphs if tg.strategy.kind == "split"]
        if not split:
            return model
        rules = context.plugins.split_rules()
        targets = {tg.index: find_targets(model, tg, rules) for tg in split}
        plan = context.plan
        if plan.local:
            return model
        _check_supported(context)
        world = context.communicator
        devices = {(tg.index, r): plan.devices(tg.index, r) for tg in split for r in range(plan.num_replicas)}
        communicators = communicators_for(world, list(devices.values()))
        rank, replica = context.cluster.rank, context.replica_index
        mine = [tg for tg in split if tg.index in plan.taskgraphs_on(rank)]
        linears = {t.name for tg in mine for t in targets[tg.index] if t.rule is shard_linear}
        # Exactly nn.CrossEntropyLoss: a subclass may compute something else from the logits.
        roles = assign_roles(model, linears, loss_is_cross_entropy=type(context.loss_fn) is nn.CrossEntropyLoss)
        for tg in mine:
            group = ShardGroup(
                communicators[tuple(sorted(devices[tg.index, replica]))],
                batch_split=plan.batch_parts(tg.index) > 1,
            )
            context.shard_groups[tg.index] = group
            replaced: set[int] = set()
            for target in targets[tg.index]:
                _start_alike(target.module, group)
                replaced.update(id(t) for t in itertools.chain(target.module.parameters(), target.module.buffers()))
                role = roles.get(target.name, "alone")
                shard = target.rule(target.module, ShardContext(group, target.name, role))
                model = _replace(model, target.name, shard)
                for tensor in itertools.chain(shard.parameters(), shard.buffers()):
                    context.split_tensors[id(tensor)] = (tg.index, is_sharded(tensor))
                if role == "logits":
                    assert isinstance(target.module, nn.Linear) and isinstance(context.loss_fn, nn.CrossEntropyLoss)
                    context.loss_fn = ShardedCrossEntropyLoss(context.loss_fn, group, target.module.out_features)
            # Forget the whole tensors, so that only the shards stay in memory.
            tg.tensors[:] = [t for t in tg.tensors if id(t) not in replaced or id(t) in context.split_tensors]
        return model


def _start_alike(module: nn.Module, group: ShardGroup) -> None:
    """Give every device of ``group`` the first device's values of ``module`` before it is sliced.

    The shards then fit together even when the devices were seeded differently, and the
    tensors every device keeps whole (a row-parallel bias) are equal.
    """
    broadcast_tensors(itertools.chain(module.parameters(), module.buffers()), group.communicator)


def _check_supported(context: ParallelContext) -> None:
    plan = context.plan
    if plan.num_stages > 1:
        raise split_stage_error(next(tg.name for tg in plan.taskgraphs if tg.strategy == "split"))
    if context.config["optimizer.max_grad_norm"] is not None:
        raise ConfigError(
            "optimizer.max_grad_norm with a split TaskGraph on several devices is not supported yet: the norm "
            "needs every shard's gradients. Leave optimizer.max_grad_norm unset for split models."
        )


def split_stage_error(name: str) -> PlacementError:
    """The error for a split TaskGraph planned as a pipeline stage (not supported yet)."""
    return PlacementError(
        f"A split TaskGraph cannot be a pipeline stage yet ({name}): its devices would need activations "
        "from another stage. Set cluster.colocate_split_and_replicate=True so that split and replicate "
        "TaskGraphs share the same devices (the manual's classification and MoE recipes)."
    )


def find_targets(
    model: nn.Module, taskgraph: TaskGraph, rules: Mapping[type[nn.Module], SplitRule]
) -> list[SplitTarget]:
    """The outermost modules holding ``taskgraph``'s tensors that a rule covers; a module no rule covers is an error."""
    owned = {id(t) for t in taskgraph.tensors}
    found: list[SplitTarget] = []
    holder: dict[int, str] = {}

    def visit(name: str, module: nn.Module) -> None:
        if not any(id(t) in owned for t in itertools.chain(module.parameters(), module.buffers())):
            return
        rule = rule_for(module, rules)
        if rule is not None:
            for tensor in itertools.chain(module.parameters(), module.buffers()):
                if id(tensor) in holder:
                    raise _shared(taskgraph, holder[id(tensor)], name)
                holder[id(tensor)] = name
            found.append(SplitTarget(name, module, rule))
            return
        own = itertools.chain(module.parameters(recurse=False), module.buffers(recurse=False))
        if any(id(t) in owned for t in own):
            raise _no_rule(taskgraph, name, module)
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)

    visit("", model)
    return found


def _shared(taskgraph: TaskGraph, first: str, second: str) -> AnnotationError:
    return AnnotationError(
        f"{taskgraph.name} (split({taskgraph.strategy.device_count})) shares a tensor between the modules "
        f"{first or 'model'!r} and {second or 'model'!r} (tied weights, or one module under two names). Split "
        "rules shard each module on its own, so they would come apart. Untie them, or create the shared "
        "module outside the epl.split scope."
    )


def _no_rule(taskgraph: TaskGraph, name: str, module: nn.Module) -> AnnotationError:
    kind = type(module)
    return AnnotationError(
        f"{taskgraph.name} (split({taskgraph.strategy.device_count})) holds the module {name or 'model'!r}, "
        f"a {kind.__module__}.{kind.__qualname__}, "
        f"and no split rule says how to shard that type. Register a rule in a plugin:\n"
        f"    @epl.hookimpl\n"
        f"    def epl_split_rules():\n"
        f"        return {{{kind.__qualname__}: shard_it}}  # shard_it(module, shard: epl.ShardContext) -> nn.Module\n"
        f"with epl.Env.get().plugins.register(plugin, name=...) or an 'epl' entry point, "
        f"or create the module outside the epl.split scope. Built-in rules: nn.Linear, nn.Embedding, "
        f"epl.nn.Experts, normalisation layers (kept whole)."
    )


def _replace(model: nn.Module, name: str, module: nn.Module) -> nn.Module:
    """``model`` with its submodule ``name`` replaced ('' replaces the model itself)."""
    if not name:
        return module
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)
    return model
