"""Checkpoints any layout can load: whole tensors under the unsplit model's names, written in parallel.

``Engine.save(path)`` writes a directory with ``torch.distributed.checkpoint`` (DCP):
every rank writes its own file at the same time, and a tensor several ranks hold
(a replicated weight) is written once. What is saved is *logical*, not per device:

- ``model/<name>``: each parameter and buffer as the whole tensor, under the name it has in the model the user
  wrote. Each rank writes the rectangles of it that it holds (a split piece, an FSDP2 ``DTensor`` chunk, a chunk
  of a split piece: :mod:`epl.sharding.chunks`, :mod:`epl.runtime.checkpoint.chunks`), so nothing is gathered;
- ``optim/<name>/<state>``: the optimizer state of each parameter (Adam's ``exp_avg``...), a logical tensor
  stored as its parameter is when shaped like it (others, such as ``step``, whole), written by whichever device
  keeps it (under the owner-based ZeRO, the owner). Format 2 stored a split parameter's states as
  ``.../shard<i>of<n>dim<d>`` pieces, which are still read;
- ``engine/meta``: the step counter, the optimizer's hyperparameters, the loss scaler (JSON
  text in a uint8 tensor: nothing in a checkpoint is pickled by EPL);
- ``rng/<rank>/<generator>``: every rank's random number generator states;
- ``data/<rank>``: where each rank's ``epl.io`` loaders stand (JSON, :mod:`epl.io.positions`).

``Engine.load(path)`` reads what this rank's layout needs, whatever layout saved it: a
pipeline stage reads its stage's names, a split or sharded device reads its rectangles, a
ZeRO owner reads the states it owns. Writing goes to ``<path>.partial`` and is renamed
to ``<path>`` once every rank has finished (in DCP's ``finish`` step on the coordinator, which
every rank waits for), so a crash while saving leaves the previous checkpoint intact. Only a checkpoint of EPL's
own is replaced, and only EPL's files are deleted: a folder holding anything else is refused on every rank before
anything is moved (:mod:`epl.runtime.checkpoint.folders`). ``save`` and ``load`` first meet every rank through the
job's store, so a rank that does not call them is named (:mod:`epl.runtime.collective_calls`,
:mod:`epl.runtime.checkpoint.meeting`).

``Engine.save(path, asynchronous=True)`` copies the state into CPU buffers (kept between saves,
as torchtitan's async checkpoint keeps pinned ones), returns a :class:`CheckpointSave`, and writes
the same files in a background thread over a gloo process group of its own, so training goes on
meanwhile; the next save, a load, ``epl.init`` and the end of the process wait for it, and its
error surfaces at the next step, save, load or ``wait()`` (:mod:`epl.runtime.checkpoint.background`).

Loading never runs code from the checkpoint and checks it first (:mod:`epl.runtime.checkpoint.files`):
every file against its recorded checksum, then, strictly by default, that the names,
shapes and dtypes are the model's and the optimizer is of the same kind. Every rank agrees
before anything is loaded (one all-reduce), so a refused checkpoint is one error on every rank,
not a hang. Each rank reads what it needs on its own (DCP's load needs no collective for that).

The modules: :mod:`~epl.runtime.checkpoint.save`, :mod:`~epl.runtime.checkpoint.background`,
:mod:`~epl.runtime.checkpoint.load`, :mod:`~epl.runtime.checkpoint.rng`, :mod:`~epl.runtime.checkpoint.data`,
:mod:`~epl.runtime.checkpoint.keys` (the entries' names), :mod:`~epl.runtime.checkpoint.folders` (the
partial/commit/rename protocol), :mod:`~epl.runtime.checkpoint.meeting` (ranks meeting and agreeing),
:mod:`~epl.runtime.checkpoint.files` (safe reads, checksums), :mod:`~epl.runtime.checkpoint.chunks` (a rank's
rectangles of a tensor), :mod:`~epl.runtime.checkpoint.common`.
"""

from __future__ import annotations

from epl.runtime.checkpoint.background import CheckpointSave, wait_for_background_save
from epl.runtime.checkpoint.common import CheckpointedEngine
from epl.runtime.checkpoint.keys import FORMAT
from epl.runtime.checkpoint.load import load_checkpoint, read_model_state
from epl.runtime.checkpoint.save import save_checkpoint

__all__ = [
    "FORMAT",
    "CheckpointSave",
    "CheckpointedEngine",
    "load_checkpoint",
    "read_model_state",
    "save_checkpoint",
    "wait_for_background_save",
]
