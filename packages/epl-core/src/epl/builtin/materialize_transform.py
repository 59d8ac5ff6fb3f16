"""The model transform that gives a model built on ``meta`` the values this rank keeps (:mod:`epl.materialize`)."""

from __future__ import annotations

import logging

from torch import nn

from epl.interfaces.phases import TransformPhase
from epl.materialize.placing import materialize_kept
from epl.plugins.context import ParallelContext

_log = logging.getLogger(__name__)


class MaterializeKept:
    """Model transform: every ``meta`` tensor of this rank's model (its stage, its shards) gets its initial values
    on this rank's device, one init unit at a time; the rest of the model never gets memory."""

    name = "materialize_kept"
    phase = TransformPhase.MATERIALIZE

    def __call__(self, model: nn.Module, context: ParallelContext) -> nn.Module:
        """Return ``model`` with values in every tensor it keeps."""
        stream = context.lazy_init
        if stream is None:
            return model
        count = materialize_kept(model, stream, context.cluster.device)
        _log.info("epl: rank %d gave %d elements of the meta model values", context.cluster.rank, count)
        return model
