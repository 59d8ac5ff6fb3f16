"""Backward split in two, for zero-bubble schedules: input gradients first, weight gradients later.

``backward_input`` runs the part of the backward that reaches the stage's inputs (what the
previous stage waits for) and records the gradients arriving at the graph nodes where the
paths to the weights branch off; ``backward_weight`` later runs only those branches, from the
recorded gradients, into the parameters' ``.grad`` (through their AccumulateGrad nodes, so
post-accumulate-grad hooks such as data parallelism's fire as usual). Nothing is computed
twice. The idea is that of ``torch.distributed.pipelining``'s zero-bubble stages, written
against autograd's public graph API (``Node.register_prehook``, ``GradientEdge``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


@dataclass(eq=False)
class _Branch:
    """Parameters reached from the same recorded nodes, and the gradients recorded there."""

    params: list[torch.Tensor]
    nodes: list[Node]
    grads: dict[Node, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)
    #: For parameters on no path to an input: their whole backward, from the stage's outputs.
    from_outputs: tuple[list[torch.Tensor], list[torch.Tensor | None]] | None = None


@dataclass
class PendingWeights:
    """What ``backward_weight`` needs: the branches, or the whole backward when no input needs a gradient."""

    branches: list[_Branch]
    whole: tuple[list[torch.Tensor], list[torch.Tensor | None]] | None = None


def _node(tensor: torch.Tensor) -> Node:
    return get_gradient_edge(tensor).node


def backward_input(
    outputs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor | None], PendingWeights]:
    """Gradients of ``inputs`` (None where unused) and what the weight gradients still need."""
    inputs = [t for t in inputs if t.requires_grad]
    params = [p for p in params if p.requires_grad]
    if not inputs:
        return [], PendingWeights([], whole=(list(outputs), list(grads)))
    parents = _parents([_node(t) for t in outputs])
    towards_inputs = _ancestors([_node(t) for t in inputs], parents)
    branches = _branches(params, towards_inputs, parents)
    handles = []
    for branch in branches:
        for node in branch.nodes:
            handles.append(node.register_prehook(lambda grads_in, n=node, b=branch: b.grads.__setitem__(n, grads_in)))
    try:
        found = torch.autograd.grad(outputs, inputs, list(grads), retain_graph=True, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    reached = {id(p) for branch in branches for p in branch.params}
    unreached = [p for p in params if id(p) not in reached]
    if unreached:
        branches.append(_Branch(unreached, [], from_outputs=(list(outputs), list(grads))))
    return list(found), PendingWeights(branches)


def backward_weight(pending: PendingWeights) -> None:
    """Accumulate the parameters' gradients from what ``backward_input`` recorded."""
    if pending.whole is not None:
        outputs, grads = pending.whole
        torch.autograd.backward(outputs, grads)
        return
    for branch in pending.branches:
        if branch.from_outputs is not None:
            outputs, grads = branch.from_outputs
            torch.autograd.backward(outputs, grads, inputs=branch.params)
            continue
        edges, seeds, handles = [], [], []
        for node in branch.nodes:
            recorded = branch.grads.get(node)
            if recorded is None:
                continue
            for index, grad in enumerate(recorded):
                if grad is not None:
                    edges.append(GradientEdge(node, index))
                    seeds.append(grad)
            if len(branch.nodes) > 1:  # a recorded node reached again from another: use what was recorded
                handles.append(node.register_prehook(lambda _, saved=recorded: saved))
        try:
            if edges:
                torch.autograd.backward(edges, seeds, inputs=branch.params)
        finally:
            for handle in handles:
                handle.remove()


def _parents(roots: list[Node]) -> dict[Node, list[Node]]:
    """For every node reachable from ``roots``, the nodes that feed gradients into it."""
    parents: dict[Node, list[Node]] = {root: [] for root in roots}
    stack = list(roots)
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in parents:
                parents[child] = []
                stack.append(child)
            parents[child].append(node)
    return parents


def _ancestors(nodes: list[Node], parents: dict[Node, list[Node]]) -> set[Node]:
    """``nodes`` and every node whose backward leads to one of them."""
    seen = set(nodes)
    stack = list(nodes)
    while stack:
        for parent in parents.get(stack.pop(), []):
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen


def _branches(params: list[torch.Tensor], towards_inputs: set[Node], parents: dict[Node, list[Node]]) -> list[_Branch]:
    """Group parameters by the input-path nodes where their paths branch off (shared nodes join groups)."""
    groups: list[_Branch] = []
    group_of: dict[Node, _Branch] = {}
    for param in params:
        start = _node(param)
        if start not in parents:
            continue  # not used by this stage's outputs
        found: set[Node] = set()
        seen, stack = {start}, [start]
        while stack:
            for parent in parents[stack.pop()]:
                if parent in towards_inputs:
                    found.add(parent)
                elif parent not in seen:
                    seen.add(parent)
                    stack.append(parent)
        if not found:
            continue
        joined = {id(group_of[n]): group_of[n] for n in found if n in group_of}
        branch = _Branch([param], sorted(found, key=id))
        for other in joined.values():
            branch.params += other.params
            branch.nodes = sorted(set(branch.nodes) | set(other.nodes), key=id)
            groups.remove(other)
        groups.append(branch)
        for node in branch.nodes:
            group_of[node] = branch
    return groups
