"""The names a wrapped model's tensors have in its base model's checkpoint, read from the model's own structure.

An adapter library wraps a pretrained model: PEFT's ``get_peft_model`` puts the model under ``base_model.model.``
(``PeftModel`` -> ``LoraModel`` -> the model) and each adapted layer under a wrapper that holds the original
layer as ``base_layer`` beside its adapters (``q_proj.base_layer.weight``, ``q_proj.lora_A.default.weight``). The
base checkpoint knows ``model.layers.0.self_attn.q_proj.weight``. :func:`base_names` gives each tensor the name it
would have without the wrappers, by a rule on modules, not on names:

- a module with ``get_base_model()`` (PEFT's ``PeftModel``) stands for the module it returns: that module's path is
  dropped from the names under it, and a tensor outside it (a prompt's embedding) belongs to the adapter;
- a module with ``get_base_layer()`` and a child ``base_layer`` (every PEFT tuner layer) stands for that child: the
  ``base_layer`` segment is dropped, and the module's other tensors (``lora_A``, ``lora_B``, ...) are the
  adapter's;
- a module with a child ``original_module`` (PEFT's ``modules_to_save`` and other auxiliary wrappers) stands for
  it: ``original_module`` is dropped; ``modules_to_save.<adapter>``, a trainable copy of the original, has the
  original's names too (it starts as the base's); its other tensors are the adapter's.

A tensor of an adapter has no base name (None): a base checkpoint does not hold it, and an adapter export holds
only those.
"""

from __future__ import annotations

from torch import nn

from epl.materialize.adapters import is_layer_wrapper


def is_wrapped(model: nn.Module) -> bool:
    """Whether ``model`` wraps a base model in the sense of :func:`base_names` (PEFT's ``PeftModel``)."""
    return _base_model(model) is not None


def unwrapped(model: nn.Module) -> nn.Module:
    """The base model ``model`` wraps (itself when it wraps none)."""
    base = _base_model(model)
    return model if base is None else base


def base_names(model: nn.Module, names: list[str]) -> dict[str, str | None]:
    """Each of ``model``'s state names in ``names`` -> its name without the wrapper modules (the base checkpoint's),
    or None for a tensor of an adapter. A model that wraps nothing maps every name to itself."""
    prefix = _prefix_of_base(model)
    result: dict[str, str | None] = {}
    for name in names:
        if prefix is not None and not name.startswith(prefix):
            result[name] = None
            continue
        module: nn.Module | None = model
        kept: list[str] = []
        parts = name.split(".")
        adapter = False
        skip = 0
        for index, part in enumerate(parts):
            if skip:
                skip -= 1
                module = module._modules.get(part) if module is not None else None
                continue
            inner = module is not None and index < len(parts) - 1
            if inner and is_layer_wrapper(module):  # type: ignore[arg-type]
                if part != "base_layer":
                    adapter = True
                    break
                module = module._modules.get(part)  # type: ignore[union-attr]
                continue
            if inner and "original_module" in module._modules:  # type: ignore[union-attr]
                if part == "modules_to_save":  # a trainable copy of the original, one per adapter
                    skip = 1
                elif part != "original_module":
                    adapter = True
                    break
                module = module._modules.get(part)  # type: ignore[union-attr]
                continue
            kept.append(part)
            module = module._modules.get(part) if module is not None else None
        if adapter:
            result[name] = None
            continue
        whole = ".".join(kept)
        if prefix is not None:
            whole = whole[len(prefix) :] if whole.startswith(prefix) else whole
        result[name] = whole
    return result


def _base_model(model: nn.Module) -> nn.Module | None:
    getter = getattr(type(model), "get_base_model", None)
    if not callable(getter):
        return None
    try:
        base = model.get_base_model()  # type: ignore[operator]
    except Exception:  # noqa: BLE001 - a wrapper a transform has since changed: treated as wrapping nothing
        return None
    return base if isinstance(base, nn.Module) and base is not model else None


def _prefix_of_base(model: nn.Module) -> str | None:
    """``base_model.model.`` for a PEFT model (the path of the module ``get_base_model()`` returns), else None."""
    base = _base_model(model)
    if base is None:
        return None
    for name, module in model.named_modules():
        if module is base:
            return f"{name}." if name else None
    return None
