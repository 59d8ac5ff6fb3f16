"""Which submodules make each pipeline stage, and what stands in for other ranks' stages.

Each rank keeps its own stage's modules; the others are replaced by ``RemoteStage``
placeholders, so the rank holds (and its optimizer updates) only its stage's tensors,
under their original names.
"""

from __future__ import annotations

import contextvars
from typing import Any

import torch
from torch import nn

from epl.plugin_api import PlacementError, Plan, TaskGraph, holders_of, meta_copy
from epl_pipeline.resharding import StageShape


def stage_shapes(plan: Plan) -> list[StageShape]:
    """How each stage runs a micro-batch: its device count, and how many ways it shares the batch out
    (k for ``replicate(k)``, 1 for ``split(t)``)."""
    return [StageShape(tg.device_count, plan.batch_parts(tg.index)) for tg in plan.taskgraphs]


def check_stages(plan: Plan) -> None:
    """Refuse what this version cannot pipeline: stages of different kinds several to a device
    (``pipeline.stages_per_rank``), and weights tied between stages that run micro-batches differently."""
    shapes = stage_shapes(plan)
    labels = ", ".join(f"{tg.name}: {tg.label}" for tg in plan.taskgraphs)
    if plan.stages_per_rank > 1 and len(set(shapes)) > 1:
        raise PlacementError(
            f"pipeline.stages_per_rank={plan.stages_per_rank} runs several stages per device, which needs stages "
            f"of one kind (all split(t) or all replicate(k), one device count); got {labels}."
        )
    for owners in plan.shared:
        if len({shapes[owner] for owner in owners}) > 1:
            names = " and ".join(repr(plan.taskgraphs[owner].name) for owner in owners)
            raise PlacementError(
                f"Stages {names} share a tied weight but run micro-batches differently ({labels}): the copies' "
                "gradients are summed position by position, which needs stages of one kind. Keep the tied "
                "modules on one stage, or give their stages the same strategy and device count."
            )


def stage_roots(model: nn.Module, taskgraphs: list[TaskGraph]) -> dict[str, int]:
    """The outermost submodules whose tensors all belong to one TaskGraph: qualified name -> stage.

    A module whose tensors several stages hold (tied weights a partition cut apart: the
    embedding on the first stage, the head on the last) is the root of the stage that lists it.
    """
    holders = holders_of(taskgraphs)
    listed = {name: tg.index for tg in taskgraphs for name in tg.modules}
    roots: dict[str, int] = {}
    every = {tg.index for tg in taskgraphs}

    def stage_bound(tensor: torch.Tensor) -> bool:
        return len(every) == 1 or holders.get(id(tensor), set()) != every

    def visit(name: str, module: nn.Module) -> None:
        held = [holders[id(t)] for t in [*module.parameters(), *module.buffers()] if id(t) in holders]
        if not held:
            return
        stages = set.union(*held)
        # A ModuleList or ModuleDict is never called (the model iterates it): its items are the roots.
        if len(stages) == 1 and name and not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            roots[name] = stages.pop()
            return
        if name in listed and listed[name] in set.intersection(*held):
            roots[name] = listed[name]
            return
        # Buffers every stage keeps (constants the code between blocks reads) belong to no stage in particular.
        own = [*module.parameters(recurse=False), *(b for b in module.buffers(recurse=False) if stage_bound(b))]
        if own:
            raise PlacementError(
                f"Module {name or type(module).__name__!r} holds tensors of several pipeline stages directly; "
                "annotate whole modules, one stage each."
            )
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)

    visit("", model)
    return roots


#: The stage run of the model's own ``forward`` in progress in this thread (set by
#: :mod:`epl_pipeline.replay`, a ``_Replay``); placeholders ask it what to return. None: no such run.
ACTIVE_REPLAY: contextvars.ContextVar[Any] = contextvars.ContextVar("epl_pipeline_replay", default=None)


class RemoteStage(nn.Module):
    """Stands where another rank's stage module was: holds no tensors.

    When a stage runs the model's own ``forward`` (:mod:`epl_pipeline.replay`), calling it
    returns what the earlier stage sent for this call, or ends this stage's part of ``forward``
    at a later stage's module. Called otherwise, it is an error.
    """

    def __init__(
        self, name: str, stage: int, kind: str, device: torch.device, original: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.name, self.stage, self.kind, self.device = name, stage, kind, device
        # What the model's code between blocks may read of the module (``embed_tokens.weight.dtype``, a layer's
        # ``attention_type``): a copy on the meta device, never registered, so it holds no memory and no tensor.
        self.__dict__["_shadow"] = meta_copy(original) if original is not None else None

    def __getattr__(self, attribute: str) -> Any:
        """An attribute of the replaced module (its tensors on the meta device) when this stand-in has none."""
        try:
            return super().__getattr__(attribute)
        except AttributeError:
            shadow = self.__dict__.get("_shadow")
            if shadow is None or attribute.startswith("__"):
                raise
            return getattr(shadow, attribute)

    def forward(self, *args: object, **kwargs: object) -> Any:
        """The replayed value of this call; outside a replayed stage, an error."""
        replay = ACTIVE_REPLAY.get()
        if replay is None:
            raise PlacementError(f"{self.kind} belongs to pipeline stage {self.stage}, which runs on another rank.")
        return replay.remote_call(self.name, self.device)

    def extra_repr(self) -> str:
        """Shown by ``print(model)``."""
        return f"{self.kind}, stage={self.stage} (on another rank)"


def replace_module(model: nn.Module, qualified_name: str, replacement: nn.Module) -> None:
    """Put ``replacement`` where ``qualified_name`` was."""
    parent_name, _, child = qualified_name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, replacement)
