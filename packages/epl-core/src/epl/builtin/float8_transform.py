"""The model transforms of ``float8.enabled`` (:mod:`epl.float8`): choose the float8 linears on the whole model,
then swap this rank's for torchao's ``Float8Linear`` before ZeRO shards them and compile compiles them."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from torch import nn

from epl.config.settings import CoreSettings
from epl.errors import EplError
from epl.float8 import Float8Choice, ShardedFloat8Product, check_device, choose_linears, convert, float8_config
from epl.float8.sharded import ShardedFeatures
from epl.interfaces.facts import MemoryTechniques
from epl.interfaces.phases import TransformPhase
from epl.plugins.context import ParallelContext
from epl.sharding.linear import ColumnParallelLinear, RowParallelLinear

#: Split's shards of a linear layer, which train in float8 through :class:`ShardedFloat8Product`.
PARALLEL_LINEARS = (ColumnParallelLinear, RowParallelLinear)

_log = logging.getLogger("epl.float8")


@dataclass
class Float8State:
    """What the choice hands the conversion, and what was converted on this rank."""

    choice: Float8Choice = field(default_factory=Float8Choice)
    converted: list[str] = field(default_factory=list)


class ChooseFloat8Linears:
    """Model transform: decide which linears train in float8 on the whole model (before a pipeline keeps a stage), so
    every rank and one process choose alike."""

    name = "choose_float8_linears"
    phase = TransformPhase.CHOOSE_FLOAT8

    def __call__(self, model: nn.Module, context: ParallelContext) -> nn.Module:
        """``model`` unchanged; the choice kept for :class:`ConvertToFloat8`."""
        settings = CoreSettings.from_config(context.config).float8
        choice = choose_linears(model, settings.exclude)
        context.state(Float8State).choice = choice
        return model


class ConvertToFloat8:
    """Model transform: swap the chosen linears this rank holds for ``Float8Linear`` (after the stage is kept and the
    split shards are made, before ZeRO's ``fully_shard`` and compile)."""

    name = "convert_to_float8"
    phase = TransformPhase.FLOAT8

    def __call__(self, model: nn.Module, context: ParallelContext) -> nn.Module:
        """``model`` with the chosen linears it holds in float8, in place."""
        settings = CoreSettings.from_config(context.config).float8
        state = context.state(Float8State)
        held = dict(model.named_modules())
        names = [name for name in state.choice.converted if type(held.get(name)) is nn.Linear]
        shards = [name for name in state.choice.converted if isinstance(held.get(name), PARALLEL_LINEARS)]
        if names or shards:
            device = held[(names or shards)[0]].get_parameter("weight").device
            if device.type == "meta":
                raise EplError(
                    "float8.enabled with a model built on the meta device (model.meta_init) is not supported: build "
                    "the model with values, or leave float8.enabled off."
                )
            check_device(device)
            sharded = bool(context.facts(MemoryTechniques).zero) and not context.plan.local
            all_gather = settings.all_gather and sharded
            if all_gather and settings.recipe != "tensorwise":
                _log.info("float8: the rowwise recipe all-gathers weights in high precision under zero.level")
            state.converted = convert(model, names, float8_config(settings.recipe, all_gather))
            sharded_config = float8_config(settings.recipe, all_gather=False)  # one for every shard
            for name in shards:  # split's shards: torchao's product, scaled over the shard group
                shard = held[name]
                features: ShardedFeatures = "out" if isinstance(shard, ColumnParallelLinear) else "in"
                shard.product = ShardedFloat8Product(sharded_config, shard.group, features)
                state.converted.append(name)
        _log.info("float8 (%s): %s", settings.recipe, state.choice.describe())
        return model
