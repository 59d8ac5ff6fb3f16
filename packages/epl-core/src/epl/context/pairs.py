"""Which fused-kernel calls compute a block of attention, told on the host from the tokens' runs.

A block is a device's queries against one block of keys. When both sides' facts carry their ``runs`` (positions
in consecutive runs, one document, no padding: :class:`~epl.context.masks.TokenFacts`), each pair of a query run
and a key run sees all of its keys, the causal triangle, or nothing, unless a sliding window cuts it.
:func:`plan` turns that into the fewest kernel calls (as torch's context parallelism does under
its load balance): the whole block as one causal call when queries and keys are the same runs in increasing order
(a device's own block), one unmasked call over the rectangle of rows and columns that see everything when the rest
sees nothing (another device's block), otherwise one call per pair (runs cut where the other side's start or
end, so that pairs line up), pairs that see nothing skipped, and a pair a window cuts computed exactly under its
mask (``masked``): the choice is made per pair. Runs not known give None: the whole block keeps the exact masked
path. Only Python integers are read: no device tensor, so no host synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass

from epl.context.masks import Masking, Runs

#: A pair that sees all its keys, the causal triangle, nothing, or what a mask no fused call gives lets it see.
FULL, TRIANGLE, NOTHING, MASKED = "full", "triangle", "nothing", "masked"


@dataclass(frozen=True)
class Call:
    """One fused-kernel call: query ``rows`` against key ``columns`` (slices of the block), causal or not; or,
    ``masked``, those rows and columns computed exactly under their mask."""

    rows: slice
    columns: slice
    causal: bool
    masked: bool = False


#: The calls that compute one block (empty: it sees nothing), or None: the exact path for all of it.
Plan = tuple[Call, ...] | None


def plan(queries: Runs | None, keys: Runs | None, masking: Masking) -> Plan:
    """The fused-kernel calls for queries of ``queries`` runs against keys of ``keys`` runs under ``masking``."""
    if queries is None or keys is None or not queries or not keys:
        return None
    if masking.causal and queries == keys and _increasing(queries) and _unbound(queries, keys, masking):
        length = sum(tokens for _, tokens in queries)
        return (Call(slice(0, length), slice(0, length), True),)
    # Runs cut where the other side's runs start or end, so that pairs line up (a whole sequence's queries
    # against one device's slice of keys).
    queries, keys = _cut(queries, keys), _cut(keys, queries)
    kinds = {(i, j): _kind(q, k, masking) for i, q in enumerate(queries) for j, k in enumerate(keys)}
    row_slices, column_slices = _slices(queries), _slices(keys)
    seen = [pair for pair, kind in kinds.items() if kind != NOTHING]
    rows = sorted({i for i, _ in seen})
    columns = sorted({j for _, j in seen})
    rectangle = len(seen) == len(rows) * len(columns) and _consecutive(rows) and _consecutive(columns)
    if seen and rectangle and all(kinds[pair] == FULL for pair in seen):
        first_row, last_row = row_slices[rows[0]], row_slices[rows[-1]]
        first_column, last_column = column_slices[columns[0]], column_slices[columns[-1]]
        return (Call(slice(first_row.start, last_row.stop), slice(first_column.start, last_column.stop), False),)
    return tuple(Call(row_slices[i], column_slices[j], kinds[i, j] == TRIANGLE, kinds[i, j] == MASKED) for i, j in seen)


def _kind(query_run: tuple[int, int], key_run: tuple[int, int], masking: Masking) -> str:
    """What a run of queries sees of a run of keys."""
    (a, m), (b, n) = query_run, key_run
    if masking.causal and b > a + m - 1:
        return NOTHING
    window = masking.window
    if window is not None and a - (b + n - 1) >= window:
        return NOTHING  # every key is past the window
    if window is not None and a + m - 1 - b >= window:
        return MASKED  # the window cuts the pair
    if not masking.causal or b + n - 1 <= a:
        return FULL
    return TRIANGLE if (a, m) == (b, n) else MASKED  # (cut runs line up: not reached)


def _cut(runs: Runs, at: Runs) -> Runs:
    """``runs`` cut at every position where a run of ``at`` starts or ends."""
    cuts = sorted({first for first, _ in at} | {first + tokens for first, tokens in at})
    pieces: list[tuple[int, int]] = []
    for first, tokens in runs:
        starts = [first, *(c for c in cuts if first < c < first + tokens), first + tokens]
        pieces.extend((a, b - a) for a, b in zip(starts, starts[1:], strict=False))
    return tuple(pieces)


def _increasing(runs: Runs) -> bool:
    """Whether each run starts after the one before it ends (then the tokens' order is the positions')."""
    return all(first >= previous + tokens for (previous, tokens), (first, _) in zip(runs, runs[1:], strict=False))


def _unbound(queries: Runs, keys: Runs, masking: Masking) -> bool:
    """Whether no query is as far as the window from a key it could see."""
    if masking.window is None:
        return True
    farthest = max(first + tokens - 1 for first, tokens in queries) - min(first for first, _ in keys)
    return farthest < masking.window


def _slices(runs: Runs) -> list[slice]:
    """Each run's tokens as a slice of the block."""
    slices, start = [], 0
    for _, tokens in runs:
        slices.append(slice(start, start + tokens))
        start += tokens
    return slices


def _consecutive(indices: list[int]) -> bool:
    return indices == list(range(indices[0], indices[0] + len(indices))) if indices else True
