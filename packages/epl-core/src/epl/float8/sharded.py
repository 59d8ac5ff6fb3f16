"""Float8 products of ``epl.split``'s column and row shards, scaled as the whole layer would be.

torchao's ``Float8Linear`` scales each tensor by its own largest magnitude (the tensorwise recipe). A shard's
largest magnitude is not the whole tensor's: a column shard's weight and output gradient, and a row shard's input
and weight, are parts. Here each of them is cast with the largest magnitude over the shard group (one all-reduce of
a scalar each), then handed to torchao's own product already in float8, so the scales, the casts and the products
are those of the layer in one process (the products' sums may differ in order: float32 rounding). The output
gradient is cast the same way in the backward. The rowwise recipe scales each row: not supported under split (the
float8 transform refuses it there).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from epl.float8.convert import torchao_float8
from epl.interfaces.communicator import ReduceOp
from epl.interfaces.shard_group import ShardGroup


class ShardedFloat8Product:
    """``F.linear(x, weight, bias)`` of a split layer's shard in float8 (module docstring); ``config``: torchao's
    ``Float8LinearConfig`` (tensorwise)."""

    def __init__(self, config: Any, group: ShardGroup) -> None:
        torchao_float8()  # one clear error without torchao
        from torchao.float8.float8_linear import Float8Linear

        self.config, self.group = config, group
        with torch.device("meta"):  # torchao's product settings, as Float8Linear makes them
            self.mm_config = Float8Linear.from_float(nn.Linear(16, 16), config=config).linear_mm_config

    @torch.compiler.disable  # its scales' all-reduces run on EPL's communicator: eager in a compiled block
    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T + bias`` in float8, every operand scaled over the group."""
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
        from torchao.float8.float8_training_tensor import GemmInputRole

        if torch.is_autocast_enabled("cuda"):  # as Float8Linear does: the output in the autocast dtype
            x = x.to(torch.get_autocast_dtype("cuda"))
        x8 = self.cast(x, GemmInputRole.INPUT)
        weight8 = self.cast(weight.t(), GemmInputRole.WEIGHT)
        y = matmul_with_hp_or_float8_args.apply(x8, weight8, self.mm_config, self.config)
        y = _GradientInFloat8.apply(y, self)
        return y if bias is None else y + bias.to(y.dtype)

    def cast(self, tensor: torch.Tensor, role: Any) -> torch.Tensor:
        """``tensor`` in float8, scaled by the largest magnitude over the group."""
        from torchao.float8.float8_training_tensor import GemmInputRole, hp_tensor_and_scale_to_float8
        from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax

        cast = {
            GemmInputRole.INPUT: self.config.cast_config_input,
            GemmInputRole.WEIGHT: self.config.cast_config_weight,
            GemmInputRole.GRAD_OUTPUT: self.config.cast_config_grad_output,
        }[role]
        amax = tensor_to_amax(tensor.detach()).to(torch.float32)
        self.group.communicator.all_reduce(amax, ReduceOp.MAX).wait()
        scale = amax_to_scale(amax, cast.target_dtype, self.config.round_scales_to_power_of_2)
        return hp_tensor_and_scale_to_float8(tensor, scale, cast.target_dtype, self.mm_config, role)


class _GradientInFloat8(torch.autograd.Function):
    """The output itself forward; backward, its gradient cast to float8 over the group (torchao's product then
    uses it as it is)."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, product: ShardedFloat8Product) -> torch.Tensor:
        ctx.product = product
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        from torchao.float8.float8_training_tensor import GemmInputRole

        return ctx.product.cast(grad.contiguous(), GemmInputRole.GRAD_OUTPUT), None
