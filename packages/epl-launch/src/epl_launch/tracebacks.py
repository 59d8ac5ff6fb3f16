"""A rank's uncaught error, read from its output, and the launcher's one-line account of it.

Python prints an uncaught exception as a traceback that starts with ``Traceback (most recent
call last):`` and ends with the error (``package.module.Name: message``); torch.distributed
prefixes each of its lines with ``[rankN]: ``. The launcher keeps such a block out of the
terminal while the rank ends (its log keeps it whole), then shows only the error, once for
the ranks that raised the same one: ``rank 1 failed: EplError: ...``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

#: The first line of a traceback (of an exception group too).
TRACEBACK_START = re.compile(r"^(?:  \+ )?(?:Exception Group )?Traceback \(most recent call last\):")
#: What torch.distributed's excepthook puts before each line of a traceback.
TORCH_PREFIX = re.compile(r"^\[rank\d+\]: ?")
#: ``package.module.Name: message`` -> ``Name: message``.
QUALIFIED = re.compile(r"^(?:[A-Za-z_]\w*\.)+(?=[A-Za-z_]\w*(?::|$))")
#: A log record of torch's C++ side (glog: ``W1023 10:11:12.345 ...``, ``[W1023 ...]``), printed as a process ends.
LOG_RECORD = re.compile(r"^\[?[DIWEF]\d{4} \d\d:\d\d:\d\d")
#: Lines of an error's message shown at most (the log has the rest).
MESSAGE_LINES = 10


def bare(line: str) -> str:
    """``line`` without torch.distributed's ``[rankN]: `` prefix."""
    return TORCH_PREFIX.sub("", line, count=1)


def starts_traceback(line: str) -> bool:
    """Whether ``line`` (as the rank wrote it) is the first line of a traceback."""
    return TRACEBACK_START.match(bare(line)) is not None


def error_of(lines: Sequence[str]) -> str | None:
    """The error a traceback ends with (its last exception, for a chain), its name unqualified; None when
    ``lines`` hold no complete traceback."""
    rows = [bare(line).rstrip() for line in lines]
    starts = [index for index, row in enumerate(rows) if TRACEBACK_START.match(row)]
    if not starts:
        return None
    tail = rows[starts[-1] + 1 :]
    first = next((index for index, row in enumerate(tail) if row and not row[0].isspace()), None)
    if first is None:
        return None
    message: list[str] = []
    for row in tail[first:]:
        if not row or LOG_RECORD.match(row) or len(message) == MESSAGE_LINES:  # what follows is other output
            break
        message.append(row)
    message[0] = QUALIFIED.sub("", message[0], count=1)
    return "\n".join(message)


def ranks_text(ranks: Sequence[int | str]) -> str:
    """``rank 1`` or ``ranks 0, 1``."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def failed_lines(errors: Mapping[int, str | None]) -> list[str]:
    """``epl launch: rank 1 failed: EplError: ...``: one line (its message's further lines indented) per error, for
    every rank that raised it; nothing for a rank whose error is unknown."""
    by_error: dict[str, list[int]] = {}
    for rank, error in sorted(errors.items()):
        if error is not None:
            by_error.setdefault(error, []).append(rank)
    return [
        f"epl launch: {ranks_text(ranks)} failed: {error}".replace("\n", "\n    ") for error, ranks in by_error.items()
    ]
