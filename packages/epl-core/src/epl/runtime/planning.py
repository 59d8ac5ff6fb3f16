"""Plan-only runs: execute a training script (or a manual example) up to ``epl.parallelize`` and stop with its Plan."""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn

from epl.config import Config
from epl.errors import EplError
from epl.placement.plan import Plan
from epl.placement.request import PlanReady, PlanRequest, planning
from epl.runtime.env import Env, init
from epl.runtime.parallelize import parallelize


def planned_script(path: str, args: Sequence[str], request: PlanRequest) -> PlanReady:
    """Run the script at ``path`` up to ``epl.parallelize``: the Plan, the model (on meta) and the config."""
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [path, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))  # as `python SCRIPT` would
    try:
        # The script's own prints go to stderr, so that stdout holds only the Plan.
        with planning(request), contextlib.redirect_stdout(sys.stderr):
            runpy.run_path(path, run_name="__main__")
    except PlanReady as ready:
        return ready
    except SystemExit as exc:
        raise EplError(f"{path} exited (code {exc.code}) before calling epl.parallelize(); nothing to plan.") from None
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        if Env._current is not None:
            Env._current.close()
    raise EplError(f"{path} finished without calling epl.parallelize(); nothing to plan.")


def plan_model(config: Config | Mapping[str, Any] | None, build: Callable[[], nn.Module], request: PlanRequest) -> Plan:
    """The Plan of the model ``build()`` makes after ``epl.init(config)``, for ``request`` (``epl plan --example``)."""
    return planned_model(config, build, request).plan


def planned_model(
    config: Config | Mapping[str, Any] | None, build: Callable[[], nn.Module], request: PlanRequest
) -> PlanReady:
    """:func:`plan_model`'s run: the Plan, the model (on meta) and the config."""
    try:
        with planning(request):
            init(config)
            parallelize(build())
    except PlanReady as ready:
        return ready
    finally:
        if Env._current is not None:
            Env._current.close()
    raise AssertionError("parallelize returned in a plan-only run")
