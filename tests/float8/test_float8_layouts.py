"""``float8.enabled`` under EPL's layouts, equal to the same float8 model trained in one process.

The tiny Llama of :mod:`tests.float8.models` (float32, 4 layers: layers 1 and 2 in float8, the edges and the head
in float32), 3 AdamW steps. The one-process reference converts the same linears (:mod:`epl.float8`) and runs each
replica's rows and each micro-batch as a separate forward, as the layout does: float8 scales are taken per forward
(the amax of what that forward sees), so a batch run whole would scale differently. Losses and every parameter
(gathered whole) within the tolerance of each layout, measured:

- data parallel, 2 replicas: ``DP_TOLERANCE``;
- ZeRO v2 over 2 replicas, weights all-gathered in float8 (tensorwise: the amax of the chunks' amaxes, the same
  scale as the whole weight's): ``DP_TOLERANCE``, and the rowwise recipe (gathered in float32);
- ZeRO v2 with each block compiled (``compile.backend aot_eager``) against the one process eager:
  ``DP_TOLERANCE``;
- an automatic 2-stage pipeline of 2 micro-batches (layer 1 on the first stage, layer 2 on the second):
  ``DP_TOLERANCE``;
- ``epl.split(2)``, each column and row shard scaled over the two devices as the whole layer (both recipes): the
  first loss within ``SPLIT_LOSS``, the gradients within ``SPLIT_GRADIENT`` of their norm.

And a checkpoint of ZeRO v2's float8-gathered weights resumes exactly.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.float8.models import ROWS, adamw, batches, llama, token_loss
from tests.helpers.distributed import run_ranks

pytest.importorskip("torchao.float8")
pytestmark = [pytest.mark.multiprocess, pytest.mark.filterwarnings("ignore::UserWarning")]

STEPS = 3
#: Relative and absolute tolerance of losses and parameters against one process (float32). Measured: every layout
#: equal to the bit (largest difference 0.0): a float8 cast is exact given the same amax, and halving a gradient is.
DP_TOLERANCE = 1e-6
#: Under split, the first loss (relative) and each parameter's gradient (relative to its norm) against one process,
#: by recipe (see the split test).
SPLIT_LOSS = {"tensorwise": DP_TOLERANCE, "rowwise": 1e-4}
SPLIT_GRADIENT = {"tensorwise": 1e-3, "rowwise": 0.1}


def float8_llama(recipe: str = "tensorwise") -> torch.nn.Module:
    """The Llama with the linears EPL chooses in float8, converted here."""
    from epl.float8 import choose_linears, convert, float8_config

    model = llama()
    convert(model, choose_linears(model).converted, float8_config(recipe, all_gather=False))  # type: ignore[arg-type]
    return model


def train_here(micro: int, replicas: int, recipe: str) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """One process: each replica's rows in ``micro`` micro-batches, gradients averaged, one AdamW step each."""
    model = float8_llama(recipe)
    optimizer = adamw(model.parameters())
    losses: list[list[float]] = [[] for _ in range(replicas)]
    for tokens in batches(STEPS, ROWS * replicas):
        optimizer.zero_grad()
        for replica, rows in enumerate(tokens.chunk(replicas)):
            parts = []
            for part in rows.chunk(micro):
                loss = token_loss(model(input_ids=part), part)
                (loss / (micro * replicas)).backward()
                parts.append(loss.detach())
            losses[replica].append(float(torch.stack(parts).mean()))
        optimizer.step()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(config: dict[str, Any], replicas: int = 1, split: int = 1) -> dict[str, Any]:
    """One rank: the Llama trained by EPL with float8 under ``config`` (built in ``epl.split(split)`` if more than
    one); its losses, whole parameters, float8 linears."""
    import epl

    epl.init(epl.Config({"float8.enabled": True, **config}))
    if split > 1:
        with epl.split(split):
            model = llama()
    else:
        model = llama()
    engine = epl.parallelize(model, optimizer=adamw, loss_fn=token_loss)
    losses = []
    for tokens in batches(STEPS, ROWS * replicas):
        index = engine.replica_index
        rows = tokens[index * ROWS : (index + 1) * ROWS] if replicas > 1 else tokens
        losses.append(float(engine.step({"input_ids": rows}, rows)))
    state = engine.state_dict(full=True)["model"]
    modules = dict(engine.model.named_modules())
    float8 = [name for name, m in modules.items() if type(m).__name__ == "Float8Linear"]
    float8 += [
        name for name, m in modules.items() if type(getattr(m, "product", None)).__name__ == "ShardedFloat8Product"
    ]
    weights = {name: modules[name].weight for name in float8 if type(modules[name]).__name__ == "Float8Linear"}
    kinds = {type(w.to_local() if hasattr(w, "to_local") else w.data).__name__ for w in weights.values()}
    report = engine.compile_report
    compiled = (report.compiled, report.eager) if report is not None else None
    return {"losses": losses, "replica": engine.replica_index, "state": state, "float8": float8, "weights": kinds,
            "compiled": compiled}  # fmt: skip


def assert_equal_to_local(
    results: list[dict[str, Any]],
    micro: int,
    replicas: int,
    recipe: str = "tensorwise",
    tolerance: float = DP_TOLERANCE,
) -> float:
    """Every rank's losses and parameters against one process; the largest difference seen."""
    losses, full = train_here(micro, replicas, recipe)
    assert {name for result in results for name in result["state"]} == full.keys()
    worst = 0.0
    for result in results:
        expected = losses[result["replica"]]
        torch.testing.assert_close(result["losses"], expected, rtol=DP_TOLERANCE, atol=DP_TOLERANCE)
        worst = max([worst, *(abs(a - b) for a, b in zip(result["losses"], expected, strict=True))])
        for name, value in result["state"].items():
            value = value.full_tensor() if hasattr(value, "full_tensor") else value
            torch.testing.assert_close(value, full[name], rtol=DP_TOLERANCE, atol=DP_TOLERANCE, msg=name)
            worst = max(worst, float((value - full[name]).abs().max()))
    return worst


def data_parallel() -> dict[str, Any]:
    return train({}, replicas=2)


@pytest.mark.timeout(200)
def test_data_parallel_float8_equals_one_process() -> None:
    results = run_ranks(data_parallel, 2, timeout=150)
    print("data parallel, largest difference:", assert_equal_to_local(results, 1, 2))
    assert all("model.layers.1.mlp.up_proj" in result["float8"] for result in results)


def zero_v2(recipe: str) -> dict[str, Any]:
    return train({"zero.level": "v2", "float8.recipe": recipe}, replicas=2)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_zero_v2_float8_equals_one_process(recipe: str) -> None:
    results = run_ranks(zero_v2, 2, recipe, timeout=240)
    print(f"ZeRO v2 ({recipe}), largest difference:", assert_equal_to_local(results, 1, 2, recipe))
    assert all("model.layers.2.self_attn.q_proj" in result["float8"] for result in results)
    gathered = "WeightWithDynamicFloat8CastTensor" if recipe == "tensorwise" else "Tensor"
    assert all(result["weights"] == {gathered} for result in results), [result["weights"] for result in results]


def zero_v2_compiled() -> dict[str, Any]:
    return train({"zero.level": "v2", "compile.enabled": True, "compile.backend": "aot_eager"}, replicas=2)


@pytest.mark.timeout(300)
def test_zero_v2_float8_compiled_equals_one_process_eager() -> None:
    """torchtitan's usual setup: float8 weights all-gathered by FSDP2, each block compiled (aot_eager here)."""
    results = run_ranks(zero_v2_compiled, 2, timeout=240)
    print("ZeRO v2 compiled, largest difference:", assert_equal_to_local(results, 1, 2))
    assert all(result["weights"] == {"WeightWithDynamicFloat8CastTensor"} for result in results)
    assert all(result["compiled"] == ([f"model.layers.{i}" for i in range(4)], {}) for result in results), results[0]


def pipeline() -> dict[str, Any]:
    return train({"auto.auto_parallel": True, "pipeline.num_stages": 2, "pipeline.num_micro_batch": 2})


@pytest.mark.timeout(300)
def test_a_two_stage_pipeline_of_float8_equals_one_process() -> None:
    results = run_ranks(pipeline, 2, timeout=240)
    print("pipeline, largest difference:", assert_equal_to_local(results, 2, 1))
    held = [set(result["float8"]) for result in results]
    assert any("model.layers.1.mlp.up_proj" in h for h in held) and any("model.layers.2.mlp.up_proj" in h for h in held)


def split_gradients(compiled: bool, recipe: str) -> dict[str, Any]:
    """One rank under ``epl.split(2)`` (each block compiled by ``aot_eager`` when ``compiled``): the first loss and
    the gradient of every parameter (gathered whole), as one SGD step of rate 1 writes it; the float8 layers."""
    import epl

    compiling = {"compile.enabled": True, "compile.backend": "aot_eager"} if compiled else {}
    epl.init(epl.Config({"float8.enabled": True, "float8.recipe": recipe, **compiling}))
    with epl.split(2):
        model = llama()
    engine = epl.parallelize(model, optimizer=lambda p: torch.optim.SGD(p, lr=1.0), loss_fn=token_loss)
    before = {k: v.detach().clone() for k, v in engine.state_dict(full=True)["model"].items()}
    tokens = batches(1)[0]
    loss = float(engine.step({"input_ids": tokens}, tokens))
    after = engine.state_dict(full=True)["model"]
    modules = dict(engine.model.named_modules())
    sharded = [
        name for name, m in modules.items() if type(getattr(m, "product", None)).__name__ == "ShardedFloat8Product"
    ]
    report = engine.compile_report
    graphs = (report.graphs, report.forward_graphs, report.backward_graphs) if report is not None else None
    return {"loss": loss, "gradients": {k: before[k] - after[k] for k in before}, "float8": sharded, "graphs": graphs}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("compiled", "recipe"),
    [(False, "tensorwise"), (True, "tensorwise"), (False, "rowwise"), (True, "rowwise")],
    ids=["eager", "compiled", "rowwise", "rowwise compiled"],
)
def test_split_float8_equals_one_process(compiled: bool, recipe: str) -> None:
    """Column shards (q, k, v, gate, up) and row shards (o, down) in float8, each operand scaled over the devices,
    against the same float8 model in one process: the first loss within ``DP_TOLERANCE``, and each parameter's
    gradient within ``SPLIT_GRADIENT`` of its norm. Float8 rounds to 3 bits of mantissa, so a value the row shards
    sum in another order can land on the next float8 step: measured 1.4e-4 of a gradient's norm at most. Scaling each
    shard by its own largest magnitude instead (what torchao's Float8Linear would do on a shard) is 0.15 off: the
    test tells the two apart by three orders of magnitude. (Over several AdamW steps, its normalisation makes such a
    difference a whole step's size on elements whose gradient is near zero, so one step is compared.) Compiled, the
    float8 products are inside the blocks' graphs (their scales' all-reduces traced as torch's functional
    collectives): one graph for the two float8 blocks and one for the two high-precision edge blocks, no break,
    each one forward and one backward graph (``engine.compile_report``).

    Rowwise, torchao computes each product in bfloat16 (no float32 output with row scales), so a row shard's part of
    a sum is rounded before the parts are added, where one process rounds the sum once: the first loss within 1e-4
    (measured 3.3e-5) and gradients within 0.1 of their norm (measured 4.6e-2), the size of float8's own rounding.
    That the shards' casts are the whole layer's, to the bit, is tested on the products
    (tests/float8/test_float8_sharded.py)."""
    model = float8_llama(recipe)
    tokens = batches(1)[0]
    loss = token_loss(model(input_ids=tokens), tokens)
    loss.backward()
    worst = 0.0
    for result in run_ranks(split_gradients, 2, compiled, recipe, timeout=240):
        assert result["loss"] == pytest.approx(float(loss), rel=SPLIT_LOSS[recipe])
        assert {"model.layers.1.self_attn.q_proj", "model.layers.2.mlp.down_proj"} <= set(result["float8"])
        two = {"LlamaDecoderLayer": 2}
        assert result["graphs"] == ((two, two, two) if compiled else None), result["graphs"]
        for name, parameter in model.named_parameters():
            assert parameter.grad is not None
            difference = float((result["gradients"][name] - parameter.grad).norm())
            assert difference <= SPLIT_GRADIENT[recipe] * float(parameter.grad.norm()) + 1e-12, (name, difference)
            worst = max(worst, difference / (float(parameter.grad.norm()) + 1e-30))
    print(f"split float8 ({recipe}), largest gradient difference over its norm: {worst:.2e}")


def save_and_resume(folder: str) -> list[list[float]]:
    """One rank, ZeRO v2 with float8 all-gather: 2 steps, save, 2 more; then a model of another seed loads the save
    and takes the same 2 steps. Both pairs of losses."""
    import epl

    data = batches(4, ROWS * 2)
    runs = []
    for seed in (0, 1):
        epl.init(epl.Config({"float8.enabled": True, "zero.level": "v2"}))
        engine = epl.parallelize(llama(seed=seed), optimizer=adamw, loss_fn=token_loss)
        rows = [tokens[engine.replica_index * ROWS : (engine.replica_index + 1) * ROWS] for tokens in data]
        if seed == 0:
            for part in rows[:2]:
                engine.step({"input_ids": part}, part)
            engine.save(folder)
        else:
            engine.load(folder)
        runs.append([float(engine.step({"input_ids": part}, part)) for part in rows[2:]])
    return runs


@pytest.mark.timeout(300)
def test_a_checkpoint_of_float8_weights_under_zero_resumes_exactly(tmp_path: Any) -> None:
    """The float8-gathered weights (a torchao subclass inside FSDP2's DTensors) save and load through EPL's
    checkpoints: the resumed run takes the same steps as the one that went on."""
    for went_on, resumed in run_ranks(save_and_resume, 2, str(tmp_path / "checkpoint"), timeout=240):
        assert went_on == resumed


#: Split's other layouts in float8 (tensorwise): with sequence parallelism, and 3D (split(2) x 2 stages, one
#: micro-batch), with their world sizes.
SPLIT_LAYOUTS = {
    "sequence parallel": ({"split.sequence_parallel": True}, 2),
    "split(2) x 2 stages": ({"pipeline.num_stages": 2, "auto.auto_parallel": True, "pipeline.num_micro_batch": 1}, 4),
}


def split_layout_gradients(name: str) -> dict[str, Any]:
    """One rank of ``SPLIT_LAYOUTS[name]``: the loss (None off the last stage) and the gradients of the parameters
    its stage holds (gathered whole over the shards), as one SGD step of rate 1 writes them."""
    import epl

    epl.init(epl.Config({"float8.enabled": True, **SPLIT_LAYOUTS[name][0]}))
    with epl.split(2):
        model = llama()
    engine = epl.parallelize(model, optimizer=lambda p: torch.optim.SGD(p, lr=1.0), loss_fn=token_loss)
    before = {k: v.detach().clone() for k, v in engine.state_dict(full=True)["model"].items()}
    tokens = batches(1)[0]
    loss = engine.step({"input_ids": tokens}, tokens)
    after = engine.state_dict(full=True)["model"]
    return {"loss": None if loss is None else float(loss), "gradients": {k: before[k] - after[k] for k in before}}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(SPLIT_LAYOUTS))
def test_split_float8_under_sequence_parallelism_and_3d_equals_one_process(name: str) -> None:
    """As ``test_split_float8_equals_one_process`` (tensorwise, eager): the tokens are whole at every product (split
    gathers them before a column layer and scatters after a row layer), so the casts are the same. Measured the same
    differences as split alone: loss 1e-7, gradients 1.4e-4 of their norm."""
    model = float8_llama()
    tokens = batches(1)[0]
    loss = token_loss(model(input_ids=tokens), tokens)
    loss.backward()
    ranks = run_ranks(split_layout_gradients, SPLIT_LAYOUTS[name][1], name, timeout=240)
    gradients = {key: value for rank in ranks for key, value in rank["gradients"].items()}
    assert gradients.keys() == dict(model.named_parameters()).keys()
    for result in ranks:
        assert result["loss"] is None or result["loss"] == pytest.approx(float(loss), rel=SPLIT_LOSS["tensorwise"])
    assert ranks[-1]["loss"] is not None
    for key, parameter in model.named_parameters():
        assert parameter.grad is not None
        difference = float((gradients[key] - parameter.grad).norm())
        assert difference <= SPLIT_GRADIENT["tensorwise"] * float(parameter.grad.norm()) + 1e-12, (key, difference)
