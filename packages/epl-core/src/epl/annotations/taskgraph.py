"""A TaskGraph: the parameters and buffers created under one annotation."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from epl.annotations.strategies import Strategy


@dataclass(eq=False)
class TaskGraph:
    """The tensors (parameters and buffers) one annotation captured, in creation order.

    ``implicit`` TaskGraphs hold what was created outside any annotation; they are
    ``replicate(1)``. ``modules`` names the model's modules whose own tensors are here.
    """

    index: int
    strategy: Strategy
    implicit: bool = False
    tensors: list[torch.Tensor] = field(default_factory=list)
    modules: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        """The strategy's name, or ``taskgraph_<index>`` (``implicit_<index>`` when implicit)."""
        if self.strategy.name:
            return self.strategy.name
        return f"{'implicit' if self.implicit else 'taskgraph'}_{self.index}"

    @property
    def parameters(self) -> list[nn.Parameter]:
        """The parameters among the tensors."""
        return [t for t in self.tensors if isinstance(t, nn.Parameter)]

    def __repr__(self) -> str:
        return (
            f"TaskGraph({self.index}, {self.name!r}, {self.strategy}, "
            f"{len(self.parameters)} parameters, modules={self.modules})"
        )


def holders_of(taskgraphs: Iterable[TaskGraph]) -> dict[int, set[int]]:
    """``id`` of each tensor -> the indices of the TaskGraphs holding it (several only for tied weights a
    pipeline partition cut apart)."""
    holders: dict[int, set[int]] = {}
    for taskgraph in taskgraphs:
        for tensor in taskgraph.tensors:
            holders.setdefault(id(tensor), set()).add(taskgraph.index)
    return holders
