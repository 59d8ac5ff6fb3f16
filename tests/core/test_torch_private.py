"""Each private torch API EPL calls (epl.torch_private) still does what EPL relies on: a torch upgrade that moves or
changes one fails here, by name."""

from __future__ import annotations

import pytest
import torch

from epl import torch_private as private


def test_engine_run_backward_accumulates_as_backward_does() -> None:
    run = private.engine_run_backward()
    assert run is not None, "torch.autograd.graph._engine_run_backward is gone: split_backward takes the public path"
    weight = torch.ones(3, requires_grad=True)
    out = (weight * 2).sum()
    run((out,), (torch.ones(()),), False, False, (), allow_unreachable=True, accumulate_grad=True)
    torch.testing.assert_close(weight.grad, torch.full((3,), 2.0))


def test_pytree_flattens_and_lists_leaves() -> None:
    tree = {"a": [1, (2, 3)], "b": 4}
    leaves, spec = private.tree_flatten(tree)
    assert sorted(leaves) == [1, 2, 3, 4] and spec is not None
    assert sorted(private.tree_leaves(tree)) == [1, 2, 3, 4]


def test_foreach_norm_and_mul() -> None:
    tensors = [torch.tensor([3.0, 4.0]), torch.tensor([-7.0])]
    assert [float(n) for n in private.foreach_norm(tensors, 2.0)] == [5.0, 7.0]
    assert [float(n) for n in private.foreach_norm(tensors, float("inf"))] == [4.0, 7.0]
    private.foreach_mul_(tensors, torch.tensor(2.0))
    assert tensors[0].tolist() == [6.0, 8.0] and tensors[1].tolist() == [-14.0]


def test_amp_unscale_multiplies_and_flags_non_finite_values() -> None:
    grads = [torch.tensor([2.0, 4.0]), torch.tensor([8.0])]
    found = torch.zeros(1)
    private.amp_unscale_(grads, found, torch.tensor([0.5]))
    assert grads[0].tolist() == [1.0, 2.0] and grads[1].tolist() == [4.0] and float(found) == 0.0
    private.amp_unscale_([torch.tensor([float("inf")])], found, torch.tensor([0.5]))
    assert float(found) == 1.0


def test_narrow_by_index_is_a_view_of_the_rectangle() -> None:
    tensor = torch.arange(12.0).reshape(3, 4)
    view = private.narrow_by_index(tensor, [1, 2], [2, 2])
    assert view.tolist() == [[6.0, 7.0], [10.0, 11.0]]
    view.zero_()
    assert float(tensor[2, 3]) == 0.0


def test_compile_backends_are_listed_and_found() -> None:
    names = private.compile_backends()
    assert {"inductor", "aot_eager", "eager"} <= set(names)
    assert callable(private.compile_backend("aot_eager"))
    assert callable(private.inductor_backend(None))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_aot_backends_tell_of_each_forward_and_backward_graph(backend: str) -> None:
    import torch._dynamo

    torch._dynamo.reset()
    seen: list[str] = []
    compiler = (
        private.aot_eager_backend(seen.append)
        if backend == "aot_eager"
        else private.inductor_backend(None, seen.append)
    )
    weight, x = torch.randn(3, requires_grad=True), torch.randn(3)
    torch.compile(lambda x: (x * weight).sin().sum(), backend=compiler)(x).backward()
    assert seen == ["forward", "backward"]  # compiled, or (inductor, a second run) found in AOTAutograd's cache
    torch.testing.assert_close(weight.grad, (x * weight.detach()).cos() * x)


def test_saved_tensor_hooks_are_seen() -> None:
    assert not private.saved_tensor_hooks_active()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert private.saved_tensor_hooks_active()


def test_torch_function_checks_and_disabling() -> None:
    class Marked(torch.Tensor):
        seen: list[str] = []

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            cls.seen.append(getattr(func, "__name__", "?"))
            return super().__torch_function__(func, types, args, kwargs or {})

    marked = torch.ones(2).as_subclass(Marked)
    assert private.has_torch_function((marked,)) and not private.has_torch_function((torch.ones(2),))
    Marked.seen.clear()
    with private.no_torch_function():
        torch.add(marked, 1)
    assert Marked.seen == []


def test_functorch_transforms_are_seen() -> None:
    assert not private.functorch_transforms_active()
    seen = []

    def probe(x: torch.Tensor) -> torch.Tensor:
        seen.append(private.functorch_transforms_active())
        return x

    torch.vmap(probe)(torch.ones(2, 2))
    assert seen == [True]


def test_a_backward_has_an_id_and_runs_a_queued_callback_at_its_end() -> None:
    assert private.current_graph_task_id() == -1
    events: list[object] = []
    weight = torch.ones(2, requires_grad=True)

    def hook(grad: torch.Tensor) -> torch.Tensor:
        events.append(private.current_graph_task_id())
        private.queue_backward_callback(lambda: events.append("end"))
        return grad

    weight.register_hook(hook)
    (weight * 3).sum().backward()
    assert isinstance(events[0], int) and events[0] >= 0 and events[1:] == ["end"]


def test_dtensor_like_keeps_the_local_tensor_where_it_is() -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from epl.ports import free_port

    created = not dist.is_initialized()
    if created:
        store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        like = distribute_tensor(torch.zeros(4, 2), mesh, [Shard(0)])
        made = private.dtensor_like(torch.ones(4, 2), like)
        assert made.placements == like.placements and made.to_local().tolist() == [[1.0, 1.0]] * 4
    finally:
        if created:
            dist.destroy_process_group()


def test_fsdp2_reduces_on_request_outside_a_backward() -> None:
    """What ``reduce_sharded_gradients_now`` reaches into: FSDP2's state, its parameter groups and their
    ``post_backward``, and the root's end-of-backward callback (used under zero-bubble schedules; the behaviour is
    tested on 4 processes in tests/memory/test_zero_layouts.py)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    assert callable(getattr(fully_shard, "state", None))
    assert callable(getattr(FSDPParamGroup, "post_backward", None))
    assert callable(getattr(FSDPState, "_root_post_backward_final_callback", None))
    state = FSDPState()
    assert hasattr(state, "_state_ctx") and hasattr(state._state_ctx, "all_states")
    assert hasattr(state, "_fsdp_param_groups")


def test_functional_collectives_run_eager_and_address_a_group_by_name() -> None:
    """What split's collectives issue inside a compiled block (traced there: tests/split/test_traced_collectives.py)."""
    import torch.distributed as dist

    from epl.ports import free_port

    created = not dist.is_initialized()
    if created:
        store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        funcol = private.functional_collectives()
        name = dist.group.WORLD.group_name  # type: ignore[union-attr]  # set once the process group is
        x = torch.arange(6.0).view(2, 3)
        assert funcol.wait_tensor(funcol.all_reduce(x, "sum", name)).tolist() == x.tolist()
        assert funcol.wait_tensor(funcol.all_gather_tensor(x, 1, name)).shape == (2, 3)
        assert funcol.wait_tensor(funcol.reduce_scatter_tensor(x, "sum", 0, name)).tolist() == x.tolist()
        assert funcol.wait_tensor(funcol.all_to_all_single(x, None, None, name)).tolist() == x.tolist()
    finally:
        if created:
            dist.destroy_process_group()


def test_checkpointed_bookkeeping_sets_dynamo_config_while_entered() -> None:
    import torch._dynamo

    before = torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint
    with private.checkpointed_bookkeeping():
        assert torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint is True
    assert torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint == before
