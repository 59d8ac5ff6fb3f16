"""How the ranks of a job meet and agree around a checkpoint (``engine.save/load``, ``save/load_pretrained``).

Every rank first meets the others at the call (:func:`meet`: a rank that does not call it is named), runs DCP's
collectives so that a late rank is named when they time out (:func:`named_when_late`), and agrees on whether a
checkpoint can be loaded before anything is applied (:func:`agree`). A job of one process (:func:`alone`) runs
DCP without torch.distributed.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from epl.errors import EplError
from epl.runtime import agreement
from epl.runtime.checkpoint.common import CheckpointedEngine, timeout
from epl.runtime.collective_calls import agree_to_call

#: Seconds a rank whose checkpoint collective timed out waits for the other waiting ranks to say so.
LATE_SETTLE_SECONDS = 2.0


def alone(engine: CheckpointedEngine) -> bool:
    """Whether this job is one process (DCP then runs without torch.distributed)."""
    return engine.plan.local or engine.context.cluster.world_size == 1


@contextlib.contextmanager
def quiet_when_alone(alone: bool) -> Iterator[None]:
    """Without DCP's warning that one process means no torch.distributed (that is the intent)."""
    if not alone:
        yield
        return
    # catch_warnings swaps the process's filters: a background save of a one-process job (the only caller
    # outside the main thread) may race another thread's catch_warnings, which can at worst show or hide a warning.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def require_default_group(engine: CheckpointedEngine) -> None:
    """DCP coordinates on torch.distributed's default process group: a job of several processes needs one."""
    import torch.distributed as dist

    if not alone(engine) and not dist.is_initialized():
        raise EplError(
            "engine.save/load coordinate through torch.distributed's default process group, which this job "
            "does not have (communication.backend 'cupy'?). Use communication.backend 'auto' or 'torch'."
        )


def named_when_late(key: str, rank: int, world_size: int, alone: bool, what: str, action: Callable[[], Any]) -> Any:
    """Run ``action`` (torch.distributed.checkpoint's collectives); when it times out, name the ranks that never
    finished it nor timed out themselves (the late ones), as EPL's own collectives do.

    Every rank records under ``key`` in the job's store that it finished, or that it timed out; the ranks with
    neither did not arrive.
    """
    import torch.distributed as dist

    if alone:
        return action()
    try:
        store = dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):  # no store: DCP's own error
        return action()
    try:
        result = action()
    except RuntimeError as error:
        if "timed out" not in str(error).lower():
            raise
        store.set(f"{key}/timed_out/{rank}", "1")
        time.sleep(LATE_SETTLE_SECONDS)
        late = [
            r for r in range(world_size) if not any(store.check([f"{key}/{how}/{r}"]) for how in ("timed_out", "done"))
        ]
        raise EplError(
            f"{what} timed out on rank {rank}: ranks {late} did not arrive at torch.distributed.checkpoint's "
            "collectives (stuck, or no longer calling engine.save/load with the others)."
        ) from None
    store.set(f"{key}/done/{rank}", "1")
    return result


def meet(engine: CheckpointedEngine, what: str, problem: Callable[[], str | None] | None = None) -> None:
    """Meet every rank at the collective call ``what`` before any of them acts, or raise on every rank: a rank that
    does not call it is named (:mod:`epl.runtime.collective_calls`), and so is rank 0's ``problem()`` (checked on
    rank 0; on every process when each runs alone)."""
    one = alone(engine)
    first = one or engine.context.cluster.rank == 0
    agree_to_call(
        what,
        rank=0 if one else engine.context.cluster.rank,
        world_size=1 if one else engine.context.cluster.world_size,
        timeout=timeout(engine),
        problem=problem() if problem is not None and first else None,
    )


def agree(engine: CheckpointedEngine, problem: str | None, weight: int = agreement.REFUSED) -> None:
    """Raise ``problem`` on this rank and, on every other, an error naming the refusing rank and its reason (a
    collective: :func:`epl.runtime.agreement.agree`)."""
    communicator = None if alone(engine) else engine.context.communicator
    agreement.agree(communicator, problem, refused="refused the checkpoint", weight=weight)
