"""Layers EPL ships because PyTorch has none: the mixture-of-experts layer and its parts."""

from epl.nn.moe import Experts, MoE, Routing, TopKGate

__all__ = ["Experts", "MoE", "Routing", "TopKGate"]
