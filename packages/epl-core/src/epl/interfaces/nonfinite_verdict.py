"""What a gradient reduction over every rank of the job found about a step's loss and gradients."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class NonFiniteVerdict:
    """A step's verdict as a gradient reduction over every rank of the job found it, the same on every rank: a
    NaN or Inf in the averaged gradients, into which a rank whose loss was not finite put a NaN.

    Read on the host only by :meth:`NonFiniteCheck.decide`.
    """

    #: Above 0: the averaged gradients held a NaN or Inf (a float32 tensor of one element, on the device).
    found: torch.Tensor
