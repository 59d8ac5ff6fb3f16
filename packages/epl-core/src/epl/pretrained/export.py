"""What ``save_pretrained`` writes of a model: the names, the pieces this rank holds, their values, and the configs.

Three formats, each read by its library alone, each written a piece per rank (nothing gathered):

- **a transformers model** (``LlamaForCausalLM``): its tensors under its own names, ``config.json``; a model that
  holds a transformers config but is not a transformers model (its names are not the config's architecture's, and
  transformers would load a random model from them) is refused;
- **a PEFT model's adapters** (the default for a ``PeftModel``): ``adapter_model.safetensors`` under PEFT's names
  (``get_peft_model_state_dict``'s, read from PEFT itself) and ``adapter_config.json``, which
  ``PeftModel.from_pretrained(base, path)`` loads;
- **a PEFT model merged** (``merged=True``): the base model's tensors under the base's names (without PEFT's
  wrappers, :mod:`epl.pretrained.wrapped`), each adapted weight plus its LoRA update ``scaling * B @ A``, and the
  base's ``config.json``: ``AutoModelForCausalLM.from_pretrained(path)`` loads it. A rank computes the update of
  the rectangles of the weight it holds from the rows of ``lora_B`` and the columns of ``lora_A`` they need. An
  adapter tensor a rank holds only part of (a split or ZeRO shard) is gathered whole first, on every rank of its
  group: only the adapters (``r x in`` and ``out x r`` elements each), never a base weight.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from epl.errors import EplError
from epl.materialize.adapters import is_layer_wrapper
from epl.pretrained.pieces import INDEX, SINGLE, Piece, is_model_weights_file, local_tensors
from epl.pretrained.wrapped import base_names, is_wrapped, unwrapped
from epl.sharding.chunks import held as held_whole
from epl.sharding.data_shards import local_tensor

if TYPE_CHECKING:
    from epl.runtime.checkpoint.common import CheckpointedEngine

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
ADAPTER_SINGLE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"

#: A tensor's local value to write, from the engine's plain model state (``engine.state_dict()["model"]``).
Value = Callable[[dict[str, torch.Tensor]], torch.Tensor]


@dataclass
class Export:
    """What this rank writes: each (name in the files, dtype, its piece of the whole, its local value)."""

    tensors: list[tuple[str, torch.dtype, Piece, Value]]
    #: The weights file's name when one file holds them all.
    single: str
    #: Whether the tensors may fill several files (transformers' index); PEFT reads one file.
    shards: bool
    write_configs: Callable[[Path], None]
    #: The weight files of an earlier export of this kind (replaced, or deleted when not written again).
    owns: Callable[[str], bool]


def describe_export(engine: CheckpointedEngine, *, merged: bool = False) -> Export:
    """The :class:`Export` of ``engine``'s model on this rank; an :class:`EplError` when no library could read it."""
    model = engine.model
    if is_wrapped(model):
        return _merged(engine) if merged else _adapters(engine)
    if merged:
        raise EplError(
            f"merged=True merges a PEFT model's adapters into its base model; this {type(model).__name__} has none. "
            "Save it without merged=True."
        )
    _check_transformers_model(model)
    tensors = [(name, t.dtype, piece, _plain(name)) for name, t, piece in local_tensors(engine)]
    return Export(tensors, SINGLE, True, lambda folder: write_configs(model, folder), is_model_weights_file)


def write_configs(model: Any, folder: Path) -> None:
    """``config.json`` when the model has a config, ``generation_config.json`` when it can generate (transformers')."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_json_file"):
        config.to_json_file(str(folder / CONFIG))
    generation = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", None)
    if generation is not None and hasattr(generation, "to_json_file") and callable(can_generate) and can_generate():
        generation.to_json_file(str(folder / GENERATION_CONFIG))


def _plain(name: str) -> Value:
    return lambda values: local_tensor(values[name])


def _check_transformers_model(model: nn.Module) -> None:
    """A model holding a transformers config is written with it only when it is that transformers model."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_json_file"):
        return
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - a transformers config without transformers
        return
    if isinstance(model, PreTrainedModel):
        return
    architectures = getattr(config, "architectures", None) or [type(config).__name__]
    first = next(iter(model.state_dict()), "")
    raise EplError(
        f"The model is a {type(model).__module__}.{type(model).__qualname__}, not a transformers model, but holds a "
        f"transformers config ({architectures[0]}): under that config.json its tensor names ({first!r}, ...) are "
        "not the architecture's, and transformers would load a random model from them. Parallelize the "
        "transformers model itself, or checkpoint this one with engine.save."
    )


def _peft_adapter(model: nn.Module) -> tuple[str, Any]:
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict) or len(configs) != 1:
        names = sorted(configs) if isinstance(configs, dict) else []
        raise EplError(
            f"save_pretrained writes one PEFT adapter; the model has {names}. Delete the others "
            "(model.delete_adapter(name)) before parallelize, or train them in separate runs."
        )
    ((adapter, config),) = configs.items()
    return adapter, config


def _adapters(engine: CheckpointedEngine) -> Export:
    """PEFT's adapter format: the adapter's tensors under PEFT's names, and its config."""
    from peft.utils import get_peft_model_state_dict

    model = engine.model
    adapter, config = _peft_adapter(model)
    local = list(local_tensors(engine))
    # PEFT's own selection and renaming (lora_A.default.weight -> lora_A.weight), on stand-ins: no values needed.
    stand_ins = {name: torch.empty(0, device="meta") for name, *_ in local}
    selected = get_peft_model_state_dict(model, state_dict=stand_ins, adapter_name=adapter)
    name_of = {id(value): name for name, value in stand_ins.items()}
    made = sorted(out for out, value in selected.items() if id(value) not in name_of)
    if made:  # a tensor PEFT computes at save time: not one of this rank's tensors, so not written piecewise here
        raise EplError(
            f"PEFT's adapter state holds {made[:3]}, which it computes when saving; EPL writes only the model's own "
            "tensors. Save this adapter with PEFT in one process (engine.save, then PeftModel.save_pretrained)."
        )
    renamed = {name_of[id(value)]: out for out, value in selected.items()}
    tensors = [(renamed[name], t.dtype, piece, _plain(name)) for name, t, piece in local if name in renamed]

    def configs(folder: Path) -> None:
        saved = copy.deepcopy(config)
        saved.inference_mode = True
        if getattr(saved, "base_model_name_or_path", None) is None:
            saved.base_model_name_or_path = getattr(unwrapped(model), "name_or_path", None) or None
        saved.save_pretrained(str(folder))

    return Export(tensors, ADAPTER_SINGLE, False, configs, lambda name: name == ADAPTER_SINGLE)


def _merged(engine: CheckpointedEngine) -> Export:
    """The base model with each LoRA update added to the rectangles of the weight this rank holds."""
    model = engine.model
    base_model = unwrapped(model)
    _check_transformers_model(base_model)
    _peft_adapter(model)
    local = list(local_tensors(engine))
    held = {name: piece for name, _, piece in local}
    base = base_names(model, list(held))
    layers = {name: module for name, module in model.named_modules() if is_layer_wrapper(module)}
    gathered = _gathered_adapters(local, layers)
    held.update({name: held_whole(value) for name, value in gathered.items()})  # plain tensors: held whole
    tied = _ties(model, base)
    tensors: list[tuple[str, torch.dtype, Piece, Value]] = []
    # A module in modules_to_save is written as trained (its copy), not as its frozen original.
    trained = {base[name] for name, *_ in local if ".modules_to_save." in name}
    for name, tensor, piece in local:
        out = base[name]
        if out is None or (out in trained and ".modules_to_save." not in name):
            continue
        owner, _, leaf = name.rpartition(".base_layer.")
        layer = layers.get(owner) if owner else None
        if layer is None or "." in leaf:
            tensors.append((out, tensor.dtype, piece, _plain(name)))
            continue
        updates = _updates(owner, layer, leaf, piece, held)
        if out in tied and any(block for block in updates):
            raise EplError(
                f"merged=True cannot merge the adapter of {owner!r}: its base weight {out!r} is tied to "
                f"{sorted(tied[out])}, which the merged update would untie (transformers ties them again at load, "
                "dropping the update). Leave that layer out of target_modules, or untie the weights "
                "(tie_word_embeddings=False) before get_peft_model; the adapters themselves are saved without "
                "merged=True."
            )
        tensors.append((out, tensor.dtype, piece, _with_updates(name, piece, updates, held, gathered)))
    return Export(tensors, SINGLE, True, lambda folder: write_configs(base_model, folder), is_model_weights_file)


def _ties(model: nn.Module, base: dict[str, str | None]) -> dict[str, set[str]]:
    """Each base name tied to others (one object under several names, or a tie transformers declares) -> them."""
    groups: dict[int, set[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        base_name = base.get(name)
        if base_name is not None:
            groups.setdefault(id(tensor), set()).add(base_name)
    ties = {name: group - {name} for group in groups.values() for name in group if len(group) > 1}
    declared = getattr(unwrapped(model), "get_expanded_tied_weights_keys", None)
    tie_word_embeddings = getattr(getattr(unwrapped(model), "config", None), "tie_word_embeddings", True)
    if callable(declared) and tie_word_embeddings:
        for target, source in declared(all_submodels=True).items():
            ties.setdefault(target, set()).add(source)
            ties.setdefault(source, set()).add(target)
    return ties


#: One adapter's update of one rectangle of a weight: (scaling, lora_B's name, its rows, lora_A's name, its
#: columns, transposed) or of a bias: (scaling, lora_B's bias name, its rows, "", (0, 0), False).
_Update = tuple[float, str, tuple[int, int], str, tuple[int, int], bool]


def _updates(owner: str, layer: nn.Module, leaf: str, piece: Piece, held: dict[str, Piece]) -> list[list[_Update]]:
    """For each rectangle of ``piece`` (of ``owner``'s base weight or bias ``leaf``), the LoRA updates to add."""
    if getattr(layer, "merged", False) or getattr(layer, "disable_adapters", False):
        return [[] for _ in piece.blocks]
    lora: Any = layer  # PEFT's LoRA layer (read by attribute: PEFT is optional)
    lora_a = getattr(lora, "lora_A", None)
    if not isinstance(lora_a, nn.ModuleDict):
        kind = type(layer)
        raise EplError(
            f"merged=True cannot merge the adapter of {owner!r}, a {kind.__module__}.{kind.__qualname__}: only "
            f"LoRA's are merged here.{_ADVICE}"
        )
    active = [a for a in lora.active_adapters if a in lora_a]
    embedding = getattr(lora, "lora_embedding_A", None) or {}
    if any(a in embedding for a in lora.active_adapters):
        active = ["embedding"]
    refused = _merge_refusal(layer, active, piece)
    if refused:
        raise EplError(f"merged=True cannot merge the adapter of {owner!r}: {refused}{_ADVICE}")
    transposed = bool(getattr(layer, "fan_in_fan_out", False))
    result: list[list[_Update]] = []
    for block in piece.blocks:
        updates: list[_Update] = []
        for adapter in active:
            scaling = float(lora.scaling[adapter])
            a_name, b_name = f"{owner}.lora_A.{adapter}.weight", f"{owner}.lora_B.{adapter}.weight"
            if leaf == "bias":
                if not lora.lora_bias.get(adapter, False):
                    continue
                bias = f"{owner}.lora_B.{adapter}.bias"
                rows = (block.offsets[0], block.offsets[0] + block.sizes[0])
                _require(held, bias, [rows], owner)
                updates.append((scaling, bias, rows, "", (0, 0), False))
                continue
            if leaf != "weight":
                continue
            first = (block.offsets[0], block.offsets[0] + block.sizes[0])
            second = (block.offsets[1], block.offsets[1] + block.sizes[1])
            out_rows, in_cols = (second, first) if transposed else (first, second)
            rank = held[a_name].shape[0] if a_name in held else 0
            _require(held, b_name, [out_rows, (0, rank)], owner)
            _require(held, a_name, [(0, rank), in_cols], owner)
            updates.append((scaling, b_name, out_rows, a_name, in_cols, transposed))
        result.append(updates)
    return result


_ADVICE = (
    " Save the adapters (save_pretrained without merged=True) and merge them in one process with PEFT: "
    "PeftModel.from_pretrained(base, path).merge_and_unload()."
)


def _merge_refusal(layer: nn.Module, active: list[str], piece: Piece) -> str | None:
    if active == ["embedding"]:
        return "merging LoRA on an embedding is not done here."
    if any(getattr(layer, "use_dora", {}).get(a, False) for a in active):
        return "DoRA's magnitudes are not merged here."
    if active and len(piece.shape) != 2:
        return f"its base weight has {len(piece.shape)} dimensions (only a Linear's are merged here)."
    return None


def _require(held: dict[str, Piece], name: str, box: list[tuple[int, int]], owner: str) -> None:
    """This rank must hold the rectangle ``box`` of ``name`` in one of its blocks."""
    piece = held.get(name)
    if piece is not None and _block_holding(piece, box) is not None:
        return
    raise EplError(
        f"merged=True: this rank holds part of {owner!r}'s weight but not the part {box} of {name!r} its update "
        f"needs (the layout cuts the adapter another way than its base layer).{_ADVICE}"
    )


def _block_holding(piece: Piece, box: list[tuple[int, int]]) -> Any:
    for block in piece.blocks:
        if all(o <= a and b <= o + s for (a, b), o, s in zip(box, block.offsets, block.sizes, strict=True)):
            return block
    return None


def _gathered_adapters(
    local: list[tuple[str, torch.Tensor, Piece]], layers: dict[str, nn.Module]
) -> dict[str, torch.Tensor]:
    """Each adapter tensor of a LoRA layer that this rank holds only part of -> the whole tensor, gathered from its
    group (a collective: every rank of a split group or a ZeRO mesh holds the same names, in the same order)."""
    from epl.sharding.data_shards import is_dtensor
    from epl.sharding.parameters import gather_split, shard_spec

    adapter_names = {
        f"{owner}.{kind}.{adapter}.{leaf}"
        for owner, layer in layers.items()
        for kind in ("lora_A", "lora_B")
        if isinstance(getattr(layer, kind, None), nn.ModuleDict)
        for adapter in getattr(layer, kind)
        for leaf in ("weight", "bias")
    }
    gathered: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, tensor, piece in local:
            if name not in adapter_names or piece.whole:
                continue
            value = tensor.full_tensor() if is_dtensor(tensor) else tensor
            gathered[name] = gather_split(value, shard_spec(tensor)).detach()
    return gathered


def _rectangle(values: dict[str, torch.Tensor], piece: Piece, name: str, box: list[tuple[int, int]]) -> torch.Tensor:
    """The rectangle ``box`` of the whole tensor ``name``, from this rank's local value of it."""
    block = _block_holding(piece, box)
    local = block.in_local(local_tensor(values[name]))
    return local[tuple(slice(a - o, b - o) for (a, b), o in zip(box, block.offsets, strict=True))]


def _with_updates(
    name: str,
    piece: Piece,
    updates: list[list[_Update]],
    held_pieces: dict[str, Piece],
    gathered: dict[str, torch.Tensor],
) -> Value:
    def value(state: dict[str, torch.Tensor]) -> torch.Tensor:
        values = {**state, **gathered}
        local = local_tensor(values[name]).detach().clone()
        for block, block_updates in zip(piece.blocks, updates, strict=True):
            target = block.in_local(local)
            for scaling, b_name, rows, a_name, cols, transposed in block_updates:
                if not a_name:  # a bias
                    target += scaling * _rectangle(values, held_pieces[b_name], b_name, [rows]).to(target.dtype)
                    continue
                b_rank = held_pieces[b_name].shape[1]
                b_part = _rectangle(values, held_pieces[b_name], b_name, [rows, (0, b_rank)])
                a_part = _rectangle(values, held_pieces[a_name], a_name, [(0, b_rank), cols])
                update = scaling * (b_part.to(target.dtype) @ a_part.to(target.dtype))
                target += update.T if transposed else update
        return local

    return value


__all__ = ["ADAPTER_CONFIG", "ADAPTER_SINGLE", "CONFIG", "GENERATION_CONFIG", "INDEX", "Export", "describe_export"]
