"""The config keys this plugin declares (``epl_config_keys``): the manual's pipeline schedule and
automatic partition keys (6.1, 6.10).
"""

from __future__ import annotations

from epl.plugin_api import ConfigKey

KEYS: tuple[ConfigKey, ...] = (
    ConfigKey(
        name="pipeline.num_stages",
        types=(int, type(None)),
        default=None,
        minimum=1,
        doc="Number of pipeline stages to partition an unannotated model into when auto.auto_parallel is True "
        "(with pipeline.stages_per_rank=v they run on num_stages / v devices per replica position).",
    ),
    ConfigKey(
        name="pipeline.strategy",
        types=(str,),
        default="PreferBackward",
        doc="Pipeline schedule, by name: PreferBackward (1F1B, like PipeDream), PreferForward (GPipe), "
        "ZeroBubble (ZB-H1: backward split into input and weight gradients), Interleaved1F1B (Megatron's "
        "virtual pipeline, with pipeline.stages_per_rank > 1), or one a plugin registers.",
    ),
    ConfigKey(
        name="pipeline.split_points",
        types=(list, type(None)),
        default=None,
        doc="Cut an unannotated model (or one built in one epl.split scope) into stages that begin at these "
        "modules, by qualified name (e.g. ['model.layers.2']), as torch.distributed.pipelining's split points: "
        "len + 1 stages, no wrapper needed.",
    ),
    # 6.10 Auto parallel
    ConfigKey(
        name="auto.auto_parallel",
        types=(bool, str),
        default=False,
        choices=("plan",),
        doc="True: cut an unannotated model into pipeline.num_stages balanced stages (between blocks such as "
        "transformer layers, in forward's call order, cost estimated by parameter count). 'plan': lay out an "
        "unannotated model as `epl plan --auto` would for this cluster (tensor, pipeline and data degrees, "
        "micro-batches, ZeRO, checkpointing, schedule), for planner.global_batch_size sequences of "
        "planner.sequence_length tokens on planner.device.",
    ),
)
