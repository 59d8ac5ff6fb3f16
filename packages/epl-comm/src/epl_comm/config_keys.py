"""The config keys this plugin declares (``epl_config_keys``): the manual's communication keys (6.8)
and EPL for PyTorch's backend and timeout.
"""

from __future__ import annotations

from epl.plugin_api import ConfigKey

KEYS: tuple[ConfigKey, ...] = (
    # 6.8 Communication
    ConfigKey(
        name="communication.num_communicators",
        types=(int,),
        default=2,
        minimum=1,
        doc="Number of communicators gradient buckets are reduced over, round-robin.",
    ),
    ConfigKey(
        name="communication.sparse_as_dense",
        types=(bool,),
        default=False,
        doc="Turn sparse gradients into dense ones before communication.",
    ),
    ConfigKey(
        name="communication.max_splits",
        types=(int,),
        default=5,
        minimum=1,
        doc="Number of gradient buckets per dtype for tensor fusion (more where one would exceed "
        "communication.bucket_size_mb).",
    ),
    ConfigKey(
        name="communication.bucket_size_mb",
        types=(int, float),
        default=25,
        minimum=0.001,
        doc="Most MiB of gradients one bucket of data parallelism holds where communication.max_splits buckets "
        "would hold more (torch DDP's bucket_cap_mb).",
    ),
    ConfigKey(
        name="communication.fp16",
        types=(bool,),
        default=False,
        doc="Reduce gradients in fp16.",
    ),
    ConfigKey(
        name="communication.fp16_scale",
        types=(int,),
        default=128,
        minimum=1,
        doc="Scale applied to gradients before an fp16 reduction and removed after it.",
    ),
    ConfigKey(
        name="communication.clip_after_allreduce",
        types=(bool,),
        default=False,
        doc="Clip gradients after the reduction instead of before it.",
    ),
    ConfigKey(
        name="communication.gradients_reduce_method",
        types=(str,),
        default="mean",
        choices=("mean", "sum"),
        doc="How gradients are reduced over replicas: 'mean' or 'sum'.",
    ),
    # Extensions of EPL for PyTorch (not in the manual).
    ConfigKey(
        name="communication.backend",
        types=(str,),
        default="auto",
        choices=("auto", "torch", "cupy"),
        doc="Communication library: 'torch' (torch.distributed: NCCL on CUDA, gloo on CPU), 'cupy' "
        "(CuPy's NCCL, needs CUDA and the epl-comm[cupy] extra), or 'auto' (= torch).",
    ),
    ConfigKey(
        name="communication.check_steps",
        types=(bool,),
        default=True,
        doc="Check every step that the ranks averaging gradients are at the same step on the same data (four "
        "int64 gathered during the step: the step and the epl.io sampler's position): a difference, such as a "
        "rank that skipped engine.step for a batch, is an error naming each rank's step or position.",
    ),
    ConfigKey(
        name="communication.timeout",
        types=(float, int),
        default=600,
        minimum=1,
        doc="Seconds a collective may take before it fails on every rank still waiting, naming the "
        "ranks that did not arrive.",
    ),
)
