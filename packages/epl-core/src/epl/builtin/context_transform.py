"""The model transform of context parallelism (``context.degree``): each device of a replica's context group takes
its share of every sequence and attends over the group (:mod:`epl.context`)."""

from __future__ import annotations

from torch import nn

from epl.context.ring import ContextGroup
from epl.context.transformers_models import gathered_outputs, install
from epl.interfaces.collectives import communicators_for
from epl.interfaces.phases import TransformPhase
from epl.plugins.context import ParallelContext
from epl.runtime.loss import compute_loss


class SpreadSequences:
    """Model transform: make the model take this device's tokens and attend over its replica's context devices;
    a ``loss_fn`` of the user's then reads the logits gathered whole."""

    name = "spread_sequences"
    phase = TransformPhase.CONTEXT

    def __call__(self, model: nn.Module, context: ParallelContext) -> nn.Module:
        """``model``, changed in place; ``context.loss_fn`` wrapped when the user gave one."""
        plan = context.plan
        groups = [plan.devices_of_replica(replica) for replica in range(plan.num_replicas)]
        mine = plan.devices_of_replica(context.replica_index)
        communicator = communicators_for(context.communicator, groups)[tuple(sorted(mine))]
        group = ContextGroup(communicator)
        context.context_group = group
        install(model, group, str(context.config["context.mode"]))
        user_loss = context.loss_fn
        if user_loss is not None:
            context.loss_fn = lambda outputs, targets=None: compute_loss(
                gathered_outputs(outputs, group), targets, user_loss
            )
        return model
