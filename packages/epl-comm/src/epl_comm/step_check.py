"""Every rank that reduces gradients together is at the same step, on the same data: checked each step.

When a step starts, each rank posts an all-gather over the ranks it reduces gradients with:
its step number (the steps its reducer has run) and where its data is
(:func:`epl.plugin_api.data_position`: the pass and the indices drawn by its
``epl.io.ReplicaSampler``), four int64 travelling during the forward and backward. When the
reduction finishes it reads them first; a difference is an error on every one of those ranks
naming each rank's step or data position, before the update is applied:

- different step numbers: an engine rebuilt on one rank, a step retried on one rank after an error;
- the same step number on different data: a rank that skipped (or repeated) an ``engine.step``
  call for one of its batches, found at the first step after it. Without an EPL sampler such a
  rank shows only when the ranks that took fewer steps end: the others' gather then fails, and
  the error says that the ranks took different numbers of steps, instead of gloo's
  "Connection closed by peer".

Data positions are compared only when every rank's latest sampler is the same one (the same
creation order), so a sampler only some ranks use (a validation loop on rank 0) never raises.
"""

from __future__ import annotations

import torch

from epl.plugin_api import Communicator, EplError, Work, data_position
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
        self._mine = torch.zeros(_FIELDS, dtype=torch.int64)

    def start(self) -> None:
        """A step begins on this rank: post the gather of every member's step number."""
        if self._work is not None:  # a step that ended in an error: its gather still completes
            self._work.wait()
        self.step += 1
        self._mine = torch.tensor([self.step, *(data_position() or (0, 0, 0))], dtype=torch.int64)
        self._gathered = torch.zeros(self.communicator.world_size * _FIELDS, dtype=torch.int64)
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
        rows = [tuple(row) for row in self._gathered.view(-1, _FIELDS).tolist()]
        steps = [row[0] for row in rows]
        if len(set(steps)) > 1:
            pairs = zip(self.communicator.ranks, steps, strict=True)
            at = ", ".join(f"rank {rank} at step {step}" for rank, step in pairs)
            raise StepMismatchError(
                f"Ranks that average their gradients are at different steps: {at}. Every rank must call "
                "engine.step the same number of times (give every replica the same number of batches, e.g. "
                "drop_last=True and a sampler that shares the data evenly); the mismatched step was not applied. "
                "Set communication.check_steps=False to skip this check."
            )
        serials = {row[1] for row in rows}
        if len(serials) == 1 and 0 not in serials and len({row[2:] for row in rows}) > 1:
            pairs = zip(self.communicator.ranks, rows, strict=True)
            at = ", ".join(
                f"rank {rank} has drawn {drawn} samples of pass {passes}" for rank, (*_, passes, drawn) in pairs
            )
            raise StepMismatchError(
                f"Ranks that average their gradients are at step {self.step} on different data: {at} (of their "
                "epl.io.ReplicaSampler). A rank skipped or repeated engine.step for a batch: every rank must call "
                "engine.step once for every batch its loader gives. The mismatched step was not applied. Set "
                "communication.check_steps=False to skip this check."
            )


#: What each rank contributes: its step, then its data position (sampler serial, pass, indices drawn).
_FIELDS = 4
