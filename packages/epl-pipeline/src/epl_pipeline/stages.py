"""Which submodules make each pipeline stage, and the proxies that stand in for other ranks' stages.

Every rank runs the model's own ``forward``; the modules of other stages are replaced by
proxies. The proxy of the previous stage receives this stage's input; the proxy of the
next stage sends this stage's output and ends this rank's part of the forward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from epl.errors import PlacementError
from epl.strategy.taskgraph import TaskGraph


class StageDone(Exception):  # noqa: N818 - control flow, not an error
    """Raised by the next stage's proxy: this rank's part of the forward is over."""


def stage_roots(model: nn.Module, taskgraphs: list[TaskGraph]) -> dict[str, int]:
    """The outermost submodules whose tensors all belong to one TaskGraph: qualified name -> stage."""
    owner = {id(t): tg.index for tg in taskgraphs for t in tg.tensors}
    roots: dict[str, int] = {}

    def visit(name: str, module: nn.Module) -> None:
        stages = {owner[id(t)] for t in [*module.parameters(), *module.buffers()] if id(t) in owner}
        if not stages:
            return
        if len(stages) == 1 and name:
            roots[name] = stages.pop()
            return
        own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if own:
            raise PlacementError(
                f"Module {name or type(module).__name__!r} holds tensors of several pipeline stages directly; "
                "annotate whole modules, one stage each."
            )
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)

    visit("", model)
    return roots


class StageProxy(nn.Module):
    """Stands in for stage ``stage`` of another rank (see the module docstring)."""

    def __init__(
        self, stage: int, receive: Callable[[int], torch.Tensor], send: Callable[[torch.Tensor], None], mine: int
    ) -> None:
        super().__init__()
        self.stage = stage
        self._receive = receive
        self._send = send
        self._mine = mine

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Receive (previous stage), stand aside (earlier stages), or send and stop (next stage)."""
        if self.stage == self._mine - 1:
            return self._receive(self.stage)
        if self.stage < self._mine:
            return torch.empty(0)
        if not isinstance(x, torch.Tensor):
            raise PlacementError(
                f"Stage {self._mine} passes a {type(x).__name__} to stage {self.stage}; this version passes one tensor."
            )
        self._send(x)
        raise StageDone

    def extra_repr(self) -> str:
        """Shown by ``print(model)``."""
        return f"stage={self.stage} (on another rank)"


def replace_module(model: nn.Module, qualified_name: str, replacement: nn.Module) -> None:
    """Put ``replacement`` where ``qualified_name`` was."""
    parent_name, _, child = qualified_name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, replacement)
