"""The model transform of context parallelism (``context.degree``): each device of a replica's context group takes
its share of every sequence and attends over the group (:mod:`epl.context`)."""

from __future__ import annotations

from torch import nn

from epl.config.settings import CoreSettings
from epl.context.proof import prove_context_parallel
from epl.context.ring import ContextGroup
from epl.context.transformers_models import ATTENTION, check_installable, gathered_outputs, install
from epl.errors import AnnotationError
from epl.interfaces.collectives import communicators_for
from epl.interfaces.phases import TransformPhase
from epl.plugins.context import ParallelContext
from epl.runtime.loss import compute_loss


class ProveContextParallel:
    """Model transform: refuse a model that would train differently under context parallelism (one check in one
    process on the whole model, :func:`epl.context.proof.prove_context_parallel`), unless ``context.verify`` is
    off."""

    name = "prove_context_parallel"
    phase = TransformPhase.PROVE_CONTEXT

    def __call__(self, model: nn.Module, context: ParallelContext) -> nn.Module:
        """``model`` unchanged, once proven."""
        if CoreSettings.from_config(context.config).context.verify:
            check_installable(model)
            prove_context_parallel(model, context.plan.context_degree, ATTENTION)
        return model


class SpreadSequences:
    """Model transform: make the model take this device's tokens and attend over its replica's context devices;
    a ``loss_fn`` of the user's then reads the logits gathered whole."""

    name = "spread_sequences"
    phase = TransformPhase.CONTEXT

    def __call__(self, model: nn.Module, context: ParallelContext) -> nn.Module:
        """``model``, changed in place; ``context.loss_fn`` wrapped when the user gave one."""
        plan = context.plan
        mine = plan.context_peers(context.cluster.rank)
        communicator = communicators_for(context.communicator, plan.context_groups())[tuple(sorted(mine))]
        group = ContextGroup(communicator)
        context.context_group = group
        settings = CoreSettings.from_config(context.config).context
        presliced = settings.presliced
        install(model, group, settings.mode, presliced=presliced)
        user_loss = context.loss_fn
        if user_loss is not None and presliced:
            raise AnnotationError(
                "context.presliced gives each rank its own tokens, so a loss_fn would read whole logits beside this "
                "rank's share of the targets. Pass shift_labels in the batch for the model's own loss (and no "
                "loss_fn), or set context.presliced to False."
            )
        if user_loss is not None:
            context.loss_fn = lambda outputs, targets=None: compute_loss(
                gathered_outputs(outputs, group), targets, user_loss
            )
        return model
