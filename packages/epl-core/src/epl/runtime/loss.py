"""The scalar loss of a model's outputs: the user's ``loss_fn``, or the loss the model computed itself.

Without ``loss_fn`` the model's output is the loss: a scalar tensor, or, as transformers'
models return when the batch holds ``labels``, an object with a ``.loss`` (a ``ModelOutput``)
or a dict with a ``"loss"`` entry. With ``loss_fn`` the outputs reach it as the model gave
them (a ``ModelOutput`` included).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from epl.errors import EplError


def compute_loss(outputs: Any, targets: Any, loss_fn: Callable[..., Any] | None) -> torch.Tensor:
    """``loss_fn(outputs, targets)`` (``loss_fn(outputs)`` without targets), or the model's own loss; a scalar
    tensor, else one clear error."""
    if loss_fn is not None:
        loss = loss_fn(outputs, targets) if targets is not None else loss_fn(outputs)
    elif targets is not None:
        raise EplError(
            "Engine.step got targets but epl.parallelize() had no loss_fn: pass loss_fn=..., or put the targets in "
            "the batch (e.g. 'labels' for a transformers model, which then returns its loss)."
        )
    else:
        loss = _own_loss(outputs)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = list(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise EplError(f"The loss must be a scalar tensor, got {shape}. Reduce it (e.g. reduction='mean').")
    return loss.reshape(()) if loss.dim() else loss


def _own_loss(outputs: Any) -> Any:
    """The loss a model returned: the outputs themselves, their ``.loss``, or their ``"loss"`` entry."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    found = outputs.get("loss") if isinstance(outputs, Mapping) else getattr(outputs, "loss", _ABSENT)
    if found is _ABSENT:
        return outputs
    if found is None:
        raise EplError(
            f"The model returned a {type(outputs).__name__} without a loss, and epl.parallelize() had no loss_fn: "
            "give the model its targets in the batch (e.g. {'input_ids': ..., 'labels': ...} for a transformers "
            "model), or pass loss_fn=... ."
        )
    return found


_ABSENT = object()
