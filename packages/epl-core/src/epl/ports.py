"""Free TCP ports, found by binding to port 0 (never guessed). Imports nothing heavy."""

from __future__ import annotations

import socket


def free_port(address: str = "127.0.0.1") -> int:
    """A TCP port free on ``address`` right now."""
    with socket.socket() as probe:
        probe.bind((address, 0))
        return int(probe.getsockname()[1])
