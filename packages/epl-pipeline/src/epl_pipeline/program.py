"""What a pipeline stage runs for one micro-batch: the interface the executor drives.

Two kinds of programs implement it. :class:`~epl_pipeline.partition.StagedGraph` runs
the operations a ``torch.fx`` trace gave the stage; :class:`~epl_pipeline.replay.ReplayedStages`
runs the model's own ``forward`` on every stage, for models fx cannot trace.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from torch import nn


class StageProgram(Protocol):
    """Runs one stage of the model's forward on one micro-batch."""

    num_stages: int

    def run(self, model: nn.Module, stage: int, inputs: Any, received: list[Any] | None) -> Any:
        """Run ``stage`` on one micro-batch.

        ``inputs``: the micro-batch's model inputs (every stage has them); ``received``: what the
        previous stage sent (None on the first stage). Returns the values to send to the next
        stage (a list), or on the last stage what the model's ``forward`` returns.
        """
        ...


def stage_program(
    model: nn.Module, roots: Mapping[str, int], num_stages: int, owner: Mapping[int, int], example: Any
) -> StageProgram:
    """The stage programs of ``model`` cut at ``roots`` (qualified name -> stage).

    First choice: a ``torch.fx`` trace (each stage runs only its own operations); ``owner``
    maps ``id`` of each annotated tensor to its stage. When fx cannot trace the forward,
    every stage runs the model's own ``forward``, recorded once on ``example`` (or inputs
    guessed from the model).
    """
    from epl.plugin_api import PlacementError, example_input
    from epl_pipeline.partition import Untraceable, trace_stages
    from epl_pipeline.replay import record_calls

    try:
        return trace_stages(model, roots, num_stages, owner)
    except Untraceable as untraceable:
        example = example if example is not None else example_input(model)
        if example is None:
            raise PlacementError(f"{untraceable}\n{NEEDS_EXAMPLE}") from None
        return record_calls(model, roots, num_stages, example)


#: What to do when neither fx nor an example run can show how the model's forward calls its stages.
NEEDS_EXAMPLE = (
    "Without a trace, EPL runs the model's own forward on every stage, which needs one example run of the model to "
    "learn what each stage sends on, and it could not guess inputs for this model: pass one micro-batch's inputs as "
    "epl.parallelize(..., example_inputs=...)."
)
