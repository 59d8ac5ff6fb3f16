"""Init units: the pieces of a model that are given values together (about one layer each).

A unit is a module with its whole subtree when it is a *layer*: a module held by a container
(``nn.ModuleList``, ``nn.ModuleDict``, ``nn.Sequential``: a transformer block, an expert list's owner) or a
module none of whose children holds tensors (an embedding, a norm, the LM head), or a layer wrapped with its
adapters (a PEFT tuner layer: its adapters' init reaches into its children). Any other module (the model,
``model.model``) is a unit of its own tensors only, and its children are looked at in turn. Containers are
never units: their elements are. A unit is initialised as one piece, so initialisation code that reaches from
a block into its children (GPT-2 scales ``c_proj`` from its block's ``_init_weights``) runs as it would on the
whole model.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
from torch import nn

from epl.materialize.adapters import is_layer_wrapper

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


@dataclass
class InitUnit:
    """One init unit: ``module`` named ``name`` in the model; ``whole``: with its subtree (else its own tensors)."""

    name: str
    module: nn.Module
    whole: bool
    #: The unit's modules with their names (the module first; its subtree in pre-order when ``whole``).
    modules: list[tuple[str, nn.Module]] = field(default_factory=list)
    #: Each module's children as built (``id`` -> name -> child): a transform may since have replaced a child
    #: by its shard or a pipeline's stand-in, but initialisation code reaching from a module into its children
    #: (``module.c_proj.weight``) must reach the children the unit initialises.
    children: dict[int, dict[str, nn.Module | None]] = field(default_factory=dict)
    #: Each (module, attribute, qualified name, tensor) of the unit's parameters and buffers as built: a
    #: transform may since have put another tensor in a slot (BERT's LM head holds its decoder's bias shard).
    as_built: list[tuple[nn.Module, str, str, torch.Tensor]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.children = {id(m): dict(m._modules) for _, m in self.modules}
        self.as_built = [
            (module, attr, f"{prefix}.{attr}" if prefix else attr, tensor)
            for prefix, module in self.modules
            for attr, tensor in itertools.chain(module._parameters.items(), module._buffers.items())
            if tensor is not None
        ]

    def slots(self) -> list[tuple[nn.Module, str, str, torch.Tensor]]:
        """Each (module, attribute, qualified name, tensor) of the unit's parameters and buffers, as built."""
        return self.as_built

    def tensors(self) -> list[torch.Tensor]:
        """The unit's tensors, each once."""
        return list({id(t): t for *_, t in self.slots()}.values())


def init_units(model: nn.Module) -> list[InitUnit]:
    """The init units of ``model`` in pre-order (a unit's tensors come before those of later units)."""
    units: list[InitUnit] = []

    def holds_tensors(module: nn.Module) -> bool:
        return any(True for _ in itertools.chain(module.parameters(), module.buffers()))

    def visit(name: str, module: nn.Module, in_container: bool) -> None:
        if not holds_tensors(module):
            return
        container = isinstance(module, _CONTAINERS)
        leaf = not any(holds_tensors(child) for child in module.children())
        if not container and (in_container or leaf or is_layer_wrapper(module)):
            modules = [(f"{name}.{sub}" if name and sub else name or sub, m) for sub, m in module.named_modules()]
            units.append(InitUnit(name, module, True, modules))
            return
        if not container and any(True for _ in itertools.chain(module.parameters(False), module.buffers(False))):
            units.append(InitUnit(name, module, False, [(name, module)]))
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child, container)

    visit("", model, False)
    return units


def has_meta_tensors(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the ``meta`` device (built without values)."""
    return any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))


def unit_of_tensors(units: list[InitUnit]) -> dict[int, InitUnit]:
    """``id`` of each tensor -> the first unit holding it (a tied tensor takes its values from that unit)."""
    first: dict[int, InitUnit] = {}
    for unit in units:
        for tensor in unit.tensors():
            first.setdefault(id(tensor), unit)
    return first


def named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every (qualified name, parameter or buffer) of ``model``, a tied tensor under each of its names."""
    return list(
        itertools.chain(model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False))
    )
