"""One outcome on every rank for a step each rank takes alone: the ranks agree before any of them goes on.

Loading a checkpoint, each rank reads its own files (its stage's tensors, its shards' slices), and a file can fail
on one rank only. A rank that raised at once would leave the others in their next collective until
``communication.timeout``; a script that caught the error and loaded an older checkpoint would pair its
collectives with the wrong ones. :func:`agree` closes such a step: one all-reduce of one number says whether any
rank failed (all it costs when none did); when one did, an all-gather of every rank's error follows, and every
rank raises an :class:`~epl.errors.EplError`: a rank that failed its own error, the others the failing rank's,
named (``Rank 1 refused the checkpoint: ...``). Both collectives wait at most ``communication.timeout`` and name
the ranks that did not arrive, as every collective of EPL does.
"""

from __future__ import annotations

import torch

from epl.errors import EplError
from epl.interfaces.communicator import Communicator, ReduceOp

#: Bytes of one rank's report in the all-gather: its weight, then its error's UTF-8 (longer errors are cut).
REPORT_BYTES = 2048
#: The weight of an ordinary refusal; heavier reports explain lighter ones (see :func:`agree`).
REFUSED = 1


def agree(communicator: Communicator | None, problem: str | None, *, refused: str, weight: int = REFUSED) -> None:
    """Raise on every rank when any rank's ``problem`` is set (this rank's error; None: it succeeded): a collective
    of ``communicator``'s members (None: one process, which raises its own problem).

    ``weight`` (1 to 255) ranks the explanations: the heaviest wins, so a damaged file explains the read errors it
    causes on other ranks. A rank whose problem is among the heaviest raises its own; every other rank raises the
    lowest such rank's, as ``Rank <r> <refused>: <its error>``.
    """
    if problem is not None and not 1 <= weight <= 255:
        raise ValueError(f"weight {weight} is not in 1..255")
    mine = weight if problem is not None else 0
    if communicator is None or communicator.world_size == 1:
        if problem is not None:
            raise EplError(problem)
        return
    heaviest = torch.tensor([mine], dtype=torch.int64)
    communicator.all_reduce(heaviest, ReduceOp.MAX).wait()
    top = int(heaviest)
    if not top:
        return
    reports = _gather(communicator, mine, problem or "")
    if mine == top:
        raise EplError(problem)
    first = next(index for index, (heft, _) in enumerate(reports) if heft == top)
    raise EplError(f"Rank {communicator.ranks[first]} {refused}: {reports[first][1]}")


def _gather(communicator: Communicator, weight: int, message: str) -> list[tuple[int, str]]:
    """Every member's (weight, message), by member: one all-gather of :data:`REPORT_BYTES` each."""
    data = message.encode()[: REPORT_BYTES - 1]
    mine = torch.zeros(REPORT_BYTES, dtype=torch.uint8)
    mine[0] = weight
    if data:
        mine[1 : 1 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    everyone = torch.zeros(REPORT_BYTES * communicator.world_size, dtype=torch.uint8)
    communicator.all_gather(everyone, mine).wait()
    reports = []
    for row in everyone.view(communicator.world_size, REPORT_BYTES):
        text = bytes(row[1:].tolist()).rstrip(b"\0").decode(errors="ignore")
        reports.append((int(row[0]), text))
    return reports
