"""Published training runs the planner is checked against (docs/planner.md): model shape, hardware, layout,
batch and sequence, and the throughput the authors report, with the source of each row.

Throughput is compared in each source's own accounting: Megatron-LM and BLOOM report hardware teraFLOP/s per GPU
counting the activation recomputation they ran, by Narayanan et al.'s formula
``96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))`` per iteration (:func:`megatron_flops`).
"""

from __future__ import annotations

from dataclasses import dataclass

from epl.planner import Layout, ModelShape, Workload

NARAYANAN = (
    "Narayanan et al. 2021, Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM, Table 1"
)
BLOOM = "Le Scao et al. 2022, BLOOM (section 3.4: 384 A100 80GB, TP 4 x PP 12 x DP 8, 150 TFLOP/s per GPU)"


@dataclass(frozen=True)
class PublishedRun:
    """One published run: what it trained, how, on what, and the teraFLOP/s per GPU its authors report."""

    name: str
    source: str
    shape: ModelShape
    layout: Layout
    workload: Workload
    device: str
    devices: int
    tflops_per_device: float


def megatron_flops(run: PublishedRun) -> float:
    """FLOPs of one iteration as Narayanan et al. count them (with full recomputation)."""
    s, shape, batch = run.workload.sequence, run.shape, run.workload.global_batch
    layers, h, v = shape.layers, shape.hidden, shape.vocab
    return 96 * batch * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))


def _gpt(layers: int, hidden: int, heads: int, vocab: int = 51200) -> ModelShape:
    return ModelShape(layers=layers, hidden=hidden, heads=heads, kv_heads=heads, ffn=4 * hidden, vocab=vocab,
                      gated=False, tied=True)  # fmt: skip


def _megatron(name: str, heads: int, hidden: int, layers: int, t: int, p: int, gpus: int, batch: int, tf: float):
    d = gpus // (t * p)
    layout = Layout(d, t, p, batch // d, 1, "none", "full", "1F1B")
    return PublishedRun(name, NARAYANAN, _gpt(layers, hidden, heads), layout, Workload(batch, 2048, sdpa=False),
                        "a100-80gb", gpus, tf)  # fmt: skip


RUNS: tuple[PublishedRun, ...] = (
    _megatron("GPT 1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    _megatron("GPT 3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
    _megatron("GPT 7.5B", 32, 4096, 36, 4, 1, 128, 512, 142),
    _megatron("GPT 18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    _megatron("GPT 39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138),
    _megatron("GPT 76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    _megatron("GPT 145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    _megatron("GPT 310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    _megatron("GPT 529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163),
    _megatron("GPT 1008B", 160, 25600, 128, 8, 64, 3072, 3072, 163),
    PublishedRun(
        "BLOOM 176B",
        BLOOM,
        _gpt(70, 14336, 112, vocab=250880),
        Layout(8, 4, 12, 128, 2, "v1", "full", "1F1B"),
        Workload(2048, 2048, sdpa=False),
        "a100-80gb",
        384,
        150,
    ),
)
#: The rows each source's device efficiency is fitted on (at most 3 per source); the others are predicted.
FITTED_ON = ("GPT 1.7B", "GPT 39.1B", "GPT 310.1B")
