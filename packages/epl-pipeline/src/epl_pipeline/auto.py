"""``auto.auto_parallel``: cut an unannotated model into ``pipeline.num_stages`` balanced stages.

The candidate cut points are between blocks: the items of every ``nn.Sequential``,
``nn.ModuleList`` and ``nn.ModuleDict`` (where repeated blocks such as transformer layers
live), and the model's other submodules; a block is opened further only when there are
fewer blocks than stages. Each block's cost is estimated by its number of parameters
(proportional to the multiply-adds of linear and convolution layers per sample), the
blocks are put in the order ``forward`` calls them (from a ``torch.fx`` trace), and the
contiguous cut with the smallest most expensive stage is chosen. Blocks that share a tensor
(tied weights) stay on one stage: EPL keeps no copies of one tensor in step across stages.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from torch import nn

from epl.plugin_api import PlacementError, Strategy, TaskGraph, replicate, split

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def partition(model: nn.Module, taskgraphs: list[TaskGraph], num_stages: int) -> list[TaskGraph]:
    """``num_stages`` TaskGraphs named ``stage_<k>`` holding ``model``'s blocks.

    Each is ``replicate(1)``, or ``split(t)`` when the whole model was built in one
    ``epl.split(t)`` scope (tensor parallel inside every stage).
    """
    stage_strategy = _stage_strategy(model, taskgraphs)
    blocks = _in_call_order(model, _blocks(model, num_stages))
    tied = _tied_spans(model, blocks)
    allowed = set(range(1, len(blocks))) - {cut for begin, end, _ in tied for cut in range(begin + 1, end + 1)}
    try:
        cuts = balanced_cuts([_cost(module) for _, module in blocks], num_stages, allowed)
    except PlacementError:
        if not tied:
            raise
        shared = "; ".join(f"{blocks[begin][0]!r} and {blocks[end][0]!r} share {name!r}" for begin, end, name in tied)
        raise PlacementError(
            f"Cannot cut {type(model).__name__} into {num_stages} pipeline stages: blocks that share a tensor "
            f"(tied weights) must stay on one stage, and {shared}. EPL does not keep copies of one tensor in "
            "step across pipeline stages; untie the weights (for a transformers model: "
            "tie_word_embeddings=False) or use fewer stages."
        ) from None
    stages = []
    for index, (begin, end) in enumerate(zip([0, *cuts], [*cuts, len(blocks)], strict=True)):
        members = blocks[begin:end]
        unique = {id(t): t for _, module in members for t in [*module.parameters(), *module.buffers()]}
        tensors = list(unique.values())
        stage = TaskGraph(index=index, strategy=stage_strategy(f"stage_{index}"), tensors=tensors)
        stage.modules = [name for name, _ in members]
        stages.append(stage)
    placed = {id(t) for stage in stages for t in stage.tensors}
    loose = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if id(t) not in placed]
    if loose:
        raise PlacementError(
            f"auto.auto_parallel places whole submodules on stages, but {loose[:3]} belong to no block that "
            "forward calls. Keep parameters inside submodules, or annotate the stages by hand."
        )
    return stages


def _stage_strategy(model: nn.Module, taskgraphs: list[TaskGraph]) -> Callable[[str], Strategy]:
    """How each stage is annotated: ``replicate(1)`` for an unannotated model, ``split(t)`` for one built in a single
    ``epl.split(t)`` scope; any other annotation is an error."""
    annotated = [tg for tg in taskgraphs if not tg.implicit]
    if not annotated:
        return lambda name: replicate(1, name=name)
    (only, *more) = annotated
    held = {id(t) for t in only.tensors}
    whole = all(id(t) in held for t in [*model.parameters(), *model.buffers()])
    if not more and only.strategy.kind == "split" and whole:
        return lambda name: split(only.strategy.device_count, name=name)
    raise PlacementError(
        f"auto.auto_parallel partitions unannotated models, or models built entirely in one epl.split scope "
        f"(each stage then tensor parallel), but this one has annotations ({[tg.name for tg in annotated]}). "
        "Remove the annotations (or build the whole model in one epl.split scope), or set auto.auto_parallel "
        "to False to use them."
    )


def balanced_cuts(costs: list[int], parts: int, allowed: Collection[int] | None = None) -> list[int]:
    """The ``parts - 1`` cut positions that split ``costs`` into contiguous parts with the smallest maximum sum.

    A cut at position ``i`` ends a part before block ``i``; ``allowed`` (default: every position) limits them.
    """
    if parts > len(costs):
        raise PlacementError(f"Cannot cut {len(costs)} blocks into {parts} pipeline stages.")
    prefix = [0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    # best[k][i]: smallest maximum over the first i blocks cut into k parts; cut_at[k][i]: where the last part starts
    infinity = float("inf")
    best = [[infinity] * (len(costs) + 1) for _ in range(parts + 1)]
    cut_at = [[0] * (len(costs) + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, len(costs) + 1):
            for j in range(k - 1, i):
                if j and allowed is not None and j not in allowed:
                    continue
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut_at[k][i] = value, j
    if best[parts][len(costs)] == infinity:
        raise PlacementError(f"Cannot cut {len(costs)} blocks into {parts} pipeline stages at the allowed positions.")
    cuts, i = [], len(costs)
    for k in range(parts, 1, -1):
        i = cut_at[k][i]
        cuts.append(i)
    return sorted(cuts)


def _tied_spans(model: nn.Module, blocks: list[tuple[str, nn.Module]]) -> list[tuple[int, int, str]]:
    """(first block, last block, tensor name) for each tensor that several blocks hold."""
    names = {id(t): name for name, t in [*model.named_parameters(), *model.named_buffers()]}
    holders: dict[int, list[int]] = {}
    for index, (_, module) in enumerate(blocks):
        for key in dict.fromkeys(id(t) for t in [*module.parameters(), *module.buffers()]):
            holders.setdefault(key, []).append(index)
    return [(min(at), max(at), names.get(key, "?")) for key, at in holders.items() if len(at) > 1]


def _cost(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _blocks(model: nn.Module, num_stages: int) -> list[tuple[str, nn.Module]]:
    """Parameter-holding submodules to cut between: containers opened, then the largest blocks until enough."""
    blocks = _open(model, "")
    while len(blocks) < num_stages:
        openable = [(i, b) for i, b in enumerate(blocks) if _openable(b[1])]
        if not openable:
            raise PlacementError(
                f"Cannot cut {type(model).__name__} into {num_stages} pipeline stages: it has only "
                f"{len(blocks)} blocks with parameters ({[name for name, _ in blocks]})."
            )
        index, (name, module) = max(openable, key=lambda item: _cost(item[1][1]))
        blocks[index : index + 1] = _open(module, name)
    return blocks


def _holds_tensors(module: nn.Module) -> bool:
    return _cost(module) > 0 or any(True for _ in module.buffers())


def _openable(module: nn.Module) -> bool:
    own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    return not own and sum(1 for child in module.children() if _holds_tensors(child)) > 1


def _open(module: nn.Module, prefix: str) -> list[tuple[str, nn.Module]]:
    blocks = []
    for name, child in module.named_children():
        qualified = f"{prefix}.{name}" if prefix else name
        if not _holds_tensors(child):
            continue
        if isinstance(child, _CONTAINERS) and _openable(child):
            blocks += _open(child, qualified)
        else:
            blocks.append((qualified, child))
    return blocks


def _in_call_order(model: nn.Module, blocks: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """``blocks`` in the order ``forward`` first calls them (blocks never called are errors)."""
    from epl_pipeline.partition import trace_module

    graph = trace_module(model, {name for name, _ in blocks})
    called = [str(n.target) for n in graph.nodes if n.op == "call_module"]
    order = {name: called.index(name) for name, _ in blocks if name in called}
    missing = [name for name, _ in blocks if name not in order]
    if missing:
        raise PlacementError(f"auto.auto_parallel: forward never calls {missing}; remove them or annotate by hand.")
    return sorted(blocks, key=lambda block: order[block[0]])
