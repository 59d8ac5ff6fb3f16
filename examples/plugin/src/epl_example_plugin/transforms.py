"""``CheckFinite``: a model transform that refuses to train a model with a non-finite parameter.

It runs in the ``CHECKPOINT`` phase (:class:`epl.plugin_api.TransformPhase`): like gradient
checkpointing it changes no tensor and needs the model's tensors to be final, i.e. after this
rank's stage is kept (``KEEP_STAGE``), split modules are sharded (``SHARD``) and every copy
starts from the same values (``SYNC_WEIGHTS``), and before offload moves them (``OFFLOAD``).
Under ZeRO the parameters are chunked over their copies by then (``PARTITION_PARAMETERS``), so
it reads what this rank holds of each (``local_tensor``: its chunk, no collective).
Within its phase, transforms run by name: ``example_check_finite`` runs before epl-memory's
``gradient_checkpointing``, which does not matter to either.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from epl.plugin_api import EplError, ParallelContext, TransformPhase, local_tensor
from epl_example_plugin.keys import CHECK_FINITE


@dataclass
class ExampleState:
    """This plugin's state in a ``ParallelContext`` (``context.state(ExampleState)``), kept by its hooks."""

    #: The parameters ``CheckFinite`` found finite, by name.
    checked: list[str] = field(default_factory=list)


class CheckFinite:
    """Model transform: raise :class:`epl.plugin_api.EplError` naming the first non-finite parameter."""

    name = "example_check_finite"
    phase = TransformPhase.CHECKPOINT

    def __call__(self, model: nn.Module, context: ParallelContext) -> nn.Module:
        """Check every parameter this rank keeps; return ``model`` unchanged."""
        state = context.state(ExampleState)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if not bool(torch.isfinite(local_tensor(parameter)).all()):
                    raise EplError(
                        f"Parameter {name!r} of rank {context.cluster.rank} holds NaN or inf before training "
                        f"({CHECK_FINITE} is set). Check its initialisation or the checkpoint it was loaded from."
                    )
                state.checked.append(name)
        return model
