"""The single-process communicator: every collective over one member is a copy or nothing."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from epl.interfaces.communicator import Communicator, CompletedWork, ReduceOp, Work


class LocalCommunicator(Communicator):
    """The communicator of a job with one process (rank 0 of 1)."""

    def __init__(self) -> None:
        self.rank = 0
        self.world_size = 1
        self.ranks = (0,)

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> Work:
        """One member: the reduction of ``tensor`` is ``tensor``."""
        return CompletedWork()

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> Work:
        """One member: its chunk is the whole input."""
        _same_size("reduce_scatter", output, input)
        output.copy_(input.view_as(output))
        return CompletedWork()

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        """One member: the gathered tensor is the input."""
        _same_size("all_gather", output, input)
        output.copy_(input.view_as(output))
        return CompletedWork()

    def broadcast(self, tensor: torch.Tensor, src: int) -> Work:
        """One member: it is the source."""
        _member("broadcast", src)
        return CompletedWork()

    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: Sequence[int] | None = None,
        input_splits: Sequence[int] | None = None,
    ) -> Work:
        """One member: it sends its only chunk to itself."""
        _same_size("all_to_all", output, input)
        for splits in (output_splits, input_splits):
            if splits is not None and list(splits) != [input.numel()]:
                raise ValueError(f"all_to_all over 1 member needs splits [{input.numel()}], got {list(splits)}")
        output.copy_(input.view_as(output))
        return CompletedWork()

    def send(self, tensor: torch.Tensor, dst: int) -> Work:
        """Point-to-point needs a peer; a single process has none."""
        raise RuntimeError(f"send to rank {dst}: a single-process job has no peer to send to")

    def recv(self, tensor: torch.Tensor, src: int) -> Work:
        """Point-to-point needs a peer; a single process has none."""
        raise RuntimeError(f"recv from rank {src}: a single-process job has no peer to receive from")

    def barrier(self) -> Work:
        """One member is always all members."""
        return CompletedWork()

    def split(self, groups: Sequence[Sequence[int]]) -> Communicator:
        """The only group of one process is itself."""
        if [list(group) for group in groups if 0 in group] != [[0]]:
            raise ValueError(f"split {[list(g) for g in groups]} of a single-process job; the only rank is 0")
        return LocalCommunicator()


def _same_size(operation: str, output: torch.Tensor, input: torch.Tensor) -> None:
    if output.numel() != input.numel():
        raise ValueError(
            f"{operation} over 1 member needs output and input of equal size, got {output.numel()} and {input.numel()}"
        )


def _member(operation: str, rank: int) -> None:
    if rank != 0:
        raise ValueError(f"{operation}: rank {rank} is not a member of a single-process job (only rank 0)")
