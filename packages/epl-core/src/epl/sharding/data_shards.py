"""Parameters that data parallelism shards over their copies (ZeRO on torch's FSDP2): the mark, and local reads.

Under ``zero.level`` a parameter with several copies becomes a ``DTensor`` whose copies each hold one even chunk of
its rows (FSDP2's ``fully_shard``). EPL marks such a parameter with the communicator over its copies
(:func:`mark_data_sharded`), so that what sums over a parameter (the clipping norm) knows where its other chunks
are, and reads it through :func:`local_tensor`: this rank's chunk, a view, never a collective.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from epl.interfaces.communicator import Communicator

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from typing_extensions import TypeIs

_MARK = "_epl_data_shards"


@dataclass(frozen=True)
class DataShards:
    """A parameter each of whose copies holds an even chunk of its rows: the communicator over those copies, and
    where the chunk lives between uses when that is not the compute device (host memory under offload)."""

    communicator: Communicator
    home: torch.device | None = None


def mark_data_sharded(parameter: torch.Tensor, communicator: Communicator, home: torch.device | None = None) -> None:
    """Mark ``parameter`` as chunked over the members of ``communicator`` (its copies), its chunk kept on ``home``
    (None: the compute device)."""
    setattr(parameter, _MARK, DataShards(communicator, home))


def data_shards(tensor: torch.Tensor) -> DataShards | None:
    """How ``tensor`` is chunked over its copies, or None when each copy holds it all."""
    return getattr(tensor, _MARK, None)


def is_dtensor(tensor: object) -> TypeIs[DTensor]:
    """Whether ``tensor`` is a ``DTensor`` (a chunk of a tensor sharded over a device mesh)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without torch.distributed
        return False
    return isinstance(tensor, DTensor)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``tensor``: a DTensor's local chunk (a view; no collective), else ``tensor``."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def sharded_modules(model: nn.Module) -> list[FSDPModule]:
    """The modules of ``model`` that FSDP2's ``fully_shard`` manages, outermost first."""
    from torch.distributed.fsdp import FSDPModule

    return [module for module in model.modules() if isinstance(module, FSDPModule)]


#: The attribute holding a module's micro-batch listeners (:func:`listen_to_micro_batches`).
_LISTENERS = "_epl_micro_batch_listeners"

#: ``listener(index, count)``: micro-batch ``index`` (from 0) of a step's ``count`` is about to run.
MicroBatchListener = Callable[[int, int], None]


def listen_to_micro_batches(module: nn.Module, listener: MicroBatchListener) -> None:
    """Call ``listener(index, count)`` before each micro-batch's forward in a step that the local step runner cuts
    into ``count > 1`` micro-batches (``index`` 0 first). A step of one batch calls nothing, nor does a pipeline's
    runner (each of its micro-batches' backwards is on its own), so a listener's default must be right alone."""
    module.__dict__.setdefault(_LISTENERS, []).append(listener)


def micro_batch_listeners(model: nn.Module) -> list[MicroBatchListener]:
    """Every listener of ``model``'s modules (:func:`listen_to_micro_batches`), outermost module first."""
    return [listener for module in model.modules() for listener in module.__dict__.get(_LISTENERS, ())]


#: The attribute holding a module's step-end listeners (:func:`listen_to_step_ends`).
_STEP_END_LISTENERS = "_epl_step_end_listeners"


def listen_to_step_ends(module: nn.Module, listener: Callable[[], None]) -> None:
    """Call ``listener()`` when a training step's last backward on this rank has run, before its gradients are
    reduced over copies, clipped and unscaled. Every step runner's ``StepUpdate`` calls it (:mod:`epl.runtime.update`;
    a pipeline's after its last action, so after a zero-bubble schedule's last weight gradient)."""
    module.__dict__.setdefault(_STEP_END_LISTENERS, []).append(listener)


def step_end_listeners(model: nn.Module) -> list[Callable[[], None]]:
    """Every step-end listener of ``model``'s modules (:func:`listen_to_step_ends`), outermost module first."""
    return [listener for module in model.modules() for listener in module.__dict__.get(_STEP_END_LISTENERS, ())]


#: The attribute holding the function that completes a module's pending update (:func:`defer_reads_until_settled`).
_SETTLE = "_epl_settle_pending_update"


def defer_reads_until_settled(model: nn.Module, settle: Callable[[], None]) -> None:
    """Say that the parameters of ``model`` (the model the engine holds) may be in the middle of an update between
    steps (an optimizer step still running off the main thread), and that ``settle()`` waits for it. The engine
    calls it before it hands out the model, the optimizer, parameters or state (:func:`settle_pending_update`)."""
    model.__dict__[_SETTLE] = settle


def settle_pending_update(model: nn.Module) -> None:
    """Wait for the pending update :func:`defer_reads_until_settled` announced on ``model``, if any."""
    settle = model.__dict__.get(_SETTLE)
    if settle is not None:
        settle()


def reduce_at_last_micro_batch(module: nn.Module) -> None:
    """Have a sharded module (``fully_shard``'s) accumulate its gradients whole over a step's micro-batches and
    reduce them once, in the last one's backward (ZeRO v0: only the optimizer state is sharded; FSDP2's
    ``set_requires_gradient_sync``)."""

    def reduce_if_last(index: int, count: int) -> None:
        module.set_requires_gradient_sync(index == count - 1, recurse=False)  # type: ignore[operator]  # an FSDPModule

    listen_to_micro_batches(module, reduce_if_last)


@contextlib.contextmanager
def gathered(model: nn.Module) -> Iterator[None]:
    """Every chunked parameter of ``model`` whole on every rank, for the ``with`` block (a collective).

    Every rank of the job calls it together: each sharded module gathers its parameters (one all-gather per module),
    so inside the block ``model.parameters()`` are plain tensors holding the whole values. On leaving, each module
    drops them again; writes inside the block are lost.
    """
    modules = sharded_modules(model)
    for module in modules:
        module.unshard()
    try:
        yield
    finally:
        for module in reversed(modules):
            module.reshard()
