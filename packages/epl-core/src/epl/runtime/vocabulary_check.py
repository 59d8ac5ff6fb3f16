"""Token ids and labels outside the vocabulary, checked by every rank of a job of several processes when the step
begins (and before ``Engine.evaluate`` and ``Engine.predict``), where nothing else raises on every rank.

Split over devices, the embedding and the parallel cross-entropy check the ids they are given
(:mod:`epl.sharding.vocabulary`), and every rank of their split group raises. Under a pipeline
only the first stage reads the ids and only the last the labels: were they alone to raise, the other
stages would wait for them until ``communication.timeout``. So there every rank of the replica checks
the batch (which each is given whole) before the step's first collective, against the vocabulary read
from the whole model before it was cut into stages (:class:`~epl.sharding.vocabulary.ModelVocabulary`).

Under data parallelism each replica's embedding is whole, so PyTorch would raise ``IndexError`` inside the forward
of the one rank given the bad id. That rank raises :class:`~epl.errors.VocabularyError` (naming the id and the
size) before the step's first collective instead; the other replicas, given other data, go on and find it gone at
their gradient reduction, which names it (or the step check names it, should its script catch the error and go
on). What is checked:

- the token ids: a dict batch's ``input_ids``, else its first integer tensor of two or more
  dimensions (what :func:`epl.runtime.batch.samples_and_tokens` counts as tokens), against the model's
  input embedding;
- the labels: a dict batch's ``labels`` (the model's own loss) and integer ``targets`` (a tensor, or a
  dict's ``labels``), against the model's output layer, -100 (``ignore_index``) allowed.

On the CPU, where a data loader hands the batch, that is two reductions per tensor (about 10 microseconds for
2 x 128 ids) and no device synchronisation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from epl.plugins.context import ParallelContext
from epl.runtime.batch import token_ids
from epl.sharding.vocabulary import IDS_FIX, LABELS_FIX, ModelVocabulary, check_in_vocabulary

#: Why the batch is checked before the step, in the error.
WHY = (
    "In one process PyTorch raises IndexError for them; EPL checks them on every rank before the step's first "
    "collective, so that no rank waits for one that failed."
)
#: The ``ignore_index`` of ``F.cross_entropy`` and transformers' losses: labels of positions without a loss.
IGNORE_INDEX = -100


class VocabularyCheck:
    """Checks a replica batch's token ids and labels against ``vocabulary`` (see the module docstring)."""

    def __init__(self, vocabulary: ModelVocabulary) -> None:
        self.vocabulary = vocabulary

    def __call__(self, inputs: Any, targets: Any = None) -> None:
        """Raise :class:`~epl.errors.VocabularyError` for an id or label outside the vocabulary."""
        tokens, classes = self.vocabulary.token_ids, self.vocabulary.labels
        if tokens is not None:
            ids, name = _token_ids(inputs)
            if ids is not None:
                check_in_vocabulary(ids, tokens, f"The token ids of the batch ({name})", fix=IDS_FIX, why=WHY)
        if classes is not None:
            for labels, name in _labels(inputs, targets):
                what = f"The labels of the batch ({name})"
                bound = "the {size} classes of the model's output layer"
                check_in_vocabulary(
                    labels, classes, what, ignore_index=IGNORE_INDEX, fix=LABELS_FIX, bound=bound, why=WHY
                )


def vocabulary_check(context: ParallelContext, whole: ModelVocabulary) -> VocabularyCheck | None:
    """The check of a job of several processes against ``whole`` (read from the model before any transform); None
    in one process (PyTorch raises), where nothing is known, and for what split modules check themselves on every
    rank of their group (no pipeline: they see every id)."""
    if context.plan.local:
        return None
    vocabulary = whole
    if context.plan.num_stages < 2:
        split = context.state(ModelVocabulary)
        vocabulary = ModelVocabulary(
            token_ids=whole.token_ids if split.token_ids is None else None,
            labels=whole.labels if split.labels is None else None,
        )
    if vocabulary.token_ids is None and vocabulary.labels is None:
        return None
    return VocabularyCheck(vocabulary)


def _integer(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and not value.is_floating_point() and not value.is_complex()


def _token_ids(inputs: Any) -> tuple[torch.Tensor | None, str]:
    """The batch's token ids (:func:`epl.runtime.batch.token_ids`, integers only) and how the error names them."""
    ids = token_ids(inputs)
    if not _integer(ids):
        return None, ""
    named = isinstance(inputs, Mapping) and inputs.get("input_ids") is ids
    return ids, "its 'input_ids'" if named else "its first integer tensor"


def _labels(inputs: Any, targets: Any) -> list[tuple[torch.Tensor, str]]:
    """The batch's labels and how the error names them."""
    found = []
    if isinstance(inputs, Mapping) and _integer(inputs.get("labels")):
        found.append((inputs["labels"], "the inputs' 'labels'"))
    if isinstance(targets, Mapping) and _integer(targets.get("labels")):
        found.append((targets["labels"], "the targets' 'labels'"))
    elif _integer(targets) and targets.dtype != torch.bool:
        found.append((targets, "the targets"))
    return found
