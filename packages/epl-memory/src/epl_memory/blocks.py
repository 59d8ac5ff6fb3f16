"""The blocks of a model that ZeRO and offload hand to FSDP2 one at a time, and a pipeline stage's roots.

A model is cut into *units*: the root and the blocks below it (the items of ``Sequential``/``ModuleList``/
``ModuleDict`` containers, and the other children that hold parameters, opening the modules that hold containers
below them, such as a transformer's body). Modules a step runner calls directly (pipeline stage roots: *entries*)
are units too, and opened like the root. Each unit's weights are gathered for its forward and backward and
released after, as FSDP wraps each transformer block.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from epl.plugin_api import ParallelContext

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def find_units(model: nn.Module, entries: Sequence[nn.Module] = (), *, loose: bool = True) -> list[nn.Module]:
    """The root, and below it the items of containers and (``loose``) the other children that hold parameters.

    A module that holds a container below it (a transformer's body holding its list of blocks, as transformers'
    ``LlamaModel`` holds ``layers``) is opened too, so a block is fetched at a time, as FSDP wraps each block.

    Without ``loose``, the children outside containers (a transformer's embedding, final norm and head) stay with
    the unit above them, as FSDP2's "each block, then the root" leaves them to the root: their gradients are then
    reduced at the end of the backward, when the activations are gone, not as it begins, when they peak. ZeRO v0
    and v1, which keep every block's weights whole through the backward, use it (on an 8-layer Llama of vocabulary
    32,000 on 2 ranks the backward's peak fell from 2,295 to 2,184 MB, FSDP2's being 2,206).

    ``entries`` (modules called directly, not through the root) are units, opened like the
    root; so are the modules above them, which are never called whole.
    """
    units = [model]
    entry_ids = {id(entry) for entry in entries}
    above_entries = {
        id(module)
        for _, module in model.named_modules()
        if any(id(inner) in entry_ids for inner in module.modules() if inner is not module)
    }

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if id(child) in entry_ids:
                units.append(child)
                visit(child)
            elif isinstance(child, _CONTAINERS) or id(child) in above_entries or _holds_blocks(child):
                visit(child)
            elif (loose or isinstance(module, _CONTAINERS)) and any(True for _ in child.parameters()):
                units.append(child)

    visit(model)
    return units


def outermost(units: Sequence[nn.Module]) -> list[nn.Module]:
    """The units no other unit of ``units`` holds: FSDP2's roots, whose forward is the model's or a stage's."""
    inner = {id(below) for unit in units for below in unit.modules() if below is not unit}
    return [unit for unit in units if id(unit) not in inner]


def stage_entries(model: nn.Module, context: ParallelContext) -> list[nn.Module]:
    """This rank's pipeline stage roots (the runner calls them, not ``model``); none for one-stage plans.

    They are the outermost modules whose tensors all belong to this rank's TaskGraphs.
    """
    plan = context.plan
    if plan.local or plan.num_stages == 1:
        return []
    mine = set(plan.taskgraphs_on(context.cluster.rank))
    local = {id(t) for tg in context.taskgraphs if tg.index in mine for t in tg.tensors}
    entries: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            tensors = [*child.parameters(), *child.buffers()]
            if tensors and all(id(t) in local for t in tensors):
                entries.append(child)
            else:
                visit(child)

    visit(model)
    return entries


def _holds_blocks(module: nn.Module) -> bool:
    """Whether a container lies below ``module`` through modules that are not containers."""
    for child in module.children():
        if isinstance(child, _CONTAINERS) or _holds_blocks(child):
            return True
    return False
