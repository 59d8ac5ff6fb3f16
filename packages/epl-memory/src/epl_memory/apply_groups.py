"""``optimizer.num_apply_group``: apply the optimizer update to a few parameters at a time.

Multi-tensor (``foreach``) optimizers allocate their temporaries for every parameter
of a ``step`` at once; applying the update in k groups of about equal size cuts that
peak to about 1/k. Each parameter's update is the same as in one step when the optimizer updates each parameter
from its own gradient and state (:mod:`epl_memory.optimizer_kinds`): each group's ``step`` touches only the group's
parameters. An optimizer known to couple its parameters is refused; one not known either way is applied in groups,
and a warning says so once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from epl.plugin_api import ConfigError
from epl_memory.optimizer_kinds import known_names, updates_each_parameter_alone
from epl_memory.optimizer_methods import replace_method

_log = logging.getLogger("epl.memory")


def balanced_partition(params: Sequence[nn.Parameter], parts: int) -> list[list[nn.Parameter]]:
    """``params`` in ``parts`` lists of about equal element counts (largest first, to the lightest list).

    Deterministic: every device computes the same partition from the same parameter order.
    """
    order = sorted(range(len(params)), key=lambda i: (-params[i].numel(), i))
    loads = [0] * parts
    owners: list[list[int]] = [[] for _ in range(parts)]
    for index in order:
        lightest = min(range(parts), key=lambda part: (loads[part], part))
        owners[lightest].append(index)
        loads[lightest] += params[index].numel()
    return [[params[i] for i in sorted(indices)] for indices in owners]


def apply_in_groups(optimizer: torch.optim.Optimizer, groups: int) -> torch.optim.Optimizer:
    """Make ``optimizer.step()`` update its parameters in ``groups`` balanced groups, one after another."""
    alone = updates_each_parameter_alone(optimizer)
    if alone is False:
        raise ConfigError(
            f"optimizer.num_apply_group = {groups}: {type(optimizer).__name__} couples all parameters in one "
            "update, so it cannot be applied in groups. Leave optimizer.num_apply_group at 1."
        )
    if alone is None:
        _log.warning(
            "optimizer.num_apply_group = %d: %s is not known to update each parameter from its own gradient and "
            "state alone (known: %s); it is applied in groups, which equals its whole step only if it does.",
            groups,
            type(optimizer).__name__,
            known_names(),
        )
    params = [p for group in optimizer.param_groups for p in group["params"]]
    parts = [{id(p) for p in part} for part in balanced_partition(params, min(groups, max(len(params), 1)))]
    whole_step = optimizer.step

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

    replace_method(optimizer, "step", step)
    return optimizer
