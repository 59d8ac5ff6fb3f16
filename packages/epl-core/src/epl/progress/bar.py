"""``Progress``: step, loss, learning rate, gradient norm, samples/s, tokens/s and ETA, from rank 0.

On a terminal it is a tqdm bar updated in place; otherwise (a log file, a pipe, CI) a plain
line every ``log_every`` steps. Under ``epl launch`` the ranks write into pipes: the launcher
says through ``EPL_LAUNCH_TERMINAL`` when its own output is a terminal, and then passes rank 0's
in-place updates on to it (see epl_launch.output).

The loss is read (``float(loss)``, which waits for the device) only on the steps that are shown
or logged, so a bar costs no synchronisation on the other steps; throughput is measured between
two such reads, when the device has finished the work counted.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

from epl.progress.tensorboard import ScalarWriter, check_installed

if TYPE_CHECKING:
    import torch

    from epl.runtime.engine import Engine

#: Set to 1 by ``epl launch`` for its ranks when the launcher's own output is a terminal.
LAUNCH_TERMINAL_VARIABLE = "EPL_LAUNCH_TERMINAL"
#: Plain lines over a run of known length when ``log_every`` is not given.
LINES_PER_RUN = 20
#: Steps between plain lines when neither ``log_every`` nor ``total`` is given.
DEFAULT_LOG_EVERY = 10


class Progress:
    """Shows a training run's progress on the job's rank 0; on every other rank each call returns at once.

    Call :meth:`update` after each ``engine.step`` with the loss it returned; :meth:`log` adds
    metrics of the current step (a validation loss); :meth:`close` ends the bar (or use ``with``).
    Shown per update: the loss, the learning rate (:attr:`Engine.lr`), the gradient norm
    (:attr:`Engine.grad_norm`, with ``optimizer.max_grad_norm``), the steps skipped for a NaN or Inf
    loss or gradient once there are any (:attr:`Engine.skipped_steps`), samples/s and tokens/s over
    every replica (:attr:`Engine.last_step_samples`, :attr:`Engine.last_step_tokens`) and the ETA
    when ``total`` is known.

    ``total``: the step number the run ends at (counted like ``engine.global_step``, so a
    resumed run's bar starts where the checkpoint left off). ``log_every``: steps between plain
    lines and TensorBoard points (default: ``total / 20``, or 10). ``tensorboard``: a log folder
    for TensorBoard scalars (needs the ``tensorboard`` package). ``file``: where to write
    (default: standard error for the bar, standard output for plain lines). ``refresh_seconds``:
    the most often the bar is redrawn.
    """

    def __init__(
        self,
        engine: Engine,
        total: int | None = None,
        *,
        description: str = "train",
        log_every: int | None = None,
        tensorboard: str | os.PathLike[str] | None = None,
        file: IO[str] | None = None,
        refresh_seconds: float = 0.5,
    ) -> None:
        if tensorboard is not None:
            check_installed()
        if log_every is not None and log_every < 1:
            raise ValueError(f"log_every must be at least 1, got {log_every}.")
        self.engine = engine
        self.total = total
        self.shown = engine.context.cluster.rank == 0
        self.log_every = log_every or (max(1, total // LINES_PER_RUN) if total else DEFAULT_LOG_EVERY)
        self.refresh_seconds = refresh_seconds
        self._first_step = engine.global_step
        self._started = self._window_started = self._last_shown = time.perf_counter()
        self._window = Counts()  # the steps since the last values: their samples and tokens
        self._first, self._rest = Counts(), Counts()  # the first window (it warms up), and every later one
        #: The loss of the last step shown or logged (None before).
        self.loss: float | None = None
        self._bar: Any = None
        self._writer: ScalarWriter | None = None
        self._file = file
        self.terminal = False
        if not self.shown:
            return
        self.terminal = on_terminal(file or sys.stderr)
        if self.terminal:
            self._bar = _tqdm_bar(description, total, self._first_step, file or sys.stderr, refresh_seconds)
        if tensorboard is not None:
            self._writer = ScalarWriter(tensorboard)

    def update(self, loss: torch.Tensor | float | None = None, **metrics: float) -> None:
        """Count the step ``engine.step`` just ran, which returned ``loss``; ``metrics`` are shown and logged too."""
        if not self.shown:
            return
        step = self.engine.global_step
        self._window.add(0.0, self.engine.last_step_samples, self.engine.last_step_tokens)
        now = time.perf_counter()
        last = self.total is not None and step >= self.total
        due_log = (step - self._first_step) % self.log_every == 0 or last
        due_show = (now - self._last_shown >= self.refresh_seconds or last) if self.terminal else due_log
        if not (due_show or due_log):
            if self._bar is not None:
                self._bar.update(step - self._bar.n)
            return
        values = self._values(loss, metrics)
        if self._bar is not None:
            self._bar.set_postfix_str(format_metrics(values), refresh=False)
            self._bar.update(step - self._bar.n)
            self._last_shown = now
        else:
            self._print(self._line(step, values, now))
        if self._writer is not None and due_log:
            self._writer.write(step, values)

    def log(self, **metrics: float) -> None:
        """Show ``metrics`` (e.g. ``val_loss=...``) at the current step on a line of their own, and log them."""
        if not self.shown:
            return
        step = self.engine.global_step
        values = {name: float(value) for name, value in metrics.items()}
        self._print(f"step {step}  {format_metrics(values)}")
        if self._writer is not None:
            self._writer.write(step, values)

    def close(self) -> None:
        """End the bar (its last state stays on screen) and close the TensorBoard file."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    @property
    def samples_per_second(self) -> float | None:
        """Samples per second over every replica across the run so far, leaving out the first stretch shown
        (its first step warms up) when there are more; None where the batches' samples are unknown."""
        run = self._rest if self._rest.parts else self._first
        return run.rate(run.samples)

    @property
    def tokens_per_second(self) -> float | None:
        """Tokens per second, counted as :attr:`samples_per_second` (None without token ids in the batches)."""
        run = self._rest if self._rest.parts else self._first
        return run.rate(run.tokens)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what is shown ---------------------------------------------------------------
    def _values(self, loss: Any, metrics: Mapping[str, float]) -> dict[str, float]:
        """The metrics of this step, throughput over the window since the last values (then a new window)."""
        values: dict[str, float] = {}
        if loss is not None:
            values["loss"] = self.loss = float(loss)  # waits for the device: the window's work is done after this
        now = time.perf_counter()
        if self.engine.lr is not None:
            values["lr"] = self.engine.lr
        if self.engine.grad_norm is not None:
            values["grad_norm"] = self.engine.grad_norm
        skipped = getattr(self.engine, "skipped_steps", 0)
        if skipped:
            values["skipped"] = skipped
        seconds = max(now - self._window_started, 1e-9)
        samples, tokens = self._window.samples or None, self._window.tokens or None
        (self._rest if self._first.parts else self._first).add(seconds, samples, tokens)
        if samples is not None:
            values["samples/s"] = samples / seconds
        if tokens is not None:
            values["tokens/s"] = tokens / seconds
        values.update({name: float(value) for name, value in metrics.items()})
        self._window_started, self._window = now, Counts()
        return values

    def _line(self, step: int, values: Mapping[str, float], now: float) -> str:
        """``step 40/200 (20%)  loss 2.3141  lr 3.00e-04  samples/s 812.4  elapsed 0:05  eta 0:20``."""
        elapsed = now - self._started
        where = f"step {step}"
        timing = f"elapsed {_interval(elapsed)}"
        if self.total:
            where += f"/{self.total} ({100 * step // self.total}%)"
            done = step - self._first_step
            if done > 0:
                timing += f"  eta {_interval(elapsed / done * max(self.total - step, 0))}"
        return f"{where}  {format_metrics(values)}  {timing}"

    def _print(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text, file=self._file or sys.stderr)
        else:  # one write with its newline: other processes writing to the same pipe cannot split the line
            stream = self._file or sys.stdout
            stream.write(text + "\n")
            stream.flush()


@dataclass
class Counts:
    """Seconds, samples and tokens added up over steps or windows; a count is None once one part's was unknown."""

    seconds: float = 0.0
    samples: int | None = 0
    tokens: int | None = 0
    parts: int = 0

    def add(self, seconds: float, samples: int | None, tokens: int | None) -> None:
        """Add one part (a step, or a window of steps)."""
        self.seconds += seconds
        self.samples = None if self.samples is None or samples is None else self.samples + samples
        self.tokens = None if self.tokens is None or tokens is None else self.tokens + tokens
        self.parts += 1

    def rate(self, count: int | None) -> float | None:
        """``count`` per second over these parts (None when unknown or zero)."""
        return count / self.seconds if count and self.seconds > 0 else None


def on_terminal(stream: IO[str]) -> bool:
    """Whether ``stream`` ends on a terminal: it is one, or ``epl launch`` passes this rank's output to one."""
    if os.environ.get(LAUNCH_TERMINAL_VARIABLE) == "1" and stream in (sys.stdout, sys.stderr):
        return True
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def format_metrics(values: Mapping[str, float]) -> str:
    """``loss 2.3141  lr 3.00e-04  skipped 1  samples/s 812.4``: 4 decimals for losses, 3 significant digits for
    rates, counts whole."""
    parts = []
    for name, value in values.items():
        if name == "lr":
            text = f"{value:.2e}"
        elif name == "skipped":
            text = f"{int(value)}"
        elif name.endswith("/s"):
            text = f"{value:.1f}" if value < 1e4 else f"{value / 1e3:.1f}k"
        else:
            text = f"{value:.4f}" if abs(value) < 1e4 else f"{value:.4g}"
        parts.append(f"{name} {text}")
    return "  ".join(parts)


def _interval(seconds: float) -> str:
    """``1:02:03`` or ``02:03``, as tqdm writes times."""
    from tqdm import tqdm

    return str(tqdm.format_interval(seconds))


def _tqdm_bar(description: str, total: int | None, initial: int, file: IO[str], refresh_seconds: float) -> Any:
    """A tqdm bar counting steps; under ``epl launch`` as wide as the launcher's terminal leaves for it."""
    from tqdm import tqdm

    columns = os.environ.get("COLUMNS")
    return tqdm(
        total=total,
        initial=initial,
        desc=description,
        unit="step",
        file=file,
        mininterval=refresh_seconds,
        ncols=int(columns) if columns and columns.isdigit() else None,
        dynamic_ncols=not columns,
        leave=True,
    )
