"""Replacing a method of one optimizer object, in the shape torch's LR schedulers expect.

An LR scheduler wraps ``optimizer.step`` by taking ``step.__func__`` and binding it to the optimizer again, so a
replacement must be a method bound to the optimizer: a plain function there fails when the scheduler is built.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch


def replace_method(optimizer: torch.optim.Optimizer, name: str, handler: Callable[..., Any]) -> None:
    """Make ``optimizer.<name>(*args)`` call ``handler(*args)``, as a method bound to ``optimizer``."""

    @functools.wraps(handler)
    def method(bound_to: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        return handler(*args, **kwargs)

    setattr(optimizer, name, types.MethodType(method, optimizer))
