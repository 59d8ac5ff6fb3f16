"""The core's answer to ``epl_estimate_shards``: the split rules run on ``meta`` copies, for ``epl plan``.

Each rule builds the shard one device would hold from a copy of the module whose tensors
live on the ``meta`` device, so every shard has the size a run gives it and nothing is
allocated. The rules see a shard group whose communicator is a stand-in (a position,
no peers): a rule that communicates while it builds fails, and the estimate falls back
to sharding along dimension 0 with a note. What the run would refuse is refused here
with the run's error (an :class:`~epl.errors.EplError`): a module no rule covers, sizes
a rule cannot share (``ShardGroup.require``, heads, experts). The rules are told the layout
the run would decide (:func:`epl.sharding.layout.decide_layout`: one example forward of the
whole model, per pipeline stage), so row-parallel layers, fused parts and whole heads are
estimated as the run shards them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

from torch import nn

from epl.annotations.taskgraph import TaskGraph
from epl.builtin.split_transform import LINEAR_RULES, find_targets, layout_of, whole_because
from epl.interfaces.shard_group import ShardGroup
from epl.interfaces.split_rule import ShardContext, SplitRule
from epl.placement.memory_estimate import ShardPieces
from epl.placement.plan import Plan
from epl.sharding.layout import Decision, SplitLayout
from epl.sharding.meta import meta_copy
from epl.sharding.parameters import is_sharded


class RuleShardShapes:
    """The shards of a model's split TaskGraphs, built by their split rules on ``meta`` copies.

    Built, it has found a rule for every module (raising the run's error where none fits).
    """

    def __init__(
        self, model: nn.Module, taskgraphs: list[TaskGraph], plan: Plan, rules: Mapping[type[nn.Module], SplitRule]
    ) -> None:
        self.plan = plan
        self.taskgraphs = {tg.index: tg for tg in taskgraphs}
        self._targets = {tg.index: find_targets(model, tg, rules) for tg in taskgraphs}
        self._decisions: dict[str, Decision] = {}
        #: Module name -> why it keeps its parameters whole (shown by ``epl plan`` when most of a TaskGraph is).
        self.whole_because: dict[str, str] = {}
        if plan.local:
            return
        # As the run decides it: over the split TaskGraphs a device runs (one pipeline stage, or all of them).
        together = [list(self._targets)] if plan.num_stages == 1 else [[index] for index in self._targets]
        for indices in together:
            targets = [t for index in indices for t in self._targets[index]]
            layout = SplitLayout({})
            if any(t.rule in LINEAR_RULES for t in targets):
                layout = layout_of(model, targets, loss_fn=None)
                self._decisions.update(layout.decisions)
            self.whole_because.update({t.name: whole_because(t, layout) for t in targets})

    def pieces(self, taskgraph: int, position: int) -> dict[int, tuple[int, ShardPieces]]:
        """``id(model parameter)`` -> (its module's index, the shard's parameters) at ``position``."""
        count = self.taskgraphs[taskgraph].strategy.device_count
        group = ShardGroup(cast(Any, _Seat(position, count)), batch_split=self.plan.batch_parts(taskgraph) > 1)
        found: dict[int, tuple[int, ShardPieces]] = {}
        for key, target in enumerate(self._targets[taskgraph]):
            if target.own_only:
                continue  # kept whole: its own tensors count as they are
            decision = self._decisions.get(target.name, Decision())
            shard_context = ShardContext(
                group, target.name, decision.role, decision.parts, decision.granule, decision.weight_layout
            )
            shard = target.rule(meta_copy(target.module), shard_context)
            prefix = f"{target.name}." if target.name else ""
            pieces: ShardPieces = [(prefix + name, p, is_sharded(p)) for name, p in shard.named_parameters()]
            for param in target.module.parameters():
                found[id(param)] = (key, pieces)
        return found


@dataclass(frozen=True)
class _Seat:
    """Stands in for a shard group's communicator while split rules run for an estimate: a position, no peers."""

    rank: int
    world_size: int
