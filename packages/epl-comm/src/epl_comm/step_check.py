"""Every rank that reduces gradients together is at the same step: checked each step, at almost no cost.

When a step starts, each rank posts an all-gather of its step number (the steps its reducer
has run) over the ranks it reduces gradients with: one int64 each, travelling during the
forward and backward. When the reduction finishes it reads them first: a difference is an
error on every one of those ranks naming each rank's step, before the update is applied (an
engine rebuilt on one rank, a step retried on one rank after an error). A rank that skips an
``engine.step`` call is not visible there (the next calls pair up as usual); it shows when
the ranks that took fewer steps end: the others' gather then fails, and the error names this
rank's step and says that the ranks took different numbers of steps, instead of gloo's
"Connection closed by peer".
"""

from __future__ import annotations

import torch

from epl.plugin_api import Communicator, EplError, Work
from epl_comm.diagnostics import PeerLostError


class StepMismatchError(EplError):
    """Ranks that reduce gradients together are at different steps."""


class StepCheck:
    """The step numbers of the members of ``communicator``, gathered once per step."""

    def __init__(self, communicator: Communicator) -> None:
        self.communicator = communicator
        self.step = 0
        self._gathered: torch.Tensor | None = None
        self._work: Work | None = None
        self._mine = torch.zeros(1, dtype=torch.int64)

    def start(self) -> None:
        """A step begins on this rank: post the gather of every member's step number."""
        if self._work is not None:  # a step that ended in an error: its gather still completes
            self._work.wait()
        self.step += 1
        self._mine = torch.tensor([self.step], dtype=torch.int64)
        self._gathered = torch.zeros(self.communicator.world_size, dtype=torch.int64)
        self._work = self.communicator.all_gather(self._gathered, self._mine)

    def finish(self) -> None:
        """The step's reduction is done: raise :class:`StepMismatchError` if the members' steps differ."""
        if self._work is None or self._gathered is None:
            return
        work, self._work = self._work, None
        try:
            work.wait()
        except PeerLostError as lost:
            raise StepMismatchError(
                f"{lost} If it finished its training loop, the ranks took different numbers of steps (this rank "
                f"is at step {self.step}): give every replica the same number of batches (drop_last=True, a "
                "sampler that shares the data evenly)."
            ) from None
        steps = self._gathered.tolist()
        if len(set(steps)) > 1:
            pairs = zip(self.communicator.ranks, steps, strict=True)
            at = ", ".join(f"rank {rank} at step {step}" for rank, step in pairs)
            raise StepMismatchError(
                f"Ranks that average their gradients are at different steps: {at}. Every rank must call "
                "engine.step the same number of times (give every replica the same number of batches, e.g. "
                "drop_last=True and a sampler that shares the data evenly); the mismatched step was not applied. "
                "Set communication.check_steps=False to skip this check."
            )
