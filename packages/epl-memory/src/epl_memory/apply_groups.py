"""``optimizer.num_apply_group``: apply the optimizer update to a few parameters at a time.

Multi-tensor (``foreach``) optimizers allocate their temporaries for every parameter
of a ``step`` at once; applying the update in k groups of about equal size cuts that
peak to about 1/k. Each parameter's update is the same as in one step: its state is
its own, and each group's ``step`` touches only the group's parameters.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from epl.plugin_api import ConfigError
from epl_memory.zero import balanced_partition

#: Optimizers whose update couples parameters (a step over a group differs from the whole step).
COUPLED = (torch.optim.LBFGS,)


def apply_in_groups(optimizer: torch.optim.Optimizer, groups: int) -> torch.optim.Optimizer:
    """Make ``optimizer.step()`` update its parameters in ``groups`` balanced groups, one after another."""
    if isinstance(optimizer, COUPLED):
        raise ConfigError(
            f"optimizer.num_apply_group = {groups}: {type(optimizer).__name__} couples all parameters in one "
            "update, so it cannot be applied in groups. Leave optimizer.num_apply_group at 1."
        )
    params = [p for group in optimizer.param_groups for p in group["params"]]
    parts = [{id(p) for p in part} for part in balanced_partition(params, min(groups, max(len(params), 1)))]
    whole_step = optimizer.step

    @functools.wraps(whole_step)
    def step(closure: Callable[[], float] | None = None) -> Any:
        if closure is not None:
            raise ConfigError("optimizer.num_apply_group does not support a closure in step(); leave it at 1.")
        everything = [group["params"] for group in optimizer.param_groups]
        try:
            for part in parts:
                for group, params_of_group in zip(optimizer.param_groups, everything, strict=True):
                    group["params"] = [p for p in params_of_group if id(p) in part]
                whole_step()
        finally:
            for group, params_of_group in zip(optimizer.param_groups, everything, strict=True):
                group["params"] = params_of_group
        return None

    optimizer.step = step  # type: ignore[method-assign]
    return optimizer
