"""Float8 products of ``epl.split``'s column and row shards, scaled as the whole layer would be.

torchao's ``Float8Linear`` casts six operands to float8 (the input and the weight in the forward; the output
gradient and the weight for the input's gradient, the output gradient and the input for the weight's gradient), each
with a scale from its largest magnitude: over the whole tensor (the tensorwise recipe) or along one dimension (a
scale a row: rowwise). On a shard, a magnitude taken over a dimension the shard holds only part of is not the whole
layer's. Here each cast takes that magnitude over the shard group instead (one all-reduce of the scales' amaxes),
and takes it locally where the shard holds the whole dimension. The scales, the casts and the products are then those
of the layer in one process (the products' sums may differ in order: float32 rounding).

Which dimension a shard holds part of: a column shard holds some of the output features (its weight's rows, its
output gradient's last dimension), a row shard some of the input features (its weight's columns, its input's last
dimension). The tokens are whole on every device (split gathers them before a column layer and scatters after a row
layer). :class:`_ShardedFloat8Matmul` follows torchao's ``matmul_with_hp_or_float8_args`` cast by cast. Inside a
compiled region the all-reduces are torch's functional collectives, so the product is part of the block's graph.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

from epl.float8.convert import torchao_float8
from epl.interfaces.shard_group import ShardGroup
from epl.sharding.links import link_of

#: Which features a shard holds part of: ``out`` for a column shard, ``in`` for a row shard.
ShardedFeatures = Literal["out", "in"]


class ShardedFloat8Product:
    """``F.linear(x, weight, bias)`` of a split layer's shard in float8 (module docstring). ``config``: torchao's
    ``Float8LinearConfig`` (either recipe); ``sharded``: the features this shard holds part of."""

    def __init__(self, config: Any, group: ShardGroup, sharded: ShardedFeatures) -> None:
        torchao_float8()  # one clear error without torchao
        from torchao.float8.float8_linear import Float8Linear

        self.config, self.group, self.sharded = config, group, sharded
        with torch.device("meta"):  # torchao's product settings, as Float8Linear makes them
            self.mm_config = Float8Linear.from_float(nn.Linear(16, 16), config=config).linear_mm_config

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T + bias`` in float8, every operand scaled as the whole layer's."""
        if torch.is_autocast_enabled("cuda"):  # as Float8Linear does: the output in the autocast dtype
            x = x.to(torch.get_autocast_dtype("cuda"))
        y = _ShardedFloat8Matmul.apply(x, weight.t(), self)
        return y if bias is None else y + bias.to(y.dtype)

    def cast(self, tensor: torch.Tensor, cast_config: Any, role: Any, dim: int, sharded_dim: int | None) -> Any:
        """``tensor`` in float8 by ``cast_config`` (its scale along ``dim`` when axiswise), its amax taken over the
        group when the scale spans ``sharded_dim``, the dimension this shard holds part of (None: none)."""
        from torchao.float8.config import ScalingGranularity, ScalingType
        from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8
        from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax

        if cast_config.scaling_type is ScalingType.DISABLED:
            return tensor
        axiswise = cast_config.scaling_granularity is ScalingGranularity.AXISWISE
        axis = dim if axiswise else None  # torchao takes 0 or -1
        amax = tensor_to_amax(tensor.detach(), False, None, cast_config.scaling_granularity, axis).to(torch.float32)
        if sharded_dim is not None and (not axiswise or dim % tensor.dim() == sharded_dim % tensor.dim()):
            amax = link_of(self.group).all_reduce(amax, "max")  # traced into a compiled block's graph
        scale = amax_to_scale(amax, cast_config.target_dtype, self.config.round_scales_to_power_of_2)
        return hp_tensor_and_scale_to_float8(tensor, scale, cast_config.target_dtype, self.mm_config, role, axis)


class _ShardedFloat8Matmul(torch.autograd.Function):
    """``x @ weight_t`` with its three products in float8, cast as torchao's ``matmul_with_hp_or_float8_args``
    casts them, each amax over the group where the shard holds part of the scale's span."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight_t: torch.Tensor, product: ShardedFloat8Product) -> torch.Tensor:
        from torchao.float8.float8_training_tensor import GemmInputRole

        ctx.save_for_backward(x, weight_t)
        ctx.product = product
        c, row = product.config, product.sharded == "in"
        x8 = product.cast(x, c.cast_config_input, GemmInputRole.INPUT, -1, -1 if row else None)
        weight8 = product.cast(weight_t, c.cast_config_weight, GemmInputRole.WEIGHT, 0, 0 if row else 1)
        y = torch.mm(x8.reshape(-1, x8.shape[-1]), weight8)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        from torchao.float8.float8_training_tensor import GemmInputRole

        x, weight_t = ctx.saved_tensors
        product: ShardedFloat8Product = ctx.product
        c, column = product.config, product.sharded == "out"
        grad_2d = grad.reshape(-1, grad.shape[-1])
        x_2d = x.reshape(-1, x.shape[-1])
        grad8 = product.cast(grad_2d, c.cast_config_grad_output, GemmInputRole.GRAD_OUTPUT, -1, -1 if column else None)
        weight8 = product.cast(
            weight_t, c.cast_config_weight_for_grad_input, GemmInputRole.WEIGHT, -1, 1 if column else 0
        )
        grad_x = torch.mm(grad8, weight8.t()).reshape(*grad.shape[:-1], weight_t.shape[0])
        grad8 = product.cast(
            grad_2d, c.cast_config_grad_output_for_grad_weight, GemmInputRole.GRAD_OUTPUT, 0, 1 if column else None
        )
        x8 = product.cast(x_2d, c.cast_config_input_for_grad_weight, GemmInputRole.INPUT, 0, None if column else 1)
        grad_weight = torch.mm(grad8.t(), x8)
        return grad_x, grad_weight.t(), None
