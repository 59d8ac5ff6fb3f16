"""Wrapped linear layers (PEFT's LoRA) under ``epl.split``: the rule for the structure, and the layout ``epl plan``
shows (one process, on meta copies). Training equal to one process and the collectives: ``tests/models/test_peft.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from epl.sharding.adapters import wrapped_linear


def shards(model: nn.Module) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Device 0's (shape, whole shape) of each parameter of the split model, by name."""
    import epl

    plan = epl.plan(model, world_size=2)
    return {row.name: (tuple(row.shape), tuple(row.whole)) for row in plan.taskgraphs[0].shards[0]}


def lora_llama(**options: Any) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    import epl
    from tests.models.test_peft import PROJECTIONS, llama

    epl.init()
    with epl.split(2):
        config = LoraConfig(r=4, target_modules=PROJECTIONS, **options)
        return get_peft_model(llama(), config)


def test_lora_layers_are_sharded_as_their_base_layers() -> None:
    found = shards(lora_llama())
    attention = "base_model.model.model.layers.*.self_attn"
    # q: column parallel, lora_B cut by output rows, lora_A whole
    assert found[f"{attention}.q_proj.base_layer.weight"] == ((16, 32), (32, 32))
    assert found[f"{attention}.q_proj.lora_B.default.weight"] == ((16, 4), (32, 4))
    assert found[f"{attention}.q_proj.lora_A.default.weight"] == ((4, 32), (4, 32))
    # o: row parallel, lora_A cut by input columns, lora_B whole
    assert found[f"{attention}.o_proj.base_layer.weight"] == ((32, 16), (32, 32))
    assert found[f"{attention}.o_proj.lora_A.default.weight"] == ((4, 16), (4, 32))
    assert found[f"{attention}.o_proj.lora_B.default.weight"] == ((32, 4), (32, 4))
    mlp = "base_model.model.model.layers.*.mlp"
    assert found[f"{mlp}.down_proj.base_layer.weight"] == ((32, 32), (32, 64))
    assert found[f"{mlp}.down_proj.lora_A.default.weight"] == ((4, 32), (4, 64))


def test_the_rule_is_for_the_structure() -> None:
    """LoRA's layer is one; DoRA's (a magnitude vector outside any linear) and a square adapter are not."""
    from peft import LoraConfig, get_peft_model

    from tests.models.test_peft import PROJECTIONS, llama

    lora = get_peft_model(llama(), LoraConfig(r=4, target_modules=PROJECTIONS))
    layer = lora.base_model.model.model.layers[0].self_attn.q_proj
    parts = wrapped_linear(layer)
    assert parts is not None and list(parts.readers) == ["lora_A.default"] and list(parts.writers) == ["lora_B.default"]
    dora = get_peft_model(llama(), LoraConfig(r=4, target_modules=PROJECTIONS, use_dora=True))
    assert wrapped_linear(dora.base_model.model.model.layers[0].self_attn.q_proj) is None

    class Square(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base_layer, self.adapter = nn.Linear(8, 8), nn.Linear(8, 8)

    assert wrapped_linear(Square()) is None


class Gated(nn.Module):
    """The structure of a wrapped linear, but a forward that multiplies: not the sum of the products."""

    def __init__(self, features: int, out: int) -> None:
        super().__init__()
        self.base_layer = nn.Linear(features, out)
        self.lora_A, self.lora_B = nn.Linear(features, 2), nn.Linear(2, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) * torch.sigmoid(self.lora_B(self.lora_A(x)))


def test_a_wrapper_not_shown_additive_keeps_whole_outputs() -> None:
    import epl

    epl.init()
    with epl.split(2):
        model = nn.Sequential(Gated(16, 64), nn.ReLU(), Gated(64, 16))
    found = shards(model)
    # no pair: each base column parallel with its output gathered, adapters whole
    assert found["0.base_layer.weight"] == ((32, 16), (64, 16))
    assert found["2.base_layer.weight"] == ((8, 64), (16, 64))
    assert found["2.lora_A.weight"] == ((2, 64), (2, 64))


def test_sequence_parallelism_with_paired_adapters_is_refused() -> None:
    """The adapters of a column-parallel wrapped layer read the gathered input whole: not proven under it."""
    import epl
    from epl.annotations.taskgraph import TaskGraph
    from epl.builtin.split_transform import find_targets, layout_of
    from epl.sharding.rules import BUILTIN_RULES
    from tests.models.test_peft import peft_llama

    model = peft_llama()
    taskgraph = TaskGraph(index=0, strategy=epl.split(2, name="s"), tensors=[*model.parameters(), *model.buffers()])
    targets = find_targets(model, taskgraph, BUILTIN_RULES)
    with pytest.raises(epl.AnnotationError, match="split.sequence_parallel with wrapped linear layers"):
        layout_of(model, targets, None, sequence_parallel=True)
