"""What epl-memory's hooks hand each other during one ``epl.parallelize`` (``ParallelContext.state(MemoryState)``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from epl_memory.checkpointing import CheckpointPlan, GradientCheck
    from epl_memory.offload import HostCopies
    from epl_memory.residency import JustInTimeParameters
    from epl_memory.zero import Partition


@dataclass
class MemoryState:
    """epl-memory's state in a ParallelContext, filled by its model transforms, read by its optimizer wrappers."""

    #: The modules gradient checkpointing recomputes (``gradient_checkpoint.type``).
    checkpoint_plan: CheckpointPlan | None = None
    #: The recomputation check (``gradient_checkpoint.check_gradients``).
    gradient_check: GradientCheck | None = None
    #: ZeRO's partition of the parameters over each group of copies.
    zero_partitions: list[Partition] | None = None
    #: ZeRO v2: the parameters fetched just in time.
    zero_residency: JustInTimeParameters | None = None
    #: Offload: the host copies of the weights.
    offload: HostCopies | None = None
