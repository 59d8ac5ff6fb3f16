"""``epl.float8.sharded``: a split shard's float8 casts are the whole layer's, on 2 processes (gloo).

Each shard (column: half the output features; row: half the input features) runs its product forward and backward,
and every operand it casts to float8 (six a product, as torchao's ``Float8Linear`` casts them) is recorded. Each must
equal, to the bit, the same slice of that operand cast whole by torchao in one process, under both recipes. The half
the second device holds is 1,000 times smaller, so a scale taken on the shard alone would differ from the whole
layer's; the test checks that it would (else it could not tell the two apart).

The products follow from the casts: a column shard's output and every shard's weight gradient equal the whole
layer's slice to the bit. A sum over the shards (a row shard's output, a column shard's input gradient) differs from
one process's by rounding only: float32's order of addition (tensorwise), or, rowwise, bfloat16's: torchao computes a
product with a scale a row in bfloat16 (torch's ``_scaled_mm`` has no float32 output with row scales), so each shard's
part is rounded before the parts are added, where one process rounds the whole sum once.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.helpers.distributed import run_ranks

pytest.importorskip("torchao.float8")
pytestmark = [pytest.mark.multiprocess, pytest.mark.filterwarnings("ignore::UserWarning")]

TOKENS, IN, OUT = 16, 64, 96
#: The sums over shards against one process's, relative to the largest element: bfloat16's rounding (2^-8) of each
#: part (rowwise), float32's otherwise. Measured: 2.6e-3 and 1.6e-7 relative to the norm.
SUM_TOLERANCE = {"rowwise": 2.0**-7, "tensorwise": 1e-6}


def whole_layer() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The input, weight and output gradient of the layer; the second half of each feature dimension 1,000 times
    smaller."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(TOKENS, IN, generator=generator)
    weight = torch.randn(OUT, IN, generator=generator) / IN**0.5
    grad = torch.randn(TOKENS, OUT, generator=generator)
    x[:, IN // 2 :] *= 1e-3
    weight[:, IN // 2 :] *= 1e-3
    weight[OUT // 2 :] *= 1e-3
    grad[:, OUT // 2 :] *= 1e-3
    return x, weight, grad


def whole_cast(tensor: torch.Tensor, config: Any, cast: str, role: Any, dim: int) -> torch.Tensor:
    """``tensor`` cast whole by torchao as ``Float8Linear`` casts it, back in float32."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic

    cast_config = getattr(config, cast)
    axiswise = cast_config.scaling_granularity is ScalingGranularity.AXISWISE
    return hp_tensor_to_float8_dynamic(
        tensor,
        cast_config.target_dtype,
        None,
        gemm_input_role=role,
        scaling_granularity=cast_config.scaling_granularity,
        axiswise_dim=dim if axiswise else None,
        round_scales_to_power_of_2=config.round_scales_to_power_of_2,
    ).to_original_precision()


def shard_products(recipe: str) -> dict[str, Any]:
    """One rank: its column shard's and row shard's products forward and backward, against the whole layer's."""
    from torchao.float8.float8_training_tensor import GemmInputRole

    import epl
    from epl.float8 import ShardedFloat8Product, float8_config
    from epl.interfaces.shard_group import ShardGroup

    class Recording(ShardedFloat8Product):
        """The product, keeping every float8 cast it makes, in order."""

        casts: list[Any]

        def cast(self, *args: Any) -> Any:
            self.casts = getattr(self, "casts", [])
            self.casts.append(super().cast(*args))
            return self.casts[-1]

    env = epl.init()
    group = ShardGroup(env.communicator)
    config = float8_config(recipe, all_gather=False)  # type: ignore[arg-type]
    x, weight, grad = whole_layer()
    rank, found = group.index, {}
    outs, ins = slice(rank * OUT // 2, (rank + 1) * OUT // 2), slice(rank * IN // 2, (rank + 1) * IN // 2)
    # Each cast in the product's order: its config, role, scaled dimension, the whole tensor and this shard's part.
    whole = {"input": x, "weight": weight.t(), "grad": grad}
    order = [
        ("cast_config_input", GemmInputRole.INPUT, -1, "input"),
        ("cast_config_weight", GemmInputRole.WEIGHT, 0, "weight"),
        ("cast_config_grad_output", GemmInputRole.GRAD_OUTPUT, -1, "grad"),
        ("cast_config_weight_for_grad_input", GemmInputRole.WEIGHT, -1, "weight"),
        ("cast_config_grad_output_for_grad_weight", GemmInputRole.GRAD_OUTPUT, 0, "grad"),
        ("cast_config_input_for_grad_weight", GemmInputRole.INPUT, 0, "input"),
    ]
    for sharded in ("out", "in"):
        part = {
            "input": (slice(None), ins if sharded == "in" else slice(None)),
            "weight": (ins, slice(None)) if sharded == "in" else (slice(None), outs),
            "grad": (slice(None), outs if sharded == "out" else slice(None)),
        }
        product = Recording(config, group, sharded)  # type: ignore[arg-type]
        leaf_x = x[part["input"]].clone().requires_grad_()
        leaf_w = weight.t()[part["weight"]].t().clone().requires_grad_()
        y = product(leaf_x, leaf_w)
        y.backward(grad[part["grad"]])
        for (name, role, dim, tensor), shard_cast in zip(order, product.casts, strict=True):
            expected = whole_cast(whole[tensor], config, name, role, dim)[part[tensor]]
            alone = whole_cast(whole[tensor][part[tensor]].contiguous(), config, name, role, dim)
            found[f"{sharded} {name}"] = (
                torch.equal(shard_cast.to_original_precision(), expected),
                torch.equal(alone, expected),
            )
        found[f"{sharded} output"] = y.detach()
        found[f"{sharded} grad_x"] = leaf_x.grad
        found[f"{sharded} grad_weight"] = leaf_w.grad
    return found


@pytest.mark.timeout(120)
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_shards_float8_casts_are_the_whole_layers(recipe: str) -> None:
    from torchao.float8.float8_linear import Float8Linear

    from epl.float8 import float8_config

    x, weight, grad = whole_layer()
    layer = Float8Linear.from_float(torch.nn.Linear(IN, OUT, bias=False), config=float8_config(recipe, False))  # type: ignore[arg-type]
    layer.weight.data.copy_(weight)
    leaf = x.clone().requires_grad_()
    y = layer(leaf)
    y.backward(grad)
    assert leaf.grad is not None and layer.weight.grad is not None
    ranks = run_ranks(shard_products, 2, recipe, timeout=100)
    casts = [(key, value) for found in ranks for key, value in found.items() if isinstance(value, tuple)]
    for key, (exact, _) in casts:
        assert exact, f"{key}: the shard's float8 cast is not the whole layer's"
    # The second device's casts of its part, scaled on the shard alone, would differ (else the test is blind).
    for prefix in ("in cast_config_input", "in cast_config_weight", "out cast_config_grad", "out cast_config_weight"):
        assert not all(alone for key, (_, alone) in casts if key.startswith(prefix)), prefix

    def close(total: torch.Tensor, expected: torch.Tensor) -> float:
        return float((total - expected).abs().max() / expected.abs().max())

    halves = [slice(0, OUT // 2), slice(OUT // 2, OUT)], [slice(0, IN // 2), slice(IN // 2, IN)]
    for rank, found in enumerate(ranks):  # exact: the products over whole dimensions
        assert torch.equal(found["out output"], y.detach()[:, halves[0][rank]])
        assert torch.equal(found["out grad_weight"], layer.weight.grad[halves[0][rank]])
        assert torch.equal(found["in grad_weight"], layer.weight.grad[:, halves[1][rank]])
        assert torch.equal(found["in grad_x"], leaf.grad[:, halves[1][rank]])
    row_output = close(ranks[0]["in output"] + ranks[1]["in output"], y.detach())
    column_grad_x = close(ranks[0]["out grad_x"] + ranks[1]["out grad_x"], leaf.grad)
    print(f"{recipe}: sums over the shards against one process: output {row_output:.1e}, grad_x {column_grad_x:.1e}")
    assert row_output <= SUM_TOLERANCE[recipe] and column_grad_x <= SUM_TOLERANCE[recipe]
