"""Small PyTorch models used by the manual's examples (laptop scale)."""

from __future__ import annotations

import torch
from torch import nn


class Experts(nn.Module):
    """``num_experts`` two-layer MLPs stored as stacked weights (dimension 0 is the expert)."""

    def __init__(self, num_experts: int, d_model: int, d_hidden: int) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(num_experts, d_model, d_hidden) * d_model**-0.5)
        self.w_out = nn.Parameter(torch.randn(num_experts, d_hidden, d_model) * d_hidden**-0.5)

    def forward(self, tokens: torch.Tensor, expert_index: torch.Tensor) -> torch.Tensor:
        """Run each token ([T, d]) through its expert (``expert_index`` [T])."""
        hidden = torch.relu(torch.bmm(tokens.unsqueeze(1), self.w_in[expert_index]))
        return torch.bmm(hidden, self.w_out[expert_index]).squeeze(1)


class MoEBlock(nn.Module):
    """Attention, then top-1 gated experts, each with a residual connection."""

    def __init__(self, attention: nn.MultiheadAttention, gate: nn.Linear, experts: Experts) -> None:
        super().__init__()
        self.attention = attention
        self.gate = gate
        self.experts = experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: [batch, sequence, d_model]."""
        attended, _ = self.attention(x, x, x, need_weights=False)
        h = x + attended
        tokens = h.reshape(-1, h.shape[-1])
        weight, index = torch.softmax(self.gate(tokens), dim=-1).max(dim=-1)
        return h + (weight.unsqueeze(-1) * self.experts(tokens, index)).reshape_as(h)


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
