"""Scalars to TensorBoard through ``torch.utils.tensorboard`` when the ``tensorboard`` package is installed."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from typing import Any

from epl.errors import EplError


def check_installed() -> None:
    """Raise a clear error when TensorBoard logging is asked for and ``tensorboard`` is not installed.

    Checked on every rank (without importing it) so that all ranks fail alike, not rank 0 alone.
    """
    if importlib.util.find_spec("tensorboard") is None:
        raise EplError(
            "epl.Progress(tensorboard=...) writes TensorBoard event files with torch.utils.tensorboard, which needs "
            "the tensorboard package: pip install tensorboard (or leave tensorboard=None)."
        )


class ScalarWriter:
    """Writes one scalar per metric and step into a TensorBoard log folder (rank 0's ``SummaryWriter``)."""

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer: Any = SummaryWriter(log_dir=str(log_dir))

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        """Add ``metrics`` (name -> value) at ``step``: as ``train/<name>`` (``samples/s`` as
        ``train/samples_per_second``), or under the name itself when it has a section (``val/loss``)."""
        for name, value in metrics.items():
            tag = name.replace("/s", "_per_second") if name.endswith("/s") else name
            self._writer.add_scalar(tag if "/" in tag else f"train/{tag}", value, global_step=step)

    def close(self) -> None:
        """Flush and close the event file."""
        self._writer.close()
