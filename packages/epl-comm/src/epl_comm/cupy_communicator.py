"""The Communicator over CuPy's NCCL bindings (``pip install epl-comm[cupy]``, needs CUDA).

Bootstrapped through the same rendezvous as torch.distributed: rank 0 of each
group creates an NCCL unique id and shares it through the job's key-value store.
Operations run on PyTorch's current CUDA stream; a handle waits on a CUDA event.
EPL's small control collectives (step and batch checks, checkpoint agreement, pipeline descriptions) pass
CPU tensors, which torch.distributed gives to gloo; NCCL reads device memory only, so here they travel
through device copies, copied back when the handle is waited for.
"""

from __future__ import annotations

import datetime
import functools
import itertools
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from epl.plugin_api import Cluster, Communicator, MissingPluginError, ReduceOp, Work
from epl_comm.diagnostics import CollectiveLog, CollectiveRecord, DiagnosedWork
from epl_comm.rendezvous import join_process_group

#: Seconds between two polls of a CUDA event while waiting.
POLL_SECONDS = 0.001

#: Host tensors given to an operation, each with the device copy it fills for them.
_CopiesBack = list[tuple[torch.Tensor, torch.Tensor]]


def load_nccl() -> Any:
    """CuPy's NCCL module, or a clear error saying what is missing."""
    if not torch.cuda.is_available():
        raise MissingPluginError(
            "communication.backend='cupy' needs CUDA, and this machine has no CUDA device. "
            "Use communication.backend='torch' (gloo on CPU)."
        )
    try:
        from cupy.cuda import nccl
    except ImportError as exc:
        raise MissingPluginError(
            f"communication.backend='cupy' needs CuPy with NCCL ({exc}). Install it: pip install 'epl-comm[cupy]'."
        ) from None
    return nccl


class CupyWork(DiagnosedWork):
    """Completion of an NCCL operation, as a CUDA event on its stream."""

    def __init__(
        self,
        event: torch.cuda.Event,
        record: CollectiveRecord,
        log: CollectiveLog,
        timeout: float,
        after: Callable[[], object] | None,
    ) -> None:
        super().__init__(record, log, timeout)
        self._event = event
        self._after = after

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the event; after ``timeout`` seconds raise, naming the ranks that did not arrive."""
        seconds = self.seconds(timeout)
        deadline = time.monotonic() + seconds
        while not self._event.query():
            if time.monotonic() > deadline:
                raise self.timed_out(seconds)
            time.sleep(POLL_SECONDS)
        if self._after is not None:
            self._after()
            self._after = None

    def is_completed(self) -> bool:
        """Whether the event has been reached."""
        return bool(self._event.query())


class CupyCommunicator(Communicator):
    """One NCCL communicator (a CuPy ``NcclCommunicator``) over ``ranks``."""

    _names = itertools.count()
    _joins = itertools.count()

    def __init__(self, ranks: Sequence[int], *, store: dist.Store, timeout: float, key: str) -> None:
        self._nccl = load_nccl()
        self.ranks = tuple(ranks)
        self.world_size = len(self.ranks)
        self.rank = self.ranks.index(dist.get_rank())
        self.timeout = timeout
        self._store = store
        self.device = torch.device("cuda", torch.cuda.current_device())
        if self.rank == 0:
            store.set(key, json.dumps(list(self._nccl.get_unique_id())))
        store.wait([key], datetime.timedelta(seconds=timeout))
        unique_id = tuple(json.loads(store.get(key).decode()))
        self._comm = self._nccl.NcclCommunicator(self.world_size, unique_id, self.rank)
        name = f"nccl{next(self._names)}-" + ".".join(map(str, self.ranks))
        self.log = CollectiveLog(name, dist.get_rank(), self.ranks, store)

    @classmethod
    def join(cls, cluster: Cluster, *, timeout: float) -> CupyCommunicator:
        """Meet the other processes through torch.distributed's rendezvous, then build the NCCL communicator."""
        load_nccl()
        join_process_group(cluster, "gloo", timeout=timeout)  # the control group: rendezvous and store
        torch.cuda.set_device(cluster.device)
        store = dist.distributed_c10d._get_default_store()
        key = f"epl/nccl/world/{next(cls._joins)}"  # a second epl.init must not read the first one's id
        return cls(range(cluster.world_size), store=store, timeout=timeout, key=key)

    # -- collectives ---------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> Work:
        """Reduce ``tensor`` over all members, in place (AVG is a sum divided by the member count)."""
        back: _CopiesBack = []
        tensor = self._on_device(tensor, back)
        after = (lambda: tensor.div_(self.world_size)) if op is ReduceOp.AVG else None
        return self._run(
            "all_reduce",
            tensor,
            lambda s: self._comm.allReduce(
                tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), self._dtype(tensor), self._op(op), s
            ),
            after,
            back=back,
        )

    def reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp = ReduceOp.SUM) -> Work:
        """Reduce ``tensor`` into member ``dst``'s (AVG: a sum divided by the member count there)."""
        back: _CopiesBack = []
        tensor = self._on_device(tensor, back)
        after = (lambda: tensor.div_(self.world_size)) if op is ReduceOp.AVG and self.rank == dst else None
        return self._run(
            "reduce",
            tensor,
            lambda s: self._comm.reduce(
                tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), self._dtype(tensor), self._op(op), dst, s
            ),
            after,
            back=back,
        )

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> Work:
        """Reduce ``input`` and give member i chunk i in ``output``."""
        back: _CopiesBack = []
        input, output = self._on_device(input, back, write=False), self._on_device(output, back, read=False)
        after = (lambda: output.div_(self.world_size)) if op is ReduceOp.AVG else None
        return self._run(
            "reduce_scatter",
            input,
            lambda s: self._comm.reduceScatter(
                input.data_ptr(), output.data_ptr(), output.numel(), self._dtype(input), self._op(op), s
            ),
            after,
            back=back,
        )

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        """Concatenate every member's ``input`` into ``output``."""
        back: _CopiesBack = []
        input, output = self._on_device(input, back, write=False), self._on_device(output, back, read=False)
        return self._run(
            "all_gather",
            input,
            lambda s: self._comm.allGather(input.data_ptr(), output.data_ptr(), input.numel(), self._dtype(input), s),
            back=back,
        )

    def broadcast(self, tensor: torch.Tensor, src: int) -> Work:
        """Copy member ``src``'s tensor to every member."""
        back: _CopiesBack = []
        tensor = self._on_device(tensor, back)
        return self._run(
            "broadcast",
            tensor,
            lambda s: self._comm.broadcast(
                tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), self._dtype(tensor), src, s
            ),
            back=back,
        )

    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: Sequence[int] | None = None,
        input_splits: Sequence[int] | None = None,
    ) -> Work:
        """Grouped NCCL send/recv: chunk j of ``input`` to member j, member j's chunk into ``output``."""
        back: _CopiesBack = []
        input, output = self._on_device(input, back, write=False), self._on_device(output, back, read=False)
        ins = list(input_splits) if input_splits is not None else [input.numel() // self.world_size] * self.world_size
        outs = (
            list(output_splits) if output_splits is not None else [output.numel() // self.world_size] * self.world_size
        )

        def launch(stream: int) -> None:
            dtype = self._dtype(input)
            size = input.element_size()
            self._nccl.groupStart()
            for peer, (in_offset, out_offset) in enumerate(zip(_offsets(ins), _offsets(outs), strict=True)):
                self._comm.send(input.data_ptr() + in_offset * size, ins[peer], dtype, peer, stream)
                self._comm.recv(output.data_ptr() + out_offset * size, outs[peer], dtype, peer, stream)
            self._nccl.groupEnd()

        return self._run("all_to_all", input, launch, back=back)

    def send(self, tensor: torch.Tensor, dst: int) -> Work:
        """Send ``tensor`` to member ``dst``."""
        tensor = self._on_device(tensor, [], write=False)  # a device copy lives on in the stream's order
        return self._run(
            "send",
            tensor,
            lambda s: self._comm.send(tensor.data_ptr(), tensor.numel(), self._dtype(tensor), dst, s),
            peer=self.ranks[dst],
        )

    def recv(self, tensor: torch.Tensor, src: int) -> Work:
        """Receive into ``tensor`` from member ``src``."""
        back: _CopiesBack = []
        tensor = self._on_device(tensor, back, read=False)
        return self._run(
            "recv",
            tensor,
            lambda s: self._comm.recv(tensor.data_ptr(), tensor.numel(), self._dtype(tensor), src, s),
            peer=self.ranks[src],
            back=back,
        )

    def barrier(self) -> Work:
        """An all-reduce of one element: complete once every member has reached it."""
        flag = torch.zeros(1, device=torch.cuda.current_device())
        return self._run(
            "barrier",
            flag,
            lambda s: self._comm.allReduce(
                flag.data_ptr(), flag.data_ptr(), 1, self._nccl.NCCL_FLOAT32, self._nccl.NCCL_SUM, s
            ),
        )

    def split(self, groups: Sequence[Sequence[int]]) -> CupyCommunicator:
        """This process's communicator among ``groups`` (global ranks); every process calls it alike."""
        call = next(self._names)
        me = dist.get_rank()
        for index, ranks in enumerate(groups):
            if me in ranks:
                return CupyCommunicator(
                    sorted(ranks), store=self._store, timeout=self.timeout, key=f"epl/nccl/split{call}/{index}"
                )
        raise ValueError(f"rank {me} is in none of the groups {[list(g) for g in groups]}")

    def close(self) -> None:
        """Destroy the NCCL communicator and stop the heartbeat."""
        self.log.close()
        self._comm.destroy()

    # -- helpers ---------------------------------------------------------------------------
    def _run(
        self,
        op: str,
        tensor: torch.Tensor,
        launch: Callable[[int], None],
        after: Callable[[], object] | None = None,
        peer: int | None = None,
        back: _CopiesBack | None = None,
    ) -> CupyWork:
        if back:
            after = functools.partial(_then_copy_back, after, list(back))
        record = self.log.start(op, tensor, peer)
        stream = torch.cuda.current_stream()
        launch(stream.cuda_stream)
        event = torch.cuda.Event()
        event.record(stream)
        return CupyWork(event, record, self.log, self.timeout, after)

    def _on_device(
        self, tensor: torch.Tensor, back: _CopiesBack, *, read: bool = True, write: bool = True
    ) -> torch.Tensor:
        """``tensor`` itself when on CUDA; else a device copy (of its values: ``read``), listed in ``back`` to be
        copied into ``tensor`` once the operation is waited for (``write``)."""
        if tensor.is_cuda:
            return tensor
        staged = tensor.to(self.device) if read else torch.empty_like(tensor, device=self.device)
        if write:
            back.append((tensor, staged))
        return staged

    def _dtype(self, tensor: torch.Tensor) -> int:
        names = {
            torch.float32: "NCCL_FLOAT32",
            torch.float64: "NCCL_FLOAT64",
            torch.float16: "NCCL_FLOAT16",
            torch.bfloat16: "NCCL_BFLOAT16",
            torch.int64: "NCCL_INT64",
            torch.int32: "NCCL_INT32",
            torch.int8: "NCCL_INT8",
            torch.uint8: "NCCL_UINT8",
            torch.bool: "NCCL_UINT8",
        }
        name = names.get(tensor.dtype)
        if name is None or not hasattr(self._nccl, name):
            raise TypeError(f"CuPy's NCCL cannot communicate {tensor.dtype}")
        return int(getattr(self._nccl, name))

    def _op(self, op: ReduceOp) -> int:
        names = {
            ReduceOp.SUM: "NCCL_SUM",
            ReduceOp.AVG: "NCCL_SUM",
            ReduceOp.MAX: "NCCL_MAX",
            ReduceOp.MIN: "NCCL_MIN",
            ReduceOp.PRODUCT: "NCCL_PROD",
        }
        return int(getattr(self._nccl, names[op]))


def _then_copy_back(after: Callable[[], object] | None, back: _CopiesBack) -> None:
    if after is not None:
        after()
    for host, staged in back:
        host.copy_(staged)


def _offsets(sizes: list[int]) -> list[int]:
    return list(itertools.accumulate([0, *sizes[:-1]]))
