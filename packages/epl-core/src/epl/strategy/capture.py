"""Capture of annotations through PyTorch's global parameter/buffer registration hooks.

While EPL is initialised and not yet parallelized, every parameter or buffer a
module registers is recorded into the TaskGraph of the innermost annotation:
the open ``with`` scope, else the current default strategy, else an implicit
``replicate(1)`` TaskGraph that starts where the unannotated code starts.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules import module as module_hooks
from torch.utils.hooks import RemovableHandle

from epl.errors import AnnotationError
from epl.strategy.strategies import Strategy
from epl.strategy.taskgraph import TaskGraph

_IMPLICIT = Strategy("replicate", 1)


class AnnotationRecorder:
    """Records which TaskGraph every parameter and buffer created after ``epl.init`` belongs to."""

    def __init__(self) -> None:
        self.taskgraphs: list[TaskGraph] = []
        self._scope: TaskGraph | None = None
        self._default: TaskGraph | None = None
        self._gap: TaskGraph | None = None
        self._owner: dict[int, TaskGraph] = {}
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
            self._handles = [
                module_hooks.register_module_parameter_registration_hook(self._on_register),
                module_hooks.register_module_buffer_registration_hook(self._on_register),
            ]

    def remove(self) -> None:
        """Remove the hooks: nothing created afterwards is recorded."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _on_register(self, module: nn.Module, name: str, tensor: torch.Tensor | None) -> None:
        if tensor is None or id(tensor) in self._owner:
            return
        owner = self._scope or self._default or self._gap
        if owner is None:
            owner = self._gap = self._open(_IMPLICIT, implicit=True)
        owner.tensors.append(tensor)
        self._owner[id(tensor)] = owner

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
        TaskGraph in front. Implicit TaskGraphs without tensors of ``model`` are
        dropped; annotated ones are kept even when empty.
        """
        model_tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
        result: list[TaskGraph] = []
        unrecorded = [t for i, t in model_tensors.items() if i not in self._owner]
        if unrecorded:
            result.append(TaskGraph(index=0, strategy=_IMPLICIT, implicit=True, tensors=unrecorded))
        for recorded in self.taskgraphs:
            tensors = [t for t in recorded.tensors if id(t) in model_tensors]
            if recorded.implicit and not tensors:
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
