"""Signalling a worker's whole process group (the worker and everything it started)."""

from __future__ import annotations

import os


def signal_group(pid: int, sig: int) -> None:
    """Send ``sig`` to the process group led by ``pid``; a group already gone is fine."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
