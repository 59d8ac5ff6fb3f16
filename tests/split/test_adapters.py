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


class GatedConv1D(Gated):
    """``Gated`` around GPT-2's ``Conv1D`` (its weight ``[in, out]``), square."""

    def __init__(self, features: int) -> None:
        from transformers.pytorch_utils import Conv1D

        super().__init__(features, features)
        self.base_layer = Conv1D(features, features)


def test_a_square_conv1d_base_not_shown_additive_is_cut_as_it_computes() -> None:
    """Its output gathered, in the orientation the example run shows (``[in, out]``): read as ``[out, in]``, a
    square weight would be cut by its input and be silently wrong, as the shapes are the same."""
    import epl
    from epl.annotations.taskgraph import TaskGraph
    from epl.builtin.split_transform import find_targets, layout_of
    from epl.sharding.rules import BUILTIN_RULES

    model = nn.Sequential(GatedConv1D(16), nn.ReLU(), GatedConv1D(16))
    taskgraph = TaskGraph(index=0, strategy=epl.split(2, name="s"), tensors=[*model.parameters(), *model.buffers()])
    layout = layout_of(model, find_targets(model, taskgraph, BUILTIN_RULES), None, torch.randn(2, 16))
    for name in ("0", "2"):
        assert (layout.decisions[name].role, layout.decisions[name].weight_layout) == ("alone", "in_out")
        assert layout.reasons[name] == "its forward is not its base layer's and adapters' sum"


def test_gpt2_conv1d_lora_layers_are_sharded_as_their_base_layers() -> None:
    """GPT-2's Conv1D layers hold their weight [in, out]: c_attn (q, k and v fused) and c_fc column parallel, the
    c_proj of attention and of the MLP row parallel, the adapters following as for nn.Linear bases."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    import epl

    epl.init()
    with epl.split(2):
        config = GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=64, n_positions=16)
        lora = LoraConfig(r=4, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True)
        model = get_peft_model(GPT2LMHeadModel(config), lora)
    found = shards(model)
    block = "base_model.model.transformer.h.0"
    assert found[f"{block}.attn.c_attn.base_layer.weight"] == ((32, 48), (32, 96))
    assert found[f"{block}.attn.c_attn.lora_B.default.weight"] == ((48, 4), (96, 4))
    assert found[f"{block}.attn.c_proj.base_layer.weight"] == ((16, 32), (32, 32))
    assert found[f"{block}.attn.c_proj.lora_A.default.weight"] == ((4, 16), (4, 32))
    assert found[f"{block}.mlp.c_fc.base_layer.weight"] == ((32, 64), (32, 128))
    assert found[f"{block}.mlp.c_proj.base_layer.weight"] == ((64, 32), (128, 32))
    assert found[f"{block}.mlp.c_proj.lora_A.default.weight"] == ((4, 64), (4, 128))


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
