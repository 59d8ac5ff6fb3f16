"""The model transform that replaces each module of a split TaskGraph by this device's shard of it."""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from epl.annotations.taskgraph import TaskGraph, holders_of
from epl.config.settings import CoreSettings
from epl.errors import AnnotationError, ConfigError
from epl.interfaces.collectives import broadcast_tensors, communicators_for
from epl.interfaces.facts import Communication
from epl.interfaces.phases import TransformPhase
from epl.interfaces.shard_group import ShardGroup
from epl.interfaces.split_rule import ShardContext, SplitRule
from epl.placement.shards import MOSTLY_WHOLE
from epl.plugins.context import LossFn, ParallelContext
from epl.sharding import sequence
from epl.sharding.adapters import shard_wrapped_linear, wrapped_linear
from epl.sharding.collectives import sum_gradient_over_shards
from epl.sharding.cross_entropy import ShardedCrossEntropyLoss
from epl.sharding.layout import Decision, SplitLayout, decide_layout, unify_tied
from epl.sharding.linear import ColumnParallelLinear, shard_linear
from epl.sharding.logits import ShardedLogitsLoss
from epl.sharding.parameters import is_sharded, shard_spec
from epl.sharding.random import RegionRandom
from epl.sharding.rules import fallback_rule, keep_whole, registered_class, rule_for, shard_linear_like
from epl.sharding.subclass import calls_super_forward, overrides_forward, with_own_forward
from epl.sharding.vocabulary import ModelVocabulary

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SplitTarget:
    """A module of a split TaskGraph that owns tensors, with its name in the model and the rule that shards it.

    ``own_only``: the module is kept whole for the tensors it holds itself (vectors,
    buffers), and its children are targets of their own. ``base``: the class the rule is
    registered for, when the module's own class is a subclass of it that adds to ``forward``
    (its shard keeps what the subclass adds: :mod:`epl.sharding.subclass`).
    """

    name: str
    module: nn.Module
    rule: SplitRule
    own_only: bool = False
    base: type[nn.Module] | None = None

    def tensors(self) -> list[torch.Tensor]:
        """The parameters and buffers this target covers."""
        recurse = not self.own_only
        return list(itertools.chain(self.module.parameters(recurse=recurse), self.module.buffers(recurse=recurse)))


@dataclass
class SplitLayoutState:
    """The core's state in a ParallelContext: the layout of this rank's split TaskGraphs, decided on the whole model."""

    layout: SplitLayout | None = None


class DecideSplitLayout:
    """Model transform: decide the layout of this rank's split TaskGraphs while the whole model is there.

    One example forward of the model (:func:`epl.sharding.layout.decide_layout`) says which
    layers pair column-then-row; it runs before a pipeline keeps only this rank's stage,
    so a split stage is laid out from the model's real computation too. Changes nothing.
    """

    name = "decide_split_layout"
    phase = TransformPhase.DECIDE_LAYOUT

    def __call__(self, model: nn.Module, context: ParallelContext) -> nn.Module:
        """Store the layout in ``context.state(SplitLayoutState)`` and the vocabulary the batch's ids must lie in
        in ``context.state(ModelVocabulary)``; return ``model`` as it is."""
        if not context.plan.local:
            _check_supported(context)
            context.state(SplitLayoutState).layout = _decide_layout(model, context)
            split = {id(t) for tg in context.taskgraphs if tg.strategy.kind == "split" for t in tg.tensors}
            context.state(ModelVocabulary).read(model, split)
        return model


def _decide_layout(model: nn.Module, context: ParallelContext) -> SplitLayout:
    """The layout of the split TaskGraphs this rank runs."""
    rules = context.plugins.split_rules()
    mine = set(context.plan.taskgraphs_on(context.cluster.rank))
    # Every split TaskGraph's targets, not only this rank's: a module no rule covers is then refused by every
    # rank here, before any collective. Were only its own ranks to refuse, the other stages' ranks would go on
    # into the pipeline's collectives and wait there for ranks that have left.
    found = {tg.index: find_targets(model, tg, rules) for tg in context.taskgraphs if tg.strategy.kind == "split"}
    targets = [t for index, listed in found.items() if index in mine for t in listed]
    sequence_parallel = CoreSettings.from_config(context.config).split.sequence_parallel
    plan = context.plan
    if sequence_parallel and any(plan.batch_parts(i) > 1 for i in mine if plan.taskgraphs[i].strategy == "split"):
        raise AnnotationError(sequence.BATCH_SPLIT_REFUSED)
    return layout_of(model, targets, context.loss_fn, context.example_inputs, sequence_parallel=sequence_parallel)


def layout_of(
    model: nn.Module,
    targets: list[SplitTarget],
    loss_fn: LossFn | None,
    example: Any = None,
    *,
    sequence_parallel: bool = False,
) -> SplitLayout:
    """The layout of ``targets`` (split together on the same devices): their linear-like modules and embeddings,
    from one example forward of ``model`` (on ``example``, or inputs guessed from the model); ``loss_fn``: the
    loss that reads the model's output, if any; ``sequence_parallel``: prove the blocks token-wise or refuse."""
    linears = {t.name for t in targets if t.rule in LINEAR_RULES}
    # A linear subclass with a forward of its own joins regions only if the example run shows a plain product.
    subclassed = frozenset(t.name for t in targets if t.rule in LINEAR_RULES and t.base is not None)
    embeddings = {t.name for t in targets if isinstance(t.module, nn.Embedding)}
    # Exactly nn.CrossEntropyLoss: a subclass may compute something else from the logits.
    cross_entropy = type(loss_fn) is nn.CrossEntropyLoss
    wrapped = frozenset(t.name for t in targets if t.rule is shard_wrapped_linear)
    layout = decide_layout(
        model,
        linears,
        embeddings,
        loss_is_cross_entropy=cross_entropy,
        has_loss=loss_fn is not None,
        example=example,
        subclassed=subclassed,
        sequence_parallel=sequence_parallel,
        wrapped=wrapped,
    )
    paired = sorted(n for n in wrapped if layout.decisions.get(n, Decision()).role in ("column", "row"))
    if sequence_parallel and paired:
        raise AnnotationError(
            f"split.sequence_parallel with wrapped linear layers (adapters on a base_layer: {paired[:3]}) is not "
            "supported yet: their adapters read the gathered input whole. Set split.sequence_parallel to False."
        )
    return unify_tied(layout, _tied_groups(targets))


def _tied_groups(targets: list[SplitTarget]) -> list[set[str]]:
    """The names of the targets that hold one tensor together (an embedding tied to a head, T5's and BART's
    ``shared`` embedding under the encoder's and the decoder's ``embed_tokens``), one set per tensor."""
    holders: dict[int, set[str]] = {}
    for target in targets:
        if not target.own_only:
            for param in target.module.parameters():
                holders.setdefault(id(param), set()).add(target.name)
    return [names for names in holders.values() if len(names) > 1]


class ShardSplitTaskGraphs:
    """Model transform: shard the modules of every split TaskGraph this rank runs, by their split rules.

    In a one-process run the rules are only looked up, so a module without one fails
    on the laptop too. The layout (which layers pair column-then-row, fused parts,
    head sizes) comes from :func:`epl.sharding.layout.decide_layout`. When the
    model's output is a split classifier and the loss is ``nn.CrossEntropyLoss``,
    the loss is replaced by the parallel cross-entropy. A whole parameter used on
    sharded activations (a per-head norm) has its gradient summed over the devices.
    """

    name = "shard_split_taskgraphs"
    phase = TransformPhase.SHARD

    def __call__(self, model: nn.Module, context: ParallelContext) -> nn.Module:
        """Return ``model`` with this rank's shards in place of the split modules."""
        split = [tg for tg in context.taskgraphs if tg.strategy.kind == "split"]
        if not split:
            return model
        rules = context.plugins.split_rules()
        targets = {tg.index: find_targets(model, tg, rules) for tg in split}
        plan = context.plan
        if plan.local:
            return model
        layout = context.state(SplitLayoutState).layout
        if layout is None:  # DecideSplitLayout did not run: decide on the model as it is now
            _check_supported(context)
            layout = _decide_layout(model, context)
        world = context.communicator
        devices = {
            (tg.index, lane): plan.lane_devices(tg.index, lane) for tg in split for lane in range(plan.num_lanes)
        }
        communicators = communicators_for(world, list(devices.values()))
        rank, lane = context.cluster.rank, context.lane_index
        mine = [tg for tg in split if tg.index in plan.taskgraphs_on(rank)]
        decisions = layout.decisions
        holders = holders_of(context.taskgraphs)
        kept_own: list[tuple[nn.Module, dict[str, nn.Parameter]]] = []
        shards_of: dict[int, tuple[str, nn.Parameter]] = {}
        group_of: dict[str, ShardGroup] = {}
        for tg in mine:
            group = ShardGroup(
                communicators[tuple(sorted(devices[tg.index, lane]))],
                batch_split=plan.batch_parts(tg.index) > 1,
            )
            group.random = RegionRandom(torch.initial_seed(), group.index, context.cluster.device)
            context.shard_groups[tg.index] = group
            replaced: set[int] = set()
            kept_whole: dict[str, tuple[int, str]] = {}
            unpaired: dict[str, str] = {}
            for target in targets[tg.index]:
                group_of[target.name] = group
                own = target.tensors()
                if context.lazy_init is None:  # built on meta: every device gives them the same values later
                    _start_alike(own, group)
                replaced.update(id(t) for t in own)
                decision = decisions.get(target.name, Decision())
                shard_context = ShardContext(
                    group, target.name, decision.role, decision.parts, decision.granule, decision.weight_layout
                )
                originals = dict(target.module.named_parameters(recurse=not target.own_only))
                shard = target.module if target.own_only else target.rule(target.module, shard_context)
                if target.base is not None and shard is not target.module and target.name not in layout.plain:
                    # A subclass whose forward computes with the weight itself (Whisper's positional embedding)
                    # stays whole: its output is then whole, as its rule's would have been outside a region.
                    reaches_parallel = calls_super_forward(target.module, target.base)
                    shard = with_own_forward(target.module, shard, target.base) if reaches_parallel else target.module
                if target.own_only:  # its own tensors stay whole, unless a sharded module holds them too (below)
                    kept_own.append((target.module, originals))
                else:
                    _tie(shard, originals, shards_of, target.name)
                made = dict(shard.named_parameters())
                for key, original in originals.items():
                    if len(holders.get(id(original), ())) > 1 and key in made:
                        context.split_holders[id(made[key])] = holders[id(original)]
                model = _replace(model, target.name, shard)
                _lower_sizes(model, decision, group)
                for tensor in own if target.own_only else itertools.chain(shard.parameters(), shard.buffers()):
                    context.split_tensors[id(tensor)] = (tg.index, is_sharded(tensor))
                whole = [p for p in (shard.parameters(recurse=not target.own_only)) if not is_sharded(p)]
                kept_whole[target.name] = (sum(p.numel() for p in whole), whole_because(target, layout))
                if _gathers_output(target, decision, shard) and target.name in layout.reasons:
                    unpaired[target.name] = layout.reasons[target.name]
                if decision.role == "logits" and isinstance(shard, ColumnParallelLinear):
                    context.loss_fn = _parallel_loss(context.loss_fn, group, shard)
            _warn_if_mostly_whole(tg, kept_whole, [t for t in tg.tensors if isinstance(t, nn.Parameter)])
            _warn_if_unpaired(tg, unpaired)
            # Forget the whole tensors, so that only the shards stay in memory.
            tg.tensors[:] = [t for t in tg.tensors if id(t) not in replaced or id(t) in context.split_tensors]
        # A module kept whole for its own tensors that holds one a sharded module holds too (BERT's LM head keeps
        # the bias of its decoder, the logits layer) holds that shard.
        for module, originals in kept_own:
            for key, original in originals.items():
                if id(original) in shards_of:
                    owner, _, attr = key.rpartition(".")
                    setattr(module.get_submodule(owner) if owner else module, attr, shards_of[id(original)][1])
        summed: set[int] = set()
        for name, columns in layout.partial_gradients.items():
            groups = {id(group_of[c]): group_of[c] for c in columns if c in group_of}
            # With the batch split over the devices, the gradient reduction averages it over them already.
            if len(groups) == 1 and not (group := next(iter(groups.values()))).batch_split:
                sum_gradient_over_shards(model.get_parameter(name), group)
                summed.add(id(model.get_parameter(name)))
        if CoreSettings.from_config(context.config).split.sequence_parallel:
            stack_groups = [context.shard_groups[tg.index] for tg in mine]
            for stack_group in stack_groups:
                sequence.install(model, stack_group, summed)
            context.forward_contexts.append(functools.partial(sequence.default_random_after, stack_groups))
        return model


def _warn_if_mostly_whole(
    taskgraph: TaskGraph, kept_whole: dict[str, tuple[int, str]], originals: list[torch.Tensor]
) -> None:
    """Log a warning when the split of ``taskgraph`` left most of its parameters whole on every device, naming
    the largest modules kept whole and why (``kept_whole``: module -> (elements it keeps whole, why))."""
    total = sum(t.numel() for t in originals)
    whole = sum(n for n, _ in kept_whole.values())
    if not total or whole <= MOSTLY_WHOLE * total:
        return
    largest = sorted(((n, name, why) for name, (n, why) in kept_whole.items() if n), reverse=True)[:5]
    named = "; ".join(f"{name or 'the model'} ({n:,} elements: {why})" for n, name, why in largest)
    _log.warning(
        "epl.split: %s (%s) keeps %.0f%% of its parameters whole on every device, so each device holds nearly the "
        "whole of it. Largest kept whole: %s. A linear layer is sharded when its output reaches exactly one other "
        "linear layer through operations that keep the shard (docs/split.md); register a split rule for a "
        "module to shard it your way.",
        taskgraph.name,
        taskgraph.strategy,
        100 * whole / total,
        named,
    )


def _gathers_output(target: SplitTarget, decision: Decision, shard: nn.Module) -> bool:
    """Whether ``target``'s shard is a linear layer cut by output features whose output is gathered (``alone``)."""
    return target.rule in LINEAR_RULES and decision.role == "alone" and any(is_sharded(p) for p in shard.parameters())


def _warn_if_unpaired(taskgraph: TaskGraph, unpaired: dict[str, str]) -> None:
    """Log a warning when linear layers of ``taskgraph`` that started a region ended in no column/row pair, so the
    split issues more collectives than Megatron's pairing of the same layers would (``unpaired``: module -> the
    operation that ended its region)."""
    if not unpaired:
        return
    named = "; ".join(f"{name} ({why})" for name, why in list(unpaired.items())[:5])
    more = f" and {len(unpaired) - 5} more" if len(unpaired) > 5 else ""
    _log.warning(
        "epl.split: %s (%s) issues more collectives than Megatron's pairing of the same layers would: linear "
        "layers in no column/row pair (%d) each gather their output forward (an all-gather) and all-reduce their "
        "input's gradient backward, where a pair costs one all-reduce each way for the whole region. What broke "
        "the pairing: %s%s. A linear layer pairs when its output reaches exactly one other linear layer through "
        "operations that keep the shard (docs/split.md); a wrapped layer (adapters on a base_layer) pairs as its "
        "base layer when its forward is the sum of their products; a split rule for a module shards it your way.",
        taskgraph.name,
        taskgraph.strategy,
        len(unpaired),
        named,
        more,
    )


def whole_because(target: SplitTarget, layout: SplitLayout) -> str:
    """Why ``target`` keeps (some of) its parameters whole (for the warning at ``parallelize`` and ``epl plan``)."""
    role = layout.decisions.get(target.name, Decision()).role
    if target.rule is shard_wrapped_linear and role in ("column", "row"):
        if role == "column":
            return "an adapter reading the whole input, as its column-parallel base layer does"
        return "an adapter writing the whole output, as its row-parallel base layer's sum is"
    if target.name in layout.reasons:
        return layout.reasons[target.name]
    if target.rule in LINEAR_RULES:
        if role == "whole":
            return "never computed as a linear layer in the example run"
        return "a linear-like layer in no column/row pair"
    if role == "whole":
        return "an embedding not read by the model's input (positions), kept whole as Megatron does"
    return "vectors and buffers only: every device needs them whole"


def _parallel_loss(loss_fn: LossFn | None, group: ShardGroup, head: ColumnParallelLinear) -> LossFn:
    """The loss over the split output layer's class-sharded logits: parallel cross-entropy where the loss has one."""
    assert loss_fn is not None
    if type(loss_fn) is nn.CrossEntropyLoss:
        return ShardedCrossEntropyLoss(loss_fn, group, head.out_features)
    return loss_fn if isinstance(loss_fn, ShardedLogitsLoss) else ShardedLogitsLoss(loss_fn)


#: The rules of linear-like modules: the layout (column, row, alone) is decided for the modules they cover.
LINEAR_RULES: tuple[SplitRule, ...] = (shard_linear, shard_linear_like, shard_wrapped_linear)


def _tie(
    shard: nn.Module, originals: dict[str, nn.Parameter], shards_of: dict[int, tuple[str, nn.Parameter]], name: str
) -> None:
    """Make the shards of one tied tensor (an LM head sharing the embedding's weight) one parameter again.

    Both rules must have cut it the same way (the vocabulary-parallel embedding and the
    column-parallel head both shard the rows); otherwise the tie cannot hold.
    """
    current = dict(shard.named_parameters())
    for key, original in originals.items():
        made = current.get(key)
        earlier = shards_of.get(id(original))
        if earlier is None:
            if made is not None:
                shards_of[id(original)] = (name, made)
            continue
        first_name, first = earlier
        if made is None or made.shape != first.shape or (shard_spec(made) is None) != (shard_spec(first) is None):
            raise AnnotationError(
                f"{first_name!r} and {name!r} share a tensor (tied weights), but their split rules cut it "
                f"differently ({list(first.shape)} and {list(made.shape) if made is not None else 'none'}). Untie "
                "them, or create the shared module outside the epl.split scope."
            )
        owner, _, attr = key.rpartition(".")
        setattr(shard.get_submodule(owner) if owner else shard, attr, first)


def _lower_sizes(model: nn.Module, decision: Decision, group: ShardGroup) -> None:
    """Lower the integer attributes that a module's code uses as sizes of now-sharded tensors to this device's.

    GPT-2's attention splits its fused q/k/v output with ``split_size``: each device's
    output holds its share of each part, so the size becomes that share.
    """
    for module_name, whole in decision.fixups:
        module = model.get_submodule(module_name)
        local = group.sizes(whole)[group.index]
        for attr, value in list(vars(module).items()):
            if type(value) is int and value == whole:
                setattr(module, attr, local)


def _start_alike(tensors: list[torch.Tensor], group: ShardGroup) -> None:
    """Give every device of ``group`` the first device's values of ``tensors`` before they are sliced.

    The shards then fit together even when the devices were seeded differently, and the
    tensors every device keeps whole (a row-parallel bias, a norm) are equal.
    """
    broadcast_tensors(tensors, group.communicator)


def _check_supported(context: ParallelContext) -> None:
    plan = context.plan
    clip_after_reduction = context.facts(Communication).clip_after_reduction
    if CoreSettings.from_config(context.config).optimizer.max_grad_norm is not None and not clip_after_reduction:
        splitting = [tg.name for tg in plan.taskgraphs if tg.strategy == "split" and plan.batch_parts(tg.index) > 1]
        if splitting:
            raise ConfigError(
                f"optimizer.max_grad_norm clips before the gradient reduction, but the devices of {splitting[0]} "
                "also split the batch (it is colocated with a replicate TaskGraph), so no device holds its "
                "replica's gradient before the reduction. Set communication.clip_after_allreduce to true (with "
                "zero.level 'v1'/'v2', which need clipping before it, use zero.level 'v0' or no clipping)."
            )


def find_targets(
    model: nn.Module, taskgraph: TaskGraph, rules: Mapping[type[nn.Module], SplitRule]
) -> list[SplitTarget]:
    """The outermost modules holding ``taskgraph``'s tensors that a rule covers (registered, or by shape).

    A module of a type no rule names is judged by the tensors it holds itself
    (:func:`epl.sharding.rules.fallback_rule`); one that no rule fits is an error.
    """
    owned = {id(t) for t in taskgraph.tensors}
    found: list[SplitTarget] = []

    def visit(name: str, module: nn.Module) -> None:
        if not any(id(t) in owned for t in itertools.chain(module.parameters(), module.buffers())):
            return
        own = list(itertools.chain(module.parameters(recurse=False), module.buffers(recurse=False)))
        has_children = any(True for child in module.children() for _ in child.parameters())
        rule = rule_for(module, rules)
        if rule is None and not own and _wrapped_with_builtin_rules(module, rules):
            rule = shard_wrapped_linear  # sharded as its base layer, the adapters following (PEFT's LoRA)
        if rule is None and not own:
            _refuse_adapters_on_sharded_base(taskgraph, name, module, rules)
        if rule is None and any(id(t) in owned for t in own):
            rule = fallback_rule(module)
            if rule is None:
                raise _no_rule(taskgraph, name, module)
            if rule is keep_whole and has_children:
                found.append(SplitTarget(name, module, rule, own_only=True))
                rule = None
        if rule is not None:
            base = registered_class(module, rules)
            subclassed = base is not None and overrides_forward(module, base)
            found.append(SplitTarget(name, module, rule, base=base if subclassed else None))
            return
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)

    visit("", model)
    return found


def _wrapped_with_builtin_rules(module: nn.Module, rules: Mapping[type[nn.Module], SplitRule]) -> bool:
    """Whether ``module`` is a wrapped linear (:mod:`epl.sharding.adapters`) whose layers the built-in linear rule
    covers: a plugin's rule for their type is left to shard them its way."""
    parts = wrapped_linear(module)
    if parts is None:
        return False
    base_rule = rule_for(parts.base, rules) or fallback_rule(parts.base)
    adapters = [*parts.readers.values(), *parts.writers.values()]
    return base_rule in (shard_linear, shard_linear_like) and all(rule_for(a, rules) is shard_linear for a in adapters)


def _refuse_adapters_on_sharded_base(
    taskgraph: TaskGraph, name: str, module: nn.Module, rules: Mapping[type[nn.Module], SplitRule]
) -> None:
    """Refuse a wrapper of another kind than a wrapped linear (a ``base_layer`` child and adapters beside it, as PEFT's
    ``ParamWrapper`` of stacked experts' weights) whose base a rule other than the linear ones would shard: its
    adapters, kept whole, would no longer match its base's shards."""
    base, inner_layer = module, getattr(module, "base_layer", None)
    while isinstance(inner_layer, nn.Module):
        base, inner_layer = inner_layer, getattr(inner_layer, "base_layer", None)
    if base is module or wrapped_linear(module) is not None:
        return
    if not any(True for _ in base.parameters(recurse=False)):
        return
    rule = rule_for(base, rules) or fallback_rule(base)
    if rule is None or rule is keep_whole or rule in LINEAR_RULES:
        return  # a linear-like base is left to the layout: whole where no pairing shows (GPT-2's Conv1D under LoRA)
    kind, inner = type(module), type(base)
    raise AnnotationError(
        f"{taskgraph.name} (split({taskgraph.strategy.device_count})) holds the module {name!r}, a "
        f"{kind.__module__}.{kind.__qualname__} that adds adapters to its base layer, a {inner.__qualname__} that "
        "a split rule may shard: EPL shards adapters only on linear layers (a base_layer nn.Linear), so these would "
        "no longer match the base's shards. Leave that module out of the adapters' targets, or build the model "
        "outside the epl.split scope."
    )


def _no_rule(taskgraph: TaskGraph, name: str, module: nn.Module) -> AnnotationError:
    kind = type(module)
    return AnnotationError(
        f"{taskgraph.name} (split({taskgraph.strategy.device_count})) holds the module {name or 'model'!r}, "
        f"a {kind.__module__}.{kind.__qualname__}, "
        f"and no split rule says how to shard that type. Register a rule in a plugin:\n"
        f"    @epl.hookimpl\n"
        f"    def epl_split_rules():\n"
        f"        return {{{kind.__qualname__}: shard_it}}  # shard_it(module, shard: epl.ShardContext) -> nn.Module\n"
        f"with epl.Env.get().plugins.register(plugin, name=...) or an 'epl' entry point, "
        f"or create the module outside the epl.split scope. Built-in rules: nn.Linear, nn.Embedding, "
        f"epl.nn.Experts, normalisation layers (kept whole); without a rule, modules holding only vectors "
        f"and buffers are kept whole, a 2-D weight (and bias) is linear-like, weights stacked by expert "
        f"are expert parallel."
    )


def _replace(model: nn.Module, name: str, module: nn.Module) -> nn.Module:
    """``model`` with its submodule ``name`` replaced ('' replaces the model itself)."""
    if not name:
        return module
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)
    return model
