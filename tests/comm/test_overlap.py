"""Bucket reductions start during backward, as soon as a bucket's last gradient arrives."""

from __future__ import annotations

import torch
from torch import nn

from epl.builtin.local_communicator import LocalCommunicator
from epl_comm.data_parallel import DataParallelReducer, ReducePolicy


def model_and_reducer(**policy: object) -> tuple[nn.Sequential, DataParallelReducer, list[bool]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    defer = bool(policy.pop("defer", False))
    reducer = DataParallelReducer(
        list(model.parameters()),
        [LocalCommunicator()],
        ReducePolicy(copies=1, max_splits=3, **policy),  # type: ignore[arg-type]
        defer_until_finish=defer,
    )
    reducer.start()
    seen: list[bool] = []
    # The first layer's weight is the last gradient of backward: what had started by then?
    model[0].weight.register_post_accumulate_grad_hook(lambda p: seen.append(reducer.buckets[0].started))
    return model, reducer, seen


def test_last_layers_start_reducing_before_backward_reaches_the_first_layer() -> None:
    model, reducer, seen = model_and_reducer()
    assert any(p is model[4].weight for p in reducer.buckets[0].params)
    model(torch.randn(3, 4)).sum().backward()
    assert seen == [True]
    reducer.finish(None)
    assert all(bucket.started is False for bucket in reducer.buckets)  # reset for the next step


def test_with_micro_batches_only_the_last_backward_starts_buckets() -> None:
    model, reducer, seen = model_and_reducer(num_micro_batch=2)
    model(torch.randn(3, 4)).sum().backward()
    model(torch.randn(3, 4)).sum().backward()
    assert seen == [False, True]
    reducer.finish(None)


def test_clipping_before_the_reduction_defers_every_bucket_to_finish() -> None:
    model, reducer, seen = model_and_reducer(defer=True)
    model(torch.randn(3, 4)).sum().backward()
    assert seen == [False]
    order: list[str] = []
    reducer.finish(lambda: order.append(f"clip with {sum(b.started for b in reducer.buckets)} started"))
    assert order == ["clip with 0 started"]


def test_reduced_gradients_are_the_local_gradients_for_one_copy() -> None:
    model, reducer, _ = model_and_reducer()
    model(torch.randn(3, 4)).sum().backward()
    before = [p.grad.clone() for p in model.parameters()]
    reducer.finish(None)
    assert all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters(), strict=True))


def test_a_backward_outside_a_step_is_not_reduced() -> None:
    model, reducer, seen = model_and_reducer()
    reducer.finish(None)  # the step ends; the next backward is outside any step
    model(torch.randn(3, 4)).sum().backward()
    assert seen == [False]
    assert all(bucket.work is None for bucket in reducer.buckets)
    model.zero_grad()
    reducer.start()
    model(torch.randn(3, 4)).sum().backward()
    assert seen == [False, True]
    reducer.finish(None)
