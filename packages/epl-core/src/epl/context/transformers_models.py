"""Context parallelism on transformers' models as they are: their attention registry, their inputs, their loss.

- **Attention.** :data:`ATTENTION` is registered in transformers' ``AttentionInterface`` and set as the model's
  attention implementation, so every attention layer calls :func:`context_attention`, which runs the chosen
  mode (ring, all-gather, Ulysses) over the context group. transformers builds no mask for an implementation
  its mask registry does not know; the mask comes from the tokens' facts instead (causal or not, the layer's
  sliding window, packed documents, padding).
- **Inputs.** A forward pre-hook on the model takes the replica's whole batch (every device of a replica passes
  the same) and keeps this device's tokens (:mod:`epl.context.chunks`): ``input_ids`` or ``inputs_embeds``,
  ``position_ids`` (made from the sequence when absent: the rotary embedding reads the global positions),
  and the facts the masks need, from ``attention_mask`` (padding) and ``position_ids`` (packed documents, read
  as transformers reads them: without a mask and without a key/value cache). ``attention_mask`` itself is not
  passed on, and no key/value cache is made.
- **Loss.** ``labels`` are shifted on the whole sequence (the next token of a device's last token lives on
  another device), then sliced, and passed as transformers' ``shift_labels``, with ``num_items_in_batch`` the
  replica's count of labelled tokens over ``c``: each device's loss is ``c`` times its tokens' share of the
  replica's token-weighted mean, so the mean over the context devices (which data parallelism takes, over data
  x context devices) is the replica's loss and gradient. A ``loss_fn`` of the user's gets the logits gathered
  whole, and its gradient is counted ``c`` times on each device's own tokens, for the same reason.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from epl.context.allgather import allgather_attention
from epl.context.chunks import check_length, shard_sequence, unshard_sequence
from epl.context.masks import Masking, TokenFacts, documents_from_positions
from epl.context.ring import ContextGroup, ring_attention
from epl.context.ulysses import ulysses_attention
from epl.errors import AnnotationError, EplError

#: The name EPL's attention is registered under in transformers' attention registry.
ATTENTION = "epl_context"
MODES = {"ring": ring_attention, "allgather": allgather_attention, "ulysses": ulysses_attention}


@dataclass(eq=False)
class ContextRun:
    """One model's context parallelism: the group, the mode, and the facts of the tokens of the forward in
    flight on this device."""

    group: ContextGroup
    mode: str
    facts: TokenFacts | None = None


def install(model: nn.Module, group: ContextGroup, mode: str) -> ContextRun:
    """Make ``model`` (a transformers model) attend over ``group`` and take only this device's tokens."""
    if mode not in MODES:
        raise AnnotationError(f"context.mode {mode!r} is not one of {sorted(MODES)}.")
    if not hasattr(model, "set_attn_implementation") or getattr(model, "config", None) is None:
        raise AnnotationError(
            f"context.degree spreads attention over devices through transformers' attention registry; "
            f"{type(model).__name__} is not a transformers model (PreTrainedModel). Keep context.degree at 1 for it."
        )
    _register()
    run = ContextRun(group, mode)
    for module in model.modules():
        module.__dict__["_epl_context"] = run  # read by context_attention, also when checkpointing recomputes
    model.set_attn_implementation(ATTENTION)
    model.register_forward_pre_hook(functools.partial(_take_my_tokens, run), with_kwargs=True)
    return run


@functools.cache
def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, context_attention)


def context_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``[b, h, t, d]`` in, ``([b, t, h, d], None)`` out."""
    run: ContextRun | None = module.__dict__.get("_epl_context")
    if run is None or run.facts is None:
        raise EplError(f"{type(module).__name__} ran EPL's context attention outside a context-parallel model.")
    if kwargs.get("softcap") is not None:
        raise AnnotationError(
            f"{type(module).__name__} caps its attention scores (softcap), which EPL's context attention does not "
            "do: keep context.degree at 1 for this model."
        )
    if dropout and module.training:
        raise AnnotationError(
            f"{type(module).__name__} has attention dropout {dropout}, which EPL's context attention does not "
            "draw: set the model's attention dropout to 0, or keep context.degree at 1."
        )
    masking = Masking(causal=bool(getattr(module, "is_causal", True)), window=kwargs.get("sliding_window"))
    output = MODES[run.mode](query, key, value, run.facts, run.group, masking=masking, scale=scaling)
    return output.transpose(1, 2).contiguous(), None


def _take_my_tokens(run: ContextRun, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The forward pre-hook: this device's tokens of every sequence, their facts, and the labels shifted whole."""
    kwargs = dict(kwargs)
    if args:
        if "input_ids" in kwargs or len(args) > 1:
            raise AnnotationError("Under context.degree pass the model's inputs by name (input_ids=..., labels=...).")
        kwargs["input_ids"], args = args[0], ()
    tokens = kwargs.get("input_ids")
    tokens = tokens if tokens is not None else kwargs.get("inputs_embeds")
    if tokens is None:
        raise AnnotationError("Under context.degree the model needs input_ids or inputs_embeds.")
    c, index = run.group.count, run.group.index
    batch, length = tokens.shape[:2]
    check_length(length, c)
    given = kwargs.get("position_ids")
    positions = given if given is not None else torch.arange(length, device=tokens.device).expand(batch, length)
    mask = kwargs.pop("attention_mask", None)
    if mask is not None and mask.dim() != 2:
        raise AnnotationError(
            f"Under context.degree the attention_mask must be [batch, sequence] (padding); got {list(mask.shape)}. "
            "Give packed documents as position_ids restarting at 0."
        )
    # transformers reads packed documents from position_ids only without a mask and without a key/value cache
    # (a training setup: use_cache False), and so does EPL; the cache itself is never made here.
    caching = kwargs.get("use_cache")
    caching = getattr(getattr(model, "config", None), "use_cache", False) if caching is None else caching
    packed = given is not None and mask is None and not caching
    documents = documents_from_positions(positions) if packed else None
    kwargs["use_cache"] = False
    facts = TokenFacts.of(positions, documents, mask)
    run.facts = TokenFacts(*(shard_sequence(t, 1, index, c) for t in (facts.positions, facts.documents, facts.valid)))
    for name in ("input_ids", "inputs_embeds"):
        if kwargs.get(name) is not None:
            kwargs[name] = shard_sequence(kwargs[name], 1, index, c)
    kwargs["position_ids"] = run.facts.positions
    labels = kwargs.get("labels")
    if labels is not None:
        shifted = torch.cat([labels[:, 1:], labels.new_full((batch, 1), -100)], 1)
        kwargs["labels"] = kwargs["shift_labels"] = shard_sequence(shifted, 1, index, c)
        kwargs["num_items_in_batch"] = (shifted != -100).sum().to(torch.float32) / c
    return args, kwargs


def gathered_outputs(outputs: Any, group: ContextGroup) -> Any:
    """The model's outputs with their logits whole (for a user's ``loss_fn``); the gradient that comes back to
    each device's own tokens is counted ``c`` times (see the module's docstring)."""
    if isinstance(outputs, torch.Tensor):
        return _GatherSequence.apply(outputs, group)
    logits = getattr(outputs, "logits", None)
    if logits is None:
        raise AnnotationError(
            "Under context.degree a loss_fn reads the model's logits gathered whole: the model returned "
            f"{type(outputs).__name__} without logits. Pass labels in the batch for the model's own loss instead."
        )
    whole = _GatherSequence.apply(logits, group)
    if isinstance(outputs, dict):
        outputs = type(outputs)(**{**outputs, "logits": whole})
    else:
        outputs.logits = whole
    return outputs


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: ContextGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        piece = local.contiguous()
        output = piece.new_empty((group.count * piece.shape[0], *piece.shape[1:]))
        group.collectives["all_gather"] += 1
        group.communicator.all_gather(output, piece).wait()
        return unshard_sequence(list(output.split(piece.shape[0])), 1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        group = ctx.group
        return shard_sequence(grad, 1, group.index, group.count) * group.count, None
