"""Giving every member of a communicator one member's values of some tensors."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from epl.comm.protocol import Communicator


def broadcast_tensors(tensors: Iterable[torch.Tensor], communicator: Communicator, src: int = 0) -> None:
    """Copy member ``src``'s values of ``tensors`` into every member's (one flat broadcast per dtype).

    Every member calls it with the same tensors in the same order (shapes and dtypes alike).
    """
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        if tensor.numel():
            by_dtype.setdefault(tensor.dtype, []).append(tensor)
    with torch.no_grad():
        for group in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            communicator.broadcast(flat, src=src).wait()
            if communicator.rank != src:
                for tensor, piece in zip(group, flat.split([t.numel() for t in group]), strict=True):
                    tensor.copy_(piece.view_as(tensor))
