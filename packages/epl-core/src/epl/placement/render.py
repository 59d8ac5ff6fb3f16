"""Text helpers for reports: device lists, byte counts, counted words, aligned tables. Imports nothing of EPL."""

from __future__ import annotations

from collections.abc import Sequence


def format_devices(devices: Sequence[int]) -> str:
    """A device list, shortened when long: ``0, 2, 4, ..., 1022 (512 devices)``."""
    devices = list(devices)
    if len(devices) <= 8:
        return ", ".join(map(str, devices))
    step = devices[1] - devices[0]
    regular = all(b - a == step for a, b in zip(devices, devices[1:], strict=False))
    head = ", ".join(map(str, devices[:3]))
    middle = "" if regular else " (irregular)"
    return f"{head}, ...{middle}, {devices[-1]} ({len(devices)} devices)"


def format_bytes(count: int) -> str:
    """``1536`` -> ``1.5 KiB``."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def count(number: int, word: str, plural: str | None = None) -> str:
    """``1 device``, ``2 devices`` (or ``plural``)."""
    return f"{number} {word if number == 1 else plural or word + 's'}"


def table(rows: list[list[str]]) -> list[str]:
    """``rows`` as lines of left-aligned columns, indented by two spaces."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
