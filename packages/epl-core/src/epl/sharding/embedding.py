"""Vocabulary-parallel ``nn.Embedding``: each device holds a range of the rows (token ids)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from epl.errors import AnnotationError
from epl.interfaces.split_rule import ShardContext
from epl.sharding import collectives as C
from epl.sharding.parameters import sharded_parameter
from epl.sharding.vocabulary import IDS_FIX, check_in_vocabulary


class VocabParallelEmbedding(nn.Module):
    """This device's rows of an embedding table (uneven allowed).

    Each device looks up the ids in its range and writes zeros for the others; the
    devices' results are summed (one all-reduce, or a reduce-scatter that leaves
    each device its own rows when the batch is split over the devices). An id outside
    ``0 .. num_embeddings - 1`` is a :class:`~epl.errors.VocabularyError` on every device
    (:mod:`epl.sharding.vocabulary`), as ``nn.Embedding``'s ``IndexError`` in one process.
    """

    def __init__(self, embedding: nn.Embedding, shard: ShardContext) -> None:
        super().__init__()
        unsupported = [
            name
            for name, value in (
                ("max_norm", embedding.max_norm),
                ("scale_grad_by_freq", embedding.scale_grad_by_freq),
                ("sparse", embedding.sparse),
            )
            if value
        ]
        if unsupported:
            raise AnnotationError(
                f"{shard.name}: nn.Embedding with {', '.join(unsupported)} cannot be split over devices yet. "
                "Create it without those options, or outside the epl.split scope."
            )
        self.name = shard.name
        self.group = shard.group
        self.group.require(embedding.num_embeddings, f"{shard.name}: the rows of nn.Embedding")
        self.num_embeddings = embedding.num_embeddings
        self.embedding_dim = embedding.embedding_dim
        rows = self.group.slice(embedding.num_embeddings)
        self.start, self.stop = rows.start, rows.stop
        self.padding_idx = embedding.padding_idx
        self.weight = sharded_parameter(embedding.weight, group=self.group, dim=0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of ``ids`` (this device's rows of them when the batch is split over the devices)."""
        group = self.group
        if group.batch_split:
            ids = C.gather_rows(ids, group)
        what = f"The token ids given to the embedding {self.name!r}"
        check_in_vocabulary(ids, self.num_embeddings, what, fix=IDS_FIX)
        outside = (ids < self.start) | (ids >= self.stop)
        local = (ids - self.start).masked_fill(outside, 0)
        padding = None
        if self.padding_idx is not None and self.start <= self.padding_idx < self.stop:
            padding = self.padding_idx - self.start
        partial = F.embedding(local, self.weight, padding).masked_fill(outside.unsqueeze(-1), 0.0)
        return C.reduce_scatter_rows(partial, group) if group.batch_split else C.reduce_from_shards(partial, group)

    def extra_repr(self) -> str:
        """What ``print(model)`` shows of this layer."""
        return (
            f"{self.num_embeddings}, {self.embedding_dim} "
            f"(rows {self.start}..{self.stop - 1}, shard {self.group.index} of {self.group.count})"
        )


def shard_embedding(module: nn.Embedding, shard: ShardContext) -> nn.Module:
    """The split rule for ``nn.Embedding``: vocabulary parallel (kept whole when the layout says ``whole``)."""
    return module if shard.role == "whole" else VocabParallelEmbedding(module, shard)
