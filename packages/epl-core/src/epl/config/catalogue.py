"""Every key of the manual's configuration chapter (and EPL for PyTorch's few additions), declared by the core.

Keys that another package implements carry ``provided_by``: ``epl config``
lists them on any installation, and setting one without its package installed is
an error that says what to install. The core implements ``pipeline.num_micro_batch``
(gradient accumulation in one stage) and the ``cluster.*`` keys itself.
"""

from __future__ import annotations

from epl.config.key import ConfigKey

COMM = "epl-comm"
MEMORY = "epl-memory"
PIPELINE = "epl-pipeline"

MANUAL_KEYS: tuple[ConfigKey, ...] = (
    # 6.1 Pipeline
    ConfigKey(
        name="pipeline.num_micro_batch",
        types=(int,),
        default=1,
        minimum=1,
        doc="Number of micro-batches per replica batch: pipeline micro-batches, or "
        "gradient accumulation steps when the model has one stage.",
    ),
    ConfigKey(
        name="pipeline.num_stages",
        types=(int, type(None)),
        default=None,
        minimum=1,
        provided_by=PIPELINE,
        doc="Number of pipeline stages to partition an unannotated model into when auto.auto_parallel is True.",
    ),
    ConfigKey(
        name="pipeline.strategy",
        types=(str,),
        default="PreferBackward",
        provided_by=PIPELINE,
        doc="Pipeline schedule, by name: PreferBackward (1F1B, like PipeDream), PreferForward (GPipe), "
        "ZeroBubble (ZB-H1: backward split into input and weight gradients), or one a plugin registers.",
    ),
    # 6.2 Gradient checkpoint
    ConfigKey(
        name="gradient_checkpoint.type",
        types=(str,),
        default="",
        choices=("", "collection", "auto"),
        provided_by=MEMORY,
        doc="Which activations to recompute: 'collection' (modules the user marks) "
        "or 'auto' (EPL chooses); '' disables checkpointing.",
    ),
    ConfigKey(
        name="gradient_checkpoint.end_taskgraph",
        types=(int,),
        default=-1,
        minimum=-1,
        provided_by=MEMORY,
        doc="Index of the last TaskGraph to apply gradient checkpointing to (-1: all).",
    ),
    ConfigKey(
        name="gradient_checkpoint.check_gradients",
        types=(bool,),
        default=False,
        provided_by=MEMORY,
        doc="Compare checkpointed gradients with plain ones once and report.",
    ),
    # 6.3 ZeRO
    ConfigKey(
        name="zero.level",
        types=(str,),
        default="",
        choices=("", "v0", "v1", "v2"),
        provided_by=MEMORY,
        doc="ZeRO level: 'v0' partitions optimizer states, 'v1' also gradients, "
        "'v2' also parameters; '' disables ZeRO.",
    ),
    # 6.4 Offload
    ConfigKey(
        name="offload.level",
        types=(str,),
        default="",
        choices=("", "v0"),
        provided_by=MEMORY,
        doc="Offload level: 'v0' keeps all weights in CPU memory; '' disables offload.",
    ),
    # 6.5 Memory-efficient AMP
    ConfigKey(
        name="amp.level",
        types=(str,),
        default="",
        choices=("", "O1"),
        provided_by=MEMORY,
        doc="Automatic mixed precision level; only 'O1' is supported; '' disables AMP.",
    ),
    ConfigKey(
        name="amp.debug_log",
        types=(bool,),
        default=False,
        provided_by=MEMORY,
        doc="Log AMP decisions (loss scale changes, skipped steps).",
    ),
    ConfigKey(
        name="amp.loss_scale",
        types=(str, int),
        default="dynamic",
        choices=("dynamic",),
        minimum=1,
        provided_by=MEMORY,
        doc="Loss scale for AMP: 'dynamic', or a fixed number.",
    ),
    ConfigKey(
        name="amp.dtype",
        types=(str,),
        default="",
        choices=("", "float16", "bfloat16"),
        provided_by=MEMORY,
        doc="Precision of the operations autocast lowers under amp.level 'O1' ('': float16 on CUDA, bfloat16 on CPU).",
    ),
    ConfigKey(
        name="amp.growth_interval",
        types=(int,),
        default=2000,
        minimum=1,
        provided_by=MEMORY,
        doc="With a dynamic loss scale: consecutive steps with finite gradients after which the scale doubles.",
    ),
    # 6.6 Optimizer
    ConfigKey(
        name="optimizer.num_apply_group",
        types=(int,),
        default=1,
        minimum=1,
        provided_by=MEMORY,
        doc="Apply the optimizer update in this many groups to lower the peak memory.",
    ),
    ConfigKey(
        name="optimizer.max_grad_norm",
        types=(float, type(None)),
        default=None,
        minimum=0,
        doc="Clip gradients to this total norm before the update (None: no clipping). With data "
        "parallelism each replica clips before the reduction unless communication.clip_after_allreduce.",
    ),
    # 6.7 Cluster
    ConfigKey(
        name="cluster.device_place_prefer_intra_node",
        types=(bool,),
        default=True,
        doc="Place one model replica's devices inside one node (row-major placement); "
        "False spreads them across nodes (column-major).",
    ),
    ConfigKey(
        name="cluster.run_visible_devices",
        types=(str,),
        default="",
        doc="Comma-separated device indices visible to this worker, usually set by "
        "the scheduler; local rank i uses the i-th of them.",
    ),
    ConfigKey(
        name="cluster.colocate_split_and_replicate",
        types=(bool,),
        default=False,
        doc="Place all TaskGraphs of a replica on the same devices instead of different ones.",
    ),
    # 6.8 Communication
    ConfigKey(
        name="communication.num_communicators",
        types=(int,),
        default=2,
        minimum=1,
        provided_by=COMM,
        doc="Number of communicators gradient buckets are reduced over, round-robin.",
    ),
    ConfigKey(
        name="communication.sparse_as_dense",
        types=(bool,),
        default=False,
        provided_by=COMM,
        doc="Turn sparse gradients into dense ones before communication.",
    ),
    ConfigKey(
        name="communication.max_splits",
        types=(int,),
        default=5,
        minimum=1,
        provided_by=COMM,
        doc="Maximum number of gradient buckets per dtype for tensor fusion.",
    ),
    ConfigKey(
        name="communication.fp16",
        types=(bool,),
        default=False,
        provided_by=COMM,
        doc="Reduce gradients in fp16.",
    ),
    ConfigKey(
        name="communication.fp16_scale",
        types=(int,),
        default=128,
        minimum=1,
        provided_by=COMM,
        doc="Scale applied to gradients before an fp16 reduction and removed after it.",
    ),
    ConfigKey(
        name="communication.clip_after_allreduce",
        types=(bool,),
        default=False,
        provided_by=COMM,
        doc="Clip gradients after the reduction instead of before it.",
    ),
    ConfigKey(
        name="communication.gradients_reduce_method",
        types=(str,),
        default="mean",
        choices=("mean", "sum"),
        provided_by=COMM,
        doc="How gradients are reduced over replicas: 'mean' or 'sum'.",
    ),
    # Extensions of EPL for PyTorch (not in the manual).
    ConfigKey(
        name="communication.backend",
        types=(str,),
        default="auto",
        choices=("auto", "torch", "cupy"),
        provided_by=COMM,
        doc="Communication library: 'torch' (torch.distributed: NCCL on CUDA, gloo on CPU), 'cupy' "
        "(CuPy's NCCL, needs CUDA and the epl-comm[cupy] extra), or 'auto' (= torch).",
    ),
    ConfigKey(
        name="communication.timeout",
        types=(float, int),
        default=600,
        minimum=1,
        provided_by=COMM,
        doc="Seconds a collective may take before it fails on every rank still waiting, naming the "
        "ranks that did not arrive.",
    ),
    # 6.9 IO
    ConfigKey(
        name="io.slicing",
        types=(bool,),
        default=False,
        doc="Give each replica its own slice of the data files.",
    ),
    ConfigKey(
        name="io.unbalanced_io_slicing",
        types=(bool,),
        default=False,
        doc="Allow replicas to get different numbers of files when slicing.",
    ),
    ConfigKey(
        name="io.drop_last_files",
        types=(bool,),
        default=False,
        doc="Partition the files evenly and drop the last ones that do not divide.",
    ),
    # 6.10 Auto parallel
    ConfigKey(
        name="auto.auto_parallel",
        types=(bool,),
        default=False,
        provided_by=PIPELINE,
        doc="Cut an unannotated model into pipeline.num_stages balanced stages (between blocks such as "
        "transformer layers, in forward's call order, cost estimated by parameter count).",
    ),
)
