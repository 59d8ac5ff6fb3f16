"""The split rules EPL ships, registered through ``epl_split_rules`` like any plugin's, and the fallbacks by shape.

A module type with a registered rule uses it (a plugin's rule replaces the core's).
A module of a type no rule names is judged by the tensors it holds itself:

- vectors, scalars and buffers only (norms, rotary tables, position ids): kept whole;
- a 2-D ``weight`` and an optional ``bias`` vector: linear-like (GPT-2's ``Conv1D``, a
  router); sharded when it is part of a column/row region, kept whole otherwise;
- weights stacked by expert (3-D and more, the same first size, which the module
  names as its number of experts: transformers' fused experts): expert parallel;
- anything else needs a rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

from torch import nn

from epl.interfaces.split_rule import ShardContext, SplitRule
from epl.nn.moe import Experts
from epl.sharding.embedding import shard_embedding
from epl.sharding.experts import shard_experts, shard_stacked_experts, stacked_experts_count
from epl.sharding.linear import shard_linear


def keep_whole(module: nn.Module, shard: ShardContext) -> nn.Module:
    """The rule for layers every device keeps whole (normalisations): they act on whole features."""
    return module


def shard_linear_like(module: nn.Module, shard: ShardContext) -> nn.Module:
    """The fallback for linear-like modules of other types: sharded inside a region, whole otherwise."""
    if shard.role in ("column", "row"):
        return shard_linear(module, shard)
    return module


#: Module type -> rule. The most specific class in a module's MRO wins. A rule is only called on modules of its key's
#: type, so the rules taking one type of module (not any ``nn.Module``) are cast to :class:`SplitRule`.
BUILTIN_RULES: dict[type[nn.Module], SplitRule] = {
    nn.Linear: shard_linear,
    nn.Embedding: cast(SplitRule, shard_embedding),
    Experts: cast(SplitRule, shard_experts),
    nn.LayerNorm: keep_whole,
    nn.RMSNorm: keep_whole,
    nn.GroupNorm: keep_whole,
}


def rule_for(module: nn.Module, rules: Mapping[type[nn.Module], SplitRule]) -> SplitRule | None:
    """The rule registered for the most specific class of ``module``, or None."""
    base = registered_class(module, rules)
    return None if base is None else rules[base]


def registered_class(module: nn.Module, rules: Mapping[type[nn.Module], SplitRule]) -> type[nn.Module] | None:
    """The most specific class of ``module`` that ``rules`` name, or None."""
    return next((cls for cls in type(module).__mro__ if cls in rules), None)


def fallback_rule(module: nn.Module) -> SplitRule | None:
    """The rule for a module of a type no rule names, judged by the tensors it holds itself (module docstring)."""
    params = dict(module.named_parameters(recurse=False))
    if all(p.dim() <= 1 for p in params.values()):
        return keep_whole
    if is_linear_like(module):
        return shard_linear_like
    if stacked_experts_count(module) is not None:
        return shard_stacked_experts
    return None


def is_linear_like(module: nn.Module) -> bool:
    """Whether ``module`` holds exactly a 2-D ``weight`` and optionally a ``bias`` vector."""
    params = dict(module.named_parameters(recurse=False))
    weight, bias = params.get("weight"), params.get("bias")
    extra = set(params) - {"weight", "bias"}
    return weight is not None and weight.dim() == 2 and not extra and (bias is None or bias.dim() == 1)
