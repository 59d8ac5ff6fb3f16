"""The hyperparameters of an optimizer's parameter groups (what checkpoints and ZeRO copy between optimizers)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def group_options(group: Mapping[str, Any]) -> dict[str, Any]:
    """Everything a parameter group holds but its parameters: ``lr``, ``betas``, ``weight_decay``..."""
    return {key: value for key, value in group.items() if key != "params"}
