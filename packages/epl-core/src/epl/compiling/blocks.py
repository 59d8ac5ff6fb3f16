"""The repeated blocks of a model: the items of its largest list of same-type modules (a transformer's layers)."""

from __future__ import annotations

from collections.abc import Collection

from torch import nn


def repeated_blocks(model: nn.Module, within: Collection[str] = ()) -> list[tuple[str, nn.Module]]:
    """The items, by qualified name, of the largest ``nn.ModuleList``/``nn.Sequential`` whose items (at least 2)
    are all of one type and hold parameters; empty when there is none.

    ``within``: the modules that run whole (a pipeline stage's roots; empty: the whole model). Only items inside
    them count, so a list of layers whose other items are other stages' gives this stage's items.
    """

    def runs(name: str) -> bool:
        return not within or any(name == root or name.startswith(f"{root}.") for root in within)

    best: list[tuple[str, nn.Module]] = []
    for name, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        children = [
            (f"{name}.{child}" if name else child, module)
            for child, module in container.named_children()
            if runs(f"{name}.{child}" if name else child)
        ]
        kinds = {type(child) for _, child in children}
        holds = bool(children) and any(True for _ in children[0][1].parameters())
        if len(children) >= 2 and len(kinds) == 1 and holds and len(children) > len(best):
            best = children
    return best
