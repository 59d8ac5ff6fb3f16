"""The check that a model trains under context parallelism as in one process, or a clear refusal.

Context parallelism changes only the attention layers that transformers' attention registry reaches: everything
else runs on each device's ``s/c`` tokens. That is right only when everything else works token by token and
reads positions from ``position_ids``. A model that computes positions itself (RoBERTa's from the token ids), mixes
tokens outside its attention (a convolution over the sequence, a linear-attention recurrence), keeps an attention
of its own outside the registry, or whose attention does more than EPL's (ALiBi biases, attention sinks) would
train to a wrong model with no error.

:func:`prove_context_parallel` runs the model twice on one small batch, in one process, before anything is
sharded: as it is, on the whole sequences, and as ``c`` context devices would run it, each device's tokens (with
their global positions) a row block of one batch, EPL's attention (:mod:`epl.context.blockwise`) crossing the row
blocks of each sequence as the ring crosses devices. Equal outputs (within the dtype's rounding) prove the model;
different ones refuse it, naming by how much. No communication: the check is the same on every rank.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from epl.context.blockwise import KeySlices, blockwise_attention
from epl.context.chunks import shard_sequence, unshard_sequence
from epl.context.masks import Masking, TokenFacts
from epl.errors import AnnotationError

if TYPE_CHECKING:
    from epl.context.transformers_models import TransformersModel

#: Largest difference allowed, relative to the largest output, by the model's dtype.
TOLERANCES = {torch.float64: 1e-9, torch.float32: 1e-4}
LOW_PRECISION_TOLERANCE = 5e-2
#: Sequences in the check's batch, and tokens per chunk of a sequence (``2c`` chunks).
ROWS, CHUNK = 2, 4


@dataclass(eq=False)
class SimulatedDevices:
    """A :class:`~epl.context.transformers_models.ContextRun` stand-in for the check: ``count`` devices' tokens as
    row blocks of one batch (``rows`` rows each), attending across the blocks in one process."""

    count: int
    rows: int
    facts: TokenFacts
    calls: int = 0
    presliced: bool = False

    def attend(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, masking: Masking, scale: float | None
    ) -> torch.Tensor:
        """Each device's queries over every device's keys and values, by EPL's blockwise attention (a block per
        device, as the ring brings them)."""
        self.calls += 1
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        facts = [_rows(self.facts, device, self.rows) for device in range(self.count)]
        blocks = KeySlices(TokenFacts.concatenated(facts), self.count)
        keys, values = (torch.cat(t.split(self.rows), 2) for t in (key, value))
        return torch.cat(
            [
                blockwise_attention(q, keys, values, f, blocks, masking, scale)
                for q, f in zip(query.split(self.rows), facts, strict=True)
            ]
        )


def _rows(facts: TokenFacts, device: int, rows: int) -> TokenFacts:
    return facts.map(lambda t: t[device * rows : (device + 1) * rows])


def prove_context_parallel(model: nn.Module, count: int, attention: str) -> None:
    """Refuse (:class:`AnnotationError`) ``model`` unless ``count`` context devices compute what one process does
    on a small batch (see the module docstring); ``attention``: the name EPL's attention is registered under."""
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        raise AnnotationError(
            "context.degree checks that the model trains as in one process by running it once on a few tokens "
            "before sharding it, and this model is on the meta device (no values yet). Build it with values, or "
            "set context.verify to False to skip the check (then nothing shows a model that crosses tokens "
            "outside its attention)."
        )
    transformers_model = cast("TransformersModel", model)
    embeddings = transformers_model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocabulary = getattr(embeddings, "num_embeddings", None)
    if not vocabulary:
        raise AnnotationError(
            f"context.degree checks {type(model).__name__} on a few tokens, but it has no token embedding "
            "(get_input_embeddings) to say which ids it takes. Set context.verify to False to skip the check."
        )
    device = next(model.parameters()).device
    length = 2 * count * CHUNK
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocabulary, (ROWS, length), generator=generator).to(device)
    positions = torch.arange(length, device=device).expand(ROWS, length)
    modes = {module: module.training for module in model.modules()}
    original = transformers_model.config._attn_implementation
    model.eval()
    try:
        with torch.no_grad():
            # As a batch without position_ids runs: positions are the model's own in one process, the global
            # ones EPL passes under context parallelism.
            whole = _first_tensor(model(input_ids=tokens, **_no_cache(model)))
            spread, calls = _spread(model, tokens, positions, count, attention)
    finally:
        transformers_model.set_attn_implementation(original)
        for module, training in modes.items():
            module.training = training
            module.__dict__.pop("_epl_context", None)
    if calls == 0:
        raise AnnotationError(
            f"context.degree spreads attention through transformers' attention registry, and no attention layer of "
            f"{type(model).__name__} called it: its attention is its own code. Keep context.degree at 1 for it."
        )
    scale = float(whole.abs().max()) or 1.0
    difference = float((spread.to(whole.dtype) - whole).abs().max()) / scale
    if difference > TOLERANCES.get(whole.dtype, LOW_PRECISION_TOLERANCE) or spread.shape != whole.shape:
        raise AnnotationError(
            f"{type(model).__name__} would train to a different model under context.degree {count}: run as {count} "
            f"context devices on a few tokens it differs from one process by {difference:.1e} of its largest "
            "output. Something in it crosses tokens outside the attention layers (a convolution or recurrence over "
            "the sequence), reads positions other than position_ids (from the token ids, relative positions), or "
            "its attention does more than EPL's (ALiBi biases, attention sinks). Keep context.degree at 1 for it."
        )


def _spread(
    model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor, count: int, attention: str
) -> tuple[torch.Tensor, int]:
    """The model's output as ``count`` context devices compute it (whole again), and how many attention calls."""
    from epl.context.transformers_models import register_attention

    register_attention()
    pieces = [shard_sequence(t, 1, device, count) for t in (tokens, positions) for device in range(count)]
    my_tokens, my_positions = torch.cat(pieces[:count]), torch.cat(pieces[count:])
    devices = SimulatedDevices(count, tokens.shape[0], TokenFacts.of(my_positions))
    for module in model.modules():
        module.__dict__["_epl_context"] = devices
    cast("TransformersModel", model).set_attn_implementation(attention)
    output = _first_tensor(model(input_ids=my_tokens, position_ids=my_positions, **_no_cache(model)))
    return unshard_sequence(list(output.split(tokens.shape[0])), 1), devices.calls


def _no_cache(model: nn.Module) -> dict[str, bool]:
    """``use_cache=False`` where the model's forward takes it (a key/value cache would outlive the check)."""
    parameters = inspect.signature(model.forward).parameters
    takes = "use_cache" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    return {"use_cache": False} if takes else {}


def _first_tensor(outputs: Any) -> torch.Tensor:
    """The logits (or first tensor) of a model's outputs."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    logits = getattr(outputs, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    return next(value for value in outputs.values() if isinstance(value, torch.Tensor))
