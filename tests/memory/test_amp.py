"""AMP O1 (autocast over float32 weights, loss scaling) equals PyTorch's torch.autocast + torch.amp.GradScaler.

The reference is the recipe of PyTorch's AMP documentation: the forward and the loss
under ``torch.autocast("cpu", torch.bfloat16)``, ``GradScaler("cpu", init_scale=2**15,
growth_interval=...)``, ``scaler.scale(loss / parts).backward()`` per micro-batch,
``unscale_`` before clipping, ``scaler.step`` and ``scaler.update``. Loss scales are
powers of two, so scaling and unscaling are exact: every comparison below is exact
(tolerance 0) unless it says otherwise, on one process, with data parallelism (2
processes against gradient accumulation over 2 micro-batches) and with a 2-stage pipeline.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import epl
from epl_memory.amp import AmpLossScaler, AmpPolicy, autocast_forward
from epl_memory.measure import kept_allocated_bytes
from tests.helpers.distributed import run_ranks

INF = float("inf")
BATCH, STEPS = 16, 4


def build(stages: bool = False) -> nn.Module:
    """12 -> 32 -> 16 -> 4 in float32; ``stages``: two replicate(1) stages (a pipeline on 2 processes)."""
    torch.manual_seed(0)
    if not stages:
        return nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4))
    with epl.replicate(device_count=1, name="stage_0"):
        first = nn.Sequential(nn.Linear(12, 32), nn.Tanh())
    with epl.replicate(device_count=1, name="stage_1"):
        second = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4))
    return nn.Sequential(first, second)


def adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2)


def batches(steps: int = STEPS, inf_at: tuple[int, int] | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``inf_at = (step, row)``: that step's batch has an inf in that row (row 8 and up: rank 1's half)."""
    generator = torch.Generator().manual_seed(1)
    result = [
        (torch.randn(BATCH, 12, generator=generator), torch.randn(BATCH, 4, generator=generator)) for _ in range(steps)
    ]
    if inf_at is not None:
        step, row = inf_at
        result[step][0][row, 3] = INF
    return result


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- the PyTorch reference ----------------------------------------------------------------
def torch_amp(
    data: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    parts: int = 1,
    max_norm: float | None = None,
    growth_interval: int = 2000,
    dtype: torch.dtype = torch.bfloat16,
    inject: Callable[[nn.Module, int], None] | None = None,
    stages: bool = False,
) -> dict[str, Any]:
    """The documented torch.autocast + GradScaler loop, micro-batches as gradient accumulation."""
    if stages:
        epl.init()  # a one-process run: the annotations are checked, not applied
    model = build(stages)
    optimizer = adam(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**15, growth_interval=growth_interval)
    losses, scales, states = [], [], []
    for step, (x, y) in enumerate(data):
        if inject is not None:
            inject(model, step)
        optimizer.zero_grad(set_to_none=True)
        pieces = []
        for xm, ym in zip(x.chunk(parts), y.chunk(parts), strict=True):
            with torch.autocast("cpu", dtype=dtype):
                loss = nn.functional.mse_loss(model(xm), ym)
            scaler.scale(loss / parts).backward()
            pieces.append(loss.detach())
        if max_norm is not None:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(optimizer)
        scaler.update()
        losses.append(torch.stack(pieces).mean())
        scales.append(scaler.get_scale())
        states.append(snapshot(model))
    return {"losses": torch.stack(losses), "scales": scales, "states": states}


def clip_per_replica(data: list[tuple[torch.Tensor, torch.Tensor]], max_norm: float) -> dict[str, Any]:
    """Two replicas clipping their own (unscaled) gradients before the mean, as data parallelism does by default."""
    model = build()
    optimizer = adam(model.parameters())
    scale = torch.tensor(2.0**15)
    losses, states = [], []
    for x, y in data:
        halves, pieces = [], []
        for xm, ym in zip(x.chunk(2), y.chunk(2), strict=True):
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.mse_loss(model(xm), ym)
            (loss * scale).backward()
            for param in model.parameters():
                param.grad.mul_(scale.double().reciprocal().float())
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            halves.append([p.grad.clone() for p in model.parameters()])
            pieces.append(loss.detach())
        for param, first, second in zip(model.parameters(), *halves, strict=True):
            param.grad = (first + second) / 2
        optimizer.step()
        losses.append(torch.stack(pieces).mean())
        states.append(snapshot(model))
    return {"losses": torch.stack(losses), "states": states}


# -- EPL ----------------------------------------------------------------------------------
def epl_amp(
    config: dict[str, Any],
    data: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    stages: bool = False,
    inject: Callable[[nn.Module, int], None] | None = None,
) -> dict[str, Any]:
    """Train with amp.level O1 (and ``config``); each replica takes its share of every batch."""
    epl.init(epl.Config({"amp.level": "O1", **config}))
    engine = epl.parallelize(build(stages), optimizer=adam, loss_fn=nn.MSELoss())
    rows = BATCH // engine.num_replicas
    share = slice(engine.replica_index * rows, (engine.replica_index + 1) * rows)
    losses, scales, states = [], [], []
    for step, (x, y) in enumerate(data):
        if inject is not None:
            inject(engine.model, step)
        losses.append(engine.step(x[share], y[share]))
        scales.append(engine.loss_scaler.scale)
        states.append(snapshot(engine.model))
    return {
        "losses": torch.stack(losses),
        "scales": scales,
        "states": states,
        "skipped": engine.loss_scaler.skipped_steps,
        "dtypes": {p.dtype for p in engine.model.parameters()},
        "replica": engine.replica_index,
    }


def assert_states_equal(result: dict[str, Any], reference: dict[str, Any], tolerance: float = 0.0) -> None:
    for step, (state, expected) in enumerate(zip(result["states"], reference["states"], strict=True)):
        for name, value in state.items():
            torch.testing.assert_close(value, expected[name], rtol=tolerance, atol=tolerance, msg=f"step {step} {name}")


def mean_over_replicas(results: list[dict[str, Any]]) -> torch.Tensor:
    per_replica = {r["replica"]: r["losses"] for r in results}
    return torch.stack([per_replica[i] for i in sorted(per_replica)]).mean(0)


# -- (a) one process ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("config", "reference"),
    [
        ({}, {}),
        ({"pipeline.num_micro_batch": 2}, {"parts": 2}),
        ({"optimizer.max_grad_norm": 0.05}, {"max_norm": 0.05}),
        ({"amp.dtype": "float16"}, {"dtype": torch.float16}),
    ],
    ids=["plain", "accumulation", "clipping", "float16"],
)
def test_one_process_equals_torch_autocast_and_grad_scaler(config: dict[str, Any], reference: dict[str, Any]) -> None:
    result = epl_amp(config, batches())
    expected = torch_amp(batches(), **reference)
    assert torch.equal(result["losses"], expected["losses"])  # the unscaled loss
    assert_states_equal(result, expected)
    assert result["scales"] == expected["scales"] == [2.0**15] * STEPS
    assert result["dtypes"] == {torch.float32}  # the weights stay float32
    assert result["skipped"] == 0


def test_a_non_finite_step_is_skipped_the_scale_halves_and_grows_back() -> None:
    """amp.growth_interval 2: 2^15, inf at step 1 -> 2^14 (step skipped), back to 2^15 after two good steps."""
    data = batches(steps=5, inf_at=(1, 3))
    result = epl_amp({"amp.growth_interval": 2}, data)
    expected = torch_amp(data, growth_interval=2)
    torch.testing.assert_close(result["losses"], expected["losses"], rtol=0, atol=0, equal_nan=True)
    assert_states_equal(result, expected)
    assert result["scales"] == expected["scales"] == [2.0**15, 2.0**14, 2.0**14, 2.0**15, 2.0**15]
    assert result["skipped"] == 1
    for name, value in result["states"][1].items():  # the skipped step changed nothing
        assert torch.equal(value, result["states"][0][name]), name
    assert torch.isfinite(result["losses"]).all()  # tanh saturates the inf: only the weight's gradient is not finite


def test_a_fixed_loss_scale_never_changes_and_still_skips_non_finite_steps() -> None:
    """amp.loss_scale 1000 (not a power of two): loss x float32(1000), gradients x float32(1/1000) as GradScaler."""
    data = batches(steps=4, inf_at=(2, 0))
    result = epl_amp({"amp.loss_scale": 1000}, data)

    model = build()
    optimizer = adam(model.parameters())
    scale = torch.tensor(1000.0)
    expected: dict[str, Any] = {"losses": [], "states": []}
    for x, y in data:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(model(x), y)
        (loss * scale).backward()
        grads = [p.grad for p in model.parameters()]
        for grad in grads:
            grad.mul_(scale.double().reciprocal().float())
        if all(torch.isfinite(g).all() for g in grads):
            optimizer.step()
        expected["losses"].append(loss.detach())
        expected["states"].append(snapshot(model))
    torch.testing.assert_close(result["losses"], torch.stack(expected["losses"]), rtol=0, atol=0, equal_nan=True)
    assert_states_equal(result, expected)
    assert result["scales"] == [1000.0] * 4
    assert result["skipped"] == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_float16_equals_torch_cuda_autocast_and_grad_scaler() -> None:
    """On CUDA the default is float16; the reference is GradScaler("cuda"), the same fused unscale kernel."""
    data = [(x.cuda(), y.cuda()) for x, y in batches(steps=3, inf_at=(1, 0))]
    epl.init(epl.Config({"amp.level": "O1"}))
    engine = epl.parallelize(build(), optimizer=adam, loss_fn=nn.MSELoss())
    losses = [engine.step(x, y) for x, y in data]
    assert next(engine.model.parameters()).dtype == torch.float32
    assert engine.predict(data[0][0]).dtype == torch.float16

    model = build().cuda()
    optimizer = adam(model.parameters())
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**15)
    expected = []
    for x, y in data:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        expected.append(loss.detach())
    torch.testing.assert_close(torch.stack(losses), torch.stack(expected), rtol=0, atol=0, equal_nan=True)
    for name, value in model.state_dict().items():
        assert torch.equal(engine.model.state_dict()[name], value), name
    assert engine.loss_scaler.scale == scaler.get_scale() <= 2.0**14  # the inf batch at least was skipped
    assert engine.loss_scaler.skipped_steps >= 1


# -- (b) and (c): data parallelism on 2 processes -----------------------------------------
def data_parallel_runs() -> dict[str, Any]:
    return {
        "plain": epl_amp({}, batches()),
        "clip_after": epl_amp({"optimizer.max_grad_norm": 0.05, "communication.clip_after_allreduce": True}, batches()),
        "clip_before": epl_amp({"optimizer.max_grad_norm": 0.05}, batches()),
        # inf in rank 1's rows only: both ranks skip, the scale halves on both, then grows back
        "inf": epl_amp({"amp.growth_interval": 2}, batches(steps=5, inf_at=(1, 12))),
    }


@pytest.mark.multiprocess
def test_data_parallel_on_two_processes_equals_the_local_grad_scaler_run() -> None:
    ranks = run_ranks(data_parallel_runs, 2, timeout=180)
    expected = {
        "plain": torch_amp(batches(), parts=2),
        "clip_after": torch_amp(batches(), parts=2, max_norm=0.05),
        "clip_before": clip_per_replica(batches(), 0.05),
        "inf": torch_amp(batches(steps=5, inf_at=(1, 12)), parts=2, growth_interval=2),
    }
    for name, reference in expected.items():
        results = [rank[name] for rank in ranks]
        torch.testing.assert_close(mean_over_replicas(results), reference["losses"], rtol=0, atol=0, equal_nan=True)
        for result in results:
            assert_states_equal(result, reference)
            assert result["dtypes"] == {torch.float32}
    before, after = (ranks[0][name]["states"][-1]["0.weight"] for name in ("clip_before", "clip_after"))
    assert not torch.equal(before, after)  # the two clipping orders give different updates: both were checked
    for rank in ranks:
        inf = rank["inf"]
        assert inf["scales"] == expected["inf"]["scales"] == [2.0**15, 2.0**14, 2.0**14, 2.0**15, 2.0**15]
        assert inf["skipped"] == 1
        for name, value in inf["states"][1].items():
            assert torch.equal(value, inf["states"][0][name]), name
        assert torch.isfinite(inf["losses"][2:]).all()
    assert torch.isfinite(ranks[0]["inf"]["losses"]).all()  # rank 0's own data was finite: it skipped anyway


# -- (e) a two-stage pipeline -------------------------------------------------------------
class PoisonLastBias:
    """At step ``at``, the last layer's bias (stage 1's) receives an inf gradient; no other parameter does."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.hook: Any = None

    def __call__(self, model: nn.Module, step: int) -> None:
        bias = dict(model.named_parameters()).get("1.2.bias")
        if bias is None:  # stage 0's rank holds no such parameter
            return
        if self.hook is not None:
            self.hook.remove()
        self.hook = bias.register_hook(lambda grad: grad * INF) if step == self.at else None


def pipeline_runs() -> dict[str, Any]:
    micro = {"pipeline.num_micro_batch": 4}
    return {
        "PreferBackward": epl_amp({**micro, "pipeline.strategy": "PreferBackward"}, batches(), stages=True),
        # only stage 1's gradient is non-finite: stage 0 must skip its update too
        "ZeroBubble": epl_amp(
            {**micro, "pipeline.strategy": "ZeroBubble", "amp.growth_interval": 2},
            batches(steps=5),
            stages=True,
            inject=PoisonLastBias(1),
        ),
    }


@pytest.mark.multiprocess
def test_pipeline_of_two_stages_equals_the_local_grad_scaler_run() -> None:
    ranks = run_ranks(pipeline_runs, 2, timeout=180)
    expected = {
        "PreferBackward": torch_amp(batches(), parts=4, stages=True),
        "ZeroBubble": torch_amp(batches(steps=5), parts=4, growth_interval=2, inject=PoisonLastBias(1), stages=True),
    }
    for name, reference in expected.items():
        for rank, result in enumerate(ranks):
            stage = result[name]
            losses = stage["losses"].float()  # the pipeline broadcasts the float32 mean as float64
            torch.testing.assert_close(losses, reference["losses"], rtol=0, atol=0, msg=f"{name} rank {rank}")
            for step, state in enumerate(stage["states"]):
                assert len(state) == (2 if rank == 0 else 4)  # only this stage's layers
                for key, value in state.items():
                    assert torch.equal(value, reference["states"][step][key]), f"{name} rank {rank} step {step} {key}"
            assert stage["scales"] == reference["scales"]
    for result in ranks:
        poisoned = result["ZeroBubble"]
        assert poisoned["scales"] == [2.0**15, 2.0**14, 2.0**14, 2.0**15, 2.0**15]
        assert poisoned["skipped"] == 1
        for key, value in poisoned["states"][1].items():  # both stages skipped step 1
            assert torch.equal(value, poisoned["states"][0][key]), key


# -- the Engine's side ----------------------------------------------------------------------
def test_loss_scaler_state_is_saved_and_loaded(tmp_path: Path) -> None:
    config = {"amp.level": "O1", "amp.growth_interval": 2}
    epl.init(epl.Config(config))
    engine = epl.parallelize(build(), optimizer=adam, loss_fn=nn.MSELoss())
    for x, y in batches(steps=3, inf_at=(0, 0)):
        engine.step(x, y)
    assert (engine.loss_scaler.scale, engine.loss_scaler.skipped_steps) == (2.0**15, 1)  # halved, then doubled
    engine.step(*batches(steps=1)[0])
    engine.save(tmp_path / "amp.pt")
    saved = engine.state_dict()["loss_scaler"]
    assert saved == {"scale": 2.0**15, "growth_tracker": 1, "skipped_steps": 1}

    epl.init(epl.Config(config))
    resumed = epl.parallelize(build(), optimizer=adam, loss_fn=nn.MSELoss())
    resumed.load(tmp_path / "amp.pt")
    assert resumed.loss_scaler.state_dict() == saved
    state = engine.state_dict()
    del state["loss_scaler"]  # a checkpoint written without AMP (or before it existed) still loads
    resumed.load_state_dict(state)
    assert resumed.loss_scaler.state_dict() == saved

    epl.init(epl.Config({"amp.level": "O1", "amp.loss_scale": 512}))
    fixed = epl.parallelize(build(), optimizer=adam, loss_fn=nn.MSELoss())
    fixed.load(tmp_path / "amp.pt")
    assert fixed.loss_scaler.scale == 512.0  # the configured fixed scale wins over the saved dynamic one
    assert fixed.loss_scaler.skipped_steps == 1

    epl.init()
    plain = epl.parallelize(build(), optimizer=adam, loss_fn=nn.MSELoss())
    assert plain.loss_scaler is None
    assert plain.state_dict()["loss_scaler"] is None
    plain.load(tmp_path / "amp.pt")  # an AMP checkpoint loads without AMP too


def test_no_low_precision_copy_of_the_weights_outlives_a_step() -> None:
    """The first SGD step keeps its gradients, with AMP also the 4-byte scale: autocast's casts die with the forward."""
    x, y = batches(steps=1)[0]
    kept = {}
    for level in ("", "O1"):
        epl.init(epl.Config({"amp.level": level}))
        engine = epl.parallelize(build(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=nn.MSELoss())
        kept[level] = kept_allocated_bytes(lambda engine=engine: engine.step(x, y))
        assert not torch.is_autocast_enabled("cpu")
    gradients = sum(p.numel() * 4 for p in build().parameters())
    assert kept[""] == gradients
    assert kept["O1"] == gradients + 4  # the loss scale as a float32 tensor; no bfloat16 weight survives


def test_predict_and_direct_calls_of_the_model_run_under_autocast() -> None:
    epl.init(epl.Config({"amp.level": "O1"}))
    engine = epl.parallelize(build(), optimizer=adam, loss_fn=nn.MSELoss())
    x, _ = batches(steps=1)[0]
    assert engine.predict(x).dtype == torch.bfloat16
    assert engine.model(x).dtype == torch.bfloat16
    autocast_forward(engine.model, AmpPolicy(device_type="cpu", dtype=torch.float16))  # already wrapped: unchanged
    assert engine.model(x).dtype == torch.bfloat16


def test_debug_log_reports_scale_changes_and_skipped_steps(caplog: pytest.LogCaptureFixture) -> None:
    epl.init(epl.Config({"amp.level": "O1", "amp.growth_interval": 2, "amp.debug_log": True}))
    engine = epl.parallelize(build(), optimizer=adam, loss_fn=nn.MSELoss())
    with caplog.at_level(logging.INFO, logger="epl.memory"):
        for x, y in batches(steps=3, inf_at=(0, 0)):
            engine.step(x, y)
    messages = [r.getMessage() for r in caplog.records if r.name == "epl.memory"]
    assert messages == [
        "AMP: inf/NaN gradient on some rank: update skipped, loss scale 32768 -> 16384",
        "AMP: 2 steps without inf/NaN: loss scale 16384 -> 32768",
    ]


def test_without_debug_log_nothing_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    epl.init(epl.Config({"amp.level": "O1", "amp.growth_interval": 1}))
    engine = epl.parallelize(build(), optimizer=adam, loss_fn=nn.MSELoss())
    with caplog.at_level(logging.DEBUG, logger="epl.memory"):
        for x, y in batches(steps=2, inf_at=(0, 0)):
            engine.step(x, y)
    assert engine.loss_scaler.skipped_steps == 1
    assert not [r for r in caplog.records if r.name == "epl.memory"]


# -- the scaler alone -------------------------------------------------------------------------
def test_scaler_unscales_once_per_step_skips_missing_gradients_and_handles_sparse_ones() -> None:
    scaler = AmpLossScaler(AmpPolicy(device_type="cpu", dtype=torch.bfloat16, loss_scale=4.0))
    dense, missing = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2))
    sparse32 = nn.Parameter(torch.zeros(5, 2))
    sparse16 = nn.Parameter(torch.zeros(5, 2, dtype=torch.float16))
    dense.grad = torch.tensor([4.0, 8.0, -4.0])
    sparse32.grad = torch.sparse_coo_tensor([[1, 3]], torch.full((2, 2), 8.0), (5, 2), check_invariants=True)
    sparse16.grad = torch.sparse_coo_tensor(
        [[2, 2]], torch.full((2, 2), 4.0, dtype=torch.float16), (5, 2), check_invariants=True
    )
    params = [dense, missing, sparse32, sparse16]
    scaler.start()
    scaler.unscale(params)
    scaler.unscale(params)  # a second call in the same step does nothing
    assert torch.equal(dense.grad, torch.tensor([1.0, 2.0, -1.0]))
    assert missing.grad is None
    assert torch.equal(sparse32.grad.to_dense()[1], torch.full((2,), 2.0))
    assert sparse16.grad.is_coalesced()  # duplicate indices summed before the check, as GradScaler does
    assert torch.equal(sparse16.grad.to_dense()[2], torch.full((2,), 2.0, dtype=torch.float16))
    assert scaler.update(params) is True

    sparse32.grad = torch.sparse_coo_tensor([[0]], torch.tensor([[INF, 1.0]]), (5, 2), check_invariants=True)
    dense.grad = None
    scaler.start()
    assert scaler.update(params) is False  # update unscales when nothing did
    assert (scaler.scale, scaler.skipped_steps) == (4.0, 1)  # fixed: unchanged
    assert "fixed scale 4" in repr(scaler)


def test_scaler_multiplies_the_loss_by_a_float32_scale_and_never_grows_past_float32() -> None:
    scaler = AmpLossScaler(AmpPolicy(device_type="cpu", dtype=torch.bfloat16, init_scale=2.0**127, growth_interval=1))
    loss = torch.tensor(3.0, dtype=torch.float64)
    assert scaler.scale_loss(loss).item() == 3.0 * 2.0**127
    assert scaler.update([]) is True
    assert scaler.scale == 2.0**127  # 2^128 is not a float32: GradScaler keeps the scale too
    assert scaler.growth_tracker == 0


def test_default_precision_per_device_and_the_amp_dtype_key() -> None:
    config = epl.Config({"amp.level": "O1"})
    assert AmpPolicy.from_config(config, torch.device("cuda", 0)).dtype == torch.float16
    assert AmpPolicy.from_config(config, torch.device("cpu")).dtype == torch.bfloat16
    chosen = AmpPolicy.from_config(epl.Config({"amp.level": "O1", "amp.dtype": "bfloat16"}), torch.device("cuda"))
    assert chosen.dtype == torch.bfloat16
    assert chosen.dynamic and chosen.init_scale == 2.0**15 and chosen.growth_interval == 2000


# -- (f) bad configurations -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("amp.level", "O2", r"'amp.level'.*expected one of '', 'O1', got 'O2'"),
        ("amp.dtype", "float8", r"'amp.dtype'.*expected one of '', 'float16', 'bfloat16', got 'float8'"),
        ("amp.loss_scale", 0, r"'amp.loss_scale'.*got 0"),
        ("amp.loss_scale", "static", r"'amp.loss_scale'.*got 'static'"),
        ("amp.loss_scale", 2.5, r"'amp.loss_scale'.*expected str/int"),
        ("amp.growth_interval", 0, r"'amp.growth_interval'.*got 0"),
    ],
)
def test_bad_amp_values_are_config_errors(key: str, value: object, message: str) -> None:
    with pytest.raises(epl.ConfigError, match=message):
        epl.Config({"amp.level": "O1", key: value})


@pytest.mark.parametrize(
    ("key", "value"), [("amp.loss_scale", 128), ("amp.dtype", "float16"), ("amp.growth_interval", 8)]
)
def test_amp_options_without_amp_level_are_an_error_not_a_no_op(key: str, value: object) -> None:
    epl.init(epl.Config({key: value}))
    with pytest.raises(epl.ConfigError, match=rf"'{key}' = .* only applies to mixed precision: set amp.level to 'O1'"):
        epl.parallelize(build(), optimizer=adam, loss_fn=nn.MSELoss())


def test_amp_without_epl_memory_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EPL_DISABLE_EXTERNAL_PLUGINS", "epl-memory")
    with pytest.raises(epl.MissingPluginError, match="'amp.level' = 'O1' needs the plugin epl-memory"):
        epl.init(epl.Config({"amp.level": "O1"}))
