"""A layout's memory per device at its peak, as named terms that add up to the peak.

Each pipeline stage is evaluated (the first and the last, or every stage where ``Layout.stage_layers`` makes them
uneven); the stage whose peak is highest is the one reported. A stage's peak is what it holds all step plus the
largest of its moments:

- **held all step**: ``parameters`` (the weights in the compute dtype and, in bf16/fp16, a float32 master copy;
  under ZeRO v0-v2 on FSDP2 only each weight's chunk over the data devices, the float32 master in bf16; under
  Megatron-LM's distributed optimizer or DeepSpeed's ZeRO-1, ``Workload.zero_once_per_step``, the working weights
  whole and the master chunked) and ``optimizer`` (the optimizer's float32 states of what the device updates);
- **held once the backward made them**: ``gradients`` (float32, a chunk under FSDP2's ZeRO; whole in
  ``Workload.gradient_bytes`` under ``zero_once_per_step``). A step begins with ``zero_grad(set_to_none=True)``,
  so the first micro-batch's backward finds none, unless data parallelism's flat buckets (or a distributed
  optimizer's buffer) keep them; a later micro-batch's backward finds them all, with one micro-batch fewer in
  flight where the schedule had all of them in flight (GPipe). Each moment of the backward is evaluated both ways;
- **the start of the backward**: ``activations`` (what the stage's blocks saved for the micro-batches the schedule
  keeps in flight, :mod:`epl.planner.activations`); ``stage_outputs`` (what a stage sent on, kept until its
  backward: EPL's runner and DeepSpeed's keep it, Megatron-LM frees its data, ``Workload.keeps_stage_outputs``);
  on the last stage ``logits`` (the float32 log-softmax the loss saved for each other micro-batch in flight, and
  this one's float32 gradient, held through the head's backward); ``block_backward`` (one block's backward working
  set: its whole activations again, made by recomputation under checkpointing or held by autograd without it); and
  what data parallelism holds to communicate: ``gathered_weights`` (ZeRO: the weights whole while blocks compute,
  every block's under v0/v1, the largest block's under v2, two where the next one's gather is prefetched),
  ``gradient_buffers`` (ZeRO: the largest block's gradients whole and the reduce-scatter's buffer; without ZeRO a
  fresh gradient before it moves into its flat bucket or is added to an earlier micro-batch's: the head's on the
  last stage, a block's largest elsewhere), and ``accumulated_gradients`` (ZeRO v0 over micro-batches and
  zero-bubble schedules: every gradient whole, float32, until the last micro-batch);
- **the loss's backward**, on the last stage: ``logits``, torch's cross-entropy's float32 log-softmax of each
  micro-batch in flight and this one's float32 gradients in and out (Megatron-LM's fused loss: 8 bytes a logit
  for this one, ``Workload.fused_loss``), with the activations, ``head_input`` (the head's input, saved whole
  for its backward) and ZeRO v0/v1's whole weights (with ``Workload.keeps_root_and_last_block``, v2's root and
  last block, as torchtitan wraps FSDP2);
- **the end of the forward**, on the last stage under tensor parallelism with ``Workload.gathered_logits``:
  ``logits``, the all-gather's working set, ``(3 + 2/t)`` logits-sized tensors in the compute dtype;
- **the end of the backward** under ZeRO v0/v1 on one stage: the root's embedding and head weights gathered
  (``gathered_weights``) and their gradients twice (``gradient_buffers``), the activations gone;
- **the optimizer step**: ``optimizer_temporary``, a float32 tensor the size of what it updates (torch's foreach
  Adam: the square roots' denominators), the activations gone.

Settings for runs EPL does not make (``Workload``, all off by default): ``saves_gathered_inputs`` (torch's DTensor
sequence parallelism saves the projections' gathered input whole: in ``block_backward``, and in ``activations``
without full recomputation), ``float8_linears`` (that gathered input in float8), ``float8_weight_gathers`` (FSDP2's
float8 all-gather: the blocks' linear weights held whole in a byte an element), ``torch_pipelining`` (torch's
pipelining: ``receive_buffers``, a receive buffer per micro-batch for the stage's input and its output's gradient
and the input gradients sent back, kept all step; ``returned_outputs``, the last stage's output of each
micro-batch, kept for ``step`` to return; with FSDP2, the root's reduce-scatter at the end of the backward, and
under interleaved 1F1B one chunk's gradients whole at a time).

Checked against resident memory per rank in ``nox -s planner-memory`` (benchmarks/planner_memory.py: every layout
the zoo runs, within 15%; docs/planner.md, "Measured here") and tests/planner/test_measured_memory.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from epl.planner.activations import block_activations, micro_batches_in_flight
from epl.planner.communication import (
    largest_unit,
    root_unit,
    stage_blocks,
    stage_root_weights,
    stages_to_check,
    updated_weights,
    weights_per_device,
    zero_accumulates_whole,
    zero_holds_whole_stage,
    zero_root_holds_ends,
)
from epl.planner.layout import Layout, Workload
from epl.planner.shape import ModelShape

#: What each term of :attr:`MemoryBreakdown.terms` is, for ``epl plan``'s lines and docs/planner.md.
TERM_MEANINGS: dict[str, str] = {
    "parameters": "the weights held (the float32 master copy besides in bf16/fp16; ZeRO's chunk)",
    "gradients": "float32 gradients held (ZeRO's chunk; none before the first backward makes them, unless data "
    "parallelism's buckets keep them)",
    "optimizer": "the optimizer's float32 states",
    "activations": "saved for backward by the stage's blocks, for the micro-batches in flight",
    "logits": "the loss's logits-sized tensors: the float32 log-softmax it saved for each micro-batch in flight and, "
    "at its backward, the gradients in and out (Megatron's fused loss: its float32 softmax and the gradient); under "
    "tensor parallelism at the end of the forward, the logits' all-gather's working set",
    "stage_outputs": "the stage's outputs kept until their backward, one per micro-batch in flight",
    "head_input": "the head's input, whole, saved for its backward",
    "receive_buffers": "torch's pipelining: a receive buffer per micro-batch for the stage's input and its output's "
    "gradient, and the input gradients sent back, kept until the next step",
    "returned_outputs": "torch's pipelining: the last stage's output of each micro-batch, kept for the step to return",
    "block_backward": "one block's backward working set (its activations recomputed, or held by autograd)",
    "gathered_weights": "weights gathered whole by ZeRO",
    "gradient_buffers": "gradients whole before their reduction and the reduction's buffer",
    "accumulated_gradients": "every gradient whole until the last micro-batch's reduction",
    "optimizer_temporary": "the optimizer step's float32 temporary (foreach Adam's denominators)",
}
#: The moments of a step a peak can be at (``MemoryBreakdown.moment``, ``--json``'s ``peak_moment``); the loss's
#: backward and the end of the forward (where the logits are gathered) on the last stage only.
BACKWARD_START, LOSS_MOMENT, FORWARD_END = "start of the backward", "the loss's backward", "end of the forward"
BACKWARD_END, OPTIMIZER_STEP = "end of the backward", "optimizer step"
MOMENTS = (BACKWARD_START, LOSS_MOMENT, FORWARD_END, BACKWARD_END, OPTIMIZER_STEP)


@dataclass(frozen=True)
class MemoryBreakdown:
    """The peak of the most loaded device: its pipeline ``stage``, the ``moment`` of the step, and ``terms`` (bytes
    by name, :data:`TERM_MEANINGS`) that add up to :attr:`peak`."""

    stage: int
    moment: str
    terms: dict[str, float]
    #: What the stage's blocks saved at the start of its backward (a term only when that is the peak's moment).
    activations: float = 0.0
    #: The gradients the device holds once its backward made them (the ``gradients`` term: what is held at the
    #: peak's moment, none at the first micro-batch's backward where the step's start freed them).
    gradients: float = 0.0

    @property
    def peak(self) -> float:
        """Bytes at the peak: the sum of the terms."""
        return sum(self.terms.values())

    def largest(self) -> tuple[str, float]:
        """The largest term and its bytes."""
        name = max(self.terms, key=self.terms.__getitem__)
        return name, self.terms[name]


def memory_breakdown(shape: ModelShape, layout: Layout, workload: Workload) -> MemoryBreakdown:
    """The peak of the most loaded device of ``layout`` (the module's documentation says what is counted)."""
    return max(
        (stage_breakdown(shape, layout, workload, stage) for stage in stages_to_check(layout)),
        key=lambda breakdown: breakdown.peak,
    )


def losses_in_flight(layout: Layout) -> float:
    """Micro-batches whose loss waits for its backward on the last stage: every one under GPipe, ``p`` under EPL's
    ZeroBubble, one under 1F1B and interleaved 1F1B (the last chunk runs each backward right after its forward)."""
    p, m = layout.pipeline, layout.micro_batches
    if p == 1:
        return 1.0
    return float(m if layout.schedule == "GPipe" else min(m, p) if layout.schedule == "ZeroBubble" else 1)


def context_as_data(layout: Layout, workload: Workload) -> tuple[Layout, Workload]:
    """Context parallelism over ``c`` devices as the planner counts it: each device a data-parallel copy (gradients
    and ZeRO over data x context devices) holding ``s/c`` tokens of each of its replica's sequences, attending over
    all ``s`` and saving no score matrix (EPL's context attention); the same layout without context parallelism."""
    c = layout.context
    if c == 1:
        return layout, workload
    return replace(layout, data=layout.data * c, context=1), replace(
        workload, global_batch=workload.global_batch * c, sequence=workload.sequence // c,
        attention_length=workload.sequence, sdpa=True,
    )  # fmt: skip


def stage_breakdown(shape: ModelShape, layout: Layout, workload: Workload, stage: int) -> MemoryBreakdown:
    """The peak of a device of pipeline ``stage`` (0 to ``layout.pipeline - 1``); of a context-parallel layout, as
    :func:`context_as_data` counts it."""
    layout, workload = context_as_data(layout, workload)
    t, p, d, b = layout.tensor, layout.pipeline, layout.data, layout.micro_batch_size
    s, e = workload.sequence, workload.dtype_bytes
    sequence_parallel = layout.sequence_parallel and t > 1
    blocks = stage_blocks(shape, layout, stage)
    weights = weights_per_device(shape, layout, stage)
    master = 4 if workload.mixed else 0
    updated = updated_weights(shape, layout, stage)
    zero = layout.zero in ("v0", "v1", "v2")
    # Megatron-LM's distributed optimizer and DeepSpeed's ZeRO-1 (zero_once_per_step) chunk the master weights and
    # the states only: the working weights and a whole gradient buffer are held all step
    chunked = zero and not workload.zero_once_per_step
    # FSDP2's float8 all-gather (Workload.float8_weight_gathers; torchao fsdp_utils.py,
    # WeightWithDynamicFloat8CastTensor.fsdp_post_all_gather returns a float8 tensor): a block's linear weights are
    # held whole in a byte an element, its norms in the compute dtype
    layer_linear = (shape.layer_parameters() - 2 * shape.hidden) / t
    float8_saved = (e - 1) * layer_linear if workload.float8_weight_gathers else 0.0  # bytes a block whole saves
    whole_bytes = weights * e - blocks * float8_saved  # the stage's working weights, whole
    held = {
        "parameters": weights * (master or e) / d if chunked else weights * e + weights * master / (d if zero else 1),
        "optimizer": updated * 4 * workload.optimizer_states,
    }
    if not chunked:  # the working weights whole
        held["parameters"] -= blocks * float8_saved
    gradients = weights * 4 / d if chunked else weights * workload.gradient_bytes
    # The step begins with zero_grad(set_to_none=True) (EPL's StepUpdate.begin, torch's default), which frees the
    # gradients, and the first micro-batch's backward makes them anew: only plain data parallelism's flat buckets
    # (each gradient a view into them) and a distributed optimizer's whole buffer outlive it. Measured: ZeRO v0-v2
    # and split(2) on 2 ranks hold none at the first backward, GPipe's last stage all of them from its second.
    persistent = not chunked and (d > 1 or zero)

    sdpa, fused = workload.sdpa, workload.fused_kernels
    dropout = workload.dropout
    block = block_activations(shape, b, s, dtype_bytes=e, sdpa=sdpa, dropout=dropout, fused=fused,
                              checkpoint=layout.gradient_checkpoint)  # fmt: skip
    whole = block_activations(shape, b, s, dtype_bytes=e, sdpa=sdpa, dropout=dropout, fused=fused)
    whole_block = whole.per_device(t, sequence_parallel)
    h = shape.hidden
    # DTensor sequence parallelism (Workload.saves_gathered_inputs; torchtitan @9dec370a parallelize_llama.py:177,
    # 186, PrepareModuleInput from Shard(1) to Replicate()) saves the q/k/v and the MLP's first projections' input
    # gathered whole where the count above has it on s/t tokens; float8 linears gather it in float8 (torchao's
    # PrepareFloat8ModuleInput, and matmul_with_hp_or_float8_args saves the argument it is given)
    gathered_inputs = 0.0
    if workload.saves_gathered_inputs and sequence_parallel:
        gathered_inputs = 2 * b * s * h * ((1 if workload.float8_linears else e) - e / t)
    whole_block += gathered_inputs
    block_saved = block.per_device(t, sequence_parallel)
    if layout.gradient_checkpoint in ("none", "auto"):  # full keeps the block's input only, ops the products
        block_saved += gathered_inputs
    # gradient accumulation (one stage, several micro-batches) keeps one micro-batch at a time
    in_flight = micro_batches_in_flight(layout, stage) if p > 1 else 1.0
    m = layout.micro_batches
    last = stage == p - 1
    vocab_share = shape.vocab if workload.gathered_logits else shape.vocab / t
    # torch's cross-entropy on the head's output (transformers, torchtitan) saves its float32 log-softmax for each
    # micro-batch in flight, and at its backward holds the float32 gradients in and out besides; the head's output
    # is freed with the model's outputs before the backward (EPL's runners; torchtitan deletes it). Measured at the
    # log-softmax's backward: 3 logits-sized float32 tensors of the micro-batch, and 1 more per micro-batch in
    # flight besides (GPipe's and ZeroBubble's last stage). On a vocabulary shard, torch's loss_parallel (DTensor:
    # torchtitan) holds 4 at its backward (the log-softmax, its exp, the gradient zeroed and the sum; measured on 2
    # ranks); Megatron's fused cross-entropy computes its float32 softmax in place and reuses it for the gradient
    # (8 bytes a logit).
    logit = b * s * vocab_share * 4  # one float32 logits-sized tensor of a micro-batch
    sharded_loss = t > 1 and not workload.gathered_logits
    at_loss = 8 * b * s * vocab_share if workload.fused_loss else (4 if sharded_loss else 3) * logit
    # Tensor parallelism with gathered logits (epl.sharding.collectives._gather, at the end of the forward): the
    # shard, its copy moved to the front, the all-gather's buffer, their concatenation and its contiguous copy,
    # (3 + 2/t) logits in the compute dtype at once (measured: 4 on split(2)).
    gather = (3 + 2 / t) * b * s * shape.vocab * e if workload.gathered_logits and t > 1 else 0.0
    # The head saves its input for its backward, whole: EPL's sequence parallelism gathers the last block's output
    # before the final norm (epl.sharding.sequence), torchtitan's head gathers its input (@9dec370a
    # parallelize_llama.py:138-139, ColwiseParallel(input_layouts=Shard(1))); freed by the head's backward
    head_input = b * s * h * e if last else 0.0
    boundary = b * s * h * e / (t if sequence_parallel else 1)  # a micro-batch's stage output, what a stage sends
    # FSDP2 under torch's pipelining: gradients accumulated whole until a stage's last micro-batch, then reduced
    fsdp_under_torch_pipeline = workload.torch_pipelining and p > 1 and zero and d > 1

    def pipelining_buffers(flight: float, later: bool) -> dict[str, float]:
        """What torch's pipelining holds besides (``Workload.torch_pipelining``) while ``flight`` micro-batches are
        in flight; ``later``: at the step's last micro-batch, when every other one's gradients were sent back."""
        if not workload.torch_pipelining or p == 1:
            return {}
        v = layout.virtual_stages if layout.schedule == "interleaved" else 1
        inputs = (v - (stage == 0)) * m  # the first stage's first chunk receives none
        output_gradients = (v - last) * m  # nor the last stage's last chunk
        # an input buffer in flight (``flight`` counts in the stage's blocks: chunk micro-batches / v) is the first
        # block's input, counted in the activations
        idle = inputs - min(flight * v, inputs)
        held = (idle + output_gradients + (inputs - v if later else 0)) * boundary
        outputs = (m if later else 1) * b * s * vocab_share * e if last else 0.0
        return {"receive_buffers": held, "returned_outputs": outputs}

    def backward_moments(flight: float, grads: float, later: bool) -> list[tuple[str, dict[str, float]]]:
        """The backward's moments of a micro-batch while ``flight`` are in flight and ``grads`` bytes of gradients
        are held; ``later``: an earlier micro-batch's backward made them."""
        outputs = 0.0
        if workload.keeps_stage_outputs and not last:  # EPL's runner keeps what it sent until its backward
            outputs = flight * boundary
        saved = {"gradients": grads, "activations": blocks * block_saved * flight,
                 "stage_outputs": outputs, **pipelining_buffers(flight, later)}  # fmt: skip
        # the log-softmax the loss saved for the others in flight
        others = (min(losses_in_flight(layout), flight) - 1) * logit if last else 0.0
        start = {**saved, "logits": others + logit if last else 0.0, "block_backward": whole_block}
        loss = {**saved, "logits": others + at_loss, "head_input": head_input}
        forward_end = {**saved, "logits": others + gather, "head_input": head_input}
        if chunked and d > 1:
            # FSDP2 (epl_memory.zero): v0 and v1 keep every block's weights whole from its forward to the end of its
            # backward, so the stage's at the start of backward; v2 one block's at a time. A block's gradients are
            # whole from its backward until they are reduce-scattered, with the reduce-scatter's buffer (the
            # previous block's released as this one's is made), float32, of the largest block.
            unit = largest_unit(shape, layout)
            whole_weights = layout.zero in ("v0", "v1") or zero_holds_whole_stage(layout)
            layer = layer_linear + 2 * h
            units = 2 if workload.weights_prefetched else 1
            if whole_weights:
                start["gathered_weights"] = whole_bytes
            else:  # float8 only where the largest unit is a block
                start["gathered_weights"] = units * (unit * e - (float8_saved if unit <= layer else 0.0))
            start["gradient_buffers"] = 2 * unit * 4
            if whole_weights:  # v2 releases the head's weights after its forward
                loss["gathered_weights"] = forward_end["gathered_weights"] = whole_bytes
            elif workload.keeps_root_and_last_block and last:
                # torchtitan's v2 (@9dec370a parallelize_llama.py:333, 339): the root, which holds the embedding,
                # the final norm and the head, is not resharded after its forward (torch's FSDPState._lazy_init
                # sets its post_forward_mesh_info to None), nor is the last block: both whole through the loss
                kept = (stage_root_weights(shape, layout, stage) + layer) * e - float8_saved
                loss["gathered_weights"] = forward_end["gathered_weights"] = kept
            if later and zero_accumulates_whole(layout):  # whole until the last micro-batch: no chunk yet
                for moment in (start, loss, forward_end):
                    moment["gradients"], moment["accumulated_gradients"] = 0.0, weights * 4
        elif not zero and (d > 1 or later):
            # each gradient is a view into its flat bucket, or is added to the one an earlier micro-batch made: a
            # fresh one is held besides until it moves there, while the activations are: the head's on the last
            # stage (its backward comes first), else a block's largest (the embedding's comes last, when the
            # micro-batch's activations are gone; measured on 2 stages: 1F1B, GPipe, ZeroBubble's first stage)
            fresh = shape.vocab * shape.hidden if last else shape.hidden * max(shape.ffn, shape.hidden)
            start["gradient_buffers"] = fresh / t * 4
        moments = [(BACKWARD_START, start)]
        if last:
            moments.append((LOSS_MOMENT, loss))
            if gather:
                moments.append((FORWARD_END, forward_end))
        return moments

    backward_gradients = gradients
    if fsdp_under_torch_pipeline and layout.schedule == "interleaved" and m <= p:
        # torch's interleaved 1F1B in one round runs every micro-batch's backward of a chunk before the next chunk's
        # (schedules.py ``backward_stage_index``), and FSDP2 reduce-scatters a chunk's gradients after its last: one
        # chunk's are whole at a time, the others' chunks (or none yet)
        v = layout.virtual_stages
        backward_gradients = gradients / v * (1 + (v - 1) / d)
    candidates = backward_moments(in_flight, backward_gradients if persistent else 0.0, later=False)
    if m > 1:  # a later micro-batch's backward: the gradients made, one fewer in flight where all were
        candidates += backward_moments(min(in_flight, m - 1), backward_gradients, later=True)
    end_of_backward: dict[str, float] = {"gradients": gradients}
    if chunked and d > 1 and zero_root_holds_ends(layout):
        # each block resharded after its backward: only the root's weights whole
        root = root_unit(shape, layout)
        end_of_backward.update({"gathered_weights": root * e, "gradient_buffers": 2 * root * 4})
    step_gradients = gradients
    if fsdp_under_torch_pipeline:
        # FSDP2 under torch's pipelining reduce-scatters every unit of the stage after its last micro-batch's
        # backward, the root first (torch's pipelining ``backward_maybe_with_nosync`` calls each state's
        # ``post_backward``): the root's gradients whole are copied into the reduce-scatter's float32 input while
        # every other gradient is still whole, and its chunk is made; the step then finds the chunks only.
        # Measured (benchmarks/recipe_memory.py): the first stage's peak with an embedding of a third of its weights.
        first_unit = stage_root_weights(shape, layout, stage) or layer_linear + 2 * h
        end_of_backward["gradient_buffers"] = first_unit * 4 * (1 + 1 / d)
        step_gradients = gradients / d
    step = {"gradients": step_gradients,
            "optimizer_temporary": updated * 4 if workload.optimizer_states >= 2 else 0.0}  # fmt: skip
    moments = [*candidates, (BACKWARD_END, end_of_backward), (OPTIMIZER_STEP, step)]
    moment, extra = max(moments, key=lambda item: sum(item[1].values()))
    terms = {"parameters": held["parameters"], "gradients": extra["gradients"], "optimizer": held["optimizer"]}
    terms.update({name: size for name, size in extra.items() if size and name != "gradients"})
    return MemoryBreakdown(stage, moment, terms, candidates[0][1]["activations"], gradients)
