"""The local run: Engine.step equals the plain PyTorch loop, bit for bit."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import epl

OptimizerFactory = Callable[..., torch.optim.Optimizer]
OPTIMIZERS: dict[str, OptimizerFactory] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
}
STEPS = 5


def data(
    steps: int = STEPS, batch: int = 8, dtype: torch.dtype = torch.float32
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(batch, 12, generator=generator, dtype=dtype),
            torch.randn(batch, 12, generator=generator, dtype=dtype),
        )
        for _ in range(steps)
    ]


def build(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    with epl.replicate(device_count=1, name="stage_0"):
        stage0 = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU())
    with epl.replicate(device_count=1, name="stage_1"):
        stage1 = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 12))
    return nn.Sequential(stage0, stage1).to(dtype)


def plain_model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    stage0 = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU())
    stage1 = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 12))
    return nn.Sequential(stage0, stage1).to(dtype)


def plain_run(
    optimizer: str, micro_batches: int, dtype: torch.dtype = torch.float32
) -> tuple[list[torch.Tensor], nn.Module]:
    """The loop a user writes without EPL (gradient accumulation written by hand when M > 1)."""
    model = plain_model(dtype)
    opt = OPTIMIZERS[optimizer](model.parameters())
    loss_fn = nn.MSELoss()
    losses = []
    for x, y in data(dtype=dtype):
        opt.zero_grad()
        if micro_batches == 1:
            loss = loss_fn(model(x), y)
            loss.backward()
            losses.append(loss.detach())
        else:
            parts = []
            for xm, ym in zip(x.chunk(micro_batches), y.chunk(micro_batches), strict=True):
                loss = loss_fn(model(xm), ym)
                (loss / micro_batches).backward()
                parts.append(loss.detach())
            losses.append(torch.stack(parts).mean())
        opt.step()
    return losses, model


def epl_run(
    optimizer: str, micro_batches: int, dtype: torch.dtype = torch.float32
) -> tuple[list[torch.Tensor], epl.Engine]:
    epl.init(epl.Config({"pipeline.num_micro_batch": micro_batches}))
    engine = epl.parallelize(build(dtype), optimizer=OPTIMIZERS[optimizer], loss_fn=nn.MSELoss())
    return [engine.step(x, y) for x, y in data(dtype=dtype)], engine


@pytest.mark.parametrize("micro_batches", [1, 4])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_local_run_is_bitwise_equal_to_plain_pytorch(optimizer: str, micro_batches: int) -> None:
    expected_losses, expected_model = plain_run(optimizer, micro_batches)
    losses, engine = epl_run(optimizer, micro_batches)
    assert torch.equal(torch.stack(losses), torch.stack(expected_losses))
    for (name, ours), theirs in zip(engine.model.named_parameters(), expected_model.parameters(), strict=True):
        assert torch.equal(ours, theirs), name


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_gradient_accumulation_matches_the_full_batch(optimizer: str) -> None:
    """M micro-batches give the full batch's training up to float rounding (float64: 1e-12)."""
    full_losses, full_model = plain_run(optimizer, 1, torch.float64)
    losses, engine = epl_run(optimizer, 4, torch.float64)
    torch.testing.assert_close(torch.stack(losses), torch.stack(full_losses), rtol=1e-12, atol=1e-12)
    for ours, theirs in zip(engine.model.parameters(), full_model.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)


def test_engine_reports_replicas_parameters_and_plan() -> None:
    _, engine = epl_run("sgd", 1)
    assert engine.num_replicas == 1 and engine.replica_index == 0
    assert [id(p) for p in engine.parameters()] == [id(p) for p in engine.model.parameters()]
    assert engine.plan.local and engine.global_step == STEPS
    assert "replica 0 of 1" in repr(engine)


def test_predict_train_eval() -> None:
    epl.init()
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    engine = epl.parallelize(model, optimizer=OPTIMIZERS["sgd"], loss_fn=nn.MSELoss())
    x = torch.randn(3, 4)
    out = engine.eval().predict(x)
    assert not out.requires_grad and not model.training
    assert torch.equal(out, engine.predict(x))
    assert engine.train().model.training


def test_evaluate_gives_the_loss_and_touches_no_gradient_or_optimizer_state() -> None:
    epl.init()
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    engine = epl.parallelize(model, optimizer=OPTIMIZERS["adam"], loss_fn=nn.MSELoss())
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    engine.step(x, y)
    grads = [p.grad.clone() for p in model.parameters()]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    loss = engine.evaluate(x * 2, y)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, nn.functional.mse_loss(model(x * 2), y).detach(), rtol=0, atol=0)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert engine.global_step == 1


def test_tuple_and_dict_inputs_and_model_computed_loss() -> None:
    class TwoInputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(3, 1), nn.Linear(3, 1)

        def forward(self, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
            return self.a(left) + self.b(right)

    epl.init(epl.Config({"pipeline.num_micro_batch": 2}))
    engine = epl.parallelize(TwoInputs(), optimizer=OPTIMIZERS["sgd"], loss_fn=nn.MSELoss())
    x, y = (torch.randn(4, 3), torch.randn(4, 3)), torch.randn(4, 1)
    assert engine.step(x, y).dim() == 0
    assert engine.step({"left": x[0], "right": x[1]}, y).dim() == 0

    class LossModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Linear(3, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.w(x).pow(2).mean()

    epl.init()
    engine = epl.parallelize(LossModel(), optimizer=OPTIMIZERS["sgd"])
    assert engine.step(torch.randn(4, 3)).dim() == 0
    with pytest.raises(epl.EplError, match="got targets but epl.parallelize\\(\\) had no loss_fn"):
        engine.step(torch.randn(4, 3), torch.randn(4))


def test_batch_that_does_not_divide_into_micro_batches() -> None:
    epl.init(epl.Config({"pipeline.num_micro_batch": 4}))
    engine = epl.parallelize(nn.Linear(2, 2), optimizer=OPTIMIZERS["sgd"], loss_fn=nn.MSELoss())
    with pytest.raises(
        epl.BatchError,
        match=r"batch of 10 samples cannot be split into 4 equal parts for pipeline.num_micro_batch=4.*multiple of 4",
    ):
        engine.step(torch.randn(10, 2), torch.randn(10, 2))


def test_inconsistent_batch_sizes_are_an_error() -> None:
    epl.init(epl.Config({"pipeline.num_micro_batch": 2}))
    engine = epl.parallelize(nn.Bilinear(2, 2, 1), optimizer=OPTIMIZERS["sgd"], loss_fn=nn.MSELoss())
    with pytest.raises(epl.BatchError, match=r"different sizes in dimension 0: \[4, 6\]"):
        engine.step((torch.randn(4, 2), torch.randn(6, 2)), torch.randn(4, 1))


def test_non_scalar_loss_is_an_error() -> None:
    epl.init()
    engine = epl.parallelize(nn.Linear(2, 2), optimizer=OPTIMIZERS["sgd"], loss_fn=nn.MSELoss(reduction="none"))
    with pytest.raises(epl.EplError, match=r"loss must be a scalar tensor, got \[4, 2\]"):
        engine.step(torch.randn(4, 2), torch.randn(4, 2))


def test_optimizer_instance_and_bad_optimizers() -> None:
    epl.init()
    model = nn.Linear(2, 2)
    engine = epl.parallelize(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=nn.MSELoss())
    engine.step(torch.randn(2, 2), torch.randn(2, 2))
    epl.init()
    with pytest.raises(epl.EplError, match="holds 2 parameters that this rank.s model does not hold"):
        epl.parallelize(nn.Linear(2, 2), optimizer=torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))
    epl.init()
    with pytest.raises(epl.EplError, match="returned list, not a torch.optim.Optimizer"):
        epl.parallelize(nn.Linear(2, 2), optimizer=lambda p: list(p))
    epl.init()
    engine = epl.parallelize(nn.Linear(2, 2))
    with pytest.raises(epl.EplError, match="needs an optimizer"):
        engine.step(torch.randn(2, 2))


def test_state_dict_save_and_load_resume_exactly(tmp_path) -> None:
    batches = data(steps=6)
    epl.init()
    engine = epl.parallelize(build(), optimizer=OPTIMIZERS["adam"], loss_fn=nn.MSELoss())
    uninterrupted = [engine.step(x, y) for x, y in batches]

    epl.init()
    engine = epl.parallelize(build(), optimizer=OPTIMIZERS["adam"], loss_fn=nn.MSELoss())
    first = [engine.step(x, y) for x, y in batches[:3]]
    engine.save(tmp_path / "ckpt" / "engine.pt")
    epl.init()
    resumed = epl.parallelize(build(), optimizer=OPTIMIZERS["adam"], loss_fn=nn.MSELoss())
    resumed.load(tmp_path / "ckpt" / "engine.pt")
    assert resumed.global_step == 3
    rest = [resumed.step(x, y) for x, y in batches[3:]]
    assert torch.equal(torch.stack(first + rest), torch.stack(uninterrupted))
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["engine.pt"]  # no temporary left


def test_parallelize_rejects_non_modules() -> None:
    epl.init()
    with pytest.raises(epl.EplError, match="takes an nn.Module"):
        epl.parallelize(lambda x: x)  # type: ignore[arg-type]


def test_gradient_clipping_matches_plain_clip_grad_norm() -> None:
    model = plain_model()
    opt = OPTIMIZERS["sgd"](model.parameters())
    expected = []
    for x, y in data():
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        opt.step()
        expected.append(loss.detach())
    epl.init(epl.Config({"optimizer.max_grad_norm": 0.1}))
    engine = epl.parallelize(build(), optimizer=OPTIMIZERS["sgd"], loss_fn=nn.MSELoss())
    losses = [engine.step(x, y) for x, y in data()]
    assert torch.equal(torch.stack(losses), torch.stack(expected))
    for ours, theirs in zip(engine.model.parameters(), model.parameters(), strict=True):
        assert torch.equal(ours, theirs)


def test_namedtuple_and_mapping_batches_keep_their_types() -> None:
    import collections

    Pair = collections.namedtuple("Pair", "x mask")

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(3, 1)

        def forward(self, pair: Pair) -> torch.Tensor:
            assert isinstance(pair, Pair)
            return self.linear(pair.x * pair.mask)

    epl.init(epl.Config({"pipeline.num_micro_batch": 2}))
    engine = epl.parallelize(Masked(), optimizer=OPTIMIZERS["sgd"], loss_fn=nn.MSELoss())
    batch = Pair(torch.randn(4, 3), torch.ones(4, 3))
    assert engine.step(batch, torch.randn(4, 1)).dim() == 0
    assert engine.predict(batch).shape == (4, 1)


def test_lazy_modules_are_planned_with_a_note_and_train() -> None:
    epl.init()
    model = nn.Sequential(nn.LazyLinear(4), nn.Linear(4, 2))
    plan = epl.plan(model)
    assert any("uninitialised (lazy) parameters" in note for note in plan.notes)
    engine = epl.parallelize(model, optimizer=OPTIMIZERS["sgd"], loss_fn=nn.MSELoss())
    assert engine.step(torch.randn(2, 3), torch.randn(2, 2)).dim() == 0


def test_a_model_without_parameters_is_one_clear_error() -> None:
    import epl

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = [nn.Linear(2, 2)]  # a plain list: not registered

    epl.init()
    with pytest.raises(epl.EplError, match="Holder has no parameters, so the optimizer has nothing to train"):
        epl.parallelize(Holder(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))


def test_infinite_max_grad_norm_reports_the_norm_without_clipping() -> None:
    """``optimizer.max_grad_norm: inf`` logs the gradient norm of every step and changes no update."""
    model = plain_model()
    opt = OPTIMIZERS["sgd"](model.parameters())
    norms = []
    for x, y in data():
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
        opt.step()
    epl.init(epl.Config({"optimizer.max_grad_norm": float("inf")}))
    engine = epl.parallelize(build(), optimizer=OPTIMIZERS["sgd"], loss_fn=nn.MSELoss())
    for (x, y), norm in zip(data(), norms, strict=True):
        engine.step(x, y)
        assert engine.grad_norm == pytest.approx(float(norm), rel=1e-12)
    for ours, theirs in zip(engine.model.parameters(), model.parameters(), strict=True):
        assert torch.equal(ours, theirs)
