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
        choices=("", "collection", "auto", "selective"),
        doc="Which activations to recompute: 'collection' (modules the user marks), 'auto' (EPL chooses the "
        "repeated blocks and recomputes each from its input) or 'selective' (the same blocks, keeping their matrix "
        "products' and attention kernels' outputs and recomputing only the cheap operations between them: norms, "
        "activations, rotary, elementwise); '' disables checkpointing.",
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
        doc="ZeRO level, on torch's FSDP2: every tensor with copies is chunked evenly over them, with its gradient "
        "and optimizer state; 'v0' and 'v1' keep each block's weights whole from its forward through its backward "
        "(FSDP2 reshard_after_forward=False), 'v2' gathers them just before each use and drops them after "
        "(reshard_after_forward=True); '' disables ZeRO.",
    ),
    ConfigKey(
        name="zero.shard_degree",
        types=(int,),
        default=0,
        minimum=0,
        doc="Under zero.level: shard each tensor over groups of this many of its copies and replicate it across the "
        "groups (hybrid sharding, FSDP's HSDP: only the shards' gradient all-reduce crosses groups; make a group a "
        "node). It must divide every group of copies; 0: shard over all copies.",
    ),
    ConfigKey(
        name="zero.param_dtype",
        types=(str,),
        default="",
        choices=("", "bfloat16", "float16", "float32"),
        doc="Under zero.level: the dtype the gathered weights are cast to for the forward and backward, the chunks "
        "(master weights) and the optimizer staying in the model's dtype (FSDP2's MixedPrecisionPolicy "
        "param_dtype); '': the model's dtype.",
    ),
    ConfigKey(
        name="zero.reduce_dtype",
        types=(str,),
        default="",
        choices=("", "bfloat16", "float16", "float32"),
        doc="Under zero.level: the dtype gradients are reduce-scattered in (FSDP2's reduce_dtype); '': the dtype "
        "of zero.param_dtype, or float16 with communication.fp16, else the model's.",
    ),
    # 6.4 Offload
    ConfigKey(
        name="offload.level",
        types=(str,),
        default="",
        choices=("", "v0"),
        doc="Offload level: 'v0' keeps weights, gradients and optimizer state in host memory (FSDP2's CPU offload; the "
        "optimizer steps on the CPU); '' disables offload.",
    ),
    ConfigKey(
        name="offload.overlap_step",
        types=(bool,),
        default=False,
        doc="Under offload.level: the CPU's optimizer step runs while the next step's forward runs, each block "
        "waiting for its own update (the same arithmetic). Between steps read the model through engine.model, not "
        "a reference kept from before epl.parallelize (docs/zero.md).",
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
