"""Plan-only runs: execute a training script up to ``epl.parallelize`` and stop with its Plan.

``epl plan SCRIPT`` runs the script under :func:`planning`; inside it,
``epl.init`` sees a virtual cluster of the requested size (so
``Env.get().cluster.total_gpu_num`` is what it would be there) and
``epl.parallelize`` raises :class:`PlanReady` instead of training.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from epl.errors import EplError
from epl.placement.plan import Plan


@dataclass(frozen=True)
class PlanRequest:
    """The cluster to plan for, config overrides to apply on top of the script's, and an optimizer to assume.

    ``optimizer`` names a ``torch.optim`` class (:data:`epl.placement.estimate.OPTIMIZER_STATES`)
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

    def __init__(self, plan: Plan) -> None:
        super().__init__("plan ready")
        self.plan = plan


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


def plan_script(path: str, args: Sequence[str], request: PlanRequest) -> Plan:
    """Run the script at ``path`` up to ``epl.parallelize`` and return the Plan it would run."""
    from epl.env import Env

    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [path, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))  # as `python SCRIPT` would
    try:
        # The script's own prints go to stderr, so that stdout holds only the Plan.
        with planning(request), contextlib.redirect_stdout(sys.stderr):
            runpy.run_path(path, run_name="__main__")
    except PlanReady as ready:
        return ready.plan
    except SystemExit as exc:
        raise EplError(f"{path} exited (code {exc.code}) before calling epl.parallelize(); nothing to plan.") from None
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        if Env._current is not None:
            Env._current.close()
    raise EplError(f"{path} finished without calling epl.parallelize(); nothing to plan.")


def plan_example(name: str, request: PlanRequest) -> Plan:
    """The Plan of one of the manual's examples (``epl.examples``) for ``request``."""
    from epl import examples
    from epl.engine.parallelize import parallelize
    from epl.env import Env, init

    example = examples.get(name)
    try:
        with planning(request):
            init(example.config)
            parallelize(example.build())
    except PlanReady as ready:
        return ready.plan
    finally:
        if Env._current is not None:
            Env._current.close()
    raise AssertionError("parallelize returned in a plan-only run")
