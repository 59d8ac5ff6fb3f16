"""``compile.enabled`` in one process: which modules are compiled, what a failing backend leaves eager (named),
the config's errors, and a transformers model trained without its KV cache."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch import nn

import epl
from epl.compiling import compile_blocks, repeated_blocks, without_kv_cache


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x)) + x


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_the_repeated_blocks_are_the_largest_list_of_one_type() -> None:
    model = Model()
    assert [name for name, _ in repeated_blocks(model)] == ["blocks.0", "blocks.1", "blocks.2"]
    assert [name for name, _ in repeated_blocks(model, within=("blocks.1", "blocks.2"))] == ["blocks.1", "blocks.2"]
    assert repeated_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) == []


def test_blocks_share_one_graph_and_train_as_eager() -> None:
    torch.manual_seed(0)
    model, eager = Model(), Model()
    eager.load_state_dict(model.state_dict())
    report = compile_blocks(repeated_blocks(model), "aot_eager")
    x = torch.randn(5, 4)
    model(x).square().sum().backward()
    eager(x).square().sum().backward()
    assert report.compiled == ["blocks.0", "blocks.1", "blocks.2"] and report.graphs == {"Block": 1}
    assert report.forward_graphs == {"Block": 1} and report.backward_graphs == {"Block": 1}  # AOTAutograd's split
    for (name, a), b in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, msg=name)
    assert list(model.state_dict()) == list(eager.state_dict())  # names unchanged: checkpoints load either way


@pytest.mark.parametrize("mode", ["", "max-autotune-no-cudagraphs"])
def test_an_inductor_block_reports_one_forward_and_one_backward_graph(mode: str) -> None:
    """Inductor's C++ code on the CPU, with and without a mode: counted whether inductor compiles the graphs or
    finds them in its cache (a second run of this test)."""
    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(0)
    model, eager = Model(), Model()
    eager.load_state_dict(model.state_dict())
    report = compile_blocks(repeated_blocks(model), "inductor", mode)
    x = torch.randn(5, 4)
    model(x).square().sum().backward()
    eager(x).square().sum().backward()
    assert report.graphs == {"Block": 1} and not report.eager, report
    assert report.forward_graphs == {"Block": 1} and report.backward_graphs == {"Block": 1}, report
    assert report.describe() == "3 modules compiled by inductor (Block: 1 graph = 1 forward + 1 backward)"
    for (name, a), b in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


def test_a_backend_without_aot_autograd_counts_no_forward_or_backward_graphs() -> None:
    import torch._dynamo

    torch._dynamo.reset()
    model = Model()
    report = compile_blocks(repeated_blocks(model), "eager")
    model(torch.randn(5, 4)).sum().backward()
    assert report.graphs == {"Block": 1} and report.forward_graphs == {} and report.backward_graphs == {}
    assert report.describe() == "3 modules compiled by eager (Block: 1 graph)"


def failing_backend(graph: torch.fx.GraphModule, example_inputs: Any) -> Any:
    raise RuntimeError("this backend cannot compile anything")


def test_what_a_backend_fails_on_runs_eager_and_is_named(caplog: pytest.LogCaptureFixture) -> None:
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.register_backend(failing_backend, name="epl_test_failing")
    torch.manual_seed(0)
    model, eager = Model(), Model()
    eager.load_state_dict(model.state_dict())
    with caplog.at_level(logging.WARNING, logger="epl.compile"):
        report = compile_blocks(repeated_blocks(model), "epl_test_failing")
        x = torch.randn(5, 4)
        torch.testing.assert_close(model(x), eager(x), rtol=0, atol=0)
    assert report.eager == {"Block": "RuntimeError: this backend cannot compile anything"}
    assert "Block stays eager" in caplog.text and "eager: Block" in report.describe()


def test_an_unknown_backend_or_a_mode_without_inductor_is_one_clear_error() -> None:
    with pytest.raises(epl.ConfigError, match="not a torch.compile backend"):
        compile_blocks(repeated_blocks(Model()), "no_such_backend")
    with pytest.raises(epl.ConfigError, match="inductor backend only"):
        compile_blocks(repeated_blocks(Model()), "aot_eager", "max-autotune")


def test_a_transformers_model_runs_without_its_kv_cache() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=16)  # fmt: skip
    model = LlamaForCausalLM(config)
    assert without_kv_cache(model) == ["LlamaForCausalLM", "LlamaModel"]
    ids = torch.randint(0, 32, (1, 8))
    assert model(input_ids=ids).past_key_values is None
    with torch.no_grad():
        assert model(input_ids=ids).past_key_values is None  # engine.predict too
    assert model(input_ids=ids, use_cache=True).past_key_values is not None  # as asked
    assert without_kv_cache(model) == []  # once


def test_the_engine_reports_what_it_compiled() -> None:
    epl.init(epl.Config({"compile.enabled": True, "compile.backend": "aot_eager"}))
    engine = epl.parallelize(Model(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=lambda y, t: y.sum())
    engine.step(torch.randn(4, 4), torch.zeros(4))
    report = engine.compile_report
    assert report is not None and report.compiled == ["blocks.0", "blocks.1", "blocks.2"]
    assert report.describe() == "3 modules compiled by aot_eager (Block: 1 graph = 1 forward + 1 backward)"
    epl.init(epl.Config({}))
    assert epl.parallelize(Model()).compile_report is None


def test_a_model_without_repeated_blocks_is_compiled_whole() -> None:
    epl.init(epl.Config({"compile.enabled": True, "compile.backend": "aot_eager"}))
    engine = epl.parallelize(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    engine.predict(torch.randn(2, 4))
    assert engine.compile_report is not None and engine.compile_report.compiled == ["model"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_inductor_on_cuda_trains_as_eager_with_amp_and_checkpointing() -> None:
    """``.ci/gpu``: inductor's CUDA (Triton) kernels, AMP bf16 and checkpointing, against the same engine eager."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def run(compiled: bool) -> list[float]:
        epl.init(epl.Config({"compile.enabled": compiled, "amp.level": "O1", "amp.dtype": "bfloat16",
                             "gradient_checkpoint.type": "auto"}))  # fmt: skip
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
        engine = epl.parallelize(LlamaForCausalLM(config), optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
        tokens = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(1))
        losses = [float(engine.step({"input_ids": tokens, "labels": tokens})) for _ in range(3)]
        if compiled:
            assert engine.compile_report is not None and not engine.compile_report.eager, engine.compile_report
        return losses

    torch.testing.assert_close(run(True), run(False), rtol=2e-2, atol=2e-2)  # bf16 kernels differ in rounding
