"""``optimizer.max_grad_norm`` under ``epl.split``: the global norm counts each shard and each whole tensor once.

Every run is compared with the same model trained in one process (same seed, same
data, ``clip_grad_norm_`` on the whole model): losses, the norm of every step
(``Engine.grad_norm``) and the parameters gathered whole, in float64 to 1e-10. The
max norm is small enough that every step clips. The models hold tensors that every
device of the shard group keeps whole (a row-parallel bias, a LayerNorm, a replicated
embedding) and the test checks that counting them once per device would change the
norm by far more than the tolerance.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import epl
from tests.helpers.distributed import run_ranks

pytestmark = pytest.mark.multiprocess

STEPS = 3
MAX_NORM = 0.05
TOLERANCE = 1e-10
REPLICA_ROWS = 8


# -- models and data ---------------------------------------------------------------------
def split_mlp() -> nn.Module:
    """All under split(2): column/row pair (its bias whole), a LayerNorm kept whole, a lone column Linear."""
    import epl

    with epl.split(2, name="mlp"):
        return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 3))


def embedding_and_split_mlp() -> nn.Module:
    """Colocated: an embedding replicated on both devices, then a split pair and a LayerNorm kept whole."""
    import epl

    with epl.replicate(2, name="embedding"):
        embedding = nn.Embedding(11, 6)
    with epl.split(2, name="mlp"):
        mlp = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 6), nn.LayerNorm(6))
    return nn.Sequential(embedding, mlp)


BUILDERS = {"split": split_mlp, "colocated": embedding_and_split_mlp, "plain": lambda: nn.Linear(6, 3)}
#: The tensors every device of the shard group holds whole: a row-parallel bias, a LayerNorm, the replicated embedding.
WHOLE_IN_GROUP = {
    "split": ["2.bias", "3.weight", "3.bias"],
    "colocated": ["0.weight", "1.2.bias", "1.3.weight", "1.3.bias"],
}


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return BUILDERS[kind]().double()


def batches(kind: str, replicas: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``STEPS`` global batches of ``replicas`` replica batches."""
    generator = torch.Generator().manual_seed(5)
    rows = replicas * REPLICA_ROWS
    if kind == "colocated":
        return [
            (
                torch.randint(0, 11, (rows, 3), generator=generator),
                torch.randn(rows, 3, 6, generator=generator, dtype=torch.float64),
            )
            for _ in range(STEPS)
        ]
    return [
        (
            torch.randn(rows, 6, generator=generator, dtype=torch.float64),
            torch.randn(rows, 3, generator=generator, dtype=torch.float64),
        )
        for _ in range(STEPS)
    ]


def adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


# -- the runs ----------------------------------------------------------------------------
def train(kind: str, config: dict[str, Any]) -> dict[str, Any]:
    """One rank: train ``kind`` with EPL; return its replica, losses, norms and whole parameters."""
    import epl

    epl.init(epl.Config({"optimizer.max_grad_norm": MAX_NORM, **config}))
    engine = epl.parallelize(build(kind), optimizer=adam, loss_fn=nn.MSELoss())
    assert engine.grad_norm is None  # no step yet
    losses, norms = [], []
    for x, y in batches(kind, engine.num_replicas):
        rows = slice(engine.replica_index * REPLICA_ROWS, (engine.replica_index + 1) * REPLICA_ROWS)
        loss = engine.step(x[rows], y[rows])
        assert isinstance(loss, torch.Tensor) and loss.dim() == 0
        losses.append(float(loss))
        norms.append(engine.grad_norm)
    state = engine.state_dict(full=True)["model"]
    owned = len(engine.context.reduced_in_backward)  # ZeRO: parameters chunked over their copies (FSDP2)
    return {"replica": engine.replica_index, "losses": losses, "norms": norms, "state": state, "owned": owned}


def train_locally(
    kind: str, replicas: int = 1, *, per_replica: bool = False
) -> tuple[list[list[float]], list[list[float]], list[float], dict[str, torch.Tensor]]:
    """The one-process reference: clip the global batch's gradient, or (``per_replica``) each replica's rows'
    gradient on its own and average them (clipping before the all-reduce).

    Returns each replica's losses and norms, the norms had each tensor of ``WHOLE_IN_GROUP`` been
    counted twice (none for other models), and the final state.
    """
    epl.init()
    model = build(kind)
    optimizer = adam(model.parameters())
    named = dict(model.named_parameters())
    parts = replicas if per_replica else 1
    losses: list[list[float]] = [[] for _ in range(parts)]
    norms: list[list[float]] = [[] for _ in range(parts)]
    twice: list[float] = []
    for x, y in batches(kind, replicas):
        total = [torch.zeros_like(p) for p in model.parameters()]
        for part, (xs, ys) in enumerate(zip(x.chunk(parts), y.chunk(parts), strict=True)):
            model.zero_grad()
            loss = nn.functional.mse_loss(model(xs), ys)
            loss.backward()
            extra = sum(float(named[name].grad.square().sum()) for name in WHOLE_IN_GROUP.get(kind, []))
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
            if kind in WHOLE_IN_GROUP:
                twice.append((norm**2 + extra) ** 0.5)
            losses[part].append(float(loss.detach()))
            norms[part].append(norm)
            for sum_, p in zip(total, model.parameters(), strict=True):
                sum_ += p.grad / parts
        for p, grad in zip(model.parameters(), total, strict=True):
            p.grad = grad
        optimizer.step()
    return losses, norms, twice, {k: v.clone() for k, v in model.state_dict().items()}


def assert_equal_to_local(
    results: list[dict[str, Any]],
    reference: tuple[list[list[float]], list[list[float]], list[float], dict[str, torch.Tensor]],
    *,
    per_replica: bool = False,
) -> None:
    losses, norms, twice, state = reference
    assert norms[0][0] > MAX_NORM  # clipping acts
    for counted_once, counted_twice in zip(sum(norms, []), twice, strict=False):
        assert abs(counted_twice - counted_once) > 1e-4 * counted_once  # double counting would fail the test
    replica_losses = {r["replica"]: r["losses"] for r in results}
    mean = torch.tensor(list(replica_losses.values()), dtype=torch.float64).mean(0).tolist()
    for result in results:
        part = result["replica"] if per_replica else 0
        assert result["losses"] == replica_losses[result["replica"]]  # every device returns its replica's loss
        # Clipping each replica: its own loss; clipping the reduced gradient: the replicas' mean is the global loss.
        mine = result["losses"] if per_replica else mean
        torch.testing.assert_close(mine, losses[part], rtol=TOLERANCE, atol=TOLERANCE)
        torch.testing.assert_close(result["norms"], norms[part], rtol=TOLERANCE, atol=TOLERANCE)
        assert set(result["state"]) == set(state)
        for name, value in result["state"].items():
            torch.testing.assert_close(value, state[name], rtol=TOLERANCE, atol=TOLERANCE, msg=name)


# -- tests -------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_split_clipping_counts_each_shard_and_each_whole_tensor_once() -> None:
    """split(2) on 2 processes: the shards' squares summed over the group, the bias and LayerNorm once."""
    results = run_ranks(train, 2, "split", {}, timeout=50)
    assert_equal_to_local(results, train_locally("split"))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", [2, 4])
def test_colocated_split_and_replicate_clipping_after_the_all_reduce(world_size: int) -> None:
    """replicate(2) embedding + split(2) block colocated (the devices split the batch), 1 or 2 replicas:
    the reduced gradient is clipped, by the global batch's norm."""
    config = {"cluster.colocate_split_and_replicate": True, "communication.clip_after_allreduce": True}
    results = run_ranks(train, world_size, "colocated", config, timeout=80)
    assert sorted(r["replica"] for r in results) == sorted(rank // 2 for rank in range(world_size))
    assert_equal_to_local(results, train_locally("colocated", world_size // 2))


@pytest.mark.timeout(90)
def test_split_times_two_replicas_with_zero_v1_clips_the_reduced_gradient() -> None:
    """split(2) x 2 replicas on 4 processes, ZeRO v1: the gradients are reduce-scattered inside the backward, so the
    reduced gradient is clipped, by the global batch's norm (over split's shards and ZeRO's chunks)."""
    results = run_ranks(train, 4, "split", {"zero.level": "v1"}, timeout=80)
    assert sorted(r["replica"] for r in results) == [0, 0, 1, 1]
    assert all(r["owned"] > 0 for r in results)
    assert_equal_to_local(results, train_locally("split", 2))


def colocated_with_clipping_before(config: dict[str, Any]) -> str:
    import epl

    epl.init(epl.Config({"optimizer.max_grad_norm": MAX_NORM, "cluster.colocate_split_and_replicate": True, **config}))
    try:
        epl.parallelize(build("colocated"), optimizer=adam, loss_fn=nn.MSELoss())
    except epl.ConfigError as error:
        return str(error)
    return "no error"


@pytest.mark.timeout(60)
def test_clipping_before_the_all_reduce_when_the_split_devices_split_the_batch_is_an_error() -> None:
    for message in run_ranks(colocated_with_clipping_before, 2, {}, timeout=50):
        assert "communication.clip_after_allreduce" in message and "mlp" in message


@pytest.mark.timeout(60)
def test_plain_data_parallelism_reports_the_norm_each_replica_clipped() -> None:
    """Two replicas of a plain Linear (no split), clipping before the all-reduce: each replica's own norm."""
    results = run_ranks(train, 2, "plain", {}, timeout=50)
    assert_equal_to_local(results, train_locally("plain", 2, per_replica=True), per_replica=True)


@pytest.mark.timeout(30)
def test_one_process_grad_norm_is_the_norm_before_clipping() -> None:
    losses, norms, _, state = train_locally("split")
    result = train("split", {})
    torch.testing.assert_close(result["losses"], losses[0], rtol=0, atol=0)
    assert result["norms"] == norms[0]  # exactly torch's clip_grad_norm_
    for name, value in result["state"].items():
        assert torch.equal(value, state[name]), name
    epl.init()
    engine = epl.parallelize(build("split"), optimizer=adam, loss_fn=nn.MSELoss())
    x, y = batches("split", 1)[0]
    engine.step(x, y)
    assert engine.grad_norm is None  # clipping off
