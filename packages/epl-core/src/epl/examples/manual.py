"""The manual's annotation examples as functions that build annotated PyTorch models.

Each ``build`` runs after ``epl.init(config)`` and returns the model to pass to
``epl.parallelize``. ``epl plan --example NAME`` plans them for any world size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from epl.annotations import replicate, set_default_strategy, split
from epl.examples.models import ConvFeatures, MoEBlock
from epl.nn import Experts, MoE, TopKGate
from epl.runtime.env import Env


@dataclass(frozen=True)
class ManualExample:
    """One example of the manual: its config and a function that builds the annotated model."""

    name: str
    summary: str
    build: Callable[[], nn.Module]
    config: dict[str, Any] = field(default_factory=dict)


def data_parallel() -> nn.Module:
    """Manual 1.2.1 / 5.1: the whole model under ``replicate(device_count=1)``."""
    with replicate(device_count=1):
        return nn.Sequential(nn.Linear(20, 2), nn.Linear(2, 10))


def pipeline() -> nn.Module:
    """Manual 1.2.2 / 5.2: two stages, one device each."""
    with replicate(device_count=1, name="stage_0"):
        stage0 = nn.Sequential(nn.Linear(12, 256), nn.ReLU(), nn.Linear(256, 64), nn.ReLU())
    with replicate(device_count=1, name="stage_1"):
        stage1 = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 12))
    return nn.Sequential(stage0, stage1)


def bert_stages() -> nn.Module:
    """Manual 8.2.1: each ``set_default_strategy`` call opens the next pipeline stage."""
    set_default_strategy(replicate(1))
    stage0 = nn.Sequential(
        nn.Embedding(1000, 32),
        nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, batch_first=True),
    )
    set_default_strategy(replicate(1))
    stage1 = nn.Sequential(
        nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, batch_first=True),
        nn.Linear(32, 2),
    )
    return nn.Sequential(stage0, stage1)


def classification() -> nn.Module:
    """Manual 5.3.1: replicated features and a split classifier, colocated on the same devices."""
    devices = Env.get().cluster.total_gpu_num
    with replicate(devices, name="features"):
        features = ConvFeatures(64)
    with split(devices, name="classifier"):
        classifier = nn.Linear(64, 1000)
    return nn.Sequential(features, classifier)


def moe() -> nn.Module:
    """Manual 5.3.2: attention and gating replicated by default, experts split (expert parallel)."""
    devices = Env.get().cluster.total_gpu_num
    experts = 2 * devices
    set_default_strategy(replicate(devices, name="attention_and_gating"))
    attention = nn.MultiheadAttention(16, 2, batch_first=True)
    gate = TopKGate(16, experts, k=2, capacity_factor=1.25)
    with split(devices, name="experts"):
        expert_weights = Experts(experts, 16, 32)
    set_default_strategy(None)
    return MoEBlock(attention, MoE(gate, expert_weights))


def by_hand() -> nn.Module:
    """The eight-layer model of pytorch_model_parallel_by_hand.md: four stages of two layers, no ``.to``."""
    widths = [12, 256, 128, 64, 8, 64, 128, 256, 12]
    stages = []
    for stage in range(4):
        with replicate(1, name=f"stage_{stage}"):
            a, b, c = widths[2 * stage : 2 * stage + 3]
            layers: list[nn.Module] = [nn.Linear(a, b), nn.ReLU(), nn.Linear(b, c)]
            if stage < 3:
                layers.append(nn.ReLU())
            stages.append(nn.Sequential(*layers))
    return nn.Sequential(*stages)


EXAMPLES: dict[str, ManualExample] = {
    example.name: example
    for example in (
        ManualExample("data_parallel", "replicate(1) over the whole model", data_parallel),
        ManualExample(
            "pipeline", "two replicate(1) stages, 4 micro-batches", pipeline, {"pipeline.num_micro_batch": 4}
        ),
        ManualExample(
            "bert_stages", "two stages opened by set_default_strategy", bert_stages, {"pipeline.num_micro_batch": 4}
        ),
        ManualExample(
            "classification",
            "replicate(n) features + split(n) classifier, colocated",
            classification,
            {"cluster.colocate_split_and_replicate": True},
        ),
        ManualExample(
            "moe",
            "replicated attention/gating + split experts, colocated",
            moe,
            {"cluster.colocate_split_and_replicate": True},
        ),
        ManualExample(
            "by_hand", "the eight-layer model as four annotated stages", by_hand, {"pipeline.num_micro_batch": 4}
        ),
    )
}
