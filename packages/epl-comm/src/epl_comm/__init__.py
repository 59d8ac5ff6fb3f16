"""epl-comm: communicators for EPL (torch.distributed, CuPy NCCL) and data parallelism.

Names are imported on first use: loading the plugin must not import PyTorch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from epl_comm.data_parallel import DataParallelReducer, ReducePolicy
    from epl_comm.diagnostics import CollectiveTimeoutError
    from epl_comm.torch_communicator import TorchCommunicator

_EXPORTS = {
    "CollectiveTimeoutError": "epl_comm.diagnostics",
    "DataParallelReducer": "epl_comm.data_parallel",
    "ReducePolicy": "epl_comm.data_parallel",
    "TorchCommunicator": "epl_comm.torch_communicator",
}
__all__ = [
    "CollectiveTimeoutError",
    "DataParallelReducer",
    "ReducePolicy",
    "TorchCommunicator",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'epl_comm' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
