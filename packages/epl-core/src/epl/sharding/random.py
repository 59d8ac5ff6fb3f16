"""Random numbers inside column/row regions: each device its own, as Megatron-LM's RNG tracker.

Between a column-parallel layer and its row-parallel partner the activations are
sharded: a dropout there must draw a different mask on each device (each holds
different heads or features), and outside the regions the activations are
replicated: a dropout there must draw the same mask on every device of the group.
Each shard group keeps a second random state, seeded with ``seed + 2718 + device
index``; the first column layer of a region switches the device's generator to it
and the row layer switches back, so the default generator (seeded alike on every
device) only draws for replicated activations.
"""

from __future__ import annotations

import torch

#: Added to the seed for the regions' random state, as Megatron-LM does.
REGION_SEED_OFFSET = 2718


class RegionRandom:
    """The random state a device uses inside column/row regions, swapped with the default one at their ends."""

    def __init__(self, seed: int, index: int, device: torch.device) -> None:
        self.device = device
        self._saved: torch.Tensor | None = None
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed + REGION_SEED_OFFSET + index)
            self.state = self._get()

    def _get(self) -> torch.Tensor:
        return torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    @property
    def inside(self) -> bool:
        """Whether the region's state is in use now."""
        return self._saved is not None

    def enter(self) -> None:
        """Use the region's state (a column layer's output is sharded from here on). Inside a compiled block,
        nothing: the block's graph is refused if it draws random numbers (``epl.compiling``), so no draw needs it."""
        if not torch.compiler.is_compiling():
            self._enter()

    @torch.compiler.disable  # swaps the generator's state: run as it is under torch.compile
    def _enter(self) -> None:
        if self._saved is None:
            self._saved = self._get()
            self._set(self.state)

    def leave(self) -> None:
        """Back to the default state (a row layer sums the region up); inside a compiled block, nothing."""
        if not torch.compiler.is_compiling():
            self._leave()

    @torch.compiler.disable
    def _leave(self) -> None:
        if self._saved is not None:
            self.state = self._get()
            self._set(self._saved)
            self._saved = None
