"""One process: the init units of a model, the values a model built on meta is given, and the refusals."""

from __future__ import annotations

import pytest
import torch

import epl
from epl.materialize.units import init_units
from tests.materialize import models


def test_the_init_units_of_llama_are_its_layers() -> None:
    with torch.device("meta"):
        model = models.llama()
    names = [(unit.name, unit.whole) for unit in init_units(model)]
    assert names == [
        ("model.embed_tokens", True),
        *[(f"model.layers.{i}", True) for i in range(4)],
        ("model.norm", True),
        ("model.rotary_emb", True),
        ("lm_head", True),  # it holds the embedding's weight (tied), whose values come from the first unit
    ]


def test_a_meta_model_gets_transformers_own_initialisation() -> None:
    """Norms are ones, weights drawn with the config's std, the rotary buffers exactly the eager model's."""
    eager = models.llama(tied=False)
    epl.init(epl.Config({"model.meta_init": True}))
    engine = epl.parallelize(models.llama(tied=False))
    built = dict(engine.model.named_parameters())
    assert all(not t.is_meta for t in engine.model.state_dict().values())
    assert torch.equal(built["model.norm.weight"], torch.ones(32))
    std = eager.config.initializer_range
    assert abs(float(built["model.layers.0.mlp.up_proj.weight"].detach().std()) - std) < 0.2 * std
    for name, buffer in eager.named_buffers():
        assert torch.equal(dict(engine.model.named_buffers())[name], buffer), name


def test_a_buffer_lost_to_torch_device_meta_is_refused_by_name() -> None:
    epl.init()
    with torch.device("meta"):
        model = models.HandWritten()  # its temperature buffer is computed at construction: meta keeps no value
    with pytest.raises(epl.errors.UninitializedError, match="temperature.*model.meta_init"):
        epl.parallelize(model)


def test_meta_init_keeps_buffers_and_a_seed_decides_the_values() -> None:
    def first_layer(seed: int) -> torch.Tensor:
        torch.manual_seed(seed)
        epl.init(epl.Config({"model.meta_init": True}))
        model = models.HandWritten()
        assert model.blocks[0].up.weight.is_meta and not model.temperature.is_meta
        return epl.parallelize(model).model.blocks[0].up.weight.detach().clone()

    assert torch.equal(first_layer(0), first_layer(0))
    assert not torch.equal(first_layer(0), first_layer(1))


def test_a_parameter_nothing_initialises_is_refused_by_name() -> None:
    epl.init()
    with torch.device("meta"):
        model = models.Unset()
    with pytest.raises(epl.errors.UninitializedError, match=r"'bias'.*reset_parameters"):
        epl.parallelize(model)


def test_values_swapped_in_keep_the_gradient_hooks() -> None:
    """A hook registered on a meta tensor (the split's sum of a per-head norm's gradient over the shards) still
    runs once, after the tensor got its values in the same object."""
    from epl.materialize.swap import swap_values

    param = torch.nn.Parameter(torch.empty(3, device="meta"))
    accumulated: list[int] = []
    param.register_hook(lambda grad: grad * 2)
    param.register_post_accumulate_grad_hook(lambda tensor: accumulated.append(1))
    swap_values(param, torch.ones(3))
    (param * 1).sum().backward()
    assert torch.equal(param.grad, torch.full((3,), 2.0)) and accumulated == [1]


def test_what_transformers_init_leaves_unset_gets_torch_init_first() -> None:
    """A transformers model's unit is initialised by its ``_init_weights`` alone (as transformers fills the weights
    a checkpoint lacks); a module that ``_init_weights`` does not know (here a gain set by its ``reset_parameters``)
    makes that unit initialise again, torch's ``reset_parameters`` first, then ``_init_weights``."""
    from epl.materialize.initialize import hf_owners, initialize_unit

    with torch.device("meta"):
        model = models.llama(tied=False)
        model.model.layers[0].gain = models.Scale(32)
    owners = hf_owners(model)
    units = {unit.name: unit for unit in init_units(model)}
    values = initialize_unit(units["model.layers.0"], 0, owners)
    layer = model.model.layers[0]
    gain = values[id(layer.gain.gain)]
    assert bool(((gain >= 0.5) & (gain <= 1.5)).all())
    std = model.config.initializer_range
    assert abs(float(values[id(layer.mlp.up_proj.weight)].std()) - std) < 0.2 * std  # then _init_weights
    assert torch.equal(values[id(layer.input_layernorm.weight)], torch.ones(32))
