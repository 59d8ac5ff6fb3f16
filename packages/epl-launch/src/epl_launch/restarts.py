"""``--max-restarts N``: start the whole job again after a rank fails, at most N times (as torchrun does).

Every rank is stopped and started again, with ``EPL_RESTART_COUNT`` (and torchrun's
``TORCHELASTIC_RESTART_COUNT``) one higher: the script resumes from its last checkpoint
(``engine.load``). A job ended by a signal (Ctrl-C, TERM, HUP) is not restarted. On one
machine each start gets a fresh rendezvous port; with ``--master-port`` it is reused.
With several machines, every launcher restarts its own ranks: a failure on one machine
makes the ranks of the others fail too, so give every launcher the same ``--max-restarts``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from epl.plugin_api import free_port
from epl_launch.config import LaunchConfig
from epl_launch.local import Outcome

#: One start of the job: (the restart number, the rendezvous port) -> how it ended.
Start = Callable[[int, int], Outcome]


def run_with_restarts(config: LaunchConfig, first_port: int, start: Start) -> Outcome:
    """Run ``start`` until it succeeds, a signal ends it, or ``config.max_restarts`` restarts are spent."""
    restart, port = 0, first_port
    while True:
        try:
            outcome = start(restart, port)
        except KeyboardInterrupt:  # between two starts, with the default handler back
            return Outcome(130, "epl launch: SIGINT received; stopped every rank.", interrupted=True)
        if outcome.exit_code == 0 or outcome.interrupted or config.max_restarts == 0:
            return outcome
        if restart == config.max_restarts:
            gave_up = f"Gave up after {restart} restart(s) (--max-restarts {config.max_restarts})."
            return Outcome(outcome.exit_code, f"{outcome.message} {gave_up}")
        restart += 1
        print(
            f"{outcome.message} Restarting every rank: restart {restart} of {config.max_restarts}.",
            file=sys.stderr,
            flush=True,
        )
        if config.master_port is None:
            port = free_port(config.master_addr)
