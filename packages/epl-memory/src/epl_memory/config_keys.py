"""The config keys this plugin declares (``epl_config_keys``): the manual's gradient checkpoint, ZeRO,
offload, AMP and apply-group keys (6.2 - 6.6).
"""

from __future__ import annotations

from epl.plugin_api import ConfigKey

KEYS: tuple[ConfigKey, ...] = (
    # 6.2 Gradient checkpoint
    ConfigKey(
        name="gradient_checkpoint.type",
        types=(str,),
        default="",
        choices=("", "collection", "auto"),
        doc="Which activations to recompute: 'collection' (modules the user marks) "
        "or 'auto' (EPL chooses); '' disables checkpointing.",
    ),
    ConfigKey(
        name="gradient_checkpoint.end_taskgraph",
        types=(int,),
        default=-1,
        minimum=-1,
        doc="Index of the last TaskGraph to apply gradient checkpointing to (-1: all).",
    ),
    ConfigKey(
        name="gradient_checkpoint.check_gradients",
        types=(bool,),
        default=False,
        doc="Compare checkpointed gradients with plain ones once and report.",
    ),
    # 6.3 ZeRO
    ConfigKey(
        name="zero.level",
        types=(str,),
        default="",
        choices=("", "v0", "v1", "v2"),
        doc="ZeRO level: 'v0' partitions optimizer states, 'v1' also gradients, "
        "'v2' also parameters; '' disables ZeRO.",
    ),
    # 6.4 Offload
    ConfigKey(
        name="offload.level",
        types=(str,),
        default="",
        choices=("", "v0"),
        doc="Offload level: 'v0' keeps all weights in CPU memory; '' disables offload.",
    ),
    # 6.5 Memory-efficient AMP
    ConfigKey(
        name="amp.level",
        types=(str,),
        default="",
        choices=("", "O1"),
        doc="Automatic mixed precision level; only 'O1' is supported; '' disables AMP.",
    ),
    ConfigKey(
        name="amp.debug_log",
        types=(bool,),
        default=False,
        doc="Log AMP decisions (loss scale changes, skipped steps).",
    ),
    ConfigKey(
        name="amp.loss_scale",
        types=(str, int),
        default="dynamic",
        choices=("dynamic",),
        minimum=1,
        doc="Loss scale for AMP: 'dynamic', or a fixed number.",
    ),
    ConfigKey(
        name="amp.dtype",
        types=(str,),
        default="",
        choices=("", "float16", "bfloat16"),
        doc="Precision of the operations autocast lowers under amp.level 'O1' ('': float16 on CUDA, bfloat16 on CPU).",
    ),
    ConfigKey(
        name="amp.growth_interval",
        types=(int,),
        default=2000,
        minimum=1,
        doc="With a dynamic loss scale: consecutive steps with finite gradients after which the scale doubles.",
    ),
    # 6.6 Optimizer
    ConfigKey(
        name="optimizer.num_apply_group",
        types=(int,),
        default=1,
        minimum=1,
        doc="Apply the optimizer update in this many groups to lower the peak memory.",
    ),
)
