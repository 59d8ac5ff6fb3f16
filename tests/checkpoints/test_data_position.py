"""The data position is in the checkpoint: a loader resumes where it stood, on the same or another number of
replicas, built before or after ``engine.load``, and within the epoch every sample is trained on exactly once."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import epl
from epl.io import positions
from tests.helpers.distributed import run_ranks

SAMPLES, GLOBAL_BATCH, SAVED_STEPS, SEED = 96, 8, 5, 7
#: Each saved case: shuffle, the workers of the loader that saved, and whether the save was asynchronous.
CASES = {"shuffled": (True, 2, True), "in order": (False, 0, False)}
RESUMES = ("before", "after")  # the loader built before or after engine.load


def engine() -> epl.Engine:
    epl.init(epl.Config({}))
    torch.manual_seed(0)
    return epl.parallelize(nn.Linear(1, 1), optimizer=lambda p: torch.optim.SGD(p, lr=1e-3), loss_fn=nn.MSELoss())


def dataset(samples: int = SAMPLES) -> TensorDataset:
    return TensorDataset(torch.arange(samples, dtype=torch.float32).unsqueeze(1))  # each sample is its own id


def loader(engine: epl.Engine, shuffle: bool, workers: int = 0) -> epl.io.ReplicaLoader[Any]:
    batch = GLOBAL_BATCH // engine.num_replicas
    # forked workers: spawned ones (the ranks' start method) take seconds each to import torch on 2 cores
    options = {"num_workers": workers, "multiprocessing_context": "fork"} if workers else {}
    return epl.io.data_loader(dataset(), batch, engine, shuffle=shuffle, seed=SEED, **options)


def train(engine: epl.Engine, batches: Any, steps: int | None = None) -> list[int]:
    """The ids of the samples this replica trained on: ``steps`` steps, or to the end of the pass."""
    seen = []
    for (x,) in batches:
        engine.step(x, torch.zeros_like(x))
        seen += x.squeeze(1).long().tolist()
        if steps is not None and engine.global_step == steps:
            break
    return seen


def save_cases(folder: str) -> dict[str, Any]:
    """Each case: 5 steps on a fresh engine, saved mid-epoch (workers fetching ahead in one); then resumed here."""
    saved = {}
    for case, (shuffle, workers, asynchronous) in CASES.items():
        trainer = engine()
        batches = loader(trainer, shuffle, workers)
        saved[case] = train(trainer, batches, SAVED_STEPS)
        handle = trainer.save(Path(folder) / case, asynchronous=asynchronous)
        handle.wait()
        del batches  # its workers end
    return {"saved": saved, "resumed": resume_cases(folder)}


def resume_cases(folder: str) -> dict[str, Any]:
    """Each case resumed to the end of the epoch, the loader built before and after the load; and epoch 1's pass."""
    result: dict[str, Any] = {}
    for case, (shuffle, _, _) in CASES.items():
        for built in RESUMES:
            trainer = engine()
            workers = 2 if built == "after" else 0
            batches = loader(trainer, shuffle, workers) if built == "before" else None
            trainer.load(Path(folder) / case)
            if batches is None:
                batches = loader(trainer, shuffle, workers)
            step, epoch, length = trainer.global_step, batches.sampler.epoch, len(batches)
            seen = train(trainer, batches)
            batches.sampler.set_epoch(epoch + 1)
            result[f"{case}/{built}"] = {
                "loaded_at": (step, epoch, length),
                "seen": seen,
                "steps": trainer.global_step,
                "next epoch": list(batches.sampler),
            }
    return result


def permutation(shuffle: bool, epoch: int = 0) -> list[int]:
    """torch's DistributedSampler's order of the epoch (one replica: the whole dataset)."""
    sampler = DistributedSampler(dataset(), num_replicas=1, rank=0, shuffle=shuffle, seed=SEED)
    sampler.set_epoch(epoch)
    return list(sampler)


@pytest.mark.multiprocess
def test_a_loader_resumes_on_4_2_and_1_replicas_and_trains_on_every_sample_once(tmp_path: Path) -> None:
    first = run_ranks(save_cases, 4, str(tmp_path), timeout=240)
    on_2 = run_ranks(resume_cases, 2, str(tmp_path), timeout=180)
    on_1 = [resume_cases(str(tmp_path))]
    for case, (shuffle, _, _) in CASES.items():
        order = permutation(shuffle)
        consumed = SAVED_STEPS * GLOBAL_BATCH
        saved = [rank["saved"][case] for rank in first]
        assert [len(seen) for seen in saved] == [consumed // 4] * 4  # in lockstep, whatever the workers fetched ahead
        assert sorted(sum(saved, [])) == sorted(order[:consumed])
        for replicas, ranks in ((4, [rank["resumed"] for rank in first]), (2, on_2), (1, on_1)):
            for built in RESUMES:
                runs = [rank[f"{case}/{built}"] for rank in ranks]
                where = f"{case}, {replicas} replica(s), loader built {built} the load"
                assert all(run["loaded_at"] == (SAVED_STEPS, 0, SAMPLES // GLOBAL_BATCH) for run in runs), where
                resumed = [run["seen"] for run in runs]
                # the rest of the epoch's order, shared out anew: replica r takes every R-th from r
                assert resumed == [order[consumed + r :: replicas] for r in range(replicas)], where
                assert sorted(sum(saved, []) + sum(resumed, [])) == list(range(SAMPLES)), where  # each exactly once
                assert all(run["steps"] == SAMPLES // GLOBAL_BATCH for run in runs), where
                next_epoch = permutation(shuffle, 1)
                assert [run["next epoch"] for run in runs] == [next_epoch[r::replicas] for r in range(replicas)], where


# -- in one process --------------------------------------------------------------------------------------------
def saved_mid_epoch(folder: Path, steps: int = 3) -> list[int]:
    trainer = engine()
    batches = loader(trainer, True)  # kept: a checkpoint records the loaders that still exist
    seen = train(trainer, batches, steps)
    trainer.save(folder)
    return seen


def test_a_changed_loader_is_refused_by_name_built_before_or_after_the_load(tmp_path: Path) -> None:
    saved_mid_epoch(tmp_path / "c")
    changes = {
        "dataset_length=96 (this loader: 95)": lambda e: epl.io.data_loader(dataset(95), 8, e, seed=SEED),
        "seed=7 (this loader: 8)": lambda e: epl.io.data_loader(dataset(), 8, e, seed=8),
        "shuffle=True (this loader: False)": lambda e: epl.io.data_loader(dataset(), 8, e, seed=SEED, shuffle=False),
    }
    for message, build in changes.items():
        trainer = engine()
        built = build(trainer)  # noqa: F841 - a checkpoint's positions go to the loaders that exist
        with pytest.raises(epl.EplError, match=r"1st epl.io loader \(in the order built; .*" + re.escape(message)):
            trainer.load(tmp_path / "c")
        assert trainer.global_step == 0  # refused before anything was applied
        trainer = engine()
        trainer.load(tmp_path / "c")
        with pytest.raises(epl.EplError, match=re.escape(message)):
            build(trainer)
        trainer = engine()
        built = build(trainer)
        with pytest.warns(UserWarning, match="It starts afresh"):
            trainer.load(tmp_path / "c", strict=False)
        assert trainer.global_step == 3 and built.sampler.state_dict()["position"] == 0


def test_a_sampler_in_a_dataloader_of_ones_own_is_not_resumed_mid_epoch(tmp_path: Path) -> None:
    trainer = engine()
    sampler = epl.io.ReplicaSampler(dataset(), trainer, seed=SEED)
    train(trainer, DataLoader(dataset(), batch_size=8, sampler=sampler), 2)
    with pytest.warns(UserWarning, match="not in a loader from epl.io.data_loader"):
        trainer.save(tmp_path / "c")
    trainer = engine()
    sampler = epl.io.ReplicaSampler(dataset(), trainer, seed=SEED)
    with pytest.raises(epl.EplError, match="in the middle of an epoch .*from a DataLoader of your own"):
        trainer.load(tmp_path / "c")
    for own in ({"sampler": sampler}, {"batch_sampler": None}):
        with pytest.raises(epl.EplError, match=f"takes no {next(iter(own))}=: EPL cannot resume a custom sampler"):
            epl.io.data_loader(dataset(), 8, trainer, **own)


def test_epochs_follow_torch_and_a_position_waits_for_its_loader(tmp_path: Path) -> None:
    seen = saved_mid_epoch(tmp_path / "c")
    trainer = engine()
    trainer.load(tmp_path / "c")
    trainer.save(tmp_path / "again")  # no loader built yet: its position is kept, unmoved
    trainer = engine()
    trainer.load(tmp_path / "again")
    batches = loader(trainer, True)
    batches.sampler.set_epoch(0)  # set_epoch as torch's: the same epoch keeps the position...
    assert seen + train(trainer, batches) == permutation(True)
    trainer = engine()
    trainer.load(tmp_path / "c")
    batches = loader(trainer, True)
    batches.sampler.set_epoch(1)  # ...another epoch is a whole pass of it
    assert len(batches) == SAMPLES // GLOBAL_BATCH and list(batches.sampler) == permutation(True, 1)

    # saved in the loop after the epoch's last step: the epoch is done; a pass that ran out starts the next whole
    trainer = engine()
    batches, finished = loader(trainer, True), loader(trainer, False)
    train(trainer, batches, SAMPLES // GLOBAL_BATCH)
    assert len(list(finished)) == SAMPLES // GLOBAL_BATCH
    trainer.save(tmp_path / "end")
    trainer = engine()
    batches, finished = loader(trainer, True), loader(trainer, False)
    trainer.load(tmp_path / "end")
    assert list(batches) == [] and len(list(finished)) == SAMPLES // GLOBAL_BATCH


def test_ranks_that_saved_different_positions_are_refused() -> None:
    state = {"order": 0, "epoch": 0, "position": 40, "in_pass": True, "counted": True, "num_replicas": 2}
    state.update(dataset_length=SAMPLES, shuffle=True, seed=SEED, drop_last=False)
    apart = {0: [state], 1: [{**state, "position": 48}]}
    problem = positions.restore_problem(apart, strict=True)
    assert problem is not None and "rank 0: epoch 0, 40 of 96 samples consumed; rank 1: epoch 0, 48 of 96" in problem
    other = {0: [state], 1: [{**state, "seed": 8}]}
    assert "read other data on rank 1" in (positions.restore_problem(other, strict=True) or "")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert positions.restore_problem(apart, strict=False) is None
