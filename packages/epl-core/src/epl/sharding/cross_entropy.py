"""Cross-entropy over logits sharded by class, without ever gathering the whole logits.

Each device holds the logits of its classes for every row. The row's maximum and
its sum of exponentials are reduced over the devices; the target's logit comes
from the device that holds the target class (a per-shard label mask). The gradient
is this device's softmax minus its part of the one-hot target: no communication.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from epl.errors import EplError
from epl.interfaces.communicator import ReduceOp
from epl.interfaces.shard_group import ShardGroup
from epl.sharding import collectives as C
from epl.sharding.vocabulary import LABELS_FIX, check_in_vocabulary


class _ShardedCrossEntropy(torch.autograd.Function):
    """Per-row loss from class-sharded logits [N, C_shard] and targets [N] (global class ids)."""

    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, targets: torch.Tensor, group: ShardGroup, start: int, ignore_index: int
    ) -> torch.Tensor:
        communicator = group.communicator
        logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        row_max = logits.max(dim=-1).values
        group.collectives["all_reduce"] += 1
        communicator.all_reduce(row_max, ReduceOp.MAX).wait()
        shifted = logits - row_max.unsqueeze(-1)
        local = targets - start
        mine = (local >= 0) & (local < logits.shape[-1])
        picked = shifted.gather(-1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
        exp = shifted.exp_()  # shifted is this function's own temporary
        sums = torch.stack([picked.masked_fill(~mine, 0.0), exp.sum(dim=-1)])
        group.collectives["all_reduce"] += 1
        communicator.all_reduce(sums, ReduceOp.SUM).wait()
        target_logit, sum_exp = sums[0], sums[1]
        loss = sum_exp.log() - target_logit
        ignored = targets == ignore_index
        loss = loss.masked_fill(ignored, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local, mine & ~ignored, ignored)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        softmax, local, hit, ignored = ctx.saved_tensors
        rows = torch.arange(softmax.shape[0], device=softmax.device)
        result = softmax.clone()
        result[rows[hit], local[hit]] -= 1.0
        result.masked_fill_(ignored.unsqueeze(-1), 0.0)
        return result.mul_(grad.unsqueeze(-1)), None, None, None, None


def sharded_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    group: ShardGroup,
    *,
    num_classes: int,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """``F.cross_entropy`` of class-sharded ``logits`` [N, this device's classes] and ``targets`` [N].

    With the batch split over the devices (``group.batch_split``), ``logits`` hold every
    device's rows and ``targets`` only this device's; the result is this device's loss. A target outside
    ``0 .. num_classes - 1`` (other than ``ignore_index``) is a :class:`~epl.errors.VocabularyError` on every
    device, as ``F.cross_entropy``'s ``IndexError`` in one process.
    """
    if logits.dim() != 2 or targets.dim() != 1:
        raise EplError(
            f"The parallel cross-entropy takes logits [batch, classes] and targets [batch]; got logits "
            f"{list(logits.shape)} and targets {list(targets.shape)}. Flatten them in the model and the data."
        )
    if targets.dtype.is_floating_point:
        raise EplError("The parallel cross-entropy takes class indices as targets, not probabilities.")
    if group.batch_split:
        targets = C.gather_rows(targets, group)
    check_in_vocabulary(
        targets,
        num_classes,
        "The targets (labels) of the parallel cross-entropy",
        ignore_index=ignore_index,
        fix=LABELS_FIX,
        bound="the {size} classes of the split output layer",
    )
    start = group.slice(num_classes).start
    per_row = _ShardedCrossEntropy.apply(logits, targets, group, start, ignore_index)
    kept = targets != ignore_index
    if group.batch_split:
        per_row, kept = C.scatter_rows(per_row, group), C.scatter_rows(kept, group)
    if reduction == "none":
        return per_row
    if reduction == "sum":
        return per_row.sum()
    return per_row.sum() / kept.sum()


class ShardedCrossEntropyLoss(nn.Module):
    """Stands in for the user's ``nn.CrossEntropyLoss`` when the model's logits are sharded by class.

    Whole logits (e.g. from ``Engine.predict``) go to the original loss unchanged.
    """

    def __init__(self, original: nn.CrossEntropyLoss, group: ShardGroup, num_classes: int) -> None:
        super().__init__()
        if original.weight is not None or original.label_smoothing:
            raise EplError(
                "The split classifier's parallel cross-entropy does not support class weights or label "
                "smoothing yet. Use nn.CrossEntropyLoss() without them, or create the classifier outside epl.split."
            )
        self.original = original
        self.group = group
        self.num_classes = num_classes

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of ``logits`` (sharded or whole) against ``targets``."""
        if logits.shape[-1] == self.num_classes:
            return self.original(logits, targets)
        return sharded_cross_entropy(
            logits,
            targets,
            self.group,
            num_classes=self.num_classes,
            ignore_index=self.original.ignore_index,
            reduction=self.original.reduction,
        )
