"""Where each split module sits: the role, fused parts and head size each split rule is told.

First choice: the model runs once on a small example input and the recorded torch
calls are followed from layer to layer (:mod:`epl.sharding.regions`): attention and
MLP blocks of any model pair column-then-row as in Megatron-LM, embeddings read by
no model input stay whole, and a layer whose output is the model's output is the
``logits`` layer when a parallel loss reads it.

When no example input can be made or the run fails, the model is traced with
``torch.fx`` instead (entering only modules that hold split Linears): a Linear whose
output passes through elementwise operations only, each used once, into another split
Linear of matching width forms a pair. When tracing fails too, the items of
``nn.Sequential`` containers are scanned. A Linear called more than once (or whose
weight is read directly) keeps the ``alone`` role.
"""

from __future__ import annotations

import collections
import logging
import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from epl.errors import AnnotationError
from epl.interfaces.split_rule import ShardRole, WeightLayout
from epl.sharding.adapters import additive, wrapped_linear
from epl.sharding.dataflow import ModuleCall, example_input, record_dataflow
from epl.sharding.regions import Pairing, find_pairs

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Decision:
    """How one split module is laid out (passed to its rule through ``ShardContext``)."""

    role: ShardRole = "alone"
    parts: int = 1
    granule: int = 1
    weight_layout: WeightLayout = "out_in"
    #: (module name, whole size): integer attributes of that module to lower to this device's size.
    fixups: frozenset[tuple[str, int]] = frozenset()


@dataclass(frozen=True)
class SplitLayout:
    """The decisions for a model's split modules, and the whole parameters whose gradients are per shard."""

    #: Module name -> its decision (modules not named take ``Decision()``).
    decisions: dict[str, Decision]
    #: Parameter name -> the column modules of the regions it is used in whole (on sharded activations, as a
    #: per-head norm's weight): each device's gradient covers its shard only and is summed over the devices.
    partial_gradients: dict[str, frozenset[str]] = field(default_factory=dict)
    #: Module name -> why its region ended before a row-parallel partner (the operation that stopped it).
    reasons: dict[str, str] = field(default_factory=dict)
    #: Linear subclasses with a forward of their own that the example run showed to be the plain product with
    #: their weight (and bias): their shards are the parallel layers as they are (Falcon's ``FalconLinear``).
    plain: frozenset[str] = frozenset()


def decide_layout(
    model: nn.Module,
    linears: set[str],
    embeddings: set[str],
    *,
    loss_is_cross_entropy: bool,
    has_loss: bool,
    example: Any = None,
    subclassed: frozenset[str] = frozenset(),
    sequence_parallel: bool = False,
    wrapped: frozenset[str] = frozenset(),
) -> SplitLayout:
    """The decision for each linear-like module in ``linears`` and each embedding in ``embeddings``.

    ``has_loss``: a loss function reads the model's output (so an output layer may keep
    its logits sharded: see :mod:`epl.sharding.logits`); ``loss_is_cross_entropy``: it is
    exactly ``nn.CrossEntropyLoss`` (what the tracing fallback requires for the ``logits`` role);
    ``example``: the inputs of the example run (default: guessed by :func:`~epl.sharding.dataflow.example_input`);
    ``subclassed``: those of ``linears`` whose class adds a ``forward`` of its own to a linear layer's (Falcon's
    ``FalconLinear``): they join regions only when the example run shows a plain product with the weight (and
    the bias), and keep whole outputs otherwise. ``sequence_parallel``: refuse a model whose blocks the example run
    does not show to work token by token outside their regions (:func:`epl.sharding.sequence.prove_token_wise`).
    ``wrapped``: those of ``linears`` that are wrapped linears (:mod:`epl.sharding.adapters`): they join regions
    only when the example run shows their forward additive, keep whole outputs otherwise, and are never ``logits``.
    """
    if example is None:
        example = example_input(model)
    if example is not None and linears:
        try:
            flow = record_dataflow(model, linears | embeddings, example)
            impure = {name for name in subclassed if any(not _plain_product(c) for c in flow.calls_of(name))}
            impure |= {name for name in wrapped if not _additive(model, name, flow.calls_of(name))}
            # How each of them held its weight when called: a layer looked through keeps its whole output, cut in
            # the orientation it computes with (a square Conv1D's [in, out] read as [out, in] would be wrong)
            impure_layouts = {name: {c.weight_layout for c in flow.calls_of(name)} for name in impure}
            if impure:  # looked through instead: what they add to the product may not keep a shard a shard
                linears = linears - impure
                flow = record_dataflow(model, linears | embeddings, example)
        except Exception as error:  # noqa: BLE001 - any failure falls back to tracing
            _log.info("epl.split: the example run of the model failed (%s); tracing it instead", error)
        else:
            pairing = find_pairs(flow)
            decisions = _from_pairing(pairing, linears, embeddings, has_loss)
            if sequence_parallel:
                from epl.sharding.sequence import prove_token_wise

                by_role = {role: {n for n, d in decisions.items() if d.role == role} for role in ("row", "column")}
                prove_token_wise(flow, model, by_role["row"], by_role["column"])
            for name in wrapped & decisions.keys():
                if decisions[name].role == "logits":  # a sum of adapters on sharded logits: not proven
                    decisions[name] = replace(decisions[name], role="alone")
            for name, layouts in impure_layouts.items():
                (computed, *others) = layouts or {None}
                if computed is None or others:  # never called, or called both ways: no orientation proven
                    decisions[name] = Decision("whole")
                else:
                    decisions[name] = Decision("alone", weight_layout=computed)
            reasons = {**dict.fromkeys(subclassed - linears, "its forward adds work to the product"), **pairing.reasons}
            reasons |= dict.fromkeys(wrapped - linears, "its forward is not its base layer's and adapters' sum")
            return SplitLayout(decisions, dict(pairing.partial_gradients), reasons, frozenset(subclassed & linears))
    if sequence_parallel:
        raise AnnotationError(
            "split.sequence_parallel needs an example run of the model to prove its blocks work token by token, "
            "and none ran: pass example_inputs= to epl.parallelize, or set split.sequence_parallel to False."
        )
    roles = assign_roles(model, linears - subclassed, loss_is_cross_entropy=loss_is_cross_entropy)
    roles |= {name: "alone" for name in wrapped if roles.get(name) == "logits"}
    unpaired = "in no pair the fx trace of the model found (no example run: pass example_inputs= to epl.parallelize)"
    reasons = {name: unpaired for name, role in roles.items() if role == "alone"} if example is None else {}
    return SplitLayout({name: Decision(role) for name, role in roles.items()}, reasons=reasons)


#: The torch calls a linear layer's own forward may make and still be a plain product (plus bias).
_PRODUCT_CALLS = {"linear", "matmul", "__matmul__", "addmm", "mm", "t", "T", "add", "__add__", "__radd__", "__get__"}


def _plain_product(call: ModuleCall) -> bool:
    """Whether a call of a linear-like module computed only its product with the weight (and the bias)."""
    return call.weight_layout is not None and set(call.inner) <= _PRODUCT_CALLS


def _additive(model: nn.Module, name: str, calls: list[ModuleCall]) -> bool:
    """Whether every call of the wrapped linear ``name`` computed its base's and adapters' products, summed."""
    parts = wrapped_linear(model.get_submodule(name))
    return parts is not None and bool(calls) and all(additive(call.inner, parts) for call in calls)


def unify_tied(layout: SplitLayout, groups: list[set[str]]) -> SplitLayout:
    """``layout`` with one cut for each group of modules that hold a tensor together.

    A module kept whole only because the example run did not shard it (never called, as
    T5's and BART's ``shared`` embedding, which the model calls under the encoder's and
    the decoder's names; or an embedding fed by something other than the model's input)
    takes the standalone cut when another holder of the tensor is sharded: an embedding
    is then vocabulary parallel and a linear layer column parallel with whole outputs,
    both correct whatever feeds them, and both cut the rows as the sharded holder does.
    Cuts that still differ (a tied weight in a head-sharded region) are refused when the
    shards are tied (``_tie`` in the split transform).
    """
    decisions = dict(layout.decisions)
    for names in groups:
        roles = {decisions.get(name, Decision()).role for name in names}
        if "whole" in roles and roles != {"whole"}:
            for name in names:
                if decisions.get(name, Decision()).role == "whole":
                    decisions[name] = replace(decisions[name], role="alone")
    return replace(layout, decisions=decisions)


def _from_pairing(pairing: Pairing, linears: set[str], embeddings: set[str], has_loss: bool) -> dict[str, Decision]:
    decisions: dict[str, Decision] = {}
    for name in linears:
        layout = pairing.weight_layouts.get(name, "out_in")
        if name in pairing.columns:
            facts = pairing.columns[name]
            decisions[name] = Decision("column", facts.parts, facts.granule, layout, frozenset(facts.fixups))
        elif name in pairing.rows:
            decisions[name] = Decision("row", weight_layout=layout)
        elif name not in pairing.weight_layouts:
            decisions[name] = Decision("whole")  # never computed as a linear layer in the example run
        elif name in pairing.outputs and has_loss and layout == "out_in":
            decisions[name] = Decision("logits", weight_layout=layout)
        else:
            decisions[name] = Decision("alone", weight_layout=layout)
    for name in embeddings:
        decisions[name] = Decision("alone" if name in pairing.input_fed else "whole")
    return decisions


ELEMENTWISE_MODULES: tuple[type[nn.Module], ...] = (
    nn.ReLU,
    nn.ReLU6,
    nn.GELU,
    nn.SiLU,
    nn.Tanh,
    nn.Sigmoid,
    nn.LeakyReLU,
    nn.ELU,
    nn.SELU,
    nn.CELU,
    nn.Mish,
    nn.Hardswish,
    nn.Hardtanh,
    nn.Softplus,
    nn.Dropout,
    nn.Identity,
)
ELEMENTWISE_FUNCTIONS: set[Callable[..., Any]] = {
    torch.relu,
    torch.tanh,
    torch.sigmoid,
    F.relu,
    F.relu6,
    F.gelu,
    F.silu,
    F.tanh,
    F.sigmoid,
    F.leaky_relu,
    F.elu,
    F.selu,
    F.celu,
    F.mish,
    F.hardswish,
    F.hardtanh,
    F.softplus,
    F.dropout,
    operator.neg,
}
ELEMENTWISE_METHODS = {"relu", "relu_", "tanh", "tanh_", "sigmoid", "sigmoid_", "neg", "contiguous"}


def assign_roles(model: nn.Module, linears: set[str], *, loss_is_cross_entropy: bool) -> dict[str, ShardRole]:
    """The role of each split Linear named in ``linears`` (names in ``model``)."""
    roles: dict[str, ShardRole] = dict.fromkeys(linears, "alone")
    if not linears:
        return roles
    try:
        graph = _trace(model, linears)
    except Exception:  # noqa: BLE001 - any model fx cannot trace falls back to the Sequential scan
        single = _used_once(model, linears)
        _pairs_in_sequentials(model, single, roles)
        last = _last_of_sequentials(model)
        if loss_is_cross_entropy and last in single and roles[last] == "alone":
            roles[last] = "logits"
        return roles
    modules = dict(model.named_modules())
    calls = collections.Counter(node.target for node in graph.nodes if node.op == "call_module")
    weights_read = {str(node.target).rpartition(".")[0] for node in graph.nodes if node.op == "get_attr"}
    # A Linear called twice, or whose weight is read directly, keeps whole outputs: a role would hold for every use.
    single = {name for name in linears if calls[name] == 1 and name not in weights_read}
    for node in graph.nodes:
        if node.op != "call_module" or node.target not in single or roles[node.target] != "alone":
            continue
        partner = _pair_end(node, modules, single)
        if partner is not None and roles[partner] == "alone":
            roles[node.target], roles[partner] = "column", "row"
    output = next(node for node in graph.nodes if node.op == "output")
    result = output.args[0]
    if (
        loss_is_cross_entropy
        and isinstance(result, torch.fx.Node)
        and result.op == "call_module"
        and result.target in single
        and roles[result.target] == "alone"
    ):
        roles[result.target] = "logits"
    return roles


class _SplitTracer(torch.fx.Tracer):
    """Enters only the modules that hold split Linears; every other module is one call."""

    def __init__(self, containers: set[str]) -> None:
        super().__init__()
        self.containers = containers

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name not in self.containers


def _trace(model: nn.Module, linears: set[str]) -> torch.fx.Graph:
    containers = {""} | {".".join(name.split(".")[:i]) for name in linears for i in range(1, name.count(".") + 1)}
    return _SplitTracer(containers).trace(model)


def _pair_end(node: torch.fx.Node, modules: dict[str, nn.Module], linears: set[str]) -> str | None:
    """The split Linear that ``node``'s output reaches through single-use elementwise operations."""
    first = modules[str(node.target)]  # a call_module node's target is the module's name
    current = node
    while len(current.users) == 1:
        (user,) = current.users
        if not user.args or user.args[0] is not current:
            return None
        if user.op == "call_module" and user.target in linears:
            second = modules[user.target]
            match = isinstance(first, nn.Linear) and isinstance(second, nn.Linear)
            return user.target if match and second.in_features == first.out_features else None
        if not _elementwise(user, modules):
            return None
        current = user
    return None


def _elementwise(node: torch.fx.Node, modules: dict[str, nn.Module]) -> bool:
    if node.op == "call_module":
        return type(modules[str(node.target)]) in ELEMENTWISE_MODULES  # a subclass may do more
    if node.op == "call_function":
        return node.target in ELEMENTWISE_FUNCTIONS
    return node.op == "call_method" and node.target in ELEMENTWISE_METHODS


def _used_once(model: nn.Module, linears: set[str]) -> set[str]:
    """The Linears registered under one name only (a module held twice may be called twice)."""
    names: dict[int, list[str]] = collections.defaultdict(list)
    for name, module in model.named_modules(remove_duplicate=False):
        names[id(module)].append(name)
    return {name for name in linears if len(names[id(model.get_submodule(name))]) == 1}


def _pairs_in_sequentials(model: nn.Module, linears: set[str], roles: dict[str, ShardRole]) -> None:
    for prefix, module in model.named_modules():
        if not isinstance(module, nn.Sequential):
            continue
        items = [(f"{prefix}.{name}" if prefix else name, child) for name, child in module.named_children()]
        i = 0
        while i < len(items):
            name, child = items[i]
            j = i + 1
            while j < len(items) and type(items[j][1]) in ELEMENTWISE_MODULES:
                j += 1
            if (
                name in linears
                and j < len(items)
                and items[j][0] in linears
                and isinstance(child, nn.Linear)
                and isinstance(items[j][1], nn.Linear)
                and items[j][1].in_features == child.out_features
                and roles[name] == roles[items[j][0]] == "alone"
            ):
                roles[name], roles[items[j][0]] = "column", "row"
                i = j + 1
            else:
                i += 1


def _last_of_sequentials(model: nn.Module) -> str:
    """The name of the module that produces a nest of Sequentials' output ('' when the model is not one)."""
    return ".".join(_last_path(model))


def _last_path(module: nn.Module) -> Iterator[str]:
    while isinstance(module, nn.Sequential) and len(module):
        name, module = list(module.named_children())[-1]
        yield name
