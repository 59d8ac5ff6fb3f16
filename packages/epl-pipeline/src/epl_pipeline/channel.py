"""Point-to-point transfer of Python values between neighbouring stages, describing them only once.

The first time a stage sends, it sends a description (the value's structure, and per
tensor its shape, dtype and whether it needs a gradient; non-tensor leaves, and
:class:`ShapeOnly` stand-ins for tensors whose values are not needed, as constants);
from then on only the tensors travel, and the receiver allocates them from the
description. Each call (a training step, an evaluation, a prediction) starts with
:meth:`Channel.begin`: its first transfer then carries one number, 0 when the values keep
the last call's description, else the length of the new description that follows, so that
calls may differ in batch size; within a call every micro-batch must keep the description.
Gradients travel back with the shapes both sides already know. A receiver may post its next
receive early (``prefetch``), so that the values travel while it computes; receives are
still posted in the order the sender sends.
"""

from __future__ import annotations

import collections
import json
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from epl.plugin_api import Communicator, EplError, Work


@dataclass(frozen=True)
class _TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


@dataclass(frozen=True)
class ShapeOnly:
    """A tensor whose values the receiving stages do not need: only its shape and dtype travel."""

    shape: tuple[int, ...]
    dtype: str

    @staticmethod
    def of(leaf: Any) -> Any:
        """``leaf`` as its shape if it is a tensor, else ``leaf`` itself."""
        if isinstance(leaf, torch.Tensor):
            return ShapeOnly(tuple(leaf.shape), str(leaf.dtype).removeprefix("torch."))
        return leaf

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype as a ``torch.dtype``."""
        return getattr(torch, self.dtype)


@dataclass(frozen=True)
class Description:
    """The structure of the values a stage sends: tensor specs and constants, in flattened order."""

    structure: pytree.TreeSpec
    leaves: tuple[_TensorSpec | Any, ...]

    @staticmethod
    def of(values: list[Any]) -> tuple[Description, list[torch.Tensor]]:
        """Describe ``values``; also return their tensors in order."""
        leaves, spec = pytree.tree_flatten(values)
        described = tuple(
            _TensorSpec(tuple(v.shape), v.dtype, v.requires_grad and v.dtype.is_floating_point)
            if isinstance(v, torch.Tensor)
            else v
            for v in leaves
        )
        return Description(spec, described), [v for v in leaves if isinstance(v, torch.Tensor)]

    def encode(self) -> torch.Tensor:
        """As bytes in a uint8 tensor."""
        leaves = [
            {"shape": list(s.shape), "dtype": str(s.dtype).removeprefix("torch."), "grad": s.requires_grad}
            if isinstance(s, _TensorSpec)
            else {"shape_only": list(s.shape), "dtype": s.dtype}
            if isinstance(s, ShapeOnly)
            else {"constant": s}
            for s in self.leaves
        ]
        try:
            text = json.dumps({"structure": pytree.treespec_dumps(self.structure), "leaves": leaves})
        except TypeError as error:
            raise EplError(
                f"Pipeline stages pass tensors and plain Python values (numbers, strings, None, lists, tuples, "
                f"dicts) between them; {error}."
            ) from None
        return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)

    @staticmethod
    def decode(data: torch.Tensor) -> Description:
        """Inverse of ``encode``."""
        raw = json.loads(bytes(data.tolist()).decode())
        leaves = tuple(
            _TensorSpec(tuple(leaf["shape"]), getattr(torch, leaf["dtype"]), leaf["grad"])
            if "shape" in leaf
            else ShapeOnly(tuple(leaf["shape_only"]), leaf["dtype"])
            if "shape_only" in leaf
            else leaf["constant"]
            for leaf in raw["leaves"]
        )
        return Description(pytree.treespec_loads(raw["structure"]), leaves)

    @property
    def tensor_specs(self) -> list[_TensorSpec]:
        """The specs of the tensor leaves, in order."""
        return [s for s in self.leaves if isinstance(s, _TensorSpec)]


@dataclass(frozen=True)
class _Posted:
    """Receives started into ``tensors``; ``wait`` returns them once they have arrived."""

    tensors: list[torch.Tensor]
    works: list[Work]

    def wait(self) -> list[torch.Tensor]:
        for work in self.works:
            work.wait()
        return self.tensors


class Channel:
    """One direction of values between this stage and a neighbour, with the matching gradients."""

    def __init__(
        self,
        world: Communicator,
        peer: int,
        device: torch.device,
        what: str,
        gradients: Communicator | None = None,
    ) -> None:
        """Values go to or come from member ``peer`` of ``world``; their gradients the same way, or by
        ``gradients``, a communicator of their own over the same ranks."""
        self.world, self.peer, self.device, self.what = world, peer, device, what
        self.gradient_world = gradients if gradients is not None else world
        self.description: Description | None = None
        #: Whether this call's first transfer (which says whether the description changed) has happened.
        self._settled = False
        self._pending: list[tuple[Work, torch.Tensor]] = []
        # Receives posted ahead of need (``prefetch``): their buffers and handles, oldest first.
        self._values_ahead: collections.deque[_Posted] = collections.deque()
        self._gradients_ahead: collections.deque[_Posted] = collections.deque()

    def begin(self) -> None:
        """Start a call (a step, an evaluation, a prediction): its first transfer says whether the values'
        description changed since the last call (e.g. a batch of another size). Both ends call it, in the same
        order of calls."""
        self._settled = False

    # -- forward: values ---------------------------------------------------------------
    def send(self, values: list[Any], rows: int | None = None) -> list[torch.Tensor]:
        """Send ``values`` (first in a call: whether their description changed, and if so the new one); return
        the tensors sent.

        ``rows`` (this device's rows of the micro-batch) is unused: the peer takes every row.
        """
        description, tensors = Description.of(values)
        if not self._settled:
            self._announce(description)
        elif description != self.description:
            assert self.description is not None
            raise EplError(
                f"{self.what} changed between micro-batches of one batch: {self._summary(self.description)} for the "
                f"first, {self._summary(description)} now. The batch is cut into micro-batches of equal size, and "
                "each must give every stage the same shapes and structure: make the model's outputs depend only on "
                "the shapes of its inputs (e.g. pad every sequence of a batch to one length)."
            )
        for tensor in tensors:
            data = tensor.detach().contiguous()
            self._track(self.world.send(data, self.peer), data)
        return tensors

    def _announce(self, description: Description) -> None:
        """This call's first transfer: 0 when ``description`` is the last call's, else its length and itself."""
        if description == self.description:
            same = torch.zeros(1, dtype=torch.int64)
            self._track(self.world.send(same, self.peer), same)
        else:
            encoded = description.encode()
            length = torch.tensor([encoded.numel()], dtype=torch.int64)
            self._track(self.world.send(length, self.peer), length)
            self._track(self.world.send(encoded, self.peer), encoded)
            self.description = description
        self._settled = True

    def receive(self) -> tuple[list[Any], list[torch.Tensor]]:
        """Receive values; the tensors that need a gradient come as leaves that collect it."""
        if not self._settled:
            length = torch.empty(1, dtype=torch.int64)
            self.world.recv(length, self.peer).wait()
            if int(length):
                encoded = torch.empty(int(length), dtype=torch.uint8)
                self.world.recv(encoded, self.peer).wait()
                self.description = Description.decode(encoded)
            self._settled = True
        assert self.description is not None, "the sender describes its values in its first call"
        posted = self._values_ahead.popleft() if self._values_ahead else self._post(self.description.tensor_specs)
        tensors = posted.wait()
        arrived = iter(tensors)
        leaves = [next(arrived) if isinstance(spec, _TensorSpec) else spec for spec in self.description.leaves]
        needs_grad = []
        for tensor, spec in zip(tensors, self.description.tensor_specs, strict=True):
            if spec.requires_grad:
                tensor.requires_grad_(True)
                needs_grad.append(tensor)
        return pytree.tree_unflatten(leaves, self.description.structure), needs_grad

    # -- backward: gradients -----------------------------------------------------------
    def send_gradients(self, grads: list[torch.Tensor]) -> None:
        """Send the gradients of the received tensors that need one, in order."""
        for grad in grads:
            data = grad.detach().contiguous()
            self._track(self.gradient_world.send(data, self.peer), data)

    def receive_gradients(self) -> list[torch.Tensor]:
        """Receive the gradients of the sent tensors that need one, in order."""
        if self._gradients_ahead:
            return self._gradients_ahead.popleft().wait()
        assert self.description is not None
        return self._post(self._gradient_specs(), gradients=True).wait()

    # -- receiving ahead -----------------------------------------------------------------
    def prefetch(self) -> None:
        """Post the receives of the next values now (once their description is known), so that they travel
        while this stage computes; the next :meth:`receive` takes them."""
        if self._settled:
            assert self.description is not None, "the call's first transfer described the values"
            self._values_ahead.append(self._post(self.description.tensor_specs))

    def prefetch_gradients(self) -> None:
        """Post the receives of the next gradients now; the next :meth:`receive_gradients` takes them."""
        if self._settled:
            self._gradients_ahead.append(self._post(self._gradient_specs(), gradients=True))

    def _gradient_specs(self) -> list[_TensorSpec]:
        assert self.description is not None
        return [spec for spec in self.description.tensor_specs if spec.requires_grad]

    def _post(self, specs: list[_TensorSpec], *, gradients: bool = False) -> _Posted:
        """Start receiving one tensor of each of ``specs``, in order (values, or ``gradients``)."""
        world = self.gradient_world if gradients else self.world
        tensors = [torch.empty(spec.shape, dtype=spec.dtype, device=self.device) for spec in specs]
        return _Posted(tensors, [world.recv(tensor, self.peer) for tensor in tensors])

    def flush(self) -> None:
        """Wait for every send started so far."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()

    def _track(self, work: Work, keep: torch.Tensor) -> None:
        """Track a started send; ``keep`` holds its buffer alive until it completes."""
        self._pending.append((work, keep))

    @staticmethod
    def _summary(description: Description) -> str:
        """The values' tensors as ``float32[4, 64, 128]`` (dtype and shape), other values as they are."""
        return ", ".join(
            f"{str(s.dtype).removeprefix('torch.')}{list(s.shape)}"
            if isinstance(s, (_TensorSpec, ShapeOnly))
            else repr(s)
            for s in description.leaves
        )
