"""The config keys the core implements, and which package owns every other key of the manual.

Each plugin declares its own keys through ``epl_config_keys`` (epl-comm the
``communication.*`` keys, epl-memory checkpointing, ZeRO, offload, AMP and apply
groups, epl-pipeline the pipeline schedule and automatic partition). The core keeps
:data:`KEY_OWNERS`, so that a key of a package that is not installed fails at
``epl.init`` with the package to install instead of "unknown key".
"""

from __future__ import annotations

from epl.interfaces.config_key import ConfigKey

#: Key prefix (a section with its dot, or a whole key name) -> the distribution that declares those keys.
#: The longest matching prefix wins, so ``pipeline.num_micro_batch`` (core) and ``pipeline.strategy``
#: (epl-pipeline) can share a section.
KEY_OWNERS: dict[str, str] = {
    "communication.": "epl-comm",
    "gradient_checkpoint.": "epl-memory",
    "zero.": "epl-memory",
    "offload.": "epl-memory",
    "amp.": "epl-memory",
    "optimizer.num_apply_group": "epl-memory",
    "pipeline.num_stages": "epl-pipeline",
    "pipeline.strategy": "epl-pipeline",
    "pipeline.split_points": "epl-pipeline",
    "auto.": "epl-pipeline",
}


def owner_of(name: str) -> str | None:
    """The distribution that declares config key ``name`` when the core does not (longest prefix), or None."""
    matches = [prefix for prefix in KEY_OWNERS if name == prefix or (prefix.endswith(".") and name.startswith(prefix))]
    return KEY_OWNERS[max(matches, key=len)] if matches else None


#: The keys of the manual's configuration chapter that the core implements (and EPL for PyTorch's additions).
CORE_KEYS: tuple[ConfigKey, ...] = (
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
        name="pipeline.stages_per_rank",
        types=(int,),
        default=1,
        minimum=1,
        doc="Pipeline stages each device runs (Megatron's virtual pipeline size v): S stages run on S / v "
        "devices per replica position, stage s on the (s mod S/v)-th, so that pipeline.strategy="
        "'Interleaved1F1B' shrinks the bubble.",
    ),
    ConfigKey(
        name="optimizer.max_grad_norm",
        types=(float, type(None)),
        default=None,
        minimum=0,
        infinite_allowed=True,
        doc="Clip gradients to this total norm before the update (None: no clipping); engine.grad_norm is "
        "then the norm before clipping. inf computes the norm without clipping (for logging). With data "
        "parallelism each replica clips before the reduction unless communication.clip_after_allreduce.",
    ),
    ConfigKey(
        name="optimizer.raise_after_skips",
        types=(int, type(None)),
        default=20,
        minimum=1,
        doc="A step whose loss or gradients are NaN or Inf on any rank is skipped on every rank (no update, no LR "
        "scheduler step; engine.skipped_steps counts them, AMP's overflows included). After this many skipped "
        "steps in a row, engine.step raises an EplError naming the step and the ranks where they began (None: "
        "never raise).",
    ),
    ConfigKey(
        name="optimizer.check_finite_gradients",
        types=(bool,),
        default=True,
        doc="Read every gradient for NaN or Inf before the update where nothing else does (without AMP, whose loss "
        "scaler checks them, and without optimizer.max_grad_norm, whose norm is checked): one pass over each "
        "rank's gradients. False: check only the losses there (docs/reliability.md gives the cost).",
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
    # 6.9 IO
    ConfigKey(
        name="io.slicing",
        types=(bool,),
        default=False,
        doc="Give each replica its own slice of a list of data files (epl.io.shard of file names); samples and "
        "datasets are always shared out.",
    ),
    ConfigKey(
        name="model.meta_init",
        types=(bool,),
        default=False,
        doc="Build the model without memory: every parameter registered between epl.init and epl.parallelize is "
        "put on the meta device (buffers keep their values), and epl.parallelize gives values only to what each "
        "rank keeps, from the model's own initialisation, one layer at a time (docs/giant-models.md). The same as "
        "writing `with torch.device('meta'):` around the construction, for scripts left as they are. epl plan "
        "always builds so.",
    ),
    ConfigKey(
        name="io.check_batches",
        types=(bool,),
        default=True,
        doc="Check that the ranks of one replica (split, pipeline stages), which must all pass the replica's "
        "batch to engine.step, were given the same one (a fingerprint all-gathered over the replica, compared "
        "before the forward): a difference, such as a sampler keyed by the global rank or batches of different "
        "sizes, is an error naming the ranks (and their sizes). Each of the first 10 steps is checked, then every "
        "io.check_batches_every-th.",
    ),
    ConfigKey(
        name="io.check_batches_every",
        types=(int,),
        default=50,
        minimum=1,
        doc="After the first 10 steps, check the batch every this many steps (1: every step; the check costs one "
        "all-gather of a few numbers, docs/benchmarks.md).",
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
    ConfigKey(
        name="split.sequence_parallel",
        types=(bool,),
        default=False,
        doc="Megatron's sequence parallelism inside epl.split: norms, dropout and residual adds run on each "
        "device's share of the tokens, each region's all-reduce becomes an all-gather before it and a "
        "reduce-scatter after it (docs/split.md).",
    ),
    # EPL for PyTorch: context parallelism (docs/context.md)
    ConfigKey(
        name="context.degree",
        types=(int,),
        default=1,
        minimum=1,
        doc="Context parallelism: each sequence's tokens are spread over this many devices; a replica is this "
        "many lanes, each laid out as its TaskGraphs say; attention crosses them (context.mode).",
    ),
    ConfigKey(
        name="context.verify",
        types=(bool,),
        default=True,
        doc="Before sharding, run the model once on a few tokens as the context devices would and as one process "
        "does, and refuse it when they differ (docs/context.md). Needs the model's values (not built on meta).",
    ),
    ConfigKey(
        name="context.presliced",
        types=(bool,),
        default=False,
        doc="The data loader gives each rank its own share of every sequence (epl.context.my_share cuts it), with "
        "global position_ids and shift_labels instead of labels; EPL then slices nothing (docs/context.md).",
    ),
    ConfigKey(
        name="context.mode",
        types=(str,),
        default="ring",
        choices=("ring", "allgather", "ulysses"),
        doc="How attention crosses the context devices: 'ring' (keys and values passed round), 'allgather' "
        "(gathered by every device, Llama 3's) or 'ulysses' (all-to-all over the heads; the heads must divide).",
    ),
    # EPL for PyTorch: the planner's job, for auto.auto_parallel: "plan" (docs/planner.md)
    ConfigKey(
        name="planner.global_batch_size",
        types=(int, type(None)),
        default=None,
        minimum=1,
        doc='Sequences per step over all replicas, for the layout auto.auto_parallel: "plan" chooses.',
    ),
    ConfigKey(
        name="planner.sequence_length",
        types=(int, type(None)),
        default=None,
        minimum=1,
        doc='Tokens per sequence, for the layout auto.auto_parallel: "plan" chooses.',
    ),
    ConfigKey(
        name="planner.device",
        types=(str,),
        default="",
        doc='The device profile auto.auto_parallel: "plan" plans for: a name `epl plan --device` takes, or a JSON '
        "file (`epl calibrate --out FILE`); empty: the profile of this machine's GPU when the planner knows it.",
    ),
    # EPL for PyTorch: the fit check before launch (docs/planner.md)
    ConfigKey(
        name="fit_check.enabled",
        types=(bool, str),
        default="auto",
        choices=("auto",),
        doc="Predict the peak memory of each device before the first step (epl.parallelize, or the first "
        "engine.step when the micro-batch is not given) and warn, or refuse (fit_check.action), when it does not "
        "fit. 'auto': on when the model trains on an accelerator (CUDA or another non-CPU device), off on CPU.",
    ),
    ConfigKey(
        name="fit_check.action",
        types=(str,),
        default="warn",
        choices=("warn", "refuse"),
        doc="What the fit check does when the predicted peak does not fit: 'warn' logs a warning (rank 0) and "
        "goes on; 'refuse' raises an EplError on every rank before the first step.",
    ),
    ConfigKey(
        name="fit_check.micro_batch_size",
        types=(int, type(None)),
        default=None,
        minimum=1,
        doc="Rows (sequences) per micro-batch, for the fit check; with fit_check.sequence_length it runs in "
        "epl.parallelize. None: read from the first engine.step's batch (its input_ids, or first tensor).",
    ),
    ConfigKey(
        name="fit_check.sequence_length",
        types=(int, type(None)),
        default=None,
        minimum=1,
        doc="Tokens per sequence, for the fit check (see fit_check.micro_batch_size). None: read from the first "
        "engine.step's batch.",
    ),
    ConfigKey(
        name="fit_check.device",
        types=(str,),
        default="",
        doc="The device the fit check judges against: a name `epl plan --device` takes, or a JSON profile file. "
        "Empty: the accelerator's memory as torch reports it (the closest named profile's other figures); on CPU "
        "the host's memory shared by its processes.",
    ),
    # EPL for PyTorch: torch.compile (docs/compile.md)
    ConfigKey(
        name="compile.enabled",
        types=(bool,),
        default=False,
        doc="Compile each repeated block (a transformer's layers; the model or its pipeline stages whole when it "
        "has none) with torch.compile after EPL's transforms, as torchtitan does. What a backend cannot compile "
        "runs eager, named in a warning and in engine.compile_report.",
    ),
    ConfigKey(
        name="compile.backend",
        types=(str,),
        default="inductor",
        doc="The torch.compile backend for compile.enabled (torch._dynamo.list_backends(); aot_eager traces and "
        "differentiates without generating code).",
    ),
    ConfigKey(
        name="compile.mode",
        types=(str,),
        default="",
        doc='The inductor mode for compile.enabled ("default", "reduce-overhead", "max-autotune", ...); empty: '
        "torch.compile's default.",
    ),
    # EPL for PyTorch: float8 training through torchao (docs/float8.md)
    ConfigKey(
        name="float8.enabled",
        types=(bool,),
        default=False,
        doc="Train the model's linear layers in float8 through torchao's convert_to_float8_training (pip install "
        "epl-core[float8]), before ZeRO and compile. The embeddings, the output head, the first and the last "
        "repeated block and any linear whose dimensions are not multiples of 16 stay in high precision.",
    ),
    ConfigKey(
        name="float8.recipe",
        types=(str,),
        default="tensorwise",
        choices=("tensorwise", "rowwise"),
        doc="torchao's float8 recipe: one scale per tensor (tensorwise) or per row (rowwise).",
    ),
    ConfigKey(
        name="float8.exclude",
        types=(list,),
        default=[],
        doc="Patterns (fnmatch) of module names that stay in high precision, added to the default exclusions; a "
        "pattern matches a module and everything below it.",
    ),
    ConfigKey(
        name="float8.all_gather",
        types=(bool,),
        default=True,
        doc="Under zero.level on several processes, all-gather the weights in float8 (torchao's "
        "enable_fsdp_float8_all_gather; tensorwise recipe only).",
    ),
)
