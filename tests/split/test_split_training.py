"""Split models trained on real processes equal the same model trained in one process.

Same seed, same data: losses and parameters (gathered whole with
``engine.state_dict(full=True)``) equal the local run, float64 to 1e-10 and float32
to 1e-5 relative. The collectives of one step are counted, so hidden
communication (say, gathering the classifier's logits) fails the test.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import epl
from tests.helpers.distributed import run_ranks
from tests.helpers.reference import assert_rank_matches, train_locally

pytestmark = pytest.mark.multiprocess

STEPS = 3


# -- models ------------------------------------------------------------------------------
def mlp() -> nn.Module:
    """Whole model under split: a column/row pair, then a lone Linear (column parallel, 5 outputs)."""
    import epl

    with epl.split(2, name="mlp"):
        return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 12), nn.Tanh(), nn.Linear(12, 5))


def embedding() -> nn.Module:
    """A vocabulary-parallel embedding (23 ids, uneven) feeding a column/row pair."""
    import epl

    with epl.split(2, name="lm"):
        return nn.Sequential(nn.Embedding(23, 8), nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))


def classification(world_size: int) -> nn.Module:
    """The manual's classification: replicated features, split classifier, colocated on every device."""
    import epl

    devices = epl.Env.get().cluster.total_gpu_num
    with epl.replicate(devices, name="features"):
        features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 16)
        )
    with epl.split(devices, name="classifier"):
        classifier = nn.Linear(16, CLASSES[world_size])
    return nn.Sequential(features, classifier)


#: Class counts (by world size) that do not divide the device count (uneven shards).
CLASSES = {2: 7, 4: 10}


def moe(k: int) -> nn.Module:
    """The manual's MoE: attention and gating replicated by default, experts split, colocated."""
    import epl
    from epl.examples.models import MoEBlock
    from epl.nn import Experts, MoE, TopKGate

    devices = epl.Env.get().cluster.total_gpu_num
    epl.set_default_strategy(epl.replicate(devices, name="attention_and_gating"))
    attention = nn.MultiheadAttention(8, 2, batch_first=True)
    # Capacity 0.5: some tokens are dropped. Routing groups are one device's tokens (2 samples x 4).
    gate = TopKGate(8, 4, k=k, capacity_factor=0.5, group_size=8)
    with epl.split(devices, name="experts"):
        experts = Experts(4, 8, 16)
    epl.set_default_strategy(None)
    return MoEBlock(attention, MoE(gate, experts))


# -- data --------------------------------------------------------------------------------
def data(kind: str, replicas: int, dtype: torch.dtype, world_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``STEPS`` global batches for ``replicas`` replicas."""
    generator = torch.Generator().manual_seed(3)
    size = replicas * 8

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=dtype)

    if kind == "mlp":
        return [(randn(size, 12), randn(size, 5)) for _ in range(STEPS)]
    if kind == "embedding":
        return [(torch.randint(0, 23, (size, 3), generator=generator), randn(size, 3, 8)) for _ in range(STEPS)]
    if kind == "classification":
        return [
            (randn(size, 3, 6, 6), torch.randint(0, CLASSES[world_size], (size,), generator=generator))
            for _ in range(STEPS)
        ]
    return [(randn(size // 2, 4, 8), randn(size // 2, 4, 8)) for _ in range(STEPS)]  # moe: 2 samples/device


BUILDERS = {"mlp": mlp, "embedding": embedding}
LOSSES = {"classification": nn.CrossEntropyLoss}


def build(kind: str, dtype: torch.dtype, k: int, world_size: int) -> nn.Module:
    torch.manual_seed(0)
    if kind == "moe":
        model = moe(k)
    elif kind == "classification":
        model = classification(world_size)
    else:
        model = BUILDERS[kind]()
    return model.to(dtype)


def train(kind: str, dtype: torch.dtype, k: int = 1) -> dict[str, Any]:
    """One rank: train with EPL; return losses, the whole state and the collectives of each step."""
    import epl

    config = {"cluster.colocate_split_and_replicate": True} if kind in ("classification", "moe") else {}
    env = epl.init(epl.Config(config))
    model = build(kind, dtype, k, env.cluster.world_size)
    loss_fn = LOSSES.get(kind, nn.MSELoss)()
    engine = epl.parallelize(model, optimizer=lambda p: torch.optim.Adam(p, lr=0.01), loss_fn=loss_fn)
    batches = data(kind, engine.num_replicas, dtype, env.cluster.world_size)
    groups = engine.context.shard_groups
    losses, steps = [], []
    for x, y in batches:
        before = [Counter(group.collectives) for group in groups.values()]
        share = x.shape[0] // engine.num_replicas
        rows = slice(engine.replica_index * share, (engine.replica_index + 1) * share)
        losses.append(float(engine.step(x[rows], y[rows])))
        steps.append([dict(Counter(g.collectives) - b) for g, b in zip(groups.values(), before, strict=True)])
    full = engine.state_dict(full=True)
    engine.load_state_dict(full)  # whole tensors load back into the shards
    assert all(torch.equal(v, full["model"][k]) for k, v in engine.state_dict(full=True)["model"].items())
    x0 = batches[0][0][: batches[0][0].shape[0] // engine.num_replicas]
    return {
        "replica": engine.replica_index,
        "predict": engine.predict(x0),
        "losses": losses,
        "state": full["model"],
        "steps": steps,
        "loss_fn": type(engine.context.loss_fn).__name__,
        "sharded_parameters": sum(p.numel() for p in engine.parameters()),
        "dropped": engine.model.moe.last_routing.dropped if kind == "moe" else None,
    }


def reference(kind: str, world_size: int, dtype: torch.dtype, k: int = 1) -> tuple[list[float], dict[str, Any]]:
    import epl

    epl.init()
    model = build(kind, dtype, k, world_size)
    devices = 2 if kind in ("mlp", "embedding") else world_size
    replicas = world_size // devices
    loss = F.cross_entropy if kind == "classification" else F.mse_loss
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    return train_locally(model, optimizer, data(kind, replicas, dtype, world_size), 1, loss)


def assert_matches(results: list[dict[str, Any]], losses: list[float], state: dict[str, Any], tolerance: float) -> None:
    """Every rank's whole parameters equal the local run's; the replicas' mean loss equals the local loss."""
    per_replica = {r["replica"]: r["losses"] for r in results}
    mean = torch.tensor(list(per_replica.values()), dtype=torch.float64).mean(0).tolist()
    for result in results:
        assert result["losses"] == per_replica[result["replica"]]  # every device returns its replica's loss
        assert_rank_matches({**result, "losses": mean}, losses, state, tolerance)


# -- tests -------------------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [2, 4])
def test_split_mlp_equals_the_local_run(world_size: int) -> None:
    """split(2) on 2 processes, and on 4: two replicas, each shard reduced over its copy in the other."""
    losses, state = reference("mlp", world_size, torch.float64)
    results = run_ranks(train, world_size, "mlp", torch.float64, timeout=180)
    assert_matches(results, losses, state, 1e-10)
    for result in results:
        # Per step: the pair's row all-reduce; the lone Linear's input-gradient all-reduce and output gather.
        assert result["steps"] == [[{"all_reduce": 2, "all_gather": 1}]] * STEPS
    whole = sum(v.numel() for v in state.values())
    assert results[0]["sharded_parameters"] < whole  # each device holds only its shards


def test_split_mlp_in_float32_within_1e_5() -> None:
    losses, state = reference("mlp", 2, torch.float32)
    assert_matches(run_ranks(train, 2, "mlp", torch.float32, timeout=120), losses, state, 1e-5)


def test_vocabulary_parallel_embedding_equals_the_local_run() -> None:
    losses, state = reference("embedding", 2, torch.float64)
    results = run_ranks(train, 2, "embedding", torch.float64, timeout=120)
    assert_matches(results, losses, state, 1e-10)
    for result in results:
        # Embedding all-reduce; pair all-reduce forward and the column's input-gradient all-reduce backward.
        assert result["steps"] == [[{"all_reduce": 3}]] * STEPS


@pytest.mark.parametrize("world_size", [2, 4])
def test_classification_recipe_with_parallel_cross_entropy(world_size: int) -> None:
    """replicate(n) features + split(n) classifier, colocated; 7 classes on 2 devices, 10 on 4."""
    losses, state = reference("classification", world_size, torch.float64)
    results = run_ranks(train, world_size, "classification", torch.float64, timeout=180)
    assert_matches(results, losses, state, 1e-10)
    for result in results:
        assert result["loss_fn"] == "ShardedCrossEntropyLoss"
        # Engine.predict gives whole logits, those of the local model with the trained weights.
        epl.init()
        local = build("classification", torch.float64, 1, world_size)
        local.load_state_dict(result["state"])
        x0 = data("classification", 1, torch.float64, world_size)[0][0][:8]
        torch.testing.assert_close(result["predict"], local(x0), rtol=1e-12, atol=1e-12)
        # Features rows gathered in, targets gathered, max and sums all-reduced, the per-row
        # losses' gradient gathered, the features' gradient reduce-scattered: never the logits.
        assert result["steps"] == [[{"all_gather": 3, "all_reduce": 2, "reduce_scatter": 1}]] * STEPS


@pytest.mark.parametrize("k", [1, 2])
def test_moe_recipe_equals_the_local_run(k: int) -> None:
    """Attention and gate replicated, experts split: expert parallel with all-to-all, tokens dropped."""
    losses, state = reference("moe", 2, torch.float64, k)
    results = run_ranks(train, 2, "moe", torch.float64, k, timeout=120)
    assert_matches(results, losses, state, 1e-10)
    for result in results:
        assert result["steps"] == [[{"all_to_all": 4}]] * STEPS
        assert result["dropped"] > 0  # capacity 0.5 drops tokens, identically in both runs
