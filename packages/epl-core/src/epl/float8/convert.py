"""The swap of chosen ``nn.Linear`` for torchao's ``Float8Linear``, and the checks that it can run here."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Collection
from typing import Any, Literal

import torch
from torch import nn

from epl.errors import ConfigError, EplError

#: The CUDA compute capability float8 matmuls need (Ada, Hopper and later).
MIN_CAPABILITY = (8, 9)
INSTALL = "pip install 'epl-core[float8]' (torchao)"


def torchao_float8() -> Any:
    """``torchao.float8``, or one error naming the install when torchao is missing."""
    try:
        return importlib.import_module("torchao.float8")
    except ImportError as exc:
        raise ConfigError(f"float8.enabled needs torchao, which is not installed: {INSTALL}.") from exc


def check_device(device: torch.device) -> None:
    """Refuse a device that cannot run float8 matmuls: CUDA below compute capability 8.9, or neither CUDA nor CPU
    (torch's CPU ``_scaled_mm`` runs float8)."""
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < MIN_CAPABILITY:
            name = torch.cuda.get_device_name(device)
            raise EplError(
                f"float8.enabled: {name} has compute capability {capability[0]}.{capability[1]}, and float8 "
                f"matmuls need {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or more (Ada, Hopper). Leave float8.enabled "
                "off on this device, or use amp.level with amp.dtype bfloat16."
            )
    elif device.type != "cpu":
        raise EplError(
            f"float8.enabled: the model is on {device.type}, and EPL runs float8 on CUDA (compute capability 8.9 or "
            "more) or on the CPU only. Leave float8.enabled off for this device."
        )


def float8_config(recipe: Literal["tensorwise", "rowwise"], all_gather: bool) -> Any:
    """torchao's ``Float8LinearConfig`` for ``recipe``; ``all_gather``: FSDP2 (ZeRO) all-gathers the weights in
    float8, which needs one scale per tensor (the tensorwise recipe; rowwise all-gathers in high precision)."""
    config = torchao_float8().Float8LinearConfig.from_recipe_name(recipe)
    if all_gather and recipe == "tensorwise":
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    return config


def convert(model: nn.Module, names: Collection[str], config: Any) -> list[str]:
    """Swap the ``nn.Linear`` of ``model`` named in ``names`` that this rank holds for ``Float8Linear`` (in place,
    parameters kept); the names swapped."""
    wanted = set(names)
    swapped: list[str] = []

    def chosen(module: nn.Module, name: str) -> bool:
        if name in wanted and type(module) is nn.Linear:
            swapped.append(name)
            return True
        return False

    torchao_float8().convert_to_float8_training(model, module_filter_fn=chosen, config=config)
    return swapped
