"""Packing tokenised documents into fixed-length rows that keep the documents apart (used by train.py).

transformers' Llama (and the other models built on ``transformers.masking_utils``) reads position ids that
restart inside a row as separate sequences and masks attention across them, under ``sdpa``, ``eager`` and
flash attention alike, when no ``attention_mask`` is given and no key-value cache is used (``use_cache=False``:
with a cache, which the model makes by default even in training, the restarts are ignored and attention crosses
the documents). So a packed row needs only ``position_ids``; its ``labels`` drop the one prediction that would
cross a boundary. ``tests/examples/test_finetune.py`` checks
that a packed row's loss is the documents' loss run one by one.
"""

from __future__ import annotations

from typing import Any


def pack(batch: dict[str, list[Any]], seq_len: int) -> dict[str, list[list[int]]]:
    """Documents (each ending in EOS) laid end to end, cut into rows of ``seq_len`` tokens.

    ``position_ids`` restart at 0 where a document (or the part of one a row begins with) starts: transformers'
    Llama reads restarting positions as separate sequences and masks attention across them. ``labels`` is -100
    where a position restarts, so no token is predicted from the document before it.
    """
    rows: dict[str, list[list[int]]] = {"input_ids": [], "position_ids": [], "labels": []}
    ids: list[int] = []
    positions: list[int] = []
    for document in batch["input_ids"]:
        ids += document
        positions += range(len(document))
    for start in range(0, len(ids) - seq_len + 1, seq_len):
        row, where, offset = ids[start : start + seq_len], [], positions[start]
        for i, position in enumerate(positions[start : start + seq_len]):
            offset = 0 if i and position == 0 else offset  # the row's first part counts from 0 too
            where.append(position - offset)
        rows["input_ids"].append(row)
        rows["position_ids"].append(where)
        rows["labels"].append([-100 if p == 0 else t for t, p in zip(row, where, strict=True)])
    return rows
