"""The Communicator over torch.distributed (gloo on CPU, NCCL on CUDA)."""

from __future__ import annotations

import datetime
import itertools
from collections.abc import Callable, Sequence
from typing import cast

import torch
import torch.distributed as dist

from epl.plugin_api import Cluster, Communicator, EplError, ReduceOp, Work
from epl_comm.diagnostics import CollectiveLog, CollectiveRecord, DiagnosedWork
from epl_comm.rendezvous import default_store, join_process_group

# torch 2.13 renamed these; older releases have only the first names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)

#: On CUDA, NCCL carries CUDA tensors and gloo the CPU ones (the batch check's fingerprints, a broadcast of
#: weights still in host memory): torch.distributed picks the backend by the tensor's device.
CUDA_BACKENDS = "cpu:gloo,cuda:nccl"

_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.AVG: dist.ReduceOp.AVG,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
}


class TorchWork(DiagnosedWork):
    """A torch.distributed async handle whose ``wait`` times out with a diagnosis."""

    def __init__(self, work: dist.Work, record: CollectiveRecord, log: CollectiveLog, timeout: float) -> None:
        super().__init__(record, log, timeout)
        self._work = work

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the operation; after ``timeout`` (default ``communication.timeout``) seconds, raise."""
        seconds = self.seconds(timeout)
        try:
            self._work.wait(datetime.timedelta(seconds=seconds))
        except RuntimeError as exc:
            if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
                raise self.timed_out(seconds) from exc
            lost = self.peer_lost(exc)
            if lost is not None:
                raise lost from None
            raise

    def is_completed(self) -> bool:
        """Whether the operation has finished."""
        return bool(self._work.is_completed())


class TorchCommunicator(Communicator):
    """Collectives of one torch.distributed process group, numbered and timed.

    ``group`` None is the default (world) group.
    """

    _names = itertools.count()

    def __init__(
        self, group: dist.ProcessGroup | None, ranks: Sequence[int], *, timeout: float, store: dist.Store | None
    ) -> None:
        self.group = group
        self.ranks = tuple(ranks)
        self.world_size = len(self.ranks)
        self.rank = self.ranks.index(dist.get_rank())
        self.timeout = timeout
        self._store = store
        # Same name on every member, different for disjoint groups made by one split.
        name = f"group{next(self._names)}-" + ".".join(map(str, self.ranks))
        self.log = CollectiveLog(name, dist.get_rank(), self.ranks, store)
        self._split_off: list[TorchCommunicator] = []
        self._closed = False

    def process_group(self) -> dist.ProcessGroup:
        """This communicator's torch process group (the default group for the world)."""
        # The world's group is there once this process joined (join), before any communicator is made.
        return self.group if self.group is not None else cast(dist.ProcessGroup, dist.group.WORLD)

    @classmethod
    def join(cls, cluster: Cluster, *, timeout: float) -> TorchCommunicator:
        """Join the processes of ``cluster`` (NCCL and gloo on CUDA, gloo on CPU) and return the world communicator."""
        if cluster.device_type == "cuda":
            torch.cuda.set_device(cluster.device)
        join_process_group(cluster, CUDA_BACKENDS if cluster.device_type == "cuda" else "gloo", timeout=timeout)
        return cls(None, range(cluster.world_size), timeout=timeout, store=default_store())

    # -- collectives ---------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> Work:
        """Reduce ``tensor`` over all members, in place."""
        return self._start("all_reduce", tensor, lambda: dist.all_reduce(tensor, _OPS[op], self.group, True))

    def reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp = ReduceOp.SUM) -> Work:
        """Reduce ``tensor`` into member ``dst``'s (the others' values are left undefined)."""
        if op is ReduceOp.AVG:  # torch.distributed.reduce has no AVG on every backend
            return super().reduce(tensor, dst, op)
        return self._start("reduce", tensor, lambda: dist.reduce(tensor, self.ranks[dst], _OPS[op], self.group, True))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> Work:
        """Reduce ``input`` and give member i its chunk i in ``output``."""
        _check_multiple("reduce_scatter", input, output, self.world_size)
        return self._start("reduce_scatter", input, lambda: _reduce_scatter(output, input, _OPS[op], self.group, True))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        """Concatenate every member's ``input`` into ``output``."""
        _check_multiple("all_gather", output, input, self.world_size)
        return self._start("all_gather", input, lambda: _all_gather(output, input, self.group, True))

    def broadcast(self, tensor: torch.Tensor, src: int) -> Work:
        """Copy member ``src``'s tensor to every member."""
        return self._start("broadcast", tensor, lambda: dist.broadcast(tensor, self.ranks[src], self.group, True))

    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: Sequence[int] | None = None,
        input_splits: Sequence[int] | None = None,
    ) -> Work:
        """Send chunk j of ``input`` to member j; receive member j's chunk into chunk j of ``output``."""
        out_splits = list(output_splits) if output_splits is not None else None
        in_splits = list(input_splits) if input_splits is not None else None
        return self._start(
            "all_to_all",
            input,
            lambda: dist.all_to_all_single(output, input, out_splits, in_splits, self.group, True),
        )

    def send(self, tensor: torch.Tensor, dst: int) -> Work:
        """Send ``tensor`` to member ``dst``."""
        return self._start("send", tensor, lambda: dist.isend(tensor, self.ranks[dst], self.group), self.ranks[dst])

    def recv(self, tensor: torch.Tensor, src: int) -> Work:
        """Receive into ``tensor`` from member ``src``."""
        return self._start("recv", tensor, lambda: dist.irecv(tensor, self.ranks[src], self.group), self.ranks[src])

    def barrier(self) -> Work:
        """Complete once every member has reached the barrier."""
        return self._start("barrier", torch.empty(0), lambda: dist.barrier(self.group, async_op=True))

    def split(self, groups: Sequence[Sequence[int]]) -> TorchCommunicator:
        """This process's communicator among ``groups`` (global ranks).

        torch.distributed makes groups collectively over the whole job: every process
        of the job calls this with the same ``groups``, members or not.
        """
        me = dist.get_rank()
        mine = None
        for ranks in groups:
            global_ranks = sorted(ranks)
            group = dist.new_group(global_ranks, timeout=datetime.timedelta(seconds=self.timeout))
            if me in global_ranks:
                mine = TorchCommunicator(group, global_ranks, timeout=self.timeout, store=self._store)
        if mine is None:
            raise ValueError(f"rank {me} is in none of the groups {[list(g) for g in groups]}")
        self._split_off.append(mine)
        return mine

    def close(self) -> None:
        """Stop the heartbeats of this communicator and of those split off it, and release the process
        groups split off it (their threads and sockets). The default group stays for a later ``epl.init``
        and ends with the process."""
        self.log.close()
        for communicator in self._split_off:
            communicator.close()
        self._split_off.clear()
        if self.group is not None and dist.is_initialized():
            dist.destroy_process_group(self.group)
            self.group = None  # the last reference: the group's threads and sockets end with it
        self._closed = True

    def _start(
        self, op: str, tensor: torch.Tensor, launch: Callable[[], dist.Work | None], peer: int | None = None
    ) -> TorchWork:
        if self._closed:
            raise EplError(
                f"{op} on a communicator of an earlier epl.init, closed when epl.init started over: call "
                "epl.parallelize again after epl.init, and use the new engine."
            )
        record = self.log.start(op, tensor, peer)
        work = launch()
        assert work is not None
        return TorchWork(work, record, self.log, self.timeout)


def _check_multiple(op: str, big: torch.Tensor, small: torch.Tensor, members: int) -> None:
    if big.numel() != small.numel() * members:
        raise ValueError(
            f"{op} over {members} members needs {members} x {small.numel()} = {small.numel() * members} elements "
            f"in the large tensor, got {big.numel()}"
        )
