"""From a model's ``forward`` to per-stage programs: trace once, give every operation a stage.

The model is traced with ``torch.fx``, keeping each stage's root modules whole (leaves).
A root runs on its stage; any other operation runs on the latest stage among its inputs
(model inputs count as stage 0), and the model's output is produced by the last stage.
What a later stage needs from an earlier one is sent along the pipeline, through the
stages in between (so a skip connection across a boundary works), as whatever Python
values the model passes: tensors, tuples, dicts, lists, numbers.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import fx, nn

from epl.plugin_api import PlacementError, as_arguments


class Untraceable(PlacementError):
    """torch.fx could not trace the model's forward (the pipeline then runs the model's own forward instead)."""


class _StageTracer(fx.Tracer):
    """Traces through everything but the stage roots (and the modules fx keeps whole anyway)."""

    def __init__(self, roots: Collection[str]) -> None:
        super().__init__()
        self.roots = roots

    def is_leaf_module(self, module: nn.Module, qualified_name: str) -> bool:
        """Stage roots are called, not traced into."""
        return qualified_name in self.roots or super().is_leaf_module(module, qualified_name)


@dataclass
class StagedGraph:
    """The traced ``forward`` with a stage for each operation.

    ``boundaries[s]`` lists, in program order, the values stage ``s`` sends to ``s + 1``.
    """

    graph: fx.Graph
    num_stages: int
    stage_of: dict[fx.Node, int]
    boundaries: list[list[fx.Node]]
    _nodes: dict[int, list[fx.Node]] = field(default_factory=dict, repr=False)

    def nodes_of(self, stage: int) -> list[fx.Node]:
        """The operations stage ``stage`` runs, in program order (placeholders and output excluded)."""
        return [n for n in self.graph.nodes if self.stage_of.get(n) == stage and n.op not in ("placeholder", "output")]

    @property
    def placeholders(self) -> list[fx.Node]:
        """The model's ``forward`` parameters."""
        return [n for n in self.graph.nodes if n.op == "placeholder"]

    @property
    def output(self) -> fx.Node:
        """The output node (its argument is what ``forward`` returns)."""
        return next(n for n in self.graph.nodes if n.op == "output")

    def run(self, model: nn.Module, stage: int, inputs: Any, received: list[Any] | None) -> Any:
        """Run ``stage``'s operations (a :class:`~epl_pipeline.program.StageProgram`): the first stage reads the
        model's inputs, the others what the previous stage sent; returns the values to send on, or the output."""
        env = (
            bind_inputs(self, inputs)
            if received is None
            else dict(zip(self.boundaries[stage - 1], received, strict=True))
        )
        if stage not in self._nodes:
            self._nodes[stage] = self.nodes_of(stage)
        run_nodes(model, self._nodes[stage], env)
        if stage < self.num_stages - 1:
            return [env[n] for n in self.boundaries[stage]]
        return output_value(self, env)


def trace_stages(model: nn.Module, roots: Mapping[str, int], num_stages: int, owner: Mapping[int, int]) -> StagedGraph:
    """Trace ``model`` and assign each operation to a stage.

    ``roots`` maps each stage root's qualified name to its stage; ``owner`` maps ``id`` of
    an annotated parameter or buffer to its stage (for tensors the ``forward`` reads directly).
    """
    graph = trace_module(model, roots)
    stage_of: dict[fx.Node, int] = {}
    for node in graph.nodes:
        inputs = [stage_of[i] for i in node.all_input_nodes]
        latest = max(inputs, default=0)
        if node.op == "call_module" and node.target in roots:
            stage = roots[node.target]
            if latest > stage:
                source = next(i for i in node.all_input_nodes if stage_of[i] == latest)
                raise PlacementError(
                    f"Cannot pipeline {type(model).__name__}: stage {stage}'s module {node.target!r} uses "
                    f"{source.name!r}, computed on the later stage {latest}. Stages must run in the order "
                    "they are annotated; annotate the modules in the order forward calls them."
                )
            stage_of[node] = stage
        elif node.op == "get_attr":
            stage_of[node] = owner.get(id(_attribute(model, str(node.target))), 0)
        elif node.op == "output":
            stage_of[node] = num_stages - 1
        else:
            stage_of[node] = latest
    boundaries = [
        [n for n in graph.nodes if stage_of[n] <= s and any(stage_of[u] > s for u in n.users)]
        for s in range(num_stages - 1)
    ]
    return StagedGraph(graph, num_stages, stage_of, boundaries)


def trace_module(model: nn.Module, leaves: Collection[str]) -> fx.Graph:
    """The graph of ``model``'s forward, calling the modules named in ``leaves`` whole."""
    try:
        graph = _StageTracer(leaves).trace(model)
    except Exception as error:  # noqa: BLE001 - every tracing failure gets the same explanation
        raise Untraceable(
            f"Cannot split {type(model).__name__} into pipeline stages: torch.fx could not trace its forward "
            f"({type(error).__name__}: {error}). {_TRACEABLE}"
        ) from error
    return graph


#: What the code between stage modules must respect for fx to trace it.
_TRACEABLE = (
    "For fx, the code between stage modules must not branch on tensor values or call untraceable functions; "
    "move such code inside one stage's module, or wrap it in a function marked with torch.fx.wrap."
)


def _attribute(model: nn.Module, qualified_name: str) -> Any:
    value: Any = model
    for part in qualified_name.split("."):
        value = getattr(value, part)
    return value


def bind_inputs(staged: StagedGraph, inputs: Any) -> dict[fx.Node, Any]:
    """The values of ``forward``'s parameters for one micro-batch (as ``Engine.step`` passes inputs)."""
    placeholders = staged.placeholders
    args, given = as_arguments(inputs)
    if len(args) > len(placeholders):
        raise PlacementError(f"The model's forward takes {len(placeholders)} inputs, got {len(args)}.")
    given.update({str(p.target): value for p, value in zip(placeholders, args, strict=False)})  # a parameter's name
    env: dict[fx.Node, Any] = {}
    for placeholder in placeholders:
        if placeholder.target in given:
            env[placeholder] = given[placeholder.target]
        elif placeholder.args:
            env[placeholder] = placeholder.args[0]
        else:
            raise PlacementError(f"The model's forward needs {placeholder.target!r}, which the batch does not give.")
    return env


def run_nodes(model: nn.Module, nodes: list[fx.Node], env: dict[fx.Node, Any]) -> None:
    """Run ``nodes`` of the traced graph on ``model``, reading and writing values in ``env``."""
    for node in nodes:
        args = fx.node.map_arg(node.args, env.__getitem__)
        kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
        if node.op == "call_module":
            env[node] = model.get_submodule(str(node.target))(*args, **kwargs)
        elif node.op == "call_function":
            env[node] = node.target(*args, **kwargs)  # type: ignore[operator]  # a call_function's: a callable
        elif node.op == "call_method":
            self_, *rest = args
            env[node] = getattr(self_, str(node.target))(*rest, **kwargs)
        elif node.op == "get_attr":
            env[node] = _attribute(model, str(node.target))
        else:
            raise PlacementError(f"Unexpected operation {node.op!r} in a pipeline stage.")


def output_value(staged: StagedGraph, env: dict[fx.Node, Any]) -> Any:
    """What ``forward`` returns, once the last stage has run."""
    return fx.node.map_arg(staged.output.args[0], env.__getitem__)
