"""What every script of the migration guides trains: a small MLP on a synthetic classification task.

Shared so that each pair of scripts differs only in how it is parallelized (the lesson), not in
the model, the data or the learning-rate schedule.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.data import TensorDataset

FEATURES, CLASSES = 32, 8


def make_model(hidden: int = 64) -> nn.Module:
    """A 3-layer MLP classifier (about 7k parameters); call ``torch.manual_seed`` first for the same weights."""
    return nn.Sequential(
        nn.Linear(FEATURES, hidden),
        nn.GELU(),
        nn.LayerNorm(hidden),
        nn.Linear(hidden, hidden),
        nn.GELU(),
        nn.Linear(hidden, CLASSES),
    )


def make_datasets(train_size: int = 256, val_size: int = 64, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """Train and validation sets: Gaussian features, labels from a noisy random linear teacher."""
    generator = torch.Generator().manual_seed(seed)
    teacher = torch.randn(FEATURES, CLASSES, generator=generator)
    x = torch.randn(train_size + val_size, FEATURES, generator=generator)
    y = (x @ teacher + 0.5 * torch.randn(len(x), CLASSES, generator=generator)).argmax(dim=1)
    return TensorDataset(x[:train_size], y[:train_size]), TensorDataset(x[train_size:], y[train_size:])


def warmup_cosine(warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """The LR factor of transformers' ``get_cosine_schedule_with_warmup``: linear from 0, then half a cosine."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return step / max(1, warmup_steps)
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))

    return factor
