"""``float8.enabled``: the model's linear layers trained in float8 through torchao, as torchtitan does (docs/float8.md).

- :func:`choose_linears` decides, on the whole model, which ``nn.Linear`` become float8 and why the others stay;
- :func:`convert` swaps them for torchao's ``Float8Linear`` on this rank's modules, after refusing a device that
  cannot run float8 matmuls (:func:`check_device`);
- :class:`ShardedFloat8Product` runs the float8 product of ``epl.split``'s column and row shards, scaled over
  the shard group as the whole layer would be (tensorwise).

torchao is optional (``pip install epl-core[float8]``): nothing here imports it until :func:`convert` runs.
"""

from __future__ import annotations

from epl.float8.convert import check_device, convert, float8_config
from epl.float8.selection import Float8Choice, choose_linears
from epl.float8.sharded import ShardedFloat8Product

__all__ = ["Float8Choice", "ShardedFloat8Product", "check_device", "choose_linears", "convert", "float8_config"]
