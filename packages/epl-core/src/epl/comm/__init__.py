"""The Communicator protocol and the single-process communicator."""

from epl.comm.local import LocalCommunicator
from epl.comm.protocol import Communicator, CompletedWork, ReduceOp, Work

__all__ = ["Communicator", "CompletedWork", "LocalCommunicator", "ReduceOp", "Work"]
