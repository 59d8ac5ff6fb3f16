"""Each built-in split rule, on real processes, against the unsplit module in the same process.

Every rank builds the whole module from one seed, shards it, and checks its shard
against the whole module: outputs, input gradients, weight gradients, and the
parameters after an SGD step, in float64 to 1e-12. With ``batch_split`` each
device brings its own rows and its loss is the sum over its rows, so the devices'
losses add up to the whole module's loss. The collectives each layer issues are counted.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers.distributed import run_ranks

pytestmark = pytest.mark.multiprocess

TOLERANCE = 1e-12
ROWS = 8


def _group(batch_split: bool) -> Any:
    import epl
    from epl.interfaces.shard_group import ShardGroup

    env = epl.init()
    return ShardGroup(env.communicator, batch_split=batch_split)


def _mine(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """This device's rows when the batch is split over the devices, else everything."""
    if not group.batch_split:
        return tensor
    rows = tensor.shape[0] // group.count
    return tensor[group.index * rows : (group.index + 1) * rows]


def _check_against_whole(
    name: str, whole: nn.Module, shard: nn.Module, inputs: torch.Tensor, group: Any, *, integer_input: bool = False
) -> Counter[str]:
    """Forward, backward and one SGD step of ``shard`` against ``whole``; return the collectives it used."""
    from epl.sharding.parameters import gather_whole

    x_whole = inputs.clone().requires_grad_(not integer_input)
    x_mine = _mine(inputs, group).clone().requires_grad_(not integer_input)
    y_whole = whole(x_whole)
    weights = torch.randn(y_whole.shape, generator=torch.Generator().manual_seed(7), dtype=y_whole.dtype)
    before = Counter(group.collectives)
    y_mine = shard(x_mine)
    torch.testing.assert_close(y_mine, _mine(y_whole, group), rtol=TOLERANCE, atol=TOLERANCE, msg=f"{name} output")
    (y_whole * weights).sum().backward()
    (y_mine * _mine(weights, group)).sum().backward()
    if not integer_input:
        torch.testing.assert_close(x_mine.grad, _mine(x_whole.grad, group), rtol=TOLERANCE, atol=TOLERANCE)
    for key, grad in {n: p.grad for n, p in shard.named_parameters()}.items():
        whole_grad = whole.get_parameter(key).grad
        spec = getattr(shard.get_parameter(key), "_epl_shard_spec", None)
        expected = spec.slice_of(whole_grad) if spec is not None else whole_grad
        if spec is None and group.batch_split:  # a whole parameter after a batch-split exit: its rows' share
            grad = grad.clone()
            group.communicator.all_reduce(grad).wait()
        torch.testing.assert_close(grad, expected, rtol=TOLERANCE, atol=TOLERANCE, msg=f"{name} grad {key}")
    used = Counter(group.collectives) - before
    if group.batch_split:  # what data parallelism does to whole parameters: add the devices' shares
        for param in shard.parameters():
            if not hasattr(param, "_epl_shard_spec"):
                group.communicator.all_reduce(param.grad).wait()
    for module in (whole, shard):
        torch.optim.SGD(module.parameters(), lr=0.1).step()
    for key, value in shard.state_dict(keep_vars=True).items():
        gathered = gather_whole(value)
        torch.testing.assert_close(gathered, whole.state_dict()[key], rtol=TOLERANCE, atol=TOLERANCE, msg=key)
    return used


def every_rule(batch_split: bool) -> dict[str, dict[str, int]]:
    from epl.interfaces.split_rule import ShardContext
    from epl.nn import Experts
    from epl.sharding.cross_entropy import sharded_cross_entropy
    from epl.sharding.rules import BUILTIN_RULES

    group = _group(batch_split)
    rows = ROWS * (group.count if batch_split else 1)
    x = torch.randn(rows, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    counts: dict[str, dict[str, int]] = {}

    def shard(module: nn.Module, role: str = "alone") -> nn.Module:
        rule = BUILTIN_RULES[type(module)]
        return rule(module, ShardContext(group, "layer", role))  # type: ignore[arg-type]

    # A lone Linear with 7 outputs: uneven shards (4+3 on 2 devices, 2+2+2+1 on 4).
    torch.manual_seed(0)
    whole = nn.Linear(6, 7).double()
    copy = nn.Linear(6, 7).double()
    copy.load_state_dict(whole.state_dict())
    counts["linear"] = _check_against_whole("linear", whole, shard(copy), x, group)

    # Linear -> GELU -> Linear: column then row parallel, hidden width 10 (uneven on 4).
    torch.manual_seed(0)
    whole = nn.Sequential(nn.Linear(6, 10), nn.GELU(), nn.Linear(10, 5)).double()
    pair = nn.Sequential(nn.Linear(6, 10), nn.GELU(), nn.Linear(10, 5)).double()
    pair.load_state_dict(whole.state_dict())
    pair[0], pair[2] = shard(pair[0], "column"), shard(pair[2], "row")
    counts["pair"] = _check_against_whole("pair", whole, pair, x, group)

    # Vocabulary-parallel embedding over 11 ids, with a padding row.
    torch.manual_seed(0)
    whole_embedding = nn.Embedding(11, 4, padding_idx=3).double()
    copy_embedding = nn.Embedding(11, 4, padding_idx=3).double()
    copy_embedding.load_state_dict(whole_embedding.state_dict())
    ids = torch.randint(0, 11, (rows, 3), generator=torch.Generator().manual_seed(2))
    counts["embedding"] = _check_against_whole(
        "embedding", whole_embedding, shard(copy_embedding), ids, group, integer_input=True
    )

    # Experts: 2 per device, dispatched tokens [experts, slots, d].
    torch.manual_seed(0)
    experts = 2 * group.count
    whole_experts = Experts(experts, 6, 8).double()
    copy_experts = Experts(experts, 6, 8).double()
    copy_experts.load_state_dict(whole_experts.state_dict())
    tokens = torch.randn(experts * (group.count if batch_split else 1), 3, 6, dtype=torch.float64)
    counts["experts"] = _check_experts(whole_experts, shard(copy_experts), tokens, group)

    # The classifier's logits (13 classes, uneven) and the parallel cross-entropy, against F.cross_entropy.
    torch.manual_seed(0)
    whole = nn.Linear(6, 13).double()
    copy = nn.Linear(6, 13).double()
    copy.load_state_dict(whole.state_dict())
    logits_layer = shard(copy, "logits")
    targets = torch.randint(0, 13, (rows,), generator=torch.Generator().manual_seed(5))
    targets[1] = -100  # ignored
    before = Counter(group.collectives)
    loss = sharded_cross_entropy(logits_layer(_mine(x, group)), _mine(targets, group), group, num_classes=13)
    whole_rows = F.cross_entropy(whole(x), targets, reduction="none")
    mine_rows = _mine(whole_rows, group)
    kept = _mine(targets, group) != -100
    torch.testing.assert_close(loss, mine_rows.sum() / kept.sum(), rtol=TOLERANCE, atol=TOLERANCE)
    loss.backward()
    # The devices' losses add up (each over its kept rows) to: sum over devices of mean over their rows.
    reference = sum(_mine_of(whole_rows, targets, device, group) for device in range(group.count if batch_split else 1))
    reference.backward()
    spec = logits_layer.weight._epl_shard_spec
    torch.testing.assert_close(logits_layer.weight.grad, spec.slice_of(whole.weight.grad), rtol=1e-12, atol=1e-12)
    counts["cross_entropy"] = Counter(group.collectives) - before
    return {name: dict(used) for name, used in counts.items()}


def _mine_of(rows_loss: torch.Tensor, targets: torch.Tensor, device: int, group: Any) -> torch.Tensor:
    if not group.batch_split:
        kept = targets != -100
        return rows_loss.sum() / kept.sum()
    size = rows_loss.shape[0] // group.count
    part = slice(device * size, (device + 1) * size)
    return rows_loss[part].sum() / (targets[part] != -100).sum()


def _check_experts(whole: nn.Module, shard: nn.Module, tokens: torch.Tensor, group: Any) -> Counter[str]:
    """Batch split: each device dispatches its own tokens to all experts (rows = experts per device)."""
    experts = whole.num_experts
    if group.batch_split:
        per_device = tokens.reshape(group.count, experts, *tokens.shape[1:])
        mine = per_device[group.index].clone().requires_grad_(True)
        whole_in = per_device.clone().requires_grad_(True)
        whole_out = torch.stack([whole(whole_in[d]) for d in range(group.count)])
        expected_out = whole_out[group.index]
    else:
        mine = tokens.clone().requires_grad_(True)
        whole_in = tokens.clone().requires_grad_(True)
        whole_out = whole(whole_in)
        expected_out = whole_out
    weights = torch.randn(whole_out.shape, generator=torch.Generator().manual_seed(7), dtype=tokens.dtype)
    before = Counter(group.collectives)
    out = shard(mine)
    torch.testing.assert_close(out, expected_out, rtol=TOLERANCE, atol=TOLERANCE)
    (whole_out * weights).sum().backward()
    (out * (weights[group.index] if group.batch_split else weights)).sum().backward()
    expected_grad = whole_in.grad[group.index] if group.batch_split else whole_in.grad
    torch.testing.assert_close(mine.grad, expected_grad, rtol=TOLERANCE, atol=TOLERANCE)
    for key, param in shard.named_parameters():
        expected = param._epl_shard_spec.slice_of(whole.get_parameter(key).grad)
        torch.testing.assert_close(param.grad, expected, rtol=TOLERANCE, atol=TOLERANCE, msg=f"experts {key}")
    return Counter(group.collectives) - before


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_rule_equals_the_whole_module(world_size: int) -> None:
    counts = run_ranks(every_rule, world_size, False, timeout=180)[0]
    # Megatron's pairs: the lone layer all-reduces the input gradient and gathers its output;
    # the pair needs one all-reduce forward (row) and one backward (column input).
    assert counts["linear"] == {"all_reduce": 1, "all_gather": 1}
    assert counts["pair"] == {"all_reduce": 2}
    assert counts["embedding"] == {"all_reduce": 1}
    assert counts["experts"] == {"all_gather": 2}
    # Parallel cross-entropy: max and (target logit, sum of exps); the logits are never gathered.
    assert counts["cross_entropy"] == {"all_reduce": 2}


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_rule_with_the_batch_split_over_the_devices(world_size: int) -> None:
    counts = run_ranks(every_rule, world_size, True, timeout=180)[0]
    # Rows are gathered on entry and reduce-scattered (or scattered) on exit, both ways.
    assert counts["linear"] == {"all_gather": 3, "reduce_scatter": 1}
    assert counts["pair"] == {"all_gather": 2, "reduce_scatter": 2}
    assert counts["embedding"] == {"all_gather": 2, "reduce_scatter": 1}
    assert counts["experts"] == {"all_to_all": 4}
    assert counts["cross_entropy"] == {"all_gather": 3, "all_reduce": 2}


class Reuses(nn.Module):
    """``a`` is called twice: once in a pair with ``b``, once alone."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """A pair-looking path and a second use of ``a``."""
        return self.b(torch.relu(self.a(x))) + self.a(x).sum(-1, keepdim=True)


def test_a_linear_used_twice_keeps_whole_outputs() -> None:
    from epl.sharding.layout import assign_roles

    assert assign_roles(Reuses(), {"a", "b"}, loss_is_cross_entropy=False) == {"a": "alone", "b": "alone"}
    shared = nn.Linear(8, 8)
    twice = nn.Sequential(shared, nn.ReLU(), shared)  # the fallback scan sees one module under two names
    assert set(assign_roles(twice, {"0", "2"}, loss_is_cross_entropy=True).values()) == {"alone"}
    pair = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.Linear(8, 3))
    roles = assign_roles(pair, {"0", "2", "3"}, loss_is_cross_entropy=True)
    assert roles == {"0": "column", "2": "row", "3": "logits"}
