"""Ring attention: exact attention over a sequence whose tokens are spread over the ``c`` devices of a ring.

Each device keeps its queries and passes its keys and values to the next device, ``c - 1`` times, so that its
queries meet every key (Liu et al. 2023; Megatron-LM's and torch's context parallelism), a block at a time
(:mod:`epl.context.blockwise`). The backward pass goes round again with the keys and values, and their gradients
travel with them back to their owners. A device saves ``s/c`` tokens' worth for backward.

Keys and values travel compact (``h_kv`` heads). A hop sends one message (keys and values together); the
forward's bytes per device are ``2·(c-1)·b·(s/c)·h_kv·d`` elements. Masks are rebuilt per block from the tokens'
facts (:class:`~epl.context.masks.TokenFacts`), which every device gathers once per call.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import torch

from epl.context.blockwise import BlockGradientsOf, blockwise_attention
from epl.context.chunks import local_runs
from epl.context.masks import Masking, TokenFacts
from epl.interfaces.communicator import Communicator

__all__ = ["ContextGroup", "Masking", "gather_facts", "ring_attention"]


@dataclass(eq=False)
class ContextGroup:
    """This device's place in a ring of ``count`` context devices; ``collectives`` counts what the ring sent, by
    kind (``send`` messages and ``send_elements``)."""

    communicator: Communicator
    collectives: collections.Counter[str] = field(default_factory=collections.Counter)

    @property
    def index(self) -> int:
        """This device's place in the ring."""
        return self.communicator.rank

    @property
    def count(self) -> int:
        """Devices in the ring."""
        return self.communicator.world_size

    def shift(self, tensor: torch.Tensor) -> torch.Tensor:
        """Send ``tensor`` to the next device and receive the previous device's (same shape and dtype)."""
        self.collectives["send"] += 1
        self.collectives["send_elements"] += tensor.numel()
        received = torch.empty_like(tensor)
        outgoing = tensor.contiguous()
        sent = self.communicator.send(outgoing, (self.index + 1) % self.count)
        self.communicator.recv(received, (self.index - 1) % self.count).wait()
        sent.wait()
        return received


def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    facts: TokenFacts,
    group: ContextGroup,
    *,
    masking: Masking = Masking(),
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of this device's ``query`` ``[b, h, t, d]`` over every device's ``key``/``value``
    ``[b, h_kv, t, d]`` (``h`` a multiple of ``h_kv``); ``facts``: this device's tokens' (``[b, t]``).
    Returns ``[b, h, t, d]``."""
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return blockwise_attention(query, key, value, facts, _Ring(group, gather_facts(facts, group)), masking, scale)


def gather_facts(facts: TokenFacts, group: ContextGroup) -> list[TokenFacts]:
    """Every device's token facts, by ring index (small int64 tensors, gathered once per call). Where this
    device's runs are the causal load balance's (:func:`~epl.context.chunks.local_runs`), every device's are, and
    each device's facts carry theirs (every device of a replica reads its facts from the same whole batch)."""
    if group.count == 1:
        return [facts]
    stacked = facts.stacked().contiguous()
    output = stacked.new_empty((group.count, *stacked.shape))
    group.collectives["all_gather"] += 1
    group.communicator.all_gather(output.view(-1, *stacked.shape[1:]), stacked).wait()
    gathered = [TokenFacts.unstacked(piece) for piece in output]
    length = 2 * group.count * (facts.positions.shape[1] // 2)
    if facts.runs is None or facts.runs != local_runs(length, group.index, group.count):
        return gathered
    return [replace(f, runs=local_runs(length, r, group.count)) for r, f in enumerate(gathered)]


@dataclass(eq=False)
class _Ring:
    """The ring's blocks: this device's keys and values first, then each previous device's, passed on; backward,
    their gradients travel with them and one more hop takes them home."""

    group: ContextGroup
    facts: list[TokenFacts]

    def forward(
        self, key: torch.Tensor, value: torch.Tensor
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, TokenFacts]]:
        """Each device's keys and values, as they come round."""
        group, k, v = self.group, key, value
        for step in range(group.count):
            if step:
                k, v = _split_kv(group.shift(torch.cat([k, v])), key.shape[0])
            yield k, v, self.facts[(group.index - step) % group.count]

    def backward(
        self, key: torch.Tensor, value: torch.Tensor, gradients_of: BlockGradientsOf
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Round again: each block's gradients so far move on with it, and reach its owner after the last hop."""
        group, k, v = self.group, key, value
        dk, dv = gradients_of(k, v, self.facts[group.index])
        for step in range(1, group.count):
            k, v, dk, dv = _split_kv(group.shift(torch.cat([k, v, dk, dv])), key.shape[0])
            block_dk, block_dv = gradients_of(k, v, self.facts[(group.index - step) % group.count])
            dk, dv = dk + block_dk, dv + block_dv
        if group.count > 1:
            dk, dv = _split_kv(group.shift(torch.cat([dk, dv])), key.shape[0])
        return dk, dv


def _split_kv(packed: torch.Tensor, batch: int) -> tuple[torch.Tensor, ...]:
    """The tensors concatenated along the batch dimension (keys, values and maybe their gradients)."""
    return tuple(packed.split(batch))
