"""The Communicator protocol: asynchronous collectives and point-to-point on flat tensors.

Every EPL feature talks to other processes only through this interface, so a
backend (torch.distributed, CuPy NCCL, ...) is a plugin implementing it.
Ranks given to a method are ranks *within the communicator* (0..world_size-1),
except ``split``, which takes global ranks.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch


class ReduceOp(enum.Enum):
    """How a reduction combines the members' tensors."""

    SUM = "sum"
    AVG = "avg"
    MAX = "max"
    MIN = "min"
    PRODUCT = "product"


class Work(ABC):
    """Handle of an operation started asynchronously."""

    @abstractmethod
    def wait(self, timeout: float | None = None) -> None:
        """Block until the operation has finished; raise if it fails or ``timeout`` seconds pass."""

    @abstractmethod
    def is_completed(self) -> bool:
        """Whether the operation has finished."""


class CompletedWork(Work):
    """A handle for an operation that finished when it was started."""

    def wait(self, timeout: float | None = None) -> None:
        """Return at once: the operation is done."""

    def is_completed(self) -> bool:
        """Always True."""
        return True


class Communicator(ABC):
    """A group of processes that exchange tensors.

    Every method starts its operation and returns a :class:`Work`; the tensors
    must not be touched until ``wait()`` returns. Collectives must be called by
    every member in the same order.
    """

    #: This process's rank within the communicator.
    rank: int
    #: Number of members.
    world_size: int
    #: Global ranks of the members, in communicator-rank order.
    ranks: tuple[int, ...]

    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> Work:
        """Reduce ``tensor`` over all members, in place on every member."""

    def reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp = ReduceOp.SUM) -> Work:
        """Reduce ``tensor`` over all members into member ``dst``'s ``tensor`` (others' are left undefined).

        The default reduces everywhere (an all-reduce); communicators override it to move less.
        """
        return self.all_reduce(tensor, op)

    @abstractmethod
    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> Work:
        """Reduce ``input`` (``world_size`` equal chunks) and give member i chunk i in ``output``."""

    @abstractmethod
    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        """Concatenate every member's ``input`` into ``output`` (``world_size`` times as long)."""

    @abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int) -> Work:
        """Copy member ``src``'s ``tensor`` into every member's ``tensor``."""

    @abstractmethod
    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: Sequence[int] | None = None,
        input_splits: Sequence[int] | None = None,
    ) -> Work:
        """Send chunk j of ``input`` to member j; receive member j's chunk into chunk j of ``output``.

        Chunks are equal unless ``input_splits``/``output_splits`` give their lengths.
        """

    @abstractmethod
    def send(self, tensor: torch.Tensor, dst: int) -> Work:
        """Send ``tensor`` to member ``dst``."""

    @abstractmethod
    def recv(self, tensor: torch.Tensor, src: int) -> Work:
        """Receive into ``tensor`` from member ``src``."""

    @abstractmethod
    def barrier(self) -> Work:
        """Complete once every member has reached the barrier."""

    @abstractmethod
    def split(self, groups: Sequence[Sequence[int]]) -> Communicator:
        """This process's communicator among ``groups`` (lists of global ranks).

        Every member calls it with the same ``groups``, in the same order; each call
        makes new communicators (so calling it twice with one group gives two
        independent communicators over the same ranks). A member in no group is an error.
        """

    def process_group(self) -> Any | None:
        """The ``torch.distributed`` process group over the same members (what torch's own parallelism, such as
        FSDP2's ``DeviceMesh.from_group``, takes), or None for a backend without one."""
        return None

    def close(self) -> None:  # noqa: B027 - optional: most communicators hold nothing to release
        """Release the communicator's resources. Further use is an error."""
