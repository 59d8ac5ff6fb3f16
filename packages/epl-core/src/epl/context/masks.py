"""What a query may attend to, told by the tokens' global facts rather than by a mask of the whole sequence.

Under context parallelism no device has the whole sequence, so the mask is rebuilt, block by block, from what
each token carries: its global position, its document (packed sequences: position ids restarting at 0, or a
document id) and whether it is padding. :class:`TokenFacts` holds these for some tokens; :func:`allowed` gives
the boolean mask between queries and keys.

Where the facts are known on the host when they are made (no padding, one document, positions in consecutive runs
the same in every row: a batch without ``position_ids`` or ``attention_mask``), they also carry those ``runs``, so
that :mod:`epl.context.pairs` can tell which blocks torch's fused kernels compute without reading a device tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

#: Runs of consecutive positions ``(first position, tokens)``, in the tokens' order.
Runs = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class TokenFacts:
    """For ``[batch, tokens]``: global ``positions``, ``documents`` (equal ids attend to each other) and ``valid``
    (False for padding, which no query attends to); ``runs``, where known on the host: the positions as runs of
    consecutive ones (the same in every row), with one document and no padding (None: not known)."""

    positions: torch.Tensor
    documents: torch.Tensor
    valid: torch.Tensor
    runs: Runs | None = None

    @classmethod
    def of(
        cls, positions: torch.Tensor, documents: torch.Tensor | None = None, valid: torch.Tensor | None = None
    ) -> TokenFacts:
        """Facts with one document and no padding unless given (their ``runs`` not known)."""
        documents = torch.zeros_like(positions) if documents is None else documents
        valid = torch.ones_like(positions, dtype=torch.bool) if valid is None else valid.bool()
        return cls(positions, documents, valid)

    @classmethod
    def of_runs(cls, runs: Runs, batch: int, device: torch.device | str | None = None) -> TokenFacts:
        """Facts of ``batch`` rows of one document without padding, positions ``runs`` (known on the host)."""
        positions = torch.cat([torch.arange(first, first + length, device=device) for first, length in runs])
        positions = positions[None].expand(batch, -1)
        return cls(positions, torch.zeros_like(positions), torch.ones_like(positions, dtype=torch.bool), runs)

    def stacked(self) -> torch.Tensor:
        """One int64 tensor ``[3, batch, tokens]`` (to send all three in one message)."""
        return torch.stack([self.positions, self.documents, self.valid.long()])

    @classmethod
    def unstacked(cls, stacked: torch.Tensor) -> TokenFacts:
        """The facts :meth:`stacked` packed."""
        return cls(stacked[0], stacked[1], stacked[2].bool())

    @classmethod
    def concatenated(cls, parts: list[TokenFacts]) -> TokenFacts:
        """The facts of ``parts``' tokens one after another (along the tokens)."""
        columns = zip(*((f.positions, f.documents, f.valid) for f in parts), strict=True)
        known = all(f.runs is not None for f in parts)
        runs = merged_runs([run for f in parts for run in f.runs or ()]) if known else None
        positions, documents, valid = (torch.cat(pieces, 1) for pieces in columns)
        return cls(positions, documents, valid, runs)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor], runs: Runs | None = None) -> TokenFacts:
        """``fn`` of each of the three tensors (the same tokens' facts elsewhere, or some of them: ``runs``)."""
        return TokenFacts(fn(self.positions), fn(self.documents), fn(self.valid), runs)

    def narrow(self, start: int, length: int) -> TokenFacts:
        """The facts of tokens ``start:start+length``."""
        runs = None if self.runs is None else narrowed_runs(self.runs, start, length)
        return self.map(lambda t: t.narrow(1, start, length), runs)


def merged_runs(runs: list[tuple[int, int]] | Runs) -> Runs:
    """``runs`` with each run that continues the one before it joined to it."""
    joined: list[tuple[int, int]] = []
    for first, length in runs:
        if joined and joined[-1][0] + joined[-1][1] == first:
            joined[-1] = (joined[-1][0], joined[-1][1] + length)
        elif length:
            joined.append((first, length))
    return tuple(joined)


def narrowed_runs(runs: Runs, start: int, length: int) -> Runs:
    """The runs of tokens ``start:start+length`` of ``runs``."""
    kept, offset = [], 0
    for first, tokens in runs:
        lo, hi = max(start, offset), min(start + length, offset + tokens)
        if lo < hi:
            kept.append((first + lo - offset, hi - lo))
        offset += tokens
    return merged_runs(kept)


def documents_from_positions(positions: torch.Tensor) -> torch.Tensor:
    """Document ids of packed sequences: a document starts wherever the position ids do not go up by one (they
    restart at 0 with each document), as transformers' ``find_packed_sequence_indices`` reads them."""
    starts = torch.zeros_like(positions)
    starts[:, 1:] = (positions[:, 1:] - positions[:, :-1] != 1).long()
    return starts.cumsum(1)


def allowed(queries: TokenFacts, keys: TokenFacts, *, causal: bool, window: int | None = None) -> torch.Tensor:
    """``[batch, queries, keys]``: whether each query attends to each key."""
    q_pos, k_pos = queries.positions[:, :, None], keys.positions[:, None, :]
    mask = (queries.documents[:, :, None] == keys.documents[:, None, :]) & keys.valid[:, None, :]
    if causal:
        mask &= k_pos <= q_pos
    if window is not None:
        mask &= q_pos - k_pos < window
    return mask


@dataclass(frozen=True)
class Masking:
    """How queries may attend: ``causal``, within a sliding ``window`` (or None), and the tokens' facts."""

    causal: bool = True
    window: int | None = None

    def between(self, queries: TokenFacts, keys: TokenFacts) -> torch.Tensor:
        """``[batch, queries, keys]``: whether each query attends to each key."""
        return allowed(queries, keys, causal=self.causal, window=self.window)
