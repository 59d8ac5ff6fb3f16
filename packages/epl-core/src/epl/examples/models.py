"""Small PyTorch models used by the manual's examples (laptop scale)."""

from __future__ import annotations

import torch
from torch import nn


class MoEBlock(nn.Module):
    """Attention, then a mixture-of-experts layer (``epl.nn.MoE``), each with a residual connection."""

    def __init__(self, attention: nn.MultiheadAttention, moe: nn.Module) -> None:
        super().__init__()
        self.attention = attention
        self.moe = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: [batch, sequence, d_model]."""
        h = x + self.attention(x, x, x, need_weights=False)[0]
        return h + self.moe(h)


class ConvFeatures(nn.Sequential):
    """A ResNet-like feature extractor reduced to three layers: [B, 3, H, W] -> [B, channels]."""

    def __init__(self, channels: int) -> None:
        super().__init__(
            nn.Conv2d(3, channels, 3, padding=1),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
