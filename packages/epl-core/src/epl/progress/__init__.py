"""Training progress from one rank: a bar on a terminal, plain lines in logs, optional TensorBoard scalars.

    progress = epl.Progress(engine, total=1000, tensorboard="runs/exp1")
    for batch in loader:
        loss = engine.step(batch)
        progress.update(loss)
    progress.close()

Only the job's rank 0 shows anything (the other ranks' calls return at once). See
:class:`epl.progress.bar.Progress`.
"""

from __future__ import annotations

from epl.progress.bar import Progress

__all__ = ["Progress"]
