"""What the planner chooses (:class:`Layout`) and what it is given (:class:`Workload`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from epl.errors import EplError

Checkpointing = Literal["none", "auto", "ops", "full"]
Schedule = Literal["GPipe", "1F1B", "interleaved", "ZeroBubble"]
ZeroLevel = Literal["none", "v0", "v1", "v2"]
CHECKPOINTING: tuple[Checkpointing, ...] = ("none", "auto", "ops", "full")
#: The checkpointing the search tries: what EPL runs (Korthikanti's ``auto`` is for published runs).
SEARCHED_CHECKPOINTING: tuple[Checkpointing, ...] = ("none", "ops", "full")
SCHEDULES: tuple[Schedule, ...] = ("GPipe", "1F1B", "interleaved", "ZeroBubble")
ZERO_LEVELS: tuple[ZeroLevel, ...] = ("none", "v0", "v1", "v2")
#: The planner's schedule names (the literature's) -> EPL's ``pipeline.strategy`` names (the manual's); the only
#: table between the two (docs/architecture.md's glossary).
EPL_SCHEDULES: dict[Schedule, str] = {
    "GPipe": "PreferForward", "1F1B": "PreferBackward", "ZeroBubble": "ZeroBubble", "interleaved": "Interleaved1F1B",
}  # fmt: skip
#: The planner's checkpointing names (the literature's) -> EPL's ``gradient_checkpoint.type``: ``ops`` (torch's
#: per-operation policy) is EPL's ``selective``, ``full`` (each block from its input) EPL's ``auto``. Korthikanti's
#: ``auto`` runs as EPL's ``selective`` too, which keeps less than it (``planner.activations``).
EPL_CHECKPOINTING: dict[Checkpointing, str] = {"none": "", "auto": "selective", "ops": "selective", "full": "auto"}
#: EPL's ``gradient_checkpoint.type`` -> the planner's name (a script's layout, ``from_plan``).
PLANNER_CHECKPOINTING: dict[str, Checkpointing] = {"": "none", "selective": "ops", "auto": "full"}


@dataclass(frozen=True)
class Layout:
    """Data x tensor x pipeline degrees, micro-batches, ZeRO level, checkpointing and schedule: one plan's layout.

    ``zero``: which of the optimizer states (v0), gradients (v1) and parameters (v2) are sharded over the data
    parallel devices. ``gradient_checkpoint``: ``auto`` recomputes the attention core and the MLP's activation
    (Korthikanti's selective recomputation), ``ops`` everything but the matrix products and attention kernels
    (torch's per-operation policy, EPL's ``selective``), ``full`` each block from its input. ``interleaved`` runs
    ``virtual_stages`` model chunks per device.
    """

    data: int
    tensor: int
    pipeline: int
    micro_batches: int
    micro_batch_size: int
    zero: ZeroLevel = "none"
    gradient_checkpoint: Checkpointing = "none"
    schedule: Schedule = "1F1B"
    virtual_stages: int = 1
    #: Megatron's sequence parallelism inside the tensor groups (``split.sequence_parallel``).
    sequence_parallel: bool = False
    #: Devices each sequence's tokens are spread over (``context.degree``), on top of data x tensor x pipeline.
    context: int = 1
    #: Blocks on each pipeline stage where they are uneven (Llama 3 gives its first and last stages one fewer);
    #: empty: the automatic partition's, at most ``ceil(L/p)`` on every stage.
    stage_layers: tuple[int, ...] = ()
    #: Interleaved 1F1B: micro-batches each chunk runs in a row (Megatron-Core's
    #: ``--microbatch-group-size-per-virtual-pipeline-stage``, Llama 3's ``N``); 0: the pipeline degree.
    interleave_group: int = 0

    def __post_init__(self) -> None:
        for name in ("data", "tensor", "pipeline", "micro_batches", "micro_batch_size", "virtual_stages", "context"):
            if getattr(self, name) < 1:
                raise EplError(f"A layout's {name} must be at least 1, not {getattr(self, name)}.")
        if self.zero not in ZERO_LEVELS or self.gradient_checkpoint not in CHECKPOINTING:
            raise EplError(f"Unknown ZeRO level {self.zero!r} or checkpointing {self.gradient_checkpoint!r}.")
        if self.schedule not in SCHEDULES:
            raise EplError(f"Unknown schedule {self.schedule!r}: one of {', '.join(SCHEDULES)}.")
        if self.stage_layers and (len(self.stage_layers) != self.pipeline or min(self.stage_layers) < 0):
            raise EplError(
                f"A layout's stage_layers {self.stage_layers} must give a count of at least 0 blocks for each of its "
                f"{self.pipeline} pipeline stages."
            )

    @property
    def devices(self) -> int:
        """Devices the layout uses: data x context x tensor x pipeline."""
        return self.data * self.context * self.tensor * self.pipeline

    def to_dict(self) -> dict[str, Any]:
        """The ``layout`` object of ``epl plan --json``."""
        data = asdict(self)
        if self.schedule != "interleaved":
            data.pop("virtual_stages")
        if not self.sequence_parallel:
            data.pop("sequence_parallel")
        if self.context == 1:
            data.pop("context")
        if self.stage_layers:
            data["stage_layers"] = list(self.stage_layers)
        else:
            data.pop("stage_layers")
        if not self.interleave_group:
            data.pop("interleave_group")
        return data

    def annotation(self) -> str:
        """The annotation to write around the model for this layout."""
        return f"with epl.split({self.tensor}):" if self.tensor > 1 else "(no annotation: data parallel)"

    def config(self) -> dict[str, Any]:
        """The ``epl.Config`` dict of this layout, in EPL's names: the schedule's ``pipeline.strategy``, ``p·v``
        stages under interleaving (``v`` a rank), ``full`` recomputation as ``gradient_checkpoint.type: auto``
        (EPL's, which recomputes each block from its input) and ``auto`` (selective) as ``selective`` (EPL's,
        which keeps each block's matrix products' and attention kernels' outputs)."""
        if self.stage_layers or self.interleave_group:
            raise EplError(
                f"The planner cannot write {self} as an epl.Config: uneven stages are cut at "
                "`pipeline.split_points`, which name the model's own modules, and EPL's interleaved schedule runs "
                "the pipeline degree's micro-batches in a row on each chunk."
            )
        config: dict[str, Any] = {}
        if self.sequence_parallel and self.tensor > 1:
            config["split.sequence_parallel"] = True
        if self.context > 1:
            config["context.degree"] = self.context
        if self.pipeline > 1:
            virtual = self.virtual_stages if self.schedule == "interleaved" else 1
            config.update({"pipeline.num_stages": self.pipeline * virtual, "auto.auto_parallel": True,
                           "pipeline.strategy": EPL_SCHEDULES[self.schedule]})  # fmt: skip
            if virtual > 1:
                config["pipeline.stages_per_rank"] = virtual
        if self.micro_batches > 1:
            config["pipeline.num_micro_batch"] = self.micro_batches
        if self.zero != "none":
            config["zero.level"] = self.zero
        if self.gradient_checkpoint != "none":
            config["gradient_checkpoint.type"] = EPL_CHECKPOINTING[self.gradient_checkpoint]
        return config


@dataclass(frozen=True)
class Workload:
    """The training job: global batch (sequences), sequence length, the compute dtype, the optimizer's states
    per parameter, whether attention saves its scores (eager) or not (SDPA/flash), the devices per node, and
    whether ZeRO v2's weight gathers are prefetched behind compute (FSDP does; EPL fetches just in time), and
    whether the head's logits are gathered whole under tensor parallelism: a transformers model given ``labels``
    computes its own loss on whole logits, so EPL all-gathers them per micro-batch (a ``loss_fn`` on the logits
    runs the vocabulary-parallel cross-entropy instead, as Megatron does)."""

    global_batch: int
    sequence: int
    dtype: str = "bf16"
    #: Tokens each query attends over, when not ``sequence`` (context parallelism: a device holds ``s/c`` tokens
    #: of sequences of ``s``); None: ``sequence``.
    attention_length: int | None = None
    optimizer_states: int = 2  # Adam's two moments
    sdpa: bool = True
    devices_per_node: int = 8
    weights_prefetched: bool = False
    gathered_logits: bool = False
    #: ZeRO as Megatron-LM's distributed optimizer and DeepSpeed's ZeRO-1 run it: the master weights and optimizer
    #: states chunked, the working weights and a gradient buffer whole all step, reduced once a step however many
    #: micro-batches; EPL's ZeRO (FSDP2, as ``epl_memory.zero`` sets it up) chunks everything and reduce-scatters
    #: and gathers each block in every micro-batch.
    zero_once_per_step: bool = False
    #: ZeRO v0/v1's weights gathered once a step and kept whole through its micro-batches, the gradients still
    #: reduce-scattered in each (FSDP not resharding between micro-batches, as Llama 3's pipeline stages run it).
    weights_gathered_once: bool = False
    #: The block's kernels are Megatron-Core's (Transformer Engine): the flash kernel's output is the output
    #: projection's input, and SwiGLU is one kernel that saves its input
    #: (:func:`epl.planner.activations.block_activations`); transformers' modules, which EPL runs, save both (False).
    fused_kernels: bool = False
    #: Bytes per weight of the gradients held under ``zero_once_per_step`` (Megatron-LM's float32 ``main_grad``: 4;
    #: DeepSpeed's fp16 ZeRO-1: 2 whole and its float32 chunk, ``4/d``).
    gradient_bytes: float = 4
    #: The loss is Megatron-LM's vocabulary-parallel cross-entropy, which computes its float32 softmax in place
    #: (8 bytes a logit at its backward); torch's cross-entropy, which EPL, transformers and torchtitan run, holds
    #: 12 (:mod:`epl.planner.memory`).
    fused_loss: bool = False
    #: A pipeline stage keeps what it sent until that micro-batch's backward (EPL's runner, DeepSpeed's); Megatron-LM
    #: and Llama 3 free the data once sent.
    keeps_stage_outputs: bool = True
    #: The model has dropout: each residual dropout keeps a mask of a byte per element.
    dropout: bool = False
    #: ``dtype`` is autocast's over float32 weights (EPL's ``amp.level: O1``, ``torch.autocast``): the products run
    #: in ``dtype``, while the weights, gradients and optimizer stay float32 with no second copy, and the
    #: activations are counted in float32. Under autocast the residual stream, the norms and the loss stay in
    #: float32, and the bf16 copies autocast keeps (of the weights, for the forward; of the products' inputs) make up
    #: what the products save in bf16: measured on a 123M Llama on 2 processes, AMP O1 bf16 held 2.865 GiB (data
    #: parallel) and 1.764 GiB (ZeRO v2), float32's prediction 2.868 and 1.792, bf16's 2.778 and 1.397
    #: (docs/planner.md).
    autocast: bool = False
    #: Under sequence parallelism, the column-parallel projections (q/k/v, the MLP's first) save their input
    #: all-gathered whole, as torch's DTensor plans run them (torchtitan's ``PrepareModuleInput`` from
    #: ``Shard(1)`` to ``Replicate()``); Megatron-LM and EPL save the shard and gather it again (False).
    saves_gathered_inputs: bool = False
    #: The blocks' linear layers are torchao's ``Float8Linear`` under its float8 tensor-parallel styles: the
    #: input is cast to float8 before its all-gather, so a gathered input saved whole is a byte an element.
    float8_linears: bool = False
    #: FSDP2 all-gathers the blocks' linear weights in float8 (torchao's ``enable_fsdp_float8_all_gather``): the
    #: weights held whole are a byte an element (the embedding, the head and the norms stay in the compute dtype).
    float8_weight_gathers: bool = False
    #: ZeRO v2 as torchtitan wraps FSDP2: the root (embedding, final norm, head) is not resharded after its forward
    #: (torch's root never is) nor is the last block (``reshard_after_forward=False``), so their weights are
    #: whole through the loss; EPL's v2 reshards every unit (False).
    keeps_root_and_last_block: bool = False
    #: The pipeline is ``torch.distributed.pipelining`` as torch 2.6 runs it (torchtitan's): a stage keeps a receive
    #: buffer per micro-batch all step, for its input and for its output's gradient; its input buffers keep the
    #: gradients it sent back until the next step; and the last stage keeps each micro-batch's output (the head's
    #: logits) until ``step`` returns them merged (torch 2.6 ``pipelining/stage.py`` ``forward_one_chunk``,
    #: ``_prepare_forward_infra``, ``clear_runtime_states``; pytorch/pytorch#159251). EPL's runner keeps none (False).
    torch_pipelining: bool = False

    @property
    def dtype_bytes(self) -> int:
        """Bytes of one activation or working weight element (float32's under autocast)."""
        return 4 if self.dtype == "fp32" or self.autocast else 2

    @property
    def mixed(self) -> bool:
        """Whether a float32 master copy of the weights is kept besides them (bf16/fp16 weights, not autocast)."""
        return self.dtype != "fp32" and not self.autocast
