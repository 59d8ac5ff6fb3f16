"""Values between two pipeline stages that share each micro-batch out differently.

A ``replicate(k)`` stage shares each micro-batch out k ways: its device at position q runs
rows q/k to (q+1)/k of it. A ``split(t)`` stage runs the whole micro-batch on each of its t
devices (each holds a shard of the weights). Where two neighbouring stages differ (in how
they share the batch out, or in device count), each device of the receiving stage takes
each of its rows from one device of the sending stage that holds them, and each device of
the sending stage takes the gradients of its rows back from one device of the receiving
stage that holds them; the choice among several holders is spread by position. A value
without the batch dimension (dimension 0 of another size, or a scalar) travels whole.

Gradients are in the units of the loss each device's copy of the weights is averaged over:
a stage that shares the batch out k ways holds k times the gradient of the replica's mean
loss for its rows, as data parallelism does. Received gradients are rescaled by the ratio
of the two stages' shares.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch
import torch.utils._pytree as pytree

from epl.plugin_api import Communicator, EplError
from epl_pipeline.channel import Channel, Description, ShapeOnly


@dataclass(frozen=True)
class StageShape:
    """How a stage runs one replica's micro-batch: on ``width`` devices, shared out ``parts`` ways."""

    width: int
    parts: int

    def share(self, position: int) -> tuple[Fraction, Fraction]:
        """The rows of each micro-batch the device at ``position`` runs, as fractions of it."""
        part = position * self.parts // self.width
        return Fraction(part, self.parts), Fraction(part + 1, self.parts)

    def holders(self, part: int) -> range:
        """The positions running part ``part`` of each micro-batch."""
        per_part = self.width // self.parts
        return range(part * per_part, (part + 1) * per_part)

    def part(self, position: int) -> tuple[int, int]:
        """(index, count) of the part of each micro-batch the device at ``position`` runs."""
        return position * self.parts // self.width, self.parts

    def loss_share(self, position: int) -> float:
        """The weight of this device's loss in the replica's mean (on the last stage): 1/parts on the first device
        of each part, 0 on the others (which compute the same loss)."""
        return 1 / self.parts if position % (self.width // self.parts) == 0 else 0.0


@dataclass(frozen=True)
class Transfer:
    """Rows ``start`` to ``stop`` of each micro-batch (fractions of it) moving from ``source`` to ``target``
    (positions in their stages)."""

    source: int
    target: int
    start: Fraction
    stop: Fraction


def _cover(holding: StageShape, target: int, start: Fraction, stop: Fraction) -> list[Transfer]:
    """Rows ``start`` to ``stop``, each from one position of ``holding`` that runs them (spread by ``target``)."""
    transfers = []
    for part in range(holding.parts):
        low, high = max(start, Fraction(part, holding.parts)), min(stop, Fraction(part + 1, holding.parts))
        if low < high:
            holders = holding.holders(part)
            transfers.append(Transfer(holders[target % len(holders)], target, low, high))
    return transfers


def forward_transfers(sending: StageShape, receiving: StageShape) -> list[Transfer]:
    """The values' moves: every device of ``receiving`` gets each of its rows from one device of ``sending``."""
    return [t for target in range(receiving.width) for t in _cover(sending, target, *receiving.share(target))]


def backward_transfers(sending: StageShape, receiving: StageShape) -> list[Transfer]:
    """The gradients' moves: every device of ``sending`` gets each of its rows' gradients from one device of
    ``receiving`` (``source`` is a position in ``receiving``, ``target`` in ``sending``)."""
    return [t for target in range(sending.width) for t in _cover(receiving, target, *sending.share(target))]


@dataclass(frozen=True)
class Route:
    """Rows ``start`` to ``stop`` of each micro-batch, to or from member ``peer`` of the communicator."""

    peer: int
    start: Fraction
    stop: Fraction


@dataclass(frozen=True)
class Boundary:
    """One device's side of a boundary between two stages that share the micro-batch out differently.

    On the sending stage's device, ``values`` are where its values go and ``gradients`` where
    their gradients come from; on the receiving stage's device, where its values come from and
    where their gradients go.
    """

    communicator: Communicator
    #: This device's rows of each micro-batch, as fractions of it.
    share: tuple[Fraction, Fraction]
    values: tuple[Route, ...]
    gradients: tuple[Route, ...]
    #: The sending stage's parts over the receiving stage's: received gradients of rows are multiplied by it.
    gradient_scale: Fraction
    #: Whether a receiving device holds the whole gradient of a value without the batch dimension (its stage
    #: runs whole micro-batches).
    whole_gradients: bool
    #: The communicator over the same ranks that carries the gradients, when not ``communicator``.
    gradient_communicator: Communicator | None = None


def boundary(
    communicator: Communicator,
    members: tuple[list[int], list[int]],
    shapes: tuple[StageShape, StageShape],
    sending: bool,
    position: int,
    gradient_communicator: Communicator | None = None,
) -> Boundary:
    """The side of the boundary of the device at ``position`` of the sending (``sending``) or receiving stage.

    ``members``: the communicator's member index of each position of the sending and the receiving stage;
    ``gradient_communicator``: the one over the same ranks that carries the gradients, when not ``communicator``.
    """
    into, back = forward_transfers(*shapes), backward_transfers(*shapes)
    senders, receivers = members
    if sending:
        values = [Route(receivers[t.target], t.start, t.stop) for t in into if t.source == position]
        gradients = [Route(receivers[t.source], t.start, t.stop) for t in back if t.target == position]
    else:
        values = [Route(senders[t.source], t.start, t.stop) for t in into if t.target == position]
        gradients = [Route(senders[t.target], t.start, t.stop) for t in back if t.source == position]
    own = shapes[0] if sending else shapes[1]
    return Boundary(
        communicator,
        own.share(position),
        tuple(values),
        tuple(gradients),
        Fraction(shapes[0].parts, shapes[1].parts),
        shapes[1].parts == 1,
        gradient_communicator,
    )


class ReshardingChannel:
    """One direction of values across a :class:`Boundary`, with their gradients: the interface of
    :class:`~epl_pipeline.channel.Channel`, over one channel per device the rows go to or come from."""

    def __init__(self, side: Boundary, device: torch.device, what: str) -> None:
        self.side, self.what = side, what
        #: The local values' description (the sending side's; None until the first send).
        self.description: Description | None = None
        self._values = [(route, Channel(side.communicator, route.peer, device, what)) for route in side.values]
        self._gradients = [
            (
                route,
                Channel(
                    side.gradient_communicator or side.communicator,  # gradients travel as values, the other way
                    route.peer,
                    device,
                    f"The gradients of {what[0].lower()}{what[1:]}",
                ),
            )
            for route in side.gradients
        ]
        self._batched_gradients: list[bool] = []  # per value needing a gradient: whether it has rows
        self._rows = 0  # this device's rows of each micro-batch

    def begin(self) -> None:
        """Start a call (see :meth:`Channel.begin`) on every channel of the boundary, values and gradients."""
        for _, channel in [*self._values, *self._gradients]:
            channel.begin()

    # -- forward: values ---------------------------------------------------------------
    def send(self, values: list[Any], rows: int | None = None) -> list[torch.Tensor]:
        """Send each receiving device its rows of ``values`` (``rows``: this device's rows); return the tensors."""
        assert rows is not None, "a resharding channel cuts values by rows: pass the micro-batch rows"
        leaves, structure = pytree.tree_flatten(values)
        batched = [_has_rows(leaf, rows) for leaf in leaves]
        self.description, tensors = Description.of(values)
        self._batched_gradients = _needing_gradients(leaves, batched)
        self._rows = rows
        for route, channel in self._values:
            low, high = self._span(route)
            piece = [
                _rows_of(leaf, low, high) if has_rows else leaf for leaf, has_rows in zip(leaves, batched, strict=True)
            ]
            channel.send([pytree.tree_unflatten(piece, structure), batched])
        return tensors

    def receive(self) -> tuple[list[Any], list[torch.Tensor]]:
        """This device's rows of the values, joined from the devices that hold them; the tensors that need a
        gradient come as leaves that collect it."""
        messages = [channel.receive()[0] for _, channel in self._values]
        flat = [pytree.tree_flatten(tree) for tree, _ in messages]
        structure, batched = flat[0][1], messages[0][1]
        columns = zip(*(leaves for leaves, _ in flat), strict=True)  # each leaf's pieces, one per sender
        leaves = [_join(list(column), has_rows) for column, has_rows in zip(columns, batched, strict=True)]
        self._rows = next((int(leaf.shape[0]) for leaf, has_rows in zip(leaves, batched, strict=True) if has_rows), 0)
        self._batched_gradients = _needing_gradients(leaves, batched)
        if not self.side.whole_gradients and not all(self._batched_gradients):
            raise EplError(
                f"{self.what} include a tensor without the batch dimension that needs a gradient, and this stage "
                "shares each micro-batch out over several devices, so none of them would hold its whole gradient. "
                "Compute that tensor inside this stage, or make this stage split(t) instead of replicate(k)."
            )
        needs_grad = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
        return pytree.tree_unflatten(leaves, structure), needs_grad

    # -- backward: gradients -----------------------------------------------------------
    def send_gradients(self, grads: list[torch.Tensor]) -> None:
        """Send each sending device the gradients of its rows of the received values that need one."""
        for route, channel in self._gradients:
            low, high = self._span(route)
            channel.send(
                [g[low:high] if has_rows else g for g, has_rows in zip(grads, self._batched_gradients, strict=True)]
            )

    def receive_gradients(self) -> list[torch.Tensor]:
        """The gradients of the sent values that need one, joined from the devices that hold them."""
        messages = [channel.receive()[0] for _, channel in self._gradients]
        scale = self.side.gradient_scale
        grads = []
        for index, has_rows in enumerate(self._batched_gradients):
            grad = _join([message[index] for message in messages], has_rows)
            grads.append(grad * float(scale) if has_rows and scale != 1 else grad)
        return grads

    # -- receiving ahead -----------------------------------------------------------------
    def prefetch(self) -> None:
        """Post the receives of the next values now (see :meth:`Channel.prefetch`)."""
        for _, channel in self._values:
            channel.prefetch()

    def prefetch_gradients(self) -> None:
        """Post the receives of the next gradients now."""
        for _, channel in self._gradients:
            channel.prefetch()

    def flush(self) -> None:
        """Wait for every send started so far."""
        for _, channel in [*self._values, *self._gradients]:
            channel.flush()

    def _span(self, route: Route) -> tuple[int, int]:
        """The rows of ``route`` among this device's ``self._rows``."""
        first, last = self.side.share
        per_micro_batch = self._rows / (last - first)
        low, high = (route.start - first) * per_micro_batch, (route.stop - first) * per_micro_batch
        assert low.denominator == 1 and high.denominator == 1, "the runner checks that micro-batches share out"
        return int(low), int(high)


def _has_rows(leaf: Any, rows: int) -> bool:
    """Whether ``leaf`` is this device's rows of something (a tensor or shape whose dimension 0 is ``rows``)."""
    shape = leaf.shape if isinstance(leaf, (torch.Tensor, ShapeOnly)) else ()
    return len(shape) > 0 and shape[0] == rows


def _rows_of(leaf: Any, low: int, high: int) -> Any:
    if isinstance(leaf, ShapeOnly):
        return ShapeOnly((high - low, *leaf.shape[1:]), leaf.dtype)
    return leaf[low:high]


def _join(pieces: list[Any], has_rows: bool) -> Any:
    """One value from the pieces several devices sent: rows concatenated, a value without rows taken once."""
    first = pieces[0]
    if not has_rows or len(pieces) == 1:
        return first
    if isinstance(first, ShapeOnly):
        return ShapeOnly((sum(p.shape[0] for p in pieces), *first.shape[1:]), first.dtype)
    joined = torch.cat([p.detach() for p in pieces])
    return joined.requires_grad_(first.requires_grad)


def _needing_gradients(leaves: list[Any], batched: list[bool]) -> list[bool]:
    """Of the tensor leaves that need a gradient (in order): whether each has rows."""
    return [
        has_rows
        for leaf, has_rows in zip(leaves, batched, strict=True)
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad and leaf.dtype.is_floating_point
    ]
