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
- **Outputs.** A forward without gradients (``Engine.predict``, ``Engine.evaluate``) returns the logits of the
  whole sequence on every device, in order; a training forward keeps each device's own tokens' logits.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
from torch import nn

from epl.context.allgather import allgather_attention
from epl.context.chunks import check_length, local_runs, shard_sequence, unshard_sequence
from epl.context.masks import Masking, TokenFacts, documents_from_positions
from epl.context.ring import ContextGroup, ring_attention
from epl.context.ulysses import ulysses_attention
from epl.errors import AnnotationError, EplError
from epl.sharding.logits import same_marks


class TransformersModel(Protocol):
    """What EPL calls on a transformers model (a ``PreTrainedModel``) beside ``nn.Module``'s own methods."""

    config: Any

    def get_input_embeddings(self) -> nn.Module:
        """The token embedding."""
        ...

    def set_attn_implementation(self, attn_implementation: str) -> None:
        """Make the attention layers call the attention registered under this name."""
        ...


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
    #: The loader gives each device its own tokens (``context.presliced``): nothing is sliced here.
    presliced: bool = False

    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, masking: Masking, scale: float | None
    ) -> torch.Tensor:
        """This device's attention over the group by the chosen mode (``[b, h, t, d]`` in and out)."""
        assert self.facts is not None
        return MODES[self.mode](query, key, value, self.facts, self.group, masking=masking, scale=scale)


def install(model: nn.Module, group: ContextGroup, mode: str, *, presliced: bool = False) -> ContextRun:
    """Make ``model`` (a transformers model) attend over ``group`` and take only this device's tokens (given only
    those, ``presliced``)."""
    if mode not in MODES:
        raise AnnotationError(f"context.mode {mode!r} is not one of {sorted(MODES)}.")
    check_installable(model)
    register_attention()
    run = ContextRun(group, mode, presliced=presliced)
    for module in model.modules():
        module.__dict__["_epl_context"] = run  # read by context_attention, also when checkpointing recomputes
    cast(TransformersModel, model).set_attn_implementation(ATTENTION)  # check_installable checked it has one
    model.register_forward_pre_hook(functools.partial(_take_my_tokens, run), with_kwargs=True)
    model.register_forward_hook(functools.partial(_whole_logits_without_grad, run))
    return run


def check_installable(model: nn.Module) -> None:
    """Refuse a model EPL's context attention cannot reach: not a transformers model, or an encoder-decoder."""
    if not hasattr(model, "set_attn_implementation") or getattr(model, "config", None) is None:
        raise AnnotationError(
            f"context.degree spreads attention over devices through transformers' attention registry; "
            f"{type(model).__name__} is not a transformers model (PreTrainedModel). Keep context.degree at 1 for it."
        )
    if getattr(model.config, "is_encoder_decoder", False):
        raise AnnotationError(
            f"context.degree spreads one sequence over devices; {type(model).__name__} is an encoder-decoder, whose "
            "decoder attends over the encoder's tokens (cross-attention between two sequences), which EPL's context "
            "attention does not spread yet. Keep context.degree at 1 for it."
        )


@functools.cache
def register_attention() -> None:
    """Register :func:`context_attention` in transformers' attention registry as :data:`ATTENTION` (once)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, context_attention)


@torch.compiler.disable  # collectives and EPL's own kernels: a compiled block breaks its graph here (compile.enabled)
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
    run: ContextRun | None = module.__dict__.get("_epl_context")  # or the check's SimulatedDevices
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
    if key.shape[-1] != value.shape[-1]:
        raise AnnotationError(
            f"{type(module).__name__} has keys of head size {key.shape[-1]} and values of {value.shape[-1]} "
            "(multi-head latent attention), which EPL's context attention does not carry yet: keep context.degree "
            "at 1 for this model."
        )
    masking = Masking(causal=bool(getattr(module, "is_causal", True)), window=kwargs.get("sliding_window"))
    output = run.attend(query, key, value, masking, scaling)
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
    mask = kwargs.pop("attention_mask", None)
    if mask is not None and mask.dim() != 2:
        raise AnnotationError(
            f"Under context.degree the attention_mask must be [batch, sequence] (padding); got {list(mask.shape)}. "
            "Give packed documents as position_ids restarting at 0."
        )
    if run.presliced:
        return _take_presliced(run, model, kwargs, mask)
    c, index = run.group.count, run.group.index
    batch, length = tokens.shape[:2]
    check_length(length, c)
    given = kwargs.get("position_ids")
    positions = given if given is not None else torch.arange(length, device=tokens.device).expand(batch, length)
    run.facts = _my_facts(run, model, kwargs, positions, mask, packed=given is not None)
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


def _whole_logits_without_grad(run: ContextRun, model: nn.Module, args: Any, outputs: Any) -> Any:
    """The forward hook: a forward without gradients (``Engine.predict``, ``Engine.evaluate``) returns the logits
    of the whole sequence, in order, on every device; training keeps each device's own."""
    if torch.is_grad_enabled():
        return None
    return gathered_outputs(outputs, run.group)


#: Set on logits already gathered whole along the sequence.
_WHOLE = "_epl_whole_sequence"


def _my_facts(
    run: ContextRun,
    model: nn.Module,
    kwargs: dict[str, Any],
    positions: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    packed: bool,
) -> TokenFacts:
    """This device's tokens' facts from the whole sequence's ``positions`` and padding ``mask``; ``packed``:
    the positions were given (documents are read from them)."""
    # transformers reads packed documents from position_ids only without a mask and without a key/value cache
    # (a training setup: use_cache False), and so does EPL; the cache itself is never made here.
    caching = kwargs.get("use_cache")
    caching = getattr(getattr(model, "config", None), "use_cache", False) if caching is None else caching
    documents = documents_from_positions(positions) if packed and mask is None and not caching else None
    kwargs["use_cache"] = False
    facts = TokenFacts.of(positions, documents, mask)
    c, index = run.group.count, run.group.index
    runs = local_runs(positions.shape[1], index, c) if _plain(positions, mask, packed=packed) else None
    return facts.map(lambda t: shard_sequence(t, 1, index, c), runs)


def _plain(positions: torch.Tensor, mask: torch.Tensor | None, *, packed: bool) -> bool:
    """Whether the whole batch is one document per row at positions ``0..s-1`` without padding (then the fused
    kernels compute its attention): known on the host when neither ``position_ids`` nor ``attention_mask`` was
    given, else read from them once per forward (one host synchronisation, not one per attention block)."""
    checks = []
    if packed:
        checks.append((positions == torch.arange(positions.shape[1], device=positions.device)).all())
    if mask is not None:
        checks.append(mask.bool().all())
    return not checks or bool(torch.stack(checks).all())


def _take_presliced(
    run: ContextRun, model: nn.Module, kwargs: dict[str, Any], mask: torch.Tensor | None
) -> tuple[tuple[()], dict[str, Any]]:
    """The forward pre-hook under ``context.presliced``: the inputs are this device's tokens already; the whole
    sequence's positions, padding and labels (small integer tensors) are gathered to read the facts and count the
    labelled tokens as the sliced path does."""
    positions = kwargs.get("position_ids")
    if positions is None or kwargs.get("labels") is not None:
        raise AnnotationError(
            "Under context.presliced each rank gives its own share of every sequence (epl.context.my_share), "
            "so EPL needs the tokens' global position_ids"
            + (
                " and shift_labels (labels shifted on the whole sequence, then cut), not labels"
                if positions is not None
                else ""
            )  # fmt: skip
            + ". Pass them by name, or set context.presliced to False and give every rank the whole batch."
        )
    whole_positions = _gather_sequence(run.group, positions)
    whole_mask = None if mask is None else _gather_sequence(run.group, mask)
    run.facts = _my_facts(run, model, kwargs, whole_positions, whole_mask, packed=True)
    kwargs["position_ids"] = run.facts.positions
    shifted = kwargs.get("shift_labels")
    if shifted is not None:
        kwargs["labels"] = shifted
        counted = (_gather_sequence(run.group, shifted) != -100).sum()
        kwargs["num_items_in_batch"] = counted.to(torch.float32) / run.group.count
    return (), kwargs


def _gather_sequence(group: ContextGroup, local: torch.Tensor) -> torch.Tensor:
    """The whole sequence of ``local`` (this device's tokens along dimension 1), in order; no gradient flows
    (:class:`_GatherSequence` gives it one)."""
    piece = local.contiguous()
    output = piece.new_empty((group.count * piece.shape[0], *piece.shape[1:]))
    group.collectives["all_gather"] += 1
    group.communicator.all_gather(output, piece).wait()
    return unshard_sequence(list(output.split(piece.shape[0])), 1)


def gathered_outputs(outputs: Any, group: ContextGroup) -> Any:
    """The model's outputs with their logits whole (for a user's ``loss_fn``); the gradient that comes back to
    each device's own tokens is counted ``c`` times (see the module's docstring)."""
    if isinstance(outputs, torch.Tensor):
        return outputs if hasattr(outputs, _WHOLE) else _whole(outputs, group)
    logits = getattr(outputs, "logits", None)
    if logits is None:
        raise AnnotationError(
            "Under context.degree a loss_fn reads the model's logits gathered whole: the model returned "
            f"{type(outputs).__name__} without logits. Pass labels in the batch for the model's own loss instead."
        )
    if hasattr(logits, _WHOLE):
        return outputs
    whole = _whole(logits, group)
    if isinstance(outputs, dict):
        outputs = type(outputs)(**{**outputs, "logits": whole})
    else:
        outputs.logits = whole
    return outputs


def _whole(local: torch.Tensor, group: ContextGroup) -> torch.Tensor:
    """``local`` ([batch, this device's tokens, ...]) gathered along the sequence, marked whole; a split head's
    logits stay marked class-sharded."""
    whole = same_marks(local, _GatherSequence.apply(local, group))
    setattr(whole, _WHOLE, True)
    return whole


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: ContextGroup) -> torch.Tensor:
        ctx.group = group
        return _gather_sequence(group, local)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        group = ctx.group
        return shard_sequence(grad, 1, group.index, group.count) * group.count, None
