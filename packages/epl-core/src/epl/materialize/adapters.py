"""The initialisation of PEFT's adapters on a model built on meta, as PEFT itself runs it.

A transformers model's ``_init_weights`` would give an adapter's ``nn.Linear`` (``lora_A.default``) the model's
normal draw; PEFT initialises it differently (LoRA's ``lora_B`` is zeros, so the adapted model starts as the base
model). :func:`adapter_inits` finds each LoRA layer of a PEFT model and the init its adapter's config names
(``init_lora_weights``); an init unit that holds the layer runs it after the model's own initialisation (the
layer's own ``reset_lora_parameters``, in the unit's random stream: PEFT's distributions, not its draws). Inits that
derive the adapters from the base weights (PiSSA, OLoRA, LoftQ, ..., and DoRA's magnitudes) cannot run before the
base has its values: they are refused, naming the layer. So are the other PEFT methods' layers, whose
initialisation EPL does not know.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from torch import nn

from epl.errors import UninitializedError


class AdapterInitError(UninitializedError):
    """A PEFT adapter on a model built on meta that EPL cannot initialise as PEFT would."""


#: LoRA inits that depend on nothing but the adapter's shape.
_PLAIN = ("gaussian",)


def is_layer_wrapper(module: nn.Module) -> bool:
    """Whether ``module`` wraps a layer it holds as ``base_layer`` beside its adapters (every PEFT tuner layer)."""
    return callable(getattr(type(module), "get_base_layer", None)) and "base_layer" in module._modules


def adapter_inits(model: nn.Module) -> dict[int, Callable[[], None]]:
    """``id`` of each PEFT tuner layer of ``model`` -> what initialises its adapters (run with the layer's slots
    holding the unit's fresh tensors)."""
    inits: dict[int, Callable[[], None]] = {}

    def visit(module: nn.Module, configs: dict[str, Any] | None) -> None:
        own = getattr(module, "peft_config", None)
        if isinstance(own, dict):
            configs = own
        if is_layer_wrapper(module):
            inits[id(module)] = partial(_init_layer, module, configs or {})
        for child in module.children():
            visit(child, configs)

    visit(model, None)
    return inits


def _init_layer(layer: nn.Module, configs: dict[str, Any]) -> None:
    kind = type(layer)
    where = f"{kind.__module__}.{kind.__qualname__}"
    reset = getattr(layer, "reset_lora_parameters", None)
    lora_a = getattr(layer, "lora_A", None)
    if not callable(reset) or not isinstance(lora_a, nn.ModuleDict):
        raise AdapterInitError(
            f"The model was built on the meta device, and EPL does not know how PEFT initialises the adapters of a "
            f"{where}: it gives values to LoRA's. Build this model off the meta device (get_peft_model on a model "
            "with values)."
        )
    adapters = list(dict.fromkeys([*lora_a.keys(), *getattr(layer, "lora_embedding_A", {}).keys()]))
    for adapter in adapters:
        config = configs.get(adapter)
        init = getattr(config, "init_lora_weights", True)
        dora = bool(getattr(layer, "use_dora", {}).get(adapter, False))
        if dora or not (init is True or init is False or (isinstance(init, str) and init.lower() in _PLAIN)):
            what = "use_dora=True" if dora else f"init_lora_weights={init!r}"
            raise AdapterInitError(
                f"The model was built on the meta device, and its LoRA adapter {adapter!r} of a {where} has {what}, "
                "which PEFT computes from the base layer's weights: those have no values before load_pretrained. "
                "Build the model off the meta device (from_pretrained, then get_peft_model), or use "
                "init_lora_weights=True or 'gaussian'."
            )
        if init is False:  # PEFT leaves the adapters as nn.Linear's construction draws them
            for container in ("lora_A", "lora_B"):
                holder = getattr(layer, container)
                if adapter in holder:
                    holder[adapter].reset_parameters()
            continue
        reset(adapter, init)
