"""Which submodules make each pipeline stage, and what stands in for other ranks' stages.

Each rank keeps its own stage's modules; the others are replaced by ``RemoteStage``
placeholders, so the rank holds (and its optimizer updates) only its stage's tensors,
under their original names.
"""

from __future__ import annotations

from torch import nn

from epl.plugin_api import PlacementError, Plan, TaskGraph


def check_stage_widths(plan: Plan) -> None:
    """Refuse stages this version cannot pipeline: stages of different device counts, ``replicate(k > 1)`` stages.

    Every stage is ``split(t)`` (tensor parallel inside the stage, each device exchanging
    activations with the device at its position in the next stage), or ``replicate(1)``,
    all with the same device count.
    """
    widths = {tg.device_count for tg in plan.taskgraphs}
    wide_replicas = [tg for tg in plan.taskgraphs if tg.strategy == "replicate" and tg.device_count > 1]
    if len(widths) > 1 or wide_replicas:
        raise PlacementError(
            "This version pipelines stages of one device count each, all split(t) (tensor parallel inside the "
            "stage) or all replicate(1); got "
            + ", ".join(f"{tg.name}: {tg.label}" for tg in plan.taskgraphs)
            + ". Give every stage the same split device_count, or device_count=1 for replicate stages; EPL "
            "adds data parallelism over the remaining devices."
        )


def stage_roots(model: nn.Module, taskgraphs: list[TaskGraph]) -> dict[str, int]:
    """The outermost submodules whose tensors all belong to one TaskGraph: qualified name -> stage."""
    owner = {id(t): tg.index for tg in taskgraphs for t in tg.tensors}
    roots: dict[str, int] = {}

    def visit(name: str, module: nn.Module) -> None:
        stages = {owner[id(t)] for t in [*module.parameters(), *module.buffers()] if id(t) in owner}
        if not stages:
            return
        if len(stages) == 1 and name:
            roots[name] = stages.pop()
            return
        own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if own:
            raise PlacementError(
                f"Module {name or type(module).__name__!r} holds tensors of several pipeline stages directly; "
                "annotate whole modules, one stage each."
            )
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)

    visit("", model)
    return roots


class RemoteStage(nn.Module):
    """Stands where another rank's stage module was: holds no tensors, and is never called."""

    def __init__(self, stage: int, kind: str) -> None:
        super().__init__()
        self.stage, self.kind = stage, kind

    def forward(self, *args: object, **kwargs: object) -> None:
        """Calling it is a bug: the pipeline runs only this rank's stage."""
        raise PlacementError(f"{self.kind} belongs to pipeline stage {self.stage}, which runs on another rank.")

    def extra_repr(self) -> str:
        """Shown by ``print(model)``."""
        return f"{self.kind}, stage={self.stage} (on another rank)"


def replace_module(model: nn.Module, qualified_name: str, replacement: nn.Module) -> None:
    """Put ``replacement`` where ``qualified_name`` was."""
    parent_name, _, child = qualified_name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, replacement)
