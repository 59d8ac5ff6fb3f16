"""The interface of a split rule: how one module type is sharded under ``epl.split``.

A rule is registered for a module class through the ``epl_split_rules`` hook::

    @epl.hookimpl
    def epl_split_rules():
        return {MyAttention: shard_my_attention}

    def shard_my_attention(module: MyAttention, shard: epl.ShardContext) -> nn.Module:
        ...  # return the part of ``module`` that device ``shard.index`` of ``shard.count`` holds
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

from torch import nn

if TYPE_CHECKING:
    from epl.interfaces.shard_group import ShardGroup

#: How the split transform wants a module laid out, from where it sits in the model.
#: ``alone``: inputs and outputs whole (the default). ``column``: a first layer of a
#: column/row region (q/k/v, gate/up: its output stays sharded). ``row``: the last layer
#: of a region (o, down: its input arrives sharded). ``logits``: the model's output layer,
#: read only by a parallel loss. ``whole``: every device keeps the module whole (a small
#: embedding not fed by the model's input, a router read by no sharded layer).
ShardRole = Literal["alone", "column", "row", "logits", "whole"]

#: How a linear-like module holds its weight: ``out_in`` as nn.Linear, ``in_out`` as GPT-2's Conv1D.
WeightLayout = Literal["out_in", "in_out"]


@dataclass(frozen=True)
class ShardContext:
    """What a split rule needs to know to build one device's shard of a module."""

    #: The devices of this replica that hold the split TaskGraph, and the collectives between them.
    group: ShardGroup
    #: The module's name in the model (``classifier.0``), for error messages.
    name: str
    #: Where the module sits (see :data:`ShardRole`); rules that do not care treat every role as ``alone``.
    role: ShardRole = "alone"
    #: A column layer's fused parts (3 for GPT-2's q/k/v ``c_attn``): each part is sharded on its own.
    parts: int = 1
    #: A column layer's output features that must stay on one device (a head's dimension).
    granule: int = 1
    #: How a linear-like module holds its weight.
    weight_layout: WeightLayout = "out_in"

    @property
    def index(self) -> int:
        """This device's shard (0 .. count - 1)."""
        return self.group.index

    @property
    def count(self) -> int:
        """How many devices share the module."""
        return self.group.count


class SplitRule(Protocol):
    """Turns a module into the shard that one device of a split TaskGraph holds.

    Called once per module that owns parameters or buffers in the split TaskGraph,
    on every device of its shard group. The shard must start from the values of
    the unsplit module (it is built from it, so the same seed gives the same values),
    and compute, together with the other shards, what the unsplit module computes.
    """

    def __call__(self, module: nn.Module, shard: ShardContext) -> nn.Module:
        """Return the shard of ``module`` for device ``shard.index`` of ``shard.count``."""
        ...
