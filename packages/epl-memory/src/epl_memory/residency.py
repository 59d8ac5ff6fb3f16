"""Parameters whose data lives elsewhere between uses and is fetched just in time for forward and backward.

ZeRO v2 keeps a parameter's data on its owner only; offload v0 keeps it in host
memory. Either way the model is cut into *units*: the root and the blocks below it
(the items of ``Sequential``/``ModuleList``/``ModuleDict`` containers, and the other
children that hold parameters, opening the modules that hold containers below them, such as a transformer's
body). Modules a step runner calls directly
(pipeline stage roots: *entries*) are units too, and opened like the root. A unit's parameters are fetched before
its forward, released after it, fetched again when the gradient of its output
arrives in backward, and each released once its own gradient is accumulated.
Parameters used by more than one unit (tied weights) are never released.

Whether a parameter is fetched is tracked the same way on every copy, so collective
fetches (ZeRO's broadcasts) are issued in the same order everywhere.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from epl.plugin_api import EplError

if TYPE_CHECKING:
    from epl.plugin_api import ParallelContext

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


class Residency(Protocol):
    """Where the data of released parameters lives, and how it comes back."""

    def keeps(self, param: nn.Parameter) -> bool:
        """Whether this device keeps ``param``'s data all the time (it is never released here)."""
        ...

    def fetch(self, params: Sequence[nn.Parameter]) -> None:
        """Give ``params`` their data on this device (storage already allocated; every copy calls it alike)."""
        ...

    def store(self, params: Sequence[nn.Parameter]) -> None:
        """Keep the current values of ``params`` where they live (after the optimizer changed them)."""
        ...


def find_units(model: nn.Module, entries: Sequence[nn.Module] = ()) -> list[nn.Module]:
    """The root, and below it the items of containers and the other children that hold parameters.

    A module that holds a container below it (a transformer's body holding its list of blocks, as transformers'
    ``LlamaModel`` holds ``layers``) is opened too, so a block is fetched at a time, as FSDP wraps each block.

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
            elif any(True for _ in child.parameters()):
                units.append(child)

    visit(model)
    return units


class JustInTimeParameters:
    """Installs the fetch and release hooks on ``model``'s units for ``residency``.

    ``entries``: modules a step runner calls directly instead of ``model`` (pipeline stage roots).
    """

    def __init__(self, model: nn.Module, residency: Residency, entries: Sequence[nn.Module] = ()) -> None:
        self.model = model
        self.residency = residency
        units = find_units(model, entries)
        nested = {id(unit) for unit in units}
        owner_count: dict[int, int] = {}
        unit_params: list[list[nn.Parameter]] = []
        for unit in units:
            params = _own_parameters(unit, nested)
            unit_params.append(params)
            for param in params:
                owner_count[id(param)] = owner_count.get(id(param), 0) + 1
        self.units = [
            (unit, [p for p in params if owner_count[id(p)] == 1])
            for unit, params in zip(units, unit_params, strict=True)
        ]
        #: Parameters this module moves (shared ones stay where they are).
        self.params = [p for _, params in self.units for p in params]
        self._fetched: set[int] = {id(p) for p in self.params}  # every parameter starts with its data
        self._handles: list[Any] = []
        for unit, params in self.units:
            if params:
                self._install(unit, params)
        for param in self.params:
            if param.requires_grad:
                self._handles.append(param.register_post_accumulate_grad_hook(self._after_gradient))
        self._handles.append(model.register_state_dict_pre_hook(lambda *_: self.fetch_all()))
        self._handles.append(model.register_state_dict_post_hook(lambda *args: self._after_state_dict(*args)))
        self._handles.append(model.register_load_state_dict_pre_hook(lambda *_: self.fetch_all()))
        self._handles.append(model.register_load_state_dict_post_hook(lambda *_: self._after_load()))
        for called in (model, *entries):
            called.forward = _explain_missing_data(called.forward)

    # -- fetching and releasing --------------------------------------------------------------
    def fetch(self, params: Iterable[nn.Parameter]) -> None:
        """Give every one of ``params`` not fetched yet its data (a collective for ZeRO: all copies call it)."""
        missing = [p for p in params if id(p) not in self._fetched]
        if not missing:
            return
        for param in missing:
            if not self.residency.keeps(param):
                storage = param.untyped_storage()
                storage.resize_(param.numel() * param.element_size())
        self.residency.fetch(missing)
        self._fetched.update(id(p) for p in missing)

    def release(self, params: Iterable[nn.Parameter]) -> None:
        """Free the data of ``params`` on this device, where it does not keep them."""
        for param in params:
            if id(param) in self._fetched:
                self._fetched.discard(id(param))
                if not self.residency.keeps(param):
                    param.untyped_storage().resize_(0)

    def fetch_all(self) -> None:
        """Fetch every parameter (before a state dict is taken or loaded, or the optimizer steps)."""
        self.fetch(self.params)

    def release_all(self) -> None:
        """Release every parameter this device does not keep."""
        self.release(self.params)

    def store_all(self) -> None:
        """Keep the parameters' current values where they live (after an optimizer step)."""
        self.residency.store(self.params)

    # -- hooks -----------------------------------------------------------------------------
    def _install(self, unit: nn.Module, params: list[nn.Parameter]) -> None:
        def before_forward(module: nn.Module, args: Any) -> None:
            self.fetch(params)

        def after_forward(module: nn.Module, args: Any, output: Any) -> None:
            self.release(params)
            if torch.is_grad_enabled():
                needing = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
                if needing:
                    torch.autograd.graph.register_multi_grad_hook(needing, lambda _: self.fetch(params), mode="any")

        self._handles.append(unit.register_forward_pre_hook(before_forward))
        self._handles.append(unit.register_forward_hook(after_forward))

    def _after_load(self) -> None:
        """Loaded values go where the parameters live; then the parameters are released."""
        self.store_all()
        self.release_all()

    def _after_gradient(self, param: nn.Parameter) -> None:
        self.release([param])

    def _after_state_dict(self, module: nn.Module, state: dict[str, Any], prefix: str, metadata: Any) -> None:
        """Entries that alias released data become copies; then the parameters are released again."""
        if any(isinstance(value, nn.Parameter) for value in state.values()):
            return  # keep_vars=True: the caller holds the parameters themselves; they are released after a step
        moved = {p.untyped_storage().data_ptr() for p in self.params if not self.residency.keeps(p)} - {0}
        for key, value in list(state.items()):
            if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() in moved:
                state[key] = value.clone()
        self.release_all()


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


def _own_parameters(unit: nn.Module, units: set[int]) -> list[nn.Parameter]:
    """Parameters under ``unit`` that no nested unit holds."""
    params: list[nn.Parameter] = list(unit.parameters(recurse=False))

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if id(child) not in units:
                params.extend(child.parameters(recurse=False))
                visit(child)

    visit(unit)
    seen: set[int] = set()
    return [p for p in params if not (id(p) in seen or seen.add(id(p)))]


def _explain_missing_data(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward``, with a clear error when it used a released parameter outside the unit that holds it."""

    @functools.wraps(forward)
    def checked(*args: Any, **kwargs: Any) -> Any:
        try:
            return forward(*args, **kwargs)
        except RuntimeError as exc:
            if "storage of size 0" not in str(exc):
                raise
            raise EplError(
                "The model used a parameter whose data had been released: zero.level 'v2' and offload.level "
                "fetch a block's parameters only while that block's forward runs (blocks: the items of "
                "Sequential/ModuleList/ModuleDict and the other children of the model). A forward that reads "
                "another block's parameter directly (e.g. block.weight outside block(...)) must call that "
                f"block instead, or use zero.level 'v1'. ({exc})"
            ) from exc

    return checked
