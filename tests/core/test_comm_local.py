"""The single-process communicator honours the Communicator protocol for one member."""

from __future__ import annotations

import pytest
import torch

from epl.builtin.local_communicator import LocalCommunicator
from epl.interfaces.communicator import ReduceOp


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64])
def test_collectives_over_one_member(dtype: torch.dtype) -> None:
    comm = LocalCommunicator()
    tensor = torch.arange(6).to(dtype)
    for op in ReduceOp:
        work = comm.all_reduce(tensor, op)
        work.wait(timeout=1.0)
        assert work.is_completed() and torch.equal(tensor, torch.arange(6).to(dtype))
    out = torch.empty(6, dtype=dtype)
    comm.all_gather(out, tensor).wait()
    assert torch.equal(out, tensor)
    out.zero_()
    comm.reduce_scatter(out, tensor).wait()
    assert torch.equal(out, tensor)
    out.zero_()
    comm.all_to_all(out, tensor, [6], [6]).wait()
    assert torch.equal(out, tensor)
    comm.broadcast(tensor, src=0).wait()
    comm.barrier().wait()
    assert comm.split([[0]]).ranks == (0,) and (comm.rank, comm.world_size, comm.ranks) == (0, 1, (0,))


def test_errors_name_the_problem() -> None:
    comm = LocalCommunicator()
    with pytest.raises(ValueError, match="output and input of equal size, got 3 and 6"):
        comm.all_gather(torch.empty(3), torch.empty(6))
    with pytest.raises(ValueError, match="rank 1 is not a member"):
        comm.broadcast(torch.empty(1), src=1)
    with pytest.raises(RuntimeError, match="no peer"):
        comm.send(torch.empty(1), dst=1)
    with pytest.raises(RuntimeError, match="no peer"):
        comm.recv(torch.empty(1), src=1)
    with pytest.raises(ValueError, match="needs splits \\[6\\]"):
        comm.all_to_all(torch.empty(6), torch.empty(6), [3, 3])
    with pytest.raises(ValueError, match="split \\[\\[1\\]\\]"):
        comm.split([[1]])
