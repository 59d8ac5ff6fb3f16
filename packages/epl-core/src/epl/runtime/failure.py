"""Ending the whole job when a rank fails under a launcher that would otherwise wait.

Under plain ``mpiexec`` (no ``epl launch``, no torchrun), a rank whose script raises runs
mpi4py's ``MPI_Finalize`` at exit, which waits for the other ranks, and they wait in their
next collective for it: the job sits until ``communication.timeout`` and then some. EPL
therefore ends such a rank at once after printing its traceback: ``MPI_Abort`` when mpi4py
is loaded (the MPI launcher then stops every rank), else an immediate exit with code 1
(which MPICH's and Open MPI's launchers also treat as the end of the job). A rank stuck
without a collective is found by the others' timeout diagnosis, which is uncaught on them
and so ends the job the same way.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from types import TracebackType

_installed = False
#: Seconds between printing the traceback and ending the job: MPI launchers drop output not yet forwarded.
_DRAIN_SECONDS = 0.5


def end_job_on_uncaught_exception(rank: int) -> None:
    """From now on, an exception nothing catches prints its traceback naming ``rank`` and ends the MPI job."""
    global _installed
    if _installed:
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, trace: TracebackType | None) -> None:
        if issubclass(kind, KeyboardInterrupt):
            previous(kind, error, trace)
            return
        text = "".join(traceback.format_exception(kind, error, trace))
        # The real stderr: torch.distributed's own hook calls this one with sys.stderr captured.
        stream = sys.__stderr__ or sys.stderr
        stream.write(f"[epl] rank {rank} failed; ending the MPI job.\n{text}")
        stream.flush()
        sys.stdout.flush()
        time.sleep(_DRAIN_SECONDS)  # the launcher forwards the output before it stops the job
        mpi = sys.modules.get("mpi4py.MPI")
        if mpi is not None:
            mpi.COMM_WORLD.Abort(1)
        os._exit(1)

    sys.excepthook = hook
    _installed = True
