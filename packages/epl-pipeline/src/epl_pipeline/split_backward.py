"""Backward split in two, for zero-bubble schedules: input gradients first, weight gradients later.

``backward_input`` runs the part of the backward that reaches the stage's inputs (what the
previous stage waits for) and records the gradients arriving at the graph nodes where the
paths to the weights branch off; ``backward_weight`` later runs only those branches, from the
recorded gradients, into the parameters' ``.grad`` (through their AccumulateGrad nodes, so
post-accumulate-grad hooks such as data parallelism's fire as usual). Nothing is computed
twice. The idea is that of ``torch.distributed.pipelining``'s zero-bubble stages, written
against autograd's graph API (``GradientEdge``, ``Node.register_prehook``).

It runs once per micro-batch, so its own work is kept small (on a stage of two 512-wide
layers it was a third of the backward itself). One walk of the graph finds each node's
parents, and the AccumulateGrad node of every leaf (parameters and received inputs), so no
tensor is viewed to reach its node. The input pass asks the engine for the gradients arriving
at the branch nodes as extra results (``GradientEdge`` inputs of the same pass) rather than
through hooks. The passes themselves go to the engine through the function
``torch.autograd.backward`` and ``torch.autograd.grad`` end with
(``torch.autograd.graph._engine_run_backward``), without their argument checks: the roots are
plain tensors with gradients of their shapes, or graph edges with the gradients the engine
recorded there (anything else takes the public functions, which say what is wrong).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from epl.plugin_api import engine_run_backward, functorch_transforms_active, has_torch_function

#: What torch.autograd.backward and torch.autograd.grad call once they have checked their arguments (None: another
#: torch, the public functions only).
_engine_run_backward = engine_run_backward()
#: The class of the graph node that accumulates a leaf's gradient into its ``.grad``.
_ACCUMULATE_GRAD = type(get_gradient_edge(torch.zeros((), requires_grad=True)).node)


@dataclass(eq=False)
class _Branch:
    """Parameters reached from the same recorded nodes, and the gradients recorded there."""

    params: list[torch.Tensor]
    nodes: list[Node]
    #: What the weight pass accumulates into, in the order of ``params``: each leaf's AccumulateGrad node.
    targets: list[GradientEdge | torch.Tensor] = field(default_factory=list)
    #: The recorded nodes' inputs that receive gradients, and the gradients the input pass found there.
    edges: list[GradientEdge] = field(default_factory=list)
    grads: list[torch.Tensor | None] = field(default_factory=list)
    #: For parameters on no path to an input: their whole backward, from the stage's outputs.
    from_outputs: tuple[list[torch.Tensor], list[torch.Tensor | None]] | None = None


@dataclass
class PendingWeights:
    """What ``backward_weight`` needs: the branches, or the whole backward when no input needs a gradient."""

    branches: list[_Branch]
    whole: tuple[list[torch.Tensor], list[torch.Tensor | None]] | None = None


def _leaf(node: Node) -> torch.Tensor:
    """The tensor an ``AccumulateGrad`` node accumulates into."""
    return node.variable  # type: ignore[attr-defined]  # AccumulateGrad's own attribute, which Node does not name


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
    if not inputs:
        return [], PendingWeights([], whole=(list(outputs), list(grads)))
    used = [p for p in params if p.requires_grad]
    roots = [(t.grad_fn, t.output_nr) if t.grad_fn is not None else (_node(t), 0) for t in outputs]
    order, position, structure = _walk([node for node, _ in roots])
    leaves = {id(_leaf(node)): at for at, node in enumerate(order) if type(node) is _ACCUMULATE_GRAD}

    def where(tensor: torch.Tensor) -> int:
        """The position of the tensor's node in ``order`` (-1: the outputs do not depend on it)."""
        grad_fn = tensor.grad_fn
        if grad_fn is not None:
            return position.get(grad_fn, -1)
        return leaves.get(id(tensor), -1)

    key = (
        tuple(structure),
        tuple(position[node] for node, _ in roots),
        tuple(nr for _, nr in roots),
        tuple(map(where, inputs)),
        tuple(map(where, used)),
        tuple(p.grad_fn is None for p in used),
    )
    plan = _PLANS.get(key)
    if plan is None:
        plan = _plan(order, [(node, nr) for node, nr in roots], key[3], key[4], used)
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = plan
    branches = [
        _Branch(
            [used[k] for k in spec.params],
            [order[at] for at in spec.nodes],
            [
                used[k] if at < 0 else GradientEdge(order[at], 0)
                for k, at in zip(spec.params, spec.targets, strict=True)
            ],
            [GradientEdge(order[at], nr) for at, nr in spec.edges],
        )
        for spec in plan.branches
    ]
    edges = [edge for branch in branches for edge in branch.edges]
    found = _input_gradients(outputs, grads, inputs, edges)
    start = len(inputs)
    for branch in branches:
        branch.grads = list(found[start : start + len(branch.edges)])
        start += len(branch.edges)
    if plan.unreached:  # parameters the outputs reach through no input path (outputs of the parameters alone)
        branches.append(_Branch([used[k] for k in plan.unreached], [], from_outputs=(list(outputs), list(grads))))
    return list(found[: len(inputs)]), PendingWeights(branches)


@dataclass(frozen=True)
class _BranchSpec:
    """A branch by positions: of its parameters in the parameters used, of their AccumulateGrad nodes (-1: the
    parameter itself, not a leaf), of its recorded nodes, and its recorded edges (node, input)."""

    params: tuple[int, ...]
    targets: tuple[int, ...]
    nodes: tuple[int, ...]
    edges: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class _Plan:
    """Where a graph's weight paths branch off its input paths, by the positions of its nodes in the walk."""

    branches: tuple[_BranchSpec, ...]
    unreached: tuple[int, ...]


#: Plans by the structure of the graph they were made for (a stage's graphs have one structure, micro-batch after
#: micro-batch: its plan is made once). The key holds every fact the plan depends on (see ``backward_input``).
_PLANS: dict[tuple[object, ...], _Plan] = {}
_MAX_PLANS = 64


def _walk(roots: list[Node]) -> tuple[list[Node], dict[Node, int], list[int]]:
    """Every node reachable from ``roots`` in the order found (breadth first), its position in that order, and
    the graph's structure in those positions: per node, each next edge as (position, input), -1 for none, and -2
    to end the node. Two graphs with the same structure list are the same graph, numbered alike."""
    position: dict[Node, int] = {}
    order: list[Node] = []
    for root in roots:
        if root not in position:
            position[root] = len(order)
            order.append(root)
    structure: list[int] = []
    for node in order:  # the list grows while it is walked
        for child, nr in node.next_functions:
            if child is None:
                structure.append(-1)
                continue
            at = position.get(child)
            if at is None:
                at = position[child] = len(order)
                order.append(child)
            structure.append(at)
            structure.append(nr)
        structure.append(-2)
    return order, position, structure


def _plan(
    order: list[Node],
    roots: list[tuple[Node, int]],
    input_at: tuple[int, ...],
    param_at: tuple[int, ...],
    used: list[torch.Tensor],
) -> _Plan:
    """Find where the paths to the parameters branch off the paths to the inputs (the graph walked into ``order``;
    ``input_at``, ``param_at``: the positions of the inputs' and parameters' nodes, -1 for unused)."""
    parents, _ = _parents([node for node, _ in roots])
    position = {node: at for at, node in enumerate(order)}
    towards_inputs = _ancestors([order[at] for at in input_at if at >= 0], parents)
    nodes_of = [(p, order[at] if at >= 0 else None) for p, at in zip(used, param_at, strict=True)]
    index_of = {id(p): k for k, p in enumerate(used)}
    specs = []
    for branch in _branches(nodes_of, towards_inputs, parents):
        edges = []
        for node in branch.nodes:  # every input of a recorded node that an edge of the graph (or a root) feeds
            slots = {nr for parent in parents[node] for child, nr in parent.next_functions if child is node}
            slots.update(nr for root, nr in roots if root is node)
            edges += [(position[node], nr) for nr in sorted(slots)]
        params = tuple(index_of[id(p)] for p in branch.params)
        targets = tuple(param_at[k] if used[k].grad_fn is None else -1 for k in params)
        specs.append(_BranchSpec(params, targets, tuple(position[node] for node in branch.nodes), tuple(edges)))
    reached = {k for spec in specs for k in spec.params}
    unreached = tuple(k for k, at in enumerate(param_at) if at >= 0 and k not in reached)
    return _Plan(tuple(specs), unreached)


def backward_weight(pending: PendingWeights) -> None:
    """Accumulate the parameters' gradients from what ``backward_input`` recorded."""
    if pending.whole is not None:
        backward(*pending.whole)
        return
    for branch in pending.branches:
        if branch.from_outputs is not None:
            outputs, grads = branch.from_outputs
            torch.autograd.backward(outputs, grads, inputs=branch.params)
            continue
        seeded = [(edge, grad) for edge, grad in zip(branch.edges, branch.grads, strict=True) if grad is not None]
        handles = []
        if len(branch.nodes) > 1:  # a recorded node reached again from another: it takes what was recorded
            for node in branch.nodes:
                mine = {e.output_nr: g for e, g in zip(branch.edges, branch.grads, strict=True) if e.node is node}
                if any(grad is not None for grad in mine.values()):
                    handles.append(node.register_prehook(_pinned(mine)))
        try:
            if seeded:
                _accumulate([edge for edge, _ in seeded], [grad for _, grad in seeded], branch.targets)
        finally:
            for handle in handles:
                handle.remove()
        branch.grads = []


def _pinned(recorded: dict[int, torch.Tensor | None]) -> Callable[[tuple[torch.Tensor | None, ...]], tuple]:
    """A node pre-hook that replaces the gradients arriving at the node's recorded inputs by the recorded ones."""

    def hook(grads_in: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...]:
        return tuple(recorded[i] if i in recorded else grad for i, grad in enumerate(grads_in))

    return hook


def backward(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
    """``torch.autograd.backward(outputs, grads)``: accumulate the gradients of every leaf into its ``.grad``."""
    seeds = _seeds(outputs, grads)
    if seeds is None:
        torch.autograd.backward(list(outputs), list(grads))
        return
    assert _engine_run_backward is not None
    _engine_run_backward(tuple(outputs), seeds, False, False, (), allow_unreachable=True, accumulate_grad=True)


def _input_gradients(
    outputs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    edges: Sequence[GradientEdge],
) -> tuple[torch.Tensor | None, ...]:
    """The gradients of ``inputs``, then those arriving at ``edges``, keeping the graph (``torch.autograd.grad``
    with ``retain_graph=True, allow_unused=True``)."""
    seeds = _seeds(outputs, grads) if not has_torch_function(tuple(inputs)) else None
    if seeds is None:
        return torch.autograd.grad(
            list(outputs),
            [*inputs, *edges],  # type: ignore[arg-type]  # tensors and edges mixed: torch takes them (not its stub)
            list(grads),
            retain_graph=True,
            allow_unused=True,
        )
    assert _engine_run_backward is not None
    return _engine_run_backward(
        tuple(outputs), seeds, True, False, (*inputs, *edges), allow_unreachable=True, accumulate_grad=False
    )


def _accumulate(
    edges: list[GradientEdge], seeds: list[torch.Tensor], targets: list[GradientEdge | torch.Tensor]
) -> None:
    """``torch.autograd.backward(edges, seeds, inputs=targets)``, from gradients the engine found at ``edges``
    (so of their shapes)."""
    if _engine_run_backward is None or functorch_transforms_active():
        torch.autograd.backward(edges, seeds, inputs=targets)  # type: ignore[arg-type]  # mixed, as above
        return
    _engine_run_backward(
        tuple(edges), tuple(seeds), False, False, tuple(targets), allow_unreachable=True, accumulate_grad=True
    )


def _seeds(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> tuple[torch.Tensor, ...] | None:
    """The gradients to start a backward from ``outputs`` with, as the public functions would make them (a
    scalar's None is ones), or None when the public functions must run: a tensor subclass, a functorch
    transform, no engine function, or a gradient they would refuse or make otherwise (they say why)."""
    if _engine_run_backward is None or functorch_transforms_active():
        return None
    if len(outputs) != len(grads) or has_torch_function(tuple(outputs)):
        return None
    seeds = []
    for output, grad in zip(outputs, grads, strict=True):
        if grad is None:
            if output.numel() != 1 or not output.dtype.is_floating_point:
                return None
            grad = torch.ones_like(output, memory_format=torch.preserve_format)
        elif output.shape != grad.shape or output.dtype.is_complex != grad.dtype.is_complex or output.is_nested:
            return None
        seeds.append(grad)
    return tuple(seeds)


def _parents(roots: list[Node]) -> tuple[dict[Node, list[Node]], dict[int, Node]]:
    """For every node reachable from ``roots``, the nodes that feed gradients into it; and the AccumulateGrad
    node of every leaf tensor reached, by the tensor's ``id``."""
    parents: dict[Node, list[Node]] = {root: [] for root in roots}
    leaves: dict[int, Node] = {}
    stack = list(parents)
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            known = parents.get(child)
            if known is None:
                parents[child] = [node]
                if type(child) is _ACCUMULATE_GRAD:
                    leaves[id(_leaf(child))] = child
                else:
                    stack.append(child)
            else:
                known.append(node)
    for root in roots:
        if type(root) is _ACCUMULATE_GRAD:
            leaves[id(_leaf(root))] = root
    return parents, leaves


def _ancestors(nodes: list[Node], parents: dict[Node, list[Node]]) -> set[Node]:
    """``nodes`` and every node whose backward leads to one of them."""
    seen = set(nodes)
    stack = list(nodes)
    while stack:
        for parent in parents.get(stack.pop(), ()):
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen


def _branches(
    params: list[tuple[torch.Tensor, Node | None]], towards_inputs: set[Node], parents: dict[Node, list[Node]]
) -> list[_Branch]:
    """Group parameters (each with its node, None when unused) by the input-path nodes where their paths
    branch off (shared nodes join groups)."""
    groups: list[_Branch | None] = []
    group_of: dict[Node, int] = {}
    for param, start in params:
        if start is None:
            continue  # not used by this stage's outputs
        found: list[Node] = []
        seen, stack = {start}, [start]
        while stack:
            for parent in parents[stack.pop()]:
                if parent in seen:
                    continue
                seen.add(parent)
                if parent in towards_inputs:
                    found.append(parent)
                else:
                    stack.append(parent)
        if not found:
            continue
        target = GradientEdge(start, 0) if param.grad_fn is None else param  # a parameter is a leaf
        joined = sorted({group_of[n] for n in found if n in group_of})
        if not joined:
            index = len(groups)
            groups.append(_Branch([param], found, [target]))
        else:
            index = joined[0]
            branch = groups[index]
            assert branch is not None
            branch.params.append(param)
            branch.targets.append(target)
            branch.nodes += [n for n in found if group_of.get(n) != index]
            for other_index in joined[1:]:
                other = groups[other_index]
                assert other is not None
                branch.params += other.params
                branch.targets += other.targets
                branch.nodes += other.nodes
                groups[other_index] = None
        for node in groups[index].nodes:  # type: ignore[union-attr]  # set above: not None
            group_of[node] = index
    return [group for group in groups if group is not None]
