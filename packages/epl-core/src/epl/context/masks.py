"""What a query may attend to, told by the tokens' global facts rather than by a mask of the whole sequence.

Under context parallelism no device has the whole sequence, so the mask is rebuilt, block by block, from what
each token carries: its global position, its document (packed sequences: position ids restarting at 0, or a
document id) and whether it is padding. :class:`TokenFacts` holds these for some tokens; :func:`allowed` gives
the boolean mask between queries and keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenFacts:
    """For ``[batch, tokens]``: global ``positions``, ``documents`` (equal ids attend to each other) and ``valid``
    (False for padding, which no query attends to)."""

    positions: torch.Tensor
    documents: torch.Tensor
    valid: torch.Tensor

    @classmethod
    def of(
        cls, positions: torch.Tensor, documents: torch.Tensor | None = None, valid: torch.Tensor | None = None
    ) -> TokenFacts:
        """Facts with one document and no padding unless given."""
        documents = torch.zeros_like(positions) if documents is None else documents
        valid = torch.ones_like(positions, dtype=torch.bool) if valid is None else valid.bool()
        return cls(positions, documents, valid)

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
        return cls(*(torch.cat(pieces, 1) for pieces in columns))

    def narrow(self, start: int, length: int) -> TokenFacts:
        """The facts of tokens ``start:start+length``."""
        return TokenFacts(*(t.narrow(1, start, length) for t in (self.positions, self.documents, self.valid)))


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
