"""The split rules EPL ships, registered through ``epl_split_rules`` like any plugin's."""

from __future__ import annotations

from torch import nn

from epl.interfaces.split_rule import ShardContext, SplitRule
from epl.nn.moe import Experts
from epl.sharding.embedding import shard_embedding
from epl.sharding.experts import shard_experts
from epl.sharding.linear import shard_linear


def keep_whole(module: nn.Module, shard: ShardContext) -> nn.Module:
    """The rule for layers every device keeps whole (normalisations): they act on whole features."""
    return module


#: Module type -> rule. The most specific class in a module's MRO wins.
BUILTIN_RULES: dict[type[nn.Module], SplitRule] = {
    nn.Linear: shard_linear,
    nn.Embedding: shard_embedding,
    Experts: shard_experts,
    nn.LayerNorm: keep_whole,
    nn.RMSNorm: keep_whole,
    nn.GroupNorm: keep_whole,
}


def rule_for(module: nn.Module, rules: dict[type[nn.Module], SplitRule]) -> SplitRule | None:
    """The rule registered for the most specific class of ``module``, or None."""
    for cls in type(module).__mro__:
        if cls in rules:
            return rules[cls]
    return None
