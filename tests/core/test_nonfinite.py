"""Non-finite steps are never applied: a NaN or Inf loss or gradient on any rank skips the update on every rank.

One launch of 2 processes runs every layout (data parallelism, ZeRO v1 and v2, split, a 2-stage pipeline, AMP's
bfloat16 autocast), each with and without ``optimizer.max_grad_norm``: step 2 of 4 holds an Inf (in one replica's
rows, or the replica batch), a NaN target, or a NaN gradient on one rank only. On every rank the bad step leaves the
weights and the optimizer's state as they were and the LR scheduler unstepped, ``engine.skipped_steps`` is 1, and
the run ends equal to one process that never saw that batch (float64: PyTorch's loop; AMP: EPL's own run). Then
``optimizer.raise_after_skips`` raises on both ranks, naming the step and the rank where the skips began.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from torch import nn

import epl
from tests.helpers.distributed import run_ranks

pytestmark = pytest.mark.multiprocess

NAN, INF = float("nan"), float("inf")
ROWS, STEPS, BAD = 8, 4, 1  # global batch rows, steps, the bad step's index
CLIP = 100.0  # clipping that computes the norm (the check rides it) but never bites: the runs stay comparable
LR, GAMMA = 0.01, 0.9


def build(layout: str, dtype: torch.dtype = torch.float64) -> nn.Module:
    """6 -> 16 -> 16 -> 4; a split(2) model under ``split``, two replicate(1) stages under ``pipeline``."""
    torch.manual_seed(0)
    whole = epl.split(2) if layout == "split" else contextlib.nullcontext()
    first_scope, second_scope = contextlib.nullcontext(), contextlib.nullcontext()
    if layout == "pipeline":
        first_scope, second_scope = epl.replicate(1, name="stage_0"), epl.replicate(1, name="stage_1")
    with whole:
        with first_scope:
            first = nn.Sequential(nn.Linear(6, 16), nn.Tanh())
        with second_scope:
            second = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    return nn.Sequential(first, second).to(dtype)


def batches(dtype: torch.dtype = torch.float64) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(ROWS, 6, generator=generator, dtype=dtype), torch.randn(ROWS, 4, generator=generator, dtype=dtype))
        for _ in range(STEPS)
    ]


#: name -> (layout, config, fault). Faults: "inf rows" (an Inf in replica 1's rows: rank 1 under data parallelism,
#: the replica batch of split and pipelines), "nan target" (rank 1's targets: its loss is NaN), "nan gradient r"
#: (rank r's first parameter gets a NaN gradient; every loss stays finite).
CASES: dict[str, tuple[str, dict[str, Any], str]] = {
    "data parallel": ("dp", {}, "inf rows"),
    "data parallel, clipped": ("dp", {"optimizer.max_grad_norm": CLIP}, "inf rows"),
    "ZeRO v1": ("dp", {"zero.level": "v1"}, "inf rows"),
    "ZeRO v1, clipped": ("dp", {"zero.level": "v1", "optimizer.max_grad_norm": CLIP}, "inf rows"),
    "ZeRO v2": ("dp", {"zero.level": "v2"}, "nan target"),
    "split": ("split", {}, "nan gradient 1"),
    "split, clipped": ("split", {"optimizer.max_grad_norm": CLIP}, "inf rows"),
    "pipeline": ("pipeline", {"pipeline.num_micro_batch": 2}, "nan gradient 0"),
    "pipeline, clipped": ("pipeline", {"pipeline.num_micro_batch": 2, "optimizer.max_grad_norm": CLIP}, "inf rows"),
    "AMP bfloat16": ("dp", {"amp.level": "O1"}, "nan target"),
    "AMP bfloat16, clipped": ("dp", {"amp.level": "O1", "optimizer.max_grad_norm": CLIP}, "nan target"),
}


def optimizer_state(engine: Any) -> dict[str, Any]:
    return {
        key: {name: value.clone() if isinstance(value, torch.Tensor) else value for name, value in entry.items()}
        for key, entry in engine.optimizer.state_dict()["state"].items()
    }


def train(layout: str, config: dict[str, Any], fault: str, *, without_bad: bool = False) -> dict[str, Any]:
    """One rank: 4 steps, step ``BAD`` poisoned by ``fault`` (``without_bad``: left out); what the bad step
    changed, and the end state."""
    dtype = torch.float32 if config.get("amp.level") else torch.float64
    epl.init(epl.Config(config))
    engine = epl.parallelize(
        build(layout, dtype),
        optimizer=lambda params: torch.optim.AdamW(params, lr=LR),
        loss_fn=nn.MSELoss(),
        lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=GAMMA),
    )
    rank = engine.context.cluster.rank
    share = ROWS // engine.num_replicas
    rows = slice(share * engine.replica_index, share * (engine.replica_index + 1))
    losses, bad = [], {}
    for index, (x, y) in enumerate(batches(dtype)):
        x, y, hook = x[rows].clone(), y[rows].clone(), None
        if index == BAD and without_bad:
            continue
        if index == BAD:
            if fault == "inf rows" and engine.replica_index == engine.num_replicas - 1:
                x[0, 2] = INF
            elif fault == "nan target" and rank == 1:
                y[0, 0] = NAN
            elif fault.startswith("nan gradient") and rank == int(fault.split()[-1]):
                hook = next(engine.parameters()).register_hook(lambda grad: torch.full_like(grad, NAN))
            weights = {name: value.clone() for name, value in engine.model.state_dict().items()}
            state, lr = optimizer_state(engine), engine.lr
        loss = engine.step(x, y)
        losses.append(float(loss.detach()))
        if hook is not None:
            hook.remove()
        if index == BAD:
            outcome = engine.runner.nonfinite.last
            bad = {
                "weights kept": all(torch.equal(v, engine.model.state_dict()[k]) for k, v in weights.items()),
                "state kept": _same(state, optimizer_state(engine)),
                "lr kept": engine.lr == lr,
                "skipped": engine.last_step_skipped,
                "gradients dropped": all(p.grad is None for p in engine.parameters()),
                "loss ranks": outcome.loss_ranks,
                "gradient ranks": outcome.gradient_ranks,
                "averaged gradients": outcome.averaged_gradients,
            }
    scaler = engine.loss_scaler
    return {
        "bad": bad,
        "losses": losses,
        "skipped_steps": engine.skipped_steps,
        "global_step": engine.global_step,
        "scheduler steps": engine.lr_scheduler.last_epoch,
        "scaler": None if scaler is None else (scaler.scale, scaler.skipped_steps),
        "state": engine.state_dict(full=True)["model"],
    }


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    for key, entry in a.items():
        for name, value in entry.items():
            other = b[key][name]
            if isinstance(value, torch.Tensor) and not torch.equal(value, other):
                return False
            if not isinstance(value, torch.Tensor) and value != other:
                return False
    return True


def raise_after_two() -> str:
    """Rank 1's targets hold a NaN at steps 2 and 3: the second skip in a row raises, on both ranks."""
    epl.init(epl.Config({"optimizer.raise_after_skips": 2}))
    engine = epl.parallelize(build("dp"), optimizer=lambda params: torch.optim.SGD(params, lr=LR), loss_fn=nn.MSELoss())
    rows = slice(4 * engine.replica_index, 4 * engine.replica_index + 4)
    for index, (x, y) in enumerate(batches()):
        y = y[rows].clone()
        if index in (1, 2) and engine.replica_index == 1:
            y[0, 0] = NAN
        try:
            engine.step(x[rows], y)
        except epl.EplError as error:
            return f"step {engine.global_step}, {engine.skipped_steps} skipped: {error}"
    return "no error"


def every_case() -> dict[str, Any]:
    results: dict[str, Any] = {name: train(*case) for name, case in CASES.items()}
    for name, case in CASES.items():
        if case[1].get("amp.level"):  # bfloat16 depends on the layout: the same layout, without that batch
            results[f"{name} without the bad batch"] = train(*case, without_bad=True)
    results["raise"] = raise_after_two()
    return results


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(every_case, 2, timeout=300)


def reference(config: dict[str, Any]) -> tuple[list[float], dict[str, torch.Tensor]]:
    """PyTorch's loop in this process over every batch but the bad one (float64)."""
    model = build("dp")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=GAMMA)
    losses = []
    for index, (x, y) in enumerate(batches()):
        if index == BAD:
            continue
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if config.get("optimizer.max_grad_norm"):
            assert float(nn.utils.clip_grad_norm_(model.parameters(), CLIP)) < CLIP  # never bites
        optimizer.step()
        scheduler.step()
        losses.append(float(loss.detach()))
    return losses, model.state_dict()


@pytest.mark.parametrize("name", list(CASES))
def test_a_non_finite_step_is_skipped_on_every_rank(ranks: list[dict[str, Any]], name: str) -> None:
    layout, config, fault = CASES[name]
    results = [rank[name] for rank in ranks]
    for rank, result in enumerate(results):
        bad = result["bad"]
        assert bad["skipped"] and bad["weights kept"] and bad["state kept"] and bad["lr kept"], (rank, bad)
        assert bad["gradients dropped"], rank
        assert (result["skipped_steps"], result["global_step"], result["scheduler steps"]) == (1, STEPS, STEPS - 1)
        assert (bad["loss ranks"], bad["gradient ranks"]) == (
            results[0]["bad"]["loss ranks"],
            results[0]["bad"]["gradient ranks"],
        )
    # under plain data parallelism the reduction finds the gradients' NaN in their average: no rank is named
    seen = {*results[0]["bad"]["loss ranks"], *results[0]["bad"]["gradient ranks"]}
    if results[0]["bad"]["averaged gradients"]:
        seen.add("averaged")
    if fault.startswith("nan gradient"):  # only that rank saw it, and every rank skipped
        assert results[0]["bad"]["loss ranks"] == () and results[0]["bad"]["gradient ranks"] == (int(fault[-1]),)
    elif fault == "nan target":
        assert 1 in results[0]["bad"]["loss ranks"]
    else:
        assert seen, results[0]["bad"]
    if config.get("amp.level"):  # bfloat16: against the same 2 ranks without that batch (loss scales are powers of 2)
        for rank, (result, clean) in enumerate(
            zip(results, [r[f"{name} without the bad batch"] for r in ranks], strict=True)
        ):
            assert result["scaler"] == (2.0**14, 1), rank  # backed off once for the NaN gradients, and counted it
            assert result["losses"][:BAD] + result["losses"][BAD + 1 :] == clean["losses"], rank
            for key, value in result["state"].items():
                assert torch.equal(value, clean["state"][key]), (name, rank, key)
        return
    losses, state = reference(config)
    # each step returns its replica's loss: their mean under data parallelism (2 replicas of 4 rows) is the batch's
    mean = [sum(values) / len(values) for values in zip(*(result["losses"] for result in results), strict=True)]
    for rank, result in enumerate(results):
        replica_losses = mean if layout == "dp" else result["losses"]
        good = [loss for index, loss in enumerate(replica_losses) if index != BAD]
        torch.testing.assert_close(good, losses, rtol=1e-10, atol=1e-10)
        for key, value in result["state"].items():
            torch.testing.assert_close(value, state[key], rtol=1e-10, atol=1e-10, msg=f"{name}, rank {rank}, {key}")


def test_skips_in_a_row_raise_naming_where_they_began(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        message = rank["raise"]
        assert message.startswith("step 3, 2 skipped: 2 steps in a row were skipped"), message
        assert "It began at step 2 with NaN or Inf in the loss on rank 1" in message, message
        assert "optimizer.raise_after_skips" in message, message


def local_engine(config: dict[str, Any]) -> Any:
    epl.init(epl.Config(config))
    return epl.parallelize(build("dp"), optimizer=lambda params: torch.optim.AdamW(params, lr=LR), loss_fn=nn.MSELoss())


def test_the_progress_bar_shows_skipped_steps() -> None:
    import io

    engine = local_engine({})
    out = io.StringIO()
    progress = epl.Progress(engine, log_every=1, file=out)
    (x, y), (x2, y2) = batches()[:2]
    progress.update(engine.step(x, y))
    y2 = y2.clone()
    y2[0, 0] = NAN
    progress.update(engine.step(x2, y2))
    first, second = out.getvalue().splitlines()
    assert "skipped" not in first and "skipped 1" in second, out.getvalue()


def test_without_the_gradient_pass_only_losses_are_checked() -> None:
    """optimizer.check_finite_gradients=False, no clipping, no AMP: a NaN loss is skipped; a NaN gradient under a
    finite loss (an Inf input through tanh) is not."""
    engine = local_engine({"optimizer.check_finite_gradients": False})
    (x, y), (x2, y2) = batches()[:2]
    y = y.clone()
    y[0, 0] = NAN
    engine.step(x, y)
    assert engine.skipped_steps == 1
    x2 = x2.clone()
    x2[0, 2] = INF
    assert torch.isfinite(engine.step(x2, y2))
    assert engine.skipped_steps == 1 and not all(torch.isfinite(p).all() for p in engine.parameters())


def test_a_checkpoint_keeps_the_count_of_skipped_steps(tmp_path: Any) -> None:
    """``engine.skipped_steps`` counts the whole run: a resumed engine goes on from the saved count."""
    engine = local_engine({})
    (x, y), (x2, y2) = batches()[:2]
    y = y.clone()
    y[0, 0] = NAN
    engine.step(x, y)
    engine.step(x2, y2)
    engine.save(tmp_path / "checkpoint")
    resumed = local_engine({})
    assert resumed.skipped_steps == 0
    resumed.load(tmp_path / "checkpoint")
    assert (resumed.skipped_steps, resumed.global_step, resumed.last_step_skipped) == (1, 2, False)
    resumed.state_dict()  # the in-memory state carries it as well
    again = local_engine({})
    again.load_state_dict(resumed.state_dict())
    assert again.skipped_steps == 1
