"""Saving: every rank writes the rectangles it holds of each logical tensor, nothing gathered.

:func:`logical_items` is everything a save writes, by key (:mod:`epl.runtime.checkpoint.keys`);
:func:`save_checkpoint` writes it now or in the background (:mod:`epl.runtime.checkpoint.background`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from epl.interfaces.optimizer_groups import group_options
from epl.runtime.checkpoint import files, folders, keys
from epl.runtime.checkpoint.background import SAVER, CheckpointSave, SaveJob, stage, wait_for_background_save
from epl.runtime.checkpoint.chunks import to_write
from epl.runtime.checkpoint.common import CheckpointedEngine, timeout
from epl.runtime.checkpoint.data import data_items
from epl.runtime.checkpoint.meeting import alone, meet, require_default_group
from epl.runtime.checkpoint.rng import rng_items
from epl.sharding.chunks import held
from epl.sharding.data_shards import local_tensor


def save_checkpoint(
    engine: CheckpointedEngine, path: str | os.PathLike[str], *, asynchronous: bool = False
) -> CheckpointSave:
    """Write ``engine``'s logical state to the directory ``path`` (a collective: every rank calls it).

    ``asynchronous``: copy the state to CPU memory, return at once, and write the files in a background thread
    (see :class:`CheckpointSave`). A save still being written in the background is waited for first.
    """
    require_default_group(engine)
    wait_for_background_save()
    target = Path(path)
    # Refused on every rank before anything is moved or deleted: a folder holding what engine.save did not write.
    meet(engine, "engine.save", lambda: folders.save_problem(target))
    items = logical_items(engine)
    cluster, one = engine.context.cluster, alone(engine)
    job = SaveJob(target, cluster.rank, cluster.world_size, one, SAVER.next_key(), timeout(engine))
    if not asynchronous:
        with _without_zip_crc():
            job.write(items, None)
        return CheckpointSave(job, finished=True)
    staged = stage(engine, items)
    group = None if one else SAVER.group(job.timeout)
    return SAVER.start(job, staged, group)


@contextlib.contextmanager
def _without_zip_crc() -> Iterator[None]:
    """Without the CRC-32 ``torch.save`` computes for every record of the zip archive it writes for each tensor.

    torch.load never checks it (a flipped bit in a tensor's bytes loads silently), and EPL's XXH3 checksum of
    every file, checked on every load, covers the same bytes. Measured on the checkpoint benchmark: the CRC-32
    took 29 ms of DCP's 49 ms to write 42 MB (XXH3: 2.3 ms). torch's switch is process-wide, so it is turned off
    only while a save holds the main thread, and background saves keep it.
    """
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


def logical_items(engine: CheckpointedEngine) -> dict[str, Any]:
    """Everything a save writes, by key: each logical tensor as this rank's rectangles of it (nothing gathered)."""
    own = engine.model.state_dict(keep_vars=True)  # FSDP2's pre-hook puts its sharded parameters back first
    values = engine.model.state_dict()  # a technique that frees parameters between uses hands copies here
    items: dict[str, Any] = {
        keys.model_key(key): to_write(held(tensor), local_tensor(values[key])) for key, tensor in own.items()
    }
    optimizer = engine.optimizer
    if optimizer is not None:
        for name, param in engine.model.named_parameters():
            state = optimizer.state.get(param)
            if not state:
                continue
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    items[keys.StateKey(name, key).format()] = to_write(held(value, like=param), local_tensor(value))
    scaler = engine.loss_scaler
    meta = {
        "format": keys.FORMAT,
        "global_step": engine.global_step,
        "skipped_steps": engine.skipped_steps,
        "param_groups": [group_options(group) for group in optimizer.param_groups] if optimizer is not None else None,
        "loss_scaler": scaler.state_dict() if scaler is not None else None,
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
    }
    items[keys.META] = files.encode_json(meta)
    items.update(rng_items(engine.context.cluster.rank))
    items.update(data_items(engine.context.cluster.rank))
    return items
