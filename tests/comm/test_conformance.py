"""Every communicator passes the same conformance suite (tests/comm/conformance.py)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.comm.conformance import CHECKS, run_checks
from tests.helpers.distributed import run_ranks

pytestmark = pytest.mark.multiprocess

_results: dict[tuple[str, int], list[dict[str, str | None]]] = {}


def results(backend: str, world_size: int) -> list[dict[str, str | None]]:
    """Run the whole suite once per backend and world size; tests read their check's outcome."""
    if (backend, world_size) not in _results:
        _results[backend, world_size] = run_ranks(run_checks, world_size, backend, timeout=300)
    return _results[backend, world_size]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_torch_communicator(check: str, world_size: int) -> None:
    for rank, outcome in enumerate(results("torch", world_size)):
        assert outcome[check] is None, f"rank {rank}:\n{outcome[check]}"


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("cupy") is None or _gpus() == 0, reason="needs CuPy and a CUDA GPU")
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_cupy_communicator(check: str) -> None:
    world_size = min(_gpus(), 2)
    for rank, outcome in enumerate(results("cupy", world_size)):
        assert outcome[check] is None, f"rank {rank}:\n{outcome[check]}"
