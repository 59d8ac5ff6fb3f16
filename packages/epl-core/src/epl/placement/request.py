"""A plan-only request: what ``epl plan`` asks ``epl.init`` and ``epl.parallelize`` to do instead of running.

Inside :func:`planning`, ``epl.init`` sees a virtual cluster of the requested size
(so ``Env.get().cluster.total_gpu_num`` is what it would be there) and
``epl.parallelize`` raises :class:`PlanReady` instead of training. The driver that
runs a script or an example this way is :mod:`epl.runtime.planning`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from epl.placement.plan import Plan


@dataclass(frozen=True)
class PlanRequest:
    """The cluster to plan for, config overrides to apply on top of the script's, and an optimizer to assume.

    ``optimizer`` names a ``torch.optim`` class (:data:`epl.placement.plan_memory.OPTIMIZER_STATES`)
    for the memory estimate, in place of the script's optimizer (or of none, for an example).
    """

    world_size: int
    gpu_per_worker: int | None = None
    overrides: Mapping[str, Any] = field(default_factory=dict)
    optimizer: str | None = None


class PlanReady(BaseException):
    """Raised by ``epl.parallelize`` in a plan-only run; carries the Plan.

    A BaseException so that a script's ``except Exception`` does not swallow it.
    """

    def __init__(self, plan: Plan, model: Any = None, config: Any = None) -> None:
        super().__init__("plan ready")
        self.plan = plan
        #: The model as planned (on meta for a plan-only run) and the run's ``epl.Config``, for the planner.
        self.model = model
        self.config = config


_request: PlanRequest | None = None


def current_request() -> PlanRequest | None:
    """The active plan request, or None in a real run."""
    return _request


@contextmanager
def planning(request: PlanRequest) -> Iterator[PlanRequest]:
    """Make every ``epl.init``/``epl.parallelize`` inside the block plan for ``request``."""
    global _request
    previous, _request = _request, request
    try:
        yield request
    finally:
        _request = previous
