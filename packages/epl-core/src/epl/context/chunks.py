"""Which tokens of a sequence each of ``c`` context devices holds: the causal load balance.

Under a causal mask the last tokens of a sequence attend to the most keys. Cutting the sequence into ``2c``
equal chunks and giving device ``r`` chunks ``r`` and ``2c-1-r`` gives every device the same work (Megatron-LM's
and torch's context parallelism do the same). A device's tokens keep their global positions, which the rotary
embedding and the masks read.
"""

from __future__ import annotations

from typing import Any

import torch

from epl.context.masks import Runs, TokenFacts, merged_runs
from epl.errors import AnnotationError


def chunks_of(index: int, count: int) -> tuple[int, int]:
    """The two chunks (of ``2·count``) device ``index`` holds."""
    return index, 2 * count - 1 - index


def check_length(length: int, count: int) -> int:
    """The chunk length for a sequence of ``length`` tokens over ``count`` devices; an error when it does not
    divide."""
    if length % (2 * count):
        raise AnnotationError(
            f"context.degree {count} cuts each sequence into {2 * count} equal chunks (two per device, for the "
            f"causal load balance): {length} tokens do not divide. Pad the sequences to a multiple of {2 * count}."
        )
    return length // (2 * count)


def local_runs(length: int, index: int, count: int) -> Runs:
    """The global positions device ``index`` holds, as runs ``(first, tokens)`` known on the host."""
    chunk = check_length(length, count)
    return merged_runs([(first * chunk, chunk) for first in chunks_of(index, count)])


def local_positions(length: int, index: int, count: int, device: torch.device | None = None) -> torch.Tensor:
    """The global positions of the tokens device ``index`` holds, in the order it holds them."""
    return local_facts(1, length, index, count, device).positions[0]


def local_facts(
    batch: int, length: int, index: int, count: int, device: torch.device | str | None = None
) -> TokenFacts:
    """The facts of the tokens device ``index`` holds of ``batch`` sequences of ``length`` tokens, one document
    each without padding (their runs known on the host: the fused kernels' case)."""
    return TokenFacts.of_runs(local_runs(length, index, count), batch, device)


def shard_sequence(tensor: torch.Tensor, dim: int, index: int, count: int) -> torch.Tensor:
    """The tokens of ``tensor`` (the sequence along ``dim``) that device ``index`` holds."""
    chunk = check_length(tensor.shape[dim], count)
    first, second = chunks_of(index, count)
    return torch.cat([tensor.narrow(dim, first * chunk, chunk), tensor.narrow(dim, second * chunk, chunk)], dim=dim)


def unshard_sequence(pieces: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The whole sequence from every device's tokens (``pieces[r]`` from device ``r``), in order."""
    count = len(pieces)
    halves: list[torch.Tensor | None] = [None] * (2 * count)
    for index, piece in enumerate(pieces):
        first, second = chunks_of(index, count)
        halves[first], halves[second] = piece.chunk(2, dim=dim)
    return torch.cat([h for h in halves if h is not None], dim=dim)


def my_share(tensor: torch.Tensor, engine: Any, dim: int = 1) -> torch.Tensor:
    """This rank's share of ``tensor``'s sequences (whole along ``dim``) under ``engine``'s ``context.degree``:
    what a loader gives each rank under ``context.presliced`` (``tensor`` itself without context parallelism)."""
    plan = engine.plan
    if plan.local or plan.context_degree == 1:
        return tensor
    index = plan.assignment(engine.context.cluster.rank).context_index
    return shard_sequence(tensor, dim, index, plan.context_degree)
