"""``auto.auto_parallel``: cut an unannotated model into ``pipeline.num_stages`` balanced stages.

The candidate cut points are between blocks: the items of every ``nn.Sequential``,
``nn.ModuleList`` and ``nn.ModuleDict`` (where repeated blocks such as transformer layers
live), and the model's other submodules; a wrapper (a module whose only child holding tensors holds
them all, as PEFT's ``PeftModel`` and ``LoraModel``) is looked through; a block is opened further when there
are fewer blocks than stages, or when it costs more than a stage's even share (so a transformers
model's decoder is opened into its layers). Each block's cost is estimated by its number of parameters
(proportional to the multiply-adds of linear and convolution layers per sample), the
blocks are put in the order ``forward`` calls them (from a ``torch.fx`` trace, or from one
example run when fx cannot trace the forward), and the contiguous cut with the smallest most
expensive stage is chosen. Blocks that share a tensor (tied weights: the embedding and the
LM head) may land on different stages: each stage keeps a copy, and their gradients are
summed between the stages every step (see ``epl.placement.copies``).

``pipeline.split_points`` cuts at modules the user names instead (``partition_at``), as
``torch.distributed.pipelining`` takes split points.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection, Sequence
from typing import Any

from torch import nn

from epl.plugin_api import PlacementError, Strategy, TaskGraph, replicate, split

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def partition(model: nn.Module, taskgraphs: list[TaskGraph], num_stages: int, example: Any = None) -> list[TaskGraph]:
    """``num_stages`` TaskGraphs named ``stage_<k>`` holding ``model``'s blocks.

    Each is ``replicate(1)``, or ``split(t)`` / ``replicate(k)`` when the whole model was built in
    one such scope (tensor or data parallel inside every stage). ``example``: inputs to find
    forward's call order with, when fx cannot trace it (default: guessed from the model).
    """
    stage_strategy = _stage_strategy(model, taskgraphs)
    every = _blocks(model, num_stages)
    blocks = _in_call_order(model, every, example)
    opened = _blocks(model, num_stages, list(blocks))  # a block opened for the call order may still be too large
    if opened != blocks:
        blocks = _in_call_order(model, opened, example)
    cuts = balanced_cuts([_cost(module) for _, module in blocks], num_stages)
    stages = _stages(model, blocks, cuts, stage_strategy, aliases=_aliases(every, blocks))
    imbalance = explain_imbalance(model, blocks, cuts, stages)
    if imbalance:
        warnings.warn(imbalance, stacklevel=2)
    return stages


#: A stage holding more than this times an even share of the parameters is explained (``explain_imbalance``).
UNEVEN = 1.1


def explain_imbalance(
    model: nn.Module, blocks: list[tuple[str, nn.Module]], cuts: list[int], stages: list[TaskGraph]
) -> str | None:
    """Why the most loaded stage holds more than ``UNEVEN`` times an even share of the parameters, or None.

    The cut is already the most even between blocks (``balanced_cuts``); what keeps it uneven is named: the
    blocks next to each cut (moving one across leaves the other side heavier) and tensors held by several stages
    (tied weights, such as an embedding and its LM head, copied onto each stage that uses them). A 2-stage T5
    (tiny zoo config) holds 0.64 on its decoder stage: two decoder blocks of 0.28 each, and the tied embedding
    (0.08) on both stages; no cut between blocks does better.
    """
    total = sum(p.numel() for p in model.parameters())
    held = [sum(p.numel() for p in {id(t): t for t in stage.parameters}.values()) for stage in stages]
    even = total / len(stages)
    if not total or max(held) <= UNEVEN * even:
        return None
    worst = held.index(max(held))
    around = sorted({i for cut in cuts for i in (cut - 1, cut)})
    movable = ", ".join(f"{blocks[i][0]} ({_cost(blocks[i][1]) / total:.2f})" for i in around)
    owners: dict[int, set[int]] = {}
    for index, stage in enumerate(stages):
        for t in stage.parameters:
            owners.setdefault(id(t), set()).add(index)
    shared = {n: p for n, p in model.named_parameters() if len(owners.get(id(p), ())) > 1}
    copies = ""
    if shared:
        names = ", ".join(list(shared)[:3])
        size = sum(p.numel() for p in shared.values()) / total
        copies = f" {names} ({size:.2f}) is held by several stages (tied weights: each stage keeps a copy)."
    return (
        f"auto.auto_parallel: stage {worst} holds {held[worst] / total:.2f} of the parameters (an even share is "
        f"{1 / len(stages):.2f}); no cut between blocks is more even. The blocks either side of the cuts: "
        f"{movable}; moving one across leaves the other stage heavier.{copies} Cut elsewhere with "
        "pipeline.split_points, or give the model more, smaller blocks."
    )


def partition_at(
    model: nn.Module, taskgraphs: list[TaskGraph], points: list[str], example: Any = None
) -> list[TaskGraph]:
    """TaskGraphs named ``stage_<k>``, each beginning at a module of ``points`` (``pipeline.split_points``).

    The model's blocks are opened until every point is one; the stages follow forward's call order.
    """
    stage_strategy = _stage_strategy(model, taskgraphs)
    names = dict(model.named_modules())
    unknown = [point for point in points if not point or point not in names]
    if unknown or not all(isinstance(point, str) for point in points):
        raise PlacementError(
            f"pipeline.split_points names modules of the model by qualified name; {unknown[:3]} is not one "
            f"(some are: {[name for name in names if name][:5]})."
        )
    every = _blocks_at(model, points)
    blocks = _in_call_order(model, every, example)
    starts = {name: index for index, (name, _) in enumerate(blocks)}
    cuts = [starts[point] for point in points]
    if cuts != sorted(set(cuts)) or cuts[0] == 0:
        order = sorted(points, key=starts.__getitem__)
        raise PlacementError(
            f"pipeline.split_points must name modules in the order forward calls them, after its first module; "
            f"forward calls them as {order} and first calls {blocks[0][0]!r}."
        )
    return _stages(model, blocks, cuts, stage_strategy, aliases=_aliases(every, blocks))


def _aliases(every: list[tuple[str, nn.Module]], blocks: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """The blocks of ``every`` the call order left out as never called (other names of called modules), not
    those it opened into parts."""
    kept = [name for name, _ in blocks]
    return [(n, m) for n, m in every if n not in kept and not any(k.startswith(f"{n}.") for k in kept)]


def _blocks_at(model: nn.Module, points: list[str]) -> list[tuple[str, nn.Module]]:
    """The model's blocks, opened until each of ``points`` is one."""
    blocks = _open(model, "")
    for point in points:
        while point not in {name for name, _ in blocks}:
            holder = next((i for i, (name, _) in enumerate(blocks) if point.startswith(f"{name}.")), None)
            if holder is None:
                raise PlacementError(f"pipeline.split_points: {point!r} holds no parameters or buffers to place.")
            name, module = blocks[holder]
            if any(True for _ in [*module.parameters(recurse=False), *module.buffers(recurse=False)]):
                raise PlacementError(
                    f"pipeline.split_points: {point!r} is inside {name!r}, which holds tensors of its own; "
                    f"cut at {name!r} or at a module after it."
                )
            blocks[holder : holder + 1] = _open(module, name)
    return blocks


def _stages(
    model: nn.Module,
    blocks: list[tuple[str, nn.Module]],
    cuts: list[int],
    stage_strategy: Callable[[str], Strategy],
    aliases: Sequence[tuple[str, nn.Module]] = (),
) -> list[TaskGraph]:
    """One TaskGraph per run of ``blocks`` between ``cuts``; every tensor of the model must be placed. Each of
    ``aliases`` (blocks never called, whose tensors called blocks hold) is listed by the first stage holding them."""
    stages = []
    for index, (begin, end) in enumerate(zip([0, *cuts], [*cuts, len(blocks)], strict=True)):
        members = blocks[begin:end]
        unique = {id(t): t for _, module in members for t in [*module.parameters(), *module.buffers()]}
        tensors = list(unique.values())
        stage = TaskGraph(index=index, strategy=stage_strategy(f"stage_{index}"), tensors=tensors)
        stage.modules = [name for name, _ in members]
        stages.append(stage)
    for name, module in aliases:
        held = {id(t) for t in [*module.parameters(), *module.buffers()]}
        next(s for s in stages if held <= {id(t) for t in s.tensors}).modules.append(name)
    placed = {id(t) for stage in stages for t in stage.tensors}
    # A buffer outside every block (BART's final_logits_bias, read by the model's own forward between blocks) is a
    # constant every stage keeps.
    for _, buffer in model.named_buffers():
        if id(buffer) not in placed:
            for stage in stages:
                stage.tensors.append(buffer)
    placed |= {id(t) for _, t in model.named_buffers()}
    loose = [name for name, t in model.named_parameters() if id(t) not in placed]
    if loose:
        raise PlacementError(
            f"auto.auto_parallel places whole submodules on stages, but {loose[:3]} belong to no block that "
            "forward calls. Keep parameters inside submodules, or annotate the stages by hand."
        )
    return stages


def _stage_strategy(model: nn.Module, taskgraphs: list[TaskGraph]) -> Callable[[str], Strategy]:
    """How each stage is annotated: ``replicate(1)`` for an unannotated model, ``split(t)`` or ``replicate(k)`` for
    one built in a single ``epl.split(t)`` or ``epl.replicate(k)`` scope; any other annotation is an error."""
    annotated = [tg for tg in taskgraphs if not tg.implicit]
    if not annotated:
        return lambda name: replicate(1, name=name)
    (only, *more) = annotated
    held = {id(t) for t in only.tensors}
    whole = all(id(t) in held for t in [*model.parameters(), *model.buffers()])
    if not more and whole:
        annotate = split if only.strategy.kind == "split" else replicate
        return lambda name: annotate(only.strategy.device_count, name=name)
    raise PlacementError(
        f"auto.auto_parallel partitions unannotated models, or models built entirely in one epl.split or "
        f"epl.replicate scope (each stage then tensor or data parallel over its devices), but this one has "
        f"annotations ({[tg.name for tg in annotated]}). Remove the annotations (or build the whole model in one "
        "scope), or set auto.auto_parallel to False to use them."
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


def _cost(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _blocks(
    model: nn.Module, num_stages: int, blocks: list[tuple[str, nn.Module]] | None = None
) -> list[tuple[str, nn.Module]]:
    """Parameter-holding submodules to cut between: containers opened, then the largest blocks while there are
    fewer blocks than stages or a block costs more than a stage's even share (a transformers model's decoder).
    ``blocks``: where to start (default: the model's children)."""
    blocks = _open(model, "") if blocks is None else blocks
    share = _cost(model) / num_stages
    while True:
        openable = [(i, b) for i, b in enumerate(blocks) if _openable(b[1])]
        if len(blocks) >= num_stages:
            openable = [(i, b) for i, b in openable if _cost(b[1]) > share]
            if not openable:
                return blocks
        elif not openable:
            raise PlacementError(
                f"Cannot cut {type(model).__name__} into {num_stages} pipeline stages: it has only "
                f"{len(blocks)} blocks with parameters ({[name for name, _ in blocks]}), none of which opens into "
                "more (a block opens when it holds no tensors of its own and its children hold them). Name where "
                "each stage after the first begins with pipeline.split_points (qualified module names, such as "
                "'model.layers.2'), or use fewer stages."
            )
        index, (name, module) = max(openable, key=lambda item: _cost(item[1][1]))
        blocks[index : index + 1] = _open(module, name)


def _holds_tensors(module: nn.Module) -> bool:
    return _cost(module) > 0 or any(True for _ in module.buffers())


def _has_parts(module: nn.Module) -> bool:
    """Whether ``module`` holds no tensors of its own and has children that do."""
    return not [*module.parameters(recurse=False), *module.buffers(recurse=False)] and bool(_open(module, ""))


def _openable(module: nn.Module) -> bool:
    """Whether ``module`` opens into several blocks: no parameters of its own, and several children holding
    tensors (through containers: BERT's encoder holds one ModuleList of layers), or a wrapper: one child holding
    every tensor, itself openable (PEFT's ``PeftModel`` -> ``LoraModel`` -> ``LlamaForCausalLM``, whatever the
    classes). Buffers of its own do not stop it: like the model's own (BART's ``final_logits_bias`` under PEFT's
    wrappers), they are constants every stage keeps (``_stages``)."""
    if any(True for _ in module.parameters(recurse=False)):
        return False
    parts = _open(module, "")
    return len(parts) > 1 or (len(parts) == 1 and _openable(parts[0][1]))


def _open(module: nn.Module, prefix: str) -> list[tuple[str, nn.Module]]:
    """``module``'s children holding tensors, as blocks (containers among them opened too)."""
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


def _without_aliases(blocks: list[tuple[str, nn.Module]], called: Collection[str]) -> list[tuple[str, nn.Module]]:
    """``blocks`` less those never called whose every tensor a called block holds too: another name of a module
    the model calls under its own names (T5's and BART's ``shared`` embedding, which the encoder and the decoder
    call as ``embed_tokens``). Their tensors go with the blocks that call them."""
    held = {id(t) for name, block in blocks if name in called for t in [*block.parameters(), *block.buffers()]}
    return [
        (name, block)
        for name, block in blocks
        if name in called or not all(id(t) in held for t in [*block.parameters(), *block.buffers()])
    ]


def _in_call_order(model: nn.Module, blocks: list[tuple[str, nn.Module]], example: Any) -> list[tuple[str, nn.Module]]:
    """``blocks`` in the order ``forward`` first calls them (blocks never called are errors): from a torch.fx
    trace, or when fx cannot trace the forward, from a run on ``example`` (or inputs guessed from the model)."""
    from epl.plugin_api import example_input, shapes_only
    from epl_pipeline.partition import Untraceable, trace_module
    from epl_pipeline.program import NEEDS_EXAMPLE
    from epl_pipeline.replay import call_order

    names = {name for name, _ in blocks}
    try:
        graph = trace_module(model, names)
    except Untraceable as untraceable:
        example = example if example is not None else example_input(model)
        if example is None:
            raise PlacementError(f"{untraceable}\n{NEEDS_EXAMPLE}") from None
        try:
            called = call_order(model, names, example)
        except Exception:
            if not shapes_only(model):
                raise
            # epl plan of a model built on meta whose forward reads values (transformers' masks): the order the
            # blocks were built in, which is their call order in the models whose forward fx cannot trace.
            called = [name for name, _ in model.named_modules() if name in names]
    else:
        called = [str(n.target) for n in graph.nodes if n.op == "call_module"]
    order = {name: called.index(name) for name, _ in blocks if name in called}
    blocks = _without_aliases(blocks, order)
    missing = [name for name, _ in blocks if name not in order]
    # A block the model never calls as a whole but whose parts it calls (OPT's ``model``: the causal LM calls
    # ``model.decoder`` directly) is opened into its parts.
    never = [(i, name, module) for i, (name, module) in enumerate(blocks) if name in missing]
    if never and all(_has_parts(module) for _, _, module in never):
        for i, name, module in reversed(never):
            blocks[i : i + 1] = _open(module, name)
        return _in_call_order(model, blocks, example)
    if missing:
        raise PlacementError(f"auto.auto_parallel: forward never calls {missing}; remove them or annotate by hand.")
    return sorted(blocks, key=lambda block: order[block[0]])
