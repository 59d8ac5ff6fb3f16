"""ZeRO under a zero-bubble pipeline schedule: each stage's gradients reduced once, when the step's backward ends.

A zero-bubble schedule splits each micro-batch's backward in two: the input gradients (I) first, the weight
gradients (W) later. FSDP2 reduce-scatters a block's gradients when the backward reaches the block's inputs, which
under such a schedule is the I pass, before any weight gradient exists. So each sharded stage root keeps its
blocks' weights gathered and their gradients whole through a step, and reduce-scatters them once the runner says
its last action has run (:func:`epl.plugin_api.listen_to_step_ends`), as ``torch.distributed.pipelining`` does for
its own FSDP stages (``PipelineStage.perform_reduce_grad``). A stage then holds its whole weights and gradients
during a step, as ZeRO v1 with one micro-batch does.

FSDP2 has no public call for "reduce now": the step end makes the private calls torch's pipelining makes
(:func:`epl.plugin_api.reduce_sharded_gradients_now`, with EPL's other private torch calls in ``epl.torch_private``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

from epl.plugin_api import listen_to_step_ends, reduce_sharded_gradients_now


def reduce_at_step_end(roots: Sequence[nn.Module]) -> None:
    """Have each of ``roots`` (sharded stage roots, ``fully_shard``'s) accumulate whole gradients over a step's
    micro-batches and reduce-scatter them when the step's last backward has run."""
    for root in roots:
        _reducing(root, False)
        listen_to_step_ends(root, _reducer(root))


def _reducing(root: nn.Module, reducing: bool) -> None:
    """Whether ``root``'s backwards reduce and reshard (and count as a step's last): not in the micro-batches, only
    at the step's end."""
    root.set_requires_gradient_sync(reducing)  # type: ignore[operator]  # an FSDPModule (fully_shard's)
    root.set_reshard_after_backward(reducing)  # type: ignore[operator]  # likewise
    root.set_is_last_backward(reducing)  # type: ignore[operator]  # likewise


def _reducer(root: nn.Module) -> Callable[[], None]:
    def reduce() -> None:
        _reducing(root, True)
        try:
            reduce_sharded_gradients_now(root)
        finally:
            _reducing(root, False)

    return reduce
