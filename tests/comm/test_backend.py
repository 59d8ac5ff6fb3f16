"""Choosing the communication backend: what cannot work here is a clear error, never a silent fallback."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

import epl
from epl.builtin.local_communicator import LocalCommunicator


def test_auto_and_torch_in_one_process_use_the_local_communicator() -> None:
    for backend in ("auto", "torch"):
        env = epl.init(epl.Config({"communication.backend": backend}))
        assert isinstance(env.communicator, LocalCommunicator)


@pytest.mark.skipif(
    torch.cuda.is_available() and importlib.util.find_spec("cupy") is not None, reason="CuPy works here"
)
def test_cupy_where_it_cannot_work_is_a_clear_error() -> None:
    with pytest.raises(epl.MissingPluginError, match="communication.backend='cupy' needs (CUDA|CuPy)"):
        epl.init(epl.Config({"communication.backend": "cupy"}))


def test_one_process_with_comm_installed_is_still_the_plain_local_run() -> None:
    epl.init()
    engine = epl.parallelize(nn.Linear(2, 2), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=nn.MSELoss())
    assert engine.context.gradient_reducer is None and type(engine.runner).__name__ == "LocalStepRunner"


def test_several_processes_need_a_rendezvous_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(epl.ClusterError, match="need MASTER_ADDR and MASTER_PORT"):
        epl.init()
