"""transformers' checkpoint folders, read and written a slice per rank: ``Engine.load_pretrained/save_pretrained``.

**Loading** (:func:`~epl.pretrained.loading.load_pretrained`) reads ``model.safetensors``, or the shards that
``model.safetensors.index.json`` lists. Each rank reads only the tensors of its pipeline stage and, of a split
tensor, only its shard's rows or columns: safetensors' slices (``safe_open(...).get_slice``) map the file and
touch the bytes of the slice alone. Names are the model's own (the checkpoint's names, or the model's under a
prefix such as transformers' ``base_model_prefix``); missing or unexpected names are an error unless
``strict=False`` (which logs what it did not load, on every call); dtypes are converted to the model's. A PEFT
model takes its base model's folder: each tensor is read under the name it has without PEFT's wrappers
(:mod:`~epl.pretrained.wrapped`), and the adapters keep their initialisation. Pickle-based ``.bin`` checkpoints are
refused: loading them runs code from the file.

**Saving** (:func:`~epl.pretrained.saving.save_pretrained`) writes what transformers' ``save_pretrained``
writes: safetensors files (``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` and
``model.safetensors.index.json`` past ``max_shard_size``) under the original names, and ``config.json`` when the
model has a ``config``; a PEFT model's adapters in PEFT's format, or with ``merged=True`` the base model with the
adapters merged (:mod:`~epl.pretrained.export`). Nothing is gathered: the ranks agree on every tensor's place in
the files (a description of the pieces each holds, written to the folder), rank 0 writes the headers, and each
rank writes its own pieces into the byte ranges of the whole tensors (a tensor several ranks hold is written by the
first). A rank holds its share and one piece's bytes at a time. Written into ``<path>.partial``, then moved beside
the files already at ``<path>`` (a tokenizer, a README: kept), replacing only its own (see
:mod:`~epl.pretrained.saving`).

The modules: :mod:`~epl.pretrained.pieces` (which part of a whole tensor a rank holds) ·
:mod:`~epl.pretrained.loading` · :mod:`~epl.pretrained.conversion` (transformers' checkpoint formats, such as
experts stored one by one) · :mod:`~epl.pretrained.wrapped` (a wrapped model's base names) ·
:mod:`~epl.pretrained.export` (what is written: a model, a PEFT adapter, a merged PEFT model) ·
:mod:`~epl.pretrained.saving`.
"""

from epl.pretrained.loading import load_pretrained
from epl.pretrained.saving import save_pretrained

__all__ = ["load_pretrained", "save_pretrained"]
