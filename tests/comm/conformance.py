"""The checks every Communicator must pass, run on every rank of a real job.

Each check takes the world communicator and raises on failure. ``run_checks`` runs
them all on one rank and reports, per check, None or the traceback, so that one
job (one process spawn) covers the whole suite.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable

import torch

from epl.interfaces.communicator import Communicator, ReduceOp

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.int64)
#: Uneven sizes, including one element and sizes not divisible by the member count.
SIZES = (1, 7, 1000)
TIMEOUT = 60.0

Check = Callable[[Communicator, torch.device], None]


def _value(
    comm: Communicator, size: int, dtype: torch.dtype, device: torch.device, rank: int | None = None
) -> torch.Tensor:
    member = comm.rank if rank is None else rank
    return (torch.arange(size, device=device) % 5 + member + 1).to(dtype)


def all_reduce(comm: Communicator, device: torch.device) -> None:
    members = range(comm.world_size)
    for dtype in DTYPES:
        for size in SIZES:
            expected = {
                ReduceOp.SUM: sum(_value(comm, size, dtype, device, r) for r in members),
                ReduceOp.MAX: _value(comm, size, dtype, device, comm.world_size - 1),
                ReduceOp.MIN: _value(comm, size, dtype, device, 0),
            }
            if dtype.is_floating_point:
                expected[ReduceOp.AVG] = expected[ReduceOp.SUM] / comm.world_size
            for op, want in expected.items():
                tensor = _value(comm, size, dtype, device)
                work = comm.all_reduce(tensor, op)
                work.wait(TIMEOUT)
                assert work.is_completed()
                torch.testing.assert_close(tensor, want.to(dtype), msg=f"all_reduce {op} {dtype} {size}")


def reduce_scatter(comm: Communicator, device: torch.device) -> None:
    for dtype in DTYPES:
        chunk = 3
        source = torch.cat([_value(comm, chunk, dtype, device) * (i + 1) for i in range(comm.world_size)])
        out = torch.empty(chunk, dtype=dtype, device=device)
        comm.reduce_scatter(out, source).wait(TIMEOUT)
        total = sum(_value(comm, chunk, dtype, device, r) for r in range(comm.world_size)) * (comm.rank + 1)
        torch.testing.assert_close(out, total.to(dtype))


def all_gather(comm: Communicator, device: torch.device) -> None:
    for dtype in DTYPES:
        for size in SIZES:
            out = torch.empty(size * comm.world_size, dtype=dtype, device=device)
            comm.all_gather(out, _value(comm, size, dtype, device)).wait(TIMEOUT)
            want = torch.cat([_value(comm, size, dtype, device, r) for r in range(comm.world_size)])
            torch.testing.assert_close(out, want)


def broadcast(comm: Communicator, device: torch.device) -> None:
    for src in range(comm.world_size):
        for dtype in DTYPES:
            tensor = _value(comm, 7, dtype, device)
            comm.broadcast(tensor, src).wait(TIMEOUT)
            torch.testing.assert_close(tensor, _value(comm, 7, dtype, device, src))


def all_to_all_even(comm: Communicator, device: torch.device) -> None:
    n = comm.world_size
    source = torch.arange(n * 2, device=device, dtype=torch.float32) + 100 * comm.rank
    out = torch.empty_like(source)
    comm.all_to_all(out, source).wait(TIMEOUT)
    want = torch.cat([torch.arange(comm.rank * 2, comm.rank * 2 + 2, device=device) + 100.0 * r for r in range(n)])
    torch.testing.assert_close(out, want)


def all_to_all_uneven(comm: Communicator, device: torch.device) -> None:
    n = comm.world_size
    # member r sends (r + j + 1) elements to member j, each equal to 10 * r + j
    sends = [comm.rank + j + 1 for j in range(n)]
    receives = [r + comm.rank + 1 for r in range(n)]
    source = torch.cat([torch.full((count,), 10.0 * comm.rank + j, device=device) for j, count in enumerate(sends)])
    out = torch.empty(sum(receives), device=device)
    comm.all_to_all(out, source, receives, sends).wait(TIMEOUT)
    want = torch.cat([torch.full((count,), 10.0 * r + comm.rank, device=device) for r, count in enumerate(receives)])
    torch.testing.assert_close(out, want)


def send_recv_ring(comm: Communicator, device: torch.device) -> None:
    n = comm.world_size
    if n == 1:
        return
    for dtype in DTYPES:
        right, left = (comm.rank + 1) % n, (comm.rank - 1) % n
        outgoing = _value(comm, 5, dtype, device)
        incoming = torch.empty_like(outgoing)
        if comm.rank % 2 == 0:
            comm.send(outgoing, right).wait(TIMEOUT)
            comm.recv(incoming, left).wait(TIMEOUT)
        else:
            comm.recv(incoming, left).wait(TIMEOUT)
            comm.send(outgoing, right).wait(TIMEOUT)
        torch.testing.assert_close(incoming, _value(comm, 5, dtype, device, left))


def barrier(comm: Communicator, device: torch.device) -> None:
    for _ in range(3):
        comm.barrier().wait(TIMEOUT)


def split_groups(comm: Communicator, device: torch.device) -> None:
    n = comm.world_size
    evens, odds = list(range(0, n, 2)), list(range(1, n, 2))
    groups = [g for g in (evens, odds) if g]
    mine = comm.split(groups)
    my_group = evens if comm.rank % 2 == 0 else odds
    assert mine.ranks == tuple(my_group) and mine.world_size == len(my_group)
    assert mine.rank == my_group.index(comm.rank)
    tensor = torch.tensor([float(comm.rank)], device=device)
    mine.all_reduce(tensor).wait(TIMEOUT)
    assert tensor.item() == float(sum(my_group))
    # two splits with the same groups are independent communicators over the same ranks
    again = comm.split(groups)
    first, second = torch.ones(1, device=device), torch.full((1,), 2.0, device=device)
    works = [mine.all_reduce(first), again.all_reduce(second)]
    for work in works:
        work.wait(TIMEOUT)
    assert first.item() == len(my_group) and second.item() == 2.0 * len(my_group)


CHECKS: dict[str, Check] = {
    check.__name__: check
    for check in (
        all_reduce,
        reduce_scatter,
        all_gather,
        broadcast,
        all_to_all_even,
        all_to_all_uneven,
        send_recv_ring,
        barrier,
        split_groups,
    )
}


def run_checks(backend: str) -> dict[str, str | None]:
    """On one rank: initialise EPL with ``backend`` and run every check; None means passed."""
    import epl

    env = epl.init(epl.Config({"communication.backend": backend, "communication.timeout": TIMEOUT}))
    comm = env.communicator
    assert comm is not None
    results: dict[str, str | None] = {}
    for name, check in CHECKS.items():
        try:
            check(comm, env.cluster.device)
            results[name] = None
        except Exception:  # noqa: BLE001 - reported per check
            results[name] = traceback.format_exc()
    return results
