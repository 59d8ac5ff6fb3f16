"""Ending the whole job when a rank fails under a launcher that would otherwise wait.

Under plain ``mpiexec`` (no ``epl launch``, no torchrun), a rank whose script raises runs
mpi4py's ``MPI_Finalize`` at exit, which waits for the other ranks, and they wait in their
next collective for it: the job sits until ``communication.timeout`` and then some. EPL
therefore ends such a rank at once after printing its traceback: ``MPI_Abort`` when mpi4py
is loaded (the MPI launcher then stops every rank), else an immediate exit with code 1
(which MPICH's and Open MPI's launchers also treat as the end of the job). A rank stuck
without a collective is found by the others' timeout diagnosis, which is uncaught on them
and so ends the job the same way.

Workers started by ``epl launch`` end when the launcher does, even one killed with SIGKILL
(which cannot pass the signal on): a thread watches the launcher's process and ends the worker
within a second of it going away. Their uncaught errors print as Python prints them, without
the ``[rankN]:`` torch.distributed puts before every line: the launcher labels each line with
the rank already, keeps the traceback in the rank's log and shows the error once.
"""

from __future__ import annotations

import os
import sys
import threading
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


#: Seconds between two looks at the launcher.
_WATCH_SECONDS = 1.0
_watching: set[int] = set()


def end_with_launcher(launcher_pid: int, rank: int) -> None:
    """End this process (exit code 1, after a line naming ``rank``) once process ``launcher_pid`` has gone."""
    if launcher_pid in _watching or launcher_pid <= 1:
        return
    direct_child = os.getppid() == launcher_pid

    def gone() -> bool:
        if direct_child and os.getppid() != launcher_pid:  # re-parented: the launcher died
            return True
        try:
            os.kill(launcher_pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # alive, another user's (a reused pid is not ours to judge)
            return False
        return False

    def watch() -> None:
        while not gone():
            time.sleep(_WATCH_SECONDS)
        try:  # the launcher read our output: the pipe may be gone with it
            stream = sys.__stderr__ or sys.stderr
            stream.write(f"[epl] rank {rank}: the launcher (pid {launcher_pid}) is gone; ending this worker.\n")
            stream.flush()
        except (OSError, ValueError):
            pass
        os._exit(1)

    threading.Thread(target=watch, name="epl-launcher-watch", daemon=True).start()
    _watching.add(launcher_pid)


_plain = False


def plain_tracebacks() -> None:
    """From now on, an exception nothing catches prints its traceback as Python does, to the real stderr, past the
    hook torch.distributed installs (which prefixes every line with ``[rankN]:``). For ``epl launch``'s workers;
    a hook the script set itself is kept."""
    global _plain
    if _plain or sys.excepthook is not sys.__excepthook__:
        return

    def hook(kind: type[BaseException], error: BaseException, trace: TracebackType | None) -> None:
        stream = sys.__stderr__ or sys.stderr
        traceback.print_exception(kind, error, trace, file=stream)
        stream.flush()

    sys.excepthook = hook
    _plain = True
