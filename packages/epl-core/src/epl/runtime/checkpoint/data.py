"""Where every rank's ``epl.io`` loaders stood in a checkpoint: ``data/<rank>`` (JSON, :mod:`epl.io.positions`)."""

from __future__ import annotations

from typing import Any

import torch

from epl.runtime.checkpoint import files, keys


def data_items(rank: int) -> dict[str, torch.Tensor]:
    """Where this rank's ``epl.io`` loaders stand, as the entry ``data/<rank>`` (none without loaders)."""
    from epl.io import positions

    states = positions.saved()
    return {keys.data_key(rank): files.encode_json(states)} if states else {}


def data_states(tensors: dict[str, torch.Tensor]) -> dict[int, list[dict[str, Any]]]:
    """The ``data/<rank>`` entries read: each saving rank's loader states."""
    return {
        rank: files.decode_json(value) for key, value in tensors.items() if (rank := keys.data_rank(key)) is not None
    }


def data_problem(tensors: dict[str, torch.Tensor], strict: bool) -> str | None:
    """Why the checkpoint's loader positions cannot be resumed here (None: they can, or there are none)."""
    from epl.io import positions

    try:
        return positions.restore_problem(data_states(tensors), strict)
    except (ValueError, TypeError, KeyError, UnicodeDecodeError) as error:
        return f"The checkpoint has an unreadable data/ entry (where its loaders stood): {error!r}."


def restore_data_positions(tensors: dict[str, torch.Tensor], strict: bool) -> None:
    """Resume the ``epl.io`` loaders built so far where the checkpoint's stood; keep the others' positions for
    when they are built."""
    from epl.io import positions

    positions.restore(data_states(tensors), strict)
