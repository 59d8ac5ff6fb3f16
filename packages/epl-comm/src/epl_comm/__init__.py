"""epl-comm: communicators for EPL (torch.distributed, CuPy NCCL) and data parallelism."""

from epl_comm.data_parallel import DataParallelReducer, ReducePolicy
from epl_comm.diagnostics import CollectiveTimeoutError
from epl_comm.torch_communicator import TorchCommunicator

__all__ = ["CollectiveTimeoutError", "DataParallelReducer", "ReducePolicy", "TorchCommunicator"]
