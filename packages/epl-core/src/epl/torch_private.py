"""Every private torch API EPL calls, in one place: what each is for, and what EPL does where it is missing.

torch keeps no promise about names that start with an underscore or live in its private modules. EPL uses some
where no public API does the job (each function below says which). They are reached only through this module, so a
torch upgrade that moves one fails here, in ``tests/core/test_torch_private.py`` (a test per API), rather than
somewhere inside a training step. Plugins reach them through :mod:`epl.plugin_api`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

try:  # torch's pytree: no public module in torch 2.13
    from torch.utils import _pytree as pytree
except ImportError:  # pragma: no cover - another torch
    from torch.utils import pytree  # type: ignore[attr-defined,no-redef]  # a torch where it is public

__all__ = [
    "amp_unscale_",
    "aot_eager_backend",
    "checkpointed_bookkeeping",
    "compile_backend",
    "compile_backends",
    "current_graph_task_id",
    "dtensor_like",
    "engine_run_backward",
    "foreach_mul_",
    "foreach_norm",
    "functional_collectives",
    "functorch_transforms_active",
    "has_torch_function",
    "inductor_backend",
    "narrow_by_index",
    "no_torch_function",
    "queue_backward_callback",
    "reduce_sharded_gradients_now",
    "saved_tensor_hooks_active",
    "tree_flatten",
    "tree_leaves",
]


def engine_run_backward() -> Callable[..., Any] | None:
    """The function ``torch.autograd.backward`` and ``torch.autograd.grad`` call once they have checked their
    arguments (``torch.autograd.graph._engine_run_backward``), for callers that run many small backwards whose
    arguments are right by construction (a zero-bubble schedule's split backward); None where torch has no such
    function (callers then take the public functions)."""
    import torch.autograd.graph

    return getattr(torch.autograd.graph, "_engine_run_backward", None)


def tree_flatten(tree: Any) -> tuple[list[Any], Any]:
    """The leaves of a nest of lists, tuples and dicts, and its structure (torch's pytree, ``tree_flatten``)."""
    return pytree.tree_flatten(tree)


def tree_leaves(tree: Any) -> list[Any]:
    """The leaves of a nest of lists, tuples and dicts (torch's pytree, ``tree_leaves``)."""
    return pytree.tree_leaves(tree)


def foreach_norm(tensors: Sequence[torch.Tensor], ord: float) -> list[torch.Tensor]:
    """Each tensor's ``ord``-norm, by one fused kernel where torch has it (``torch._foreach_norm``)."""
    fused = getattr(torch, "_foreach_norm", None)
    if fused is None:  # pragma: no cover - another torch
        return [torch.linalg.vector_norm(t, ord) for t in tensors]
    return list(fused(list(tensors), ord))


def foreach_mul_(tensors: Sequence[torch.Tensor], factor: torch.Tensor) -> None:
    """Multiply every tensor in place by ``factor`` (a one-element tensor), by one fused kernel
    (``torch._foreach_mul_``)."""
    fused = getattr(torch, "_foreach_mul_", None)
    if fused is None:  # pragma: no cover - another torch
        for tensor in tensors:
            tensor.mul_(factor)
        return
    fused(list(tensors), factor)


def amp_unscale_(grads: Sequence[torch.Tensor], found: torch.Tensor, inverse: torch.Tensor) -> None:
    """Multiply ``grads`` in place by ``inverse`` and set ``found`` (float, one element) to 1 where one holds a NaN
    or Inf: what ``torch.amp.GradScaler.unscale_`` runs (``torch._amp_foreach_non_finite_check_and_unscale_``),
    one kernel over all of them without a host sync."""
    fused = getattr(torch, "_amp_foreach_non_finite_check_and_unscale_", None)
    if fused is None:  # pragma: no cover - another torch
        for grad in grads:
            found.copy_(torch.maximum(found, (~torch.isfinite(grad)).any().to(found.dtype)))
            grad.mul_(inverse)
        return
    fused(list(grads), found, inverse)


def narrow_by_index(tensor: torch.Tensor, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    """The view of ``tensor`` at ``offsets`` of ``sizes`` (DCP's own helper for a stored rectangle,
    ``torch.distributed._shard._utils.narrow_tensor_by_index``)."""
    try:
        from torch.distributed._shard._utils import narrow_tensor_by_index
    except ImportError:  # pragma: no cover - another torch
        for dim, (offset, size) in enumerate(zip(offsets, sizes, strict=True)):
            if size < tensor.size(dim):
                tensor = tensor.narrow(dim, offset, size)
        return tensor
    return narrow_tensor_by_index(tensor, offsets, sizes)


def compile_backend(name: str) -> Callable[..., Any]:
    """The ``torch.compile`` backend registered as ``name`` (``torch._dynamo.lookup_backend``)."""
    import torch._dynamo

    return torch._dynamo.lookup_backend(name)


def checkpointed_bookkeeping() -> contextlib.AbstractContextManager[Any]:
    """While entered, dynamo traces a checkpointed forward that sets attributes of objects outside it, without
    replaying those writes when the backward recomputes it (``torch._dynamo.config.patch(
    skip_fwd_side_effects_in_bwd_under_checkpoint=True)``; dynamo reads its config as it traces). Without it dynamo
    gives up on the whole frame, which then runs eager."""
    import torch._dynamo

    patched: contextlib.AbstractContextManager[Any] = torch._dynamo.config.patch(
        skip_fwd_side_effects_in_bwd_under_checkpoint=True
    )
    return patched


def compile_backends() -> list[str]:
    """The names ``torch.compile`` takes as a backend, every tag included (``torch._dynamo.list_backends``)."""
    import torch._dynamo

    return list(torch._dynamo.list_backends(exclude_tags=()))


def inductor_backend(mode: str | None, on_graph: Callable[[str], None] | None = None) -> Callable[..., Any]:
    """What ``torch.compile(backend="inductor", mode=mode)`` builds (``torch._TorchCompileInductorWrapper``), so that
    EPL can wrap it.

    With ``on_graph``, it calls ``on_graph("forward")`` or ``on_graph("backward")`` for each graph AOTAutograd has
    inductor compile: it passes ``torch._inductor.compile_fx.compile_fx`` an ``inner_compile`` that counts and
    calls inductor's own (``compile_fx_inner``; ``is_backward`` tells the backward), with the mode's config as
    ``config_patches``, as the wrapper does. A backward graph is compiled at the first backward. A graph found in
    AOTAutograd's cache (``counters["aot_autograd"]["autograd_cache_hit"]``) comes back compiled, backward
    included, without ``inner_compile``: it is counted as a forward, and a backward where AOTAutograd makes one
    (grad mode on and an input that requires grad).
    """
    if on_graph is None:
        return torch._TorchCompileInductorWrapper(mode, None, None)
    return _CountedInductor(mode, on_graph)


class _CountedInductor(torch._TorchCompileInductorWrapper):
    """``torch._TorchCompileInductorWrapper`` (its mode's config, ``reset`` and ``get_compiler_config`` kept) that
    tells ``on_graph`` of each forward and backward graph it compiles (:func:`inductor_backend`)."""

    def __init__(self, mode: str | None, on_graph: Callable[[str], None]) -> None:
        super().__init__(mode, None, None)  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        self.on_graph = on_graph

    def __call__(self, model_: Any, inputs_: Any, *, config_patches: dict[str, Any] | None = None) -> Any:
        from torch._dynamo.utils import counters
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        def inner_compile(graph: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
            compiled = compile_fx_inner(graph, example_inputs, **kwargs)
            self.on_graph("backward" if kwargs.get("is_backward") else "forward")
            return compiled

        hits = counters["aot_autograd"]["autograd_cache_hit"]
        # The region's name, where this torch's wrapper and compile_fx have one (torch 2.13 does; older ones not)
        named = getattr(self, "name", None) is not None and "compile_region_name" in _parameters(compile_fx)
        compiled = compile_fx(
            model_,
            inputs_,
            inner_compile=inner_compile,
            config_patches={**self.config, **(config_patches or {})},
            **({"compile_region_name": self.name} if named else {}),
        )
        if counters["aot_autograd"]["autograd_cache_hit"] > hits:  # forward and backward loaded, not compiled
            self.on_graph("forward")
            if torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in inputs_):
                self.on_graph("backward")
        return compiled


def _parameters(function: Callable[..., Any]) -> set[str]:
    """The names of ``function``'s parameters (none when it has no signature)."""
    try:
        return set(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return set()


def aot_eager_backend(on_graph: Callable[[str], None]) -> Callable[..., Any]:
    """torch's ``aot_eager`` backend (``torch._dynamo.backends.debugging.aot_eager``: AOTAutograd around a compiler
    that runs the graph as it is, ``get_nop_func``), calling ``on_graph("forward")`` for each forward (or
    inference) graph it is given and ``on_graph("backward")`` for each backward graph (at the first backward)."""
    from torch._dynamo.backends.debugging import aot_eager, get_nop_func

    def counted(direction: str) -> Callable[..., Any]:
        def compiler(graph: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
            compiled = get_nop_func()(graph, list(example_inputs))
            on_graph(direction)
            return compiled

        return compiler

    return functools.partial(aot_eager, fw_compiler=counted("forward"), bw_compiler=counted("backward"))


def functional_collectives() -> Any:
    """torch's functional collectives (``torch.distributed._functional_collectives``: ``all_reduce``,
    ``all_gather_tensor``, ``reduce_scatter_tensor``, ``all_to_all_single``, ``wait_tensor``), which dynamo traces
    into a compiled graph rather than breaking it; they address a process group by its name."""
    import torch.distributed._functional_collectives as funcol

    return funcol


def saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor hooks are active already (``torch._C._autograd._top_saved_tensors_default_hooks``); True
    where torch cannot say, the safe answer for its callers."""
    try:
        return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
    except (AttributeError, TypeError):  # pragma: no cover - another torch
        return True


def no_torch_function() -> contextlib.AbstractContextManager[Any]:
    """A block in which tensor subclasses' ``__torch_function__`` is not called (``torch._C.DisableTorchFunction``)."""
    return torch._C.DisableTorchFunction()


def has_torch_function(tensors: tuple[Any, ...]) -> bool:
    """Whether any of ``tensors`` overrides torch functions (``torch._C._has_torch_function``)."""
    return bool(torch._C._has_torch_function(tensors))


def functorch_transforms_active() -> bool:
    """Whether a functorch transform (vmap, grad) is active (``torch._C._are_functorch_transforms_active``)."""
    return bool(torch._C._are_functorch_transforms_active())


def current_graph_task_id() -> int:
    """The id of the backward running on this thread, -1 outside one (``torch._C._current_graph_task_id``)."""
    return int(torch._C._current_graph_task_id())


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the running backward ends, on its thread (the engine's ``queue_callback``, as FSDP2
    does for its own end of backward)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def dtensor_like(local: torch.Tensor, like: Any) -> Any:
    """A DTensor over ``local`` placed as ``like`` (a DTensor) is, wherever ``local`` lives: DTensor's constructor with
    ``like``'s spec. ``DTensor.from_local`` would move ``local`` to the mesh's device type; FSDP2 builds its host
    chunks under offload the same way."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, like._spec, requires_grad=False)


def reduce_sharded_gradients_now(root: torch.nn.Module) -> None:
    """Have FSDP2 reduce-scatter the gradients its groups under ``root`` (a root ``fully_shard`` module) hold now, and
    wait for it, outside a backward. FSDP2 has no public call for it; these are the calls
    ``torch.distributed.pipelining`` makes for its own FSDP stages (``PipelineStage.perform_reduce_grad``): each
    group's ``post_backward``, then the root's end-of-backward callback."""
    from torch.distributed.fsdp import fully_shard

    state = fully_shard.state(root)  # type: ignore[attr-defined]  # set on it by torch's @contract decorator
    for each in state._state_ctx.all_states:
        for group in each._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()
