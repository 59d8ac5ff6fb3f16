"""Each of split's collectives compiled (``aot_eager``, ``fullgraph=True``: traced as torch's functional collectives,
no graph break) gives the same output and input gradient as the same function eager, on 2 processes (gloo)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers.distributed import run_ranks

pytestmark = pytest.mark.multiprocess


def cases(group: Any) -> dict[str, Any]:
    from epl.sharding import collectives as C

    return {
        "copy_to_shards": lambda x: C.copy_to_shards(x, group) * (group.index + 1),
        "reduce_from_shards": lambda x: C.reduce_from_shards(x, group),
        "gather_from_shards (uneven)": lambda x: C.gather_from_shards(x[:, : 3 - group.index], group, 1, [3, 2]),
        "split_to_shards (uneven)": lambda x: C.split_to_shards(x, group, 1, [3, 2]) * (group.index + 1),
        "gather_rows along 1": lambda x: C.gather_rows(x, group, 1) * (group.index + 1),
        "scatter_rows": lambda x: C.scatter_rows(x, group) * (group.index + 1),
        "reduce_scatter_rows along 1": lambda x: C.reduce_scatter_rows(x[:, :4], group, 1),
        "all_to_all": lambda x: C.all_to_all(x, group) * (group.index + 1),
    }


def compare_traced_with_eager() -> dict[str, Any]:
    import torch._dynamo

    import epl
    from epl.interfaces.shard_group import ShardGroup

    env = epl.init()
    group = ShardGroup(env.communicator)
    assert group.traced_group is not None
    checked = {}
    for name, function in cases(group).items():
        torch._dynamo.reset()
        x = torch.randn(4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(group.index))
        results = []
        for run in (function, torch.compile(function, backend="aot_eager", fullgraph=True)):
            leaf = x.clone().requires_grad_()
            out = run(leaf)
            out.backward(torch.arange(out.numel(), dtype=out.dtype).view_as(out))
            results.append((out.detach(), leaf.grad))
        for eager, traced in zip(*results, strict=True):
            torch.testing.assert_close(traced, eager, rtol=0, atol=1e-12, msg=name)
        checked[name] = group.collectives.total()
    return checked


def test_each_collective_traced_equals_it_eager() -> None:
    for found in run_ranks(compare_traced_with_eager, 2, timeout=120):
        assert len(found) == 8, found
