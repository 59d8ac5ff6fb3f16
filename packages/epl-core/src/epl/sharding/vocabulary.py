"""Token ids and class labels outside the vocabulary fail under ``epl.split`` as they do in one process.

In one process ``nn.Embedding`` and ``F.cross_entropy`` raise ``IndexError`` for an id outside
``0 .. size - 1``. Split over devices, nothing would: the vocabulary-parallel embedding looks an id up
on the device whose rows hold it and writes zeros on the others, so an id outside every device's rows
embeds as zeros; the parallel cross-entropy finds the target's logit on no device and trains towards
nothing. Both check what they are given first (:func:`check_in_vocabulary`) and raise one
:class:`~epl.errors.VocabularyError` naming the id and the size. The ranks of a split group are given the
same ids (the replica's batch, or every device's rows gathered), so each of them raises, before the
collective that follows: none waits for another.

**Cost.** One reduction (``aminmax``) and one read of its two numbers on the host per call (labels: one
more pass, which sets ``ignore_index`` to 0). On the CPU, where EPL's split benchmarks run, that is 11
microseconds for the 2 x 128 ids of the split Llama benchmark and 22 for its 254 labels (2-core CI machine,
torch 2.13; best of 5 x 5000 calls): 0.02 % of that benchmark's 203 ms step, with no collective (every rank
checks the same ids). On a GPU the read is a host synchronisation: 47 microseconds a call on an idle
H200 (torch 2.11). ``torch._assert_async`` would cost more there (56: four small kernels instead of two)
and kill the CUDA context without naming the id, so it is not used. The split needs two GPUs; on one H200
the split benchmark's Llama (hidden 512, 4 layers, 2 x 128 tokens, AdamW) steps in 22.2 ms, so the two
checks of a step (ids and labels) are about 0.4 % of it; timed with them (15 rounds of 20 steps, with and
without a ``float(loss)`` after each), the step took 22.1 to 23.2 ms: within its own noise. The check is
skipped on the ``meta`` device and runs eagerly under ``torch.compile``.

**Pipelines.** A stage that holds no embedding never sees the ids; were only the first stage to raise,
the others would wait for its activations until ``communication.timeout``. So where split TaskGraphs
run in pipeline stages, every rank checks the batch itself when the step begins, against the
:class:`ModelVocabulary` read from the whole model before it was cut into stages
(:mod:`epl.runtime.vocabulary_check`).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch
from torch import nn

from epl.errors import VocabularyError

#: What the error of a token id outside the vocabulary advises.
IDS_FIX = (
    "Give the model ids its tokenizer made for this vocabulary (a transformers model's config.vocab_size), or "
    "resize the embedding first (model.resize_token_embeddings(len(tokenizer)))."
)
#: What the error of a label outside the output layer's classes advises.
LABELS_FIX = "Give labels the model's output layer has classes for, and -100 (ignore_index) where no loss is wanted."


@dataclass
class ModelVocabulary:
    """What a batch's token ids and labels must lie in, read from the whole model on every rank (None: not known).

    ``token_ids``: the rows of the model's input embedding (transformers' ``get_input_embeddings()``) where
    a split TaskGraph holds it; ``labels``: the output features of its output layer
    (``get_output_embeddings()``) where a split TaskGraph holds that.
    """

    token_ids: int | None = None
    labels: int | None = None

    def read(self, model: nn.Module, split_tensors: Collection[int] | None = None) -> None:
        """Fill this in from ``model`` (whole), whose split TaskGraphs hold the tensors of ids ``split_tensors``
        (None: read both wherever they are)."""
        embedding = _call(model, "get_input_embeddings")
        if isinstance(embedding, nn.Embedding) and (split_tensors is None or id(embedding.weight) in split_tensors):
            self.token_ids = embedding.num_embeddings
        head = _call(model, "get_output_embeddings")
        if isinstance(head, nn.Linear) and (split_tensors is None or id(head.weight) in split_tensors):
            self.labels = head.out_features

    @classmethod
    def of(cls, model: nn.Module) -> ModelVocabulary:
        """The input embedding's rows and the output layer's classes of ``model`` (whole), wherever they are."""
        vocabulary = cls()
        vocabulary.read(model)
        return vocabulary


def _call(model: nn.Module, name: str) -> nn.Module | None:
    """``model.<name>()`` (transformers' accessors), or None where the model has none or it fails."""
    method = getattr(model, name, None)
    try:
        return method() if callable(method) else None
    except Exception:  # noqa: BLE001 - a model without the accessor is one EPL knows nothing of: no check
        return None


@torch.compiler.disable
def check_in_vocabulary(
    ids: torch.Tensor,
    size: int,
    what: str,
    *,
    ignore_index: int | None = None,
    fix: str = "",
    bound: str = "the vocabulary of {size}",
    why: str = "In one process PyTorch raises IndexError for them; split over devices they would train silently on "
    "zeros.",
) -> None:
    """Raise :class:`~epl.errors.VocabularyError` unless every element of ``ids`` is in ``0 .. size - 1``
    (or equals ``ignore_index``). ``what`` names the ids and their reader in the message, ``bound`` what ``size``
    counts; ``why`` says why EPL checks; ``fix`` adds advice."""
    if ids.numel() == 0 or ids.device.type == "meta" or ids.is_floating_point() or ids.dtype == torch.bool:
        return  # nothing to index with, or an error of its own in the lookup
    checked = ids if ignore_index is None or 0 <= ignore_index < size else ids.masked_fill(ids == ignore_index, 0)
    low, high = torch.stack(torch.aminmax(checked)).tolist()
    if low >= 0 and high < size:
        return
    outside = (checked < 0) | (checked >= size)
    where = [int(i) for i in outside.nonzero()[0].tolist()]
    count = int(outside.sum())
    worst = high if high >= size else low
    allowed = f"0 .. {size - 1}" + (f", or {ignore_index} (ignore_index)" if ignore_index is not None else "")
    raise VocabularyError(
        f"{what} hold {worst}, outside {bound.format(size=size)} ({allowed}): {count} of {ids.numel()} elements are "
        f"outside, the first at index {where} of a tensor of shape {list(ids.shape)}; the smallest is {low}, the "
        f"largest {high}. {why} {fix}".rstrip()
    )
