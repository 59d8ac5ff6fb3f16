"""Capture of annotations through PyTorch's global parameter/buffer/module registration hooks.

While EPL is initialised and not yet parallelized, every parameter or buffer slot a
module registers (module, name) is recorded into the TaskGraph of the innermost
annotation: the open ``with`` scope, else the current default strategy, else an
implicit ``replicate(1)`` TaskGraph that starts where the unannotated code starts.

A module registered as another's child inside a scope (or under a default strategy)
takes the unannotated slots of its subtree into that TaskGraph: those of an implicit
TaskGraph and those recorded nowhere (made before ``epl.init``). So
``nn.Sequential(*layers)`` built in ``epl.replicate(1, name="stage_0")`` holds its layers
in stage_0 wherever they were built; an implicit TaskGraph emptied so is no longer listed.
Annotated slots never move: a container of stage_1 holding a module of stage_0 leaves it
in stage_0.

Slots, not tensor objects, carry the membership, so ``.half()``, ``to_empty`` or
``load_state_dict(assign=True)``, which put new tensors into the same slots, keep it.
A tensor registered into a second slot (weight tying) stays with its first TaskGraph.
Nothing is kept alive: modules and tensors are referenced weakly.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import nn
from torch.nn.modules import module as module_hooks
from torch.utils.hooks import RemovableHandle

from epl.annotations.strategies import Strategy
from epl.annotations.taskgraph import TaskGraph
from epl.errors import AnnotationError

_IMPLICIT = Strategy("replicate", 1)


class AnnotationRecorder:
    """Records which TaskGraph every parameter and buffer slot created after ``epl.init`` belongs to."""

    def __init__(self, *, meta_parameters: bool = False) -> None:
        #: Put every parameter registered while the hooks are installed on the ``meta`` device (``model.meta_init``).
        self.meta_parameters = meta_parameters
        self.taskgraphs: list[TaskGraph] = []
        self._scope: TaskGraph | None = None
        self._default: TaskGraph | None = None
        self._gap: TaskGraph | None = None
        self._slots: weakref.WeakKeyDictionary[nn.Module, dict[str, TaskGraph]] = weakref.WeakKeyDictionary()
        self._tensors: dict[int, tuple[weakref.ref[torch.Tensor], TaskGraph]] = {}
        self._recorded: dict[int, int] = {}
        self._handles: list[RemovableHandle] = []
        self._names: dict[str, Strategy] = {}

    # -- hooks -----------------------------------------------------------------------
    @property
    def installed(self) -> bool:
        """Whether the registration hooks are installed."""
        return bool(self._handles)

    def install(self) -> None:
        """Install the global registration hooks (idempotent)."""
        if not self._handles:
            # torch registers a tensor the parameter hook returns in place of the parameter (its annotation says None).
            hook: Callable[..., None] = self._on_register_parameter  # type: ignore[assignment]  # returns a tensor
            self._handles = [
                module_hooks.register_module_parameter_registration_hook(hook),
                module_hooks.register_module_buffer_registration_hook(self._on_register),
                module_hooks.register_module_module_registration_hook(self._on_register_module),
            ]

    def remove(self) -> None:
        """Remove the hooks: nothing created afterwards is recorded."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _on_register_parameter(self, module: nn.Module, name: str, param: torch.Tensor | None) -> torch.Tensor | None:
        """Record the parameter (on ``meta`` instead, with ``meta_parameters``: what the module then holds)."""
        if param is not None and self.meta_parameters and not param.is_meta:
            meta = torch.Tensor._make_subclass(type(param), param.detach().to("meta"), param.requires_grad)
            meta.__dict__.update(param.__dict__)
            self._on_register(module, name, meta)
            return meta
        self._on_register(module, name, param)
        return None

    def _on_register(self, module: nn.Module, name: str, tensor: torch.Tensor | None) -> None:
        if tensor is None:
            return
        slots = self._slots.setdefault(module, {})
        if name in slots:
            return
        owner = self._owner_of(tensor)
        if owner is None:
            owner = self._scope or self._default or self._gap
            if owner is None:
                owner = self._gap = self._open(_IMPLICIT, implicit=True)
            self._tensors[id(tensor)] = (weakref.ref(tensor), owner)
        slots[name] = owner
        self._recorded[owner.index] = self._recorded.get(owner.index, 0) + 1

    def _on_register_module(self, parent: nn.Module, name: str, child: nn.Module | None) -> None:
        """Inside a scope or under a default strategy, take ``child``'s unannotated slots into its TaskGraph."""
        target = self._scope or self._default
        if child is None or target is None:
            return
        # Decide on the state before the move, so that every slot of a tensor shared within
        # the subtree moves with it.
        unannotated: list[tuple[dict[str, TaskGraph], str, torch.Tensor]] = []
        for module in child.modules():
            slots = self._slots.get(module, {})
            for slot, tensor in [*module._parameters.items(), *module._buffers.items()]:
                if tensor is None:
                    continue
                owner = self._owner_of(tensor) or slots.get(slot)
                if owner is None or owner.implicit:
                    unannotated.append((self._slots.setdefault(module, slots), slot, tensor))
        for slots, slot, tensor in unannotated:
            self._tensors[id(tensor)] = (weakref.ref(tensor), target)
            previous = slots.get(slot)
            if previous is not target:
                if previous is not None:
                    self._recorded[previous.index] -= 1
                slots[slot] = target
                self._recorded[target.index] = self._recorded.get(target.index, 0) + 1

    def forget_tensors(self) -> None:
        """Drop the weak references to the recorded tensors; the slots keep their TaskGraphs (a tied tensor's
        second slot recorded its first TaskGraph). ``torch.utils.swap_tensors``, which gives a model built on
        ``meta`` its values in the same objects, refuses tensors that are weakly referenced."""
        self._tensors.clear()

    def _owner_of(self, tensor: torch.Tensor) -> TaskGraph | None:
        entry = self._tensors.get(id(tensor))
        return entry[1] if entry is not None and entry[0]() is tensor else None

    # -- annotations -----------------------------------------------------------------
    def open_scope(self, strategy: Strategy) -> None:
        """Start a ``with`` scope; nesting is an error."""
        if self._scope is not None:
            raise AnnotationError(
                f"Nested annotations are not allowed: {strategy} was opened inside "
                f"{self._scope.strategy}. Close the first `with` block before opening the next."
            )
        self._require_hooks(strategy)
        self._scope = self._open(strategy)
        self._gap = None

    def close_scope(self, strategy: Strategy) -> None:
        """End the ``with`` scope of ``strategy``."""
        self._scope = None

    def set_default(self, strategy: Strategy | None) -> None:
        """Open a new default TaskGraph for ``strategy`` (None: back to implicit)."""
        if self._scope is not None:
            raise AnnotationError(
                f"set_default_strategy({strategy}) was called inside the scope of "
                f"{self._scope.strategy}; call it outside any `with` block."
            )
        if strategy is not None:
            self._require_hooks(strategy)
        self._default = self._open(strategy) if strategy is not None else None
        self._gap = None

    def _require_hooks(self, strategy: Strategy) -> None:
        if not self.installed:
            raise AnnotationError(
                f"{strategy} was used after epl.parallelize() finished capturing annotations. "
                "Annotate the model before calling epl.parallelize(), or call epl.init() to start over."
            )

    def _open(self, strategy: Strategy, *, implicit: bool = False) -> TaskGraph:
        if strategy.name is not None:
            if strategy.name in self._names:
                raise AnnotationError(
                    f"Two annotations are named {strategy.name!r} ({self._names[strategy.name]} and "
                    f"{strategy}). Give every TaskGraph its own name."
                )
            self._names[strategy.name] = strategy
        taskgraph = TaskGraph(index=len(self.taskgraphs), strategy=strategy, implicit=implicit)
        self.taskgraphs.append(taskgraph)
        return taskgraph

    # -- result ----------------------------------------------------------------------
    def taskgraphs_for(self, model: nn.Module) -> list[TaskGraph]:
        """The TaskGraphs of ``model``, in annotation order, holding only its tensors.

        Tensors created before ``epl.init`` form an implicit ``replicate(1)``
        TaskGraph in front. TaskGraphs that recorded slots, none of them in
        ``model`` (another model's), are dropped; annotated ones that recorded
        nothing are kept (the Plan notes them).
        """
        owners: dict[int, tuple[torch.Tensor, TaskGraph | None]] = {}
        present: set[int] = set()
        for module in model.modules():
            slots = self._slots.get(module, {})
            present.update(tg.index for tg in slots.values())
            for name, tensor in [*module._parameters.items(), *module._buffers.items()]:
                if tensor is not None and id(tensor) not in owners:
                    owners[id(tensor)] = (tensor, self._owner_of(tensor) or slots.get(name))
        result: list[TaskGraph] = []
        unrecorded = [tensor for tensor, owner in owners.values() if owner is None]
        if unrecorded:
            result.append(TaskGraph(index=0, strategy=_IMPLICIT, implicit=True, tensors=unrecorded))
        for recorded in self.taskgraphs:
            tensors = [tensor for tensor, owner in owners.values() if owner is recorded]
            other_model = self._recorded.get(recorded.index) and recorded.index not in present
            if not tensors and (recorded.implicit or other_model):
                continue
            if recorded.implicit and result and result[-1].implicit:
                result[-1].tensors.extend(tensors)
                continue
            result.append(
                TaskGraph(index=len(result), strategy=recorded.strategy, implicit=recorded.implicit, tensors=tensors)
            )
        if not result:
            result.append(TaskGraph(index=0, strategy=_IMPLICIT, implicit=True))
        _name_modules(model, result)
        return result


def _name_modules(model: nn.Module, taskgraphs: list[TaskGraph]) -> None:
    owner = {id(t): tg for tg in taskgraphs for t in tg.tensors}
    for name, module in model.named_modules():
        own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if own and id(own[0]) in owner:
            owner[id(own[0])].modules.append(name or type(module).__name__)
