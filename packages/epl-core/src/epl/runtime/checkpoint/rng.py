"""Every rank's random number generator states in a checkpoint: ``rng/<rank>/<generator>``.

torch's and each CUDA device's as their state tensors, Python's as JSON (nothing is pickled).
"""

from __future__ import annotations

import random

import torch

from epl.runtime.checkpoint import files, keys


def rng_state() -> dict[str, torch.Tensor]:
    """This process's generator states as tensors: torch's, Python's (as JSON), each CUDA device's."""
    state = {"torch": torch.get_rng_state(), "python": files.encode_json(random.getstate())}
    if torch.cuda.is_available():
        state["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    """Restore what :func:`rng_state` returned (CUDA's only where CUDA is available)."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = files.decode_json(state["python"])
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"]))


def rng_items(rank: int) -> dict[str, torch.Tensor]:
    """The entries a save writes for ``rank``'s generators."""
    return {keys.rng_key(rank, generator): value for generator, value in rng_state().items()}


def restore_rng(tensors: dict[str, torch.Tensor], rank: int) -> None:
    """Restore ``rank``'s generators from the entries read (``tensors``), if the checkpoint has them."""
    state = {
        generator: value for key, value in tensors.items() if (generator := keys.rng_generator(key, rank)) is not None
    }
    if state:
        set_rng_state(state)
