"""EPL's Ulysses context parallelism against Accelerate's Ulysses (DeepSpeed's ``UlyssesSPAttentionHF`` underneath),
on 2 processes (gloo, CPU): the same model, the same processes, the same sequence, the same optimizer.

Model: transformers' ``LlamaForCausalLM`` (hidden 256, 4 layers, 8 query heads over 2 key/value heads, vocabulary
1024, float32, ``sdpa``, ``use_cache=False``), built twice from one seed; batch 1 x ``SEQUENCE`` tokens; AdamW
(lr 1e-3, weight decay 0.01), plain float32, no gradient clipping on either side.

- **EPL**: ``context.degree`` 2, ``context.mode`` ``"ulysses"``; every rank passes the whole sequence with
  ``labels`` and EPL keeps its share (chunks ``r`` and ``3-r`` of 4), shifts the labels whole, and weighs the loss
  by tokens over the context group.
- **Accelerate**: ``ParallelismConfig(sp_size=2, sp_backend="deepspeed", sp_handler=DeepSpeedSequenceParallelConfig(
  sp_seq_length_is_variable=True, sp_attn_implementation="sdpa"))`` with a DeepSpeed plugin (ZeRO stage 0, no
  mixed precision) and ``accelerator.prepare(model, optimizer)``: Accelerate registers DeepSpeed's Ulysses attention
  in place of ``sdpa`` and hands DeepSpeed the torch AdamW. The training loop is Accelerate's own recipe
  (docs/source/concept_guides/sequence_parallelism.md and examples/alst_ulysses_sequence_parallelism/sp-alst.py of
  accelerate 1.15): each rank feeds its contiguous half of the sequence with the global ``position_ids`` and the
  labels shifted on the whole sequence (what ``UlyssesSPDataLoaderAdapter`` would hand it; sliced here, so that no
  loader's gathers are timed), the model's ``loss_function`` on its logits and ``shift_labels``, the losses combined
  over the sequence-parallel group by a differentiable all-gather weighted by labelled tokens, then
  ``accelerator.backward`` (DeepSpeed's backward and step) and ``optimizer.step()``. The group comes from
  DeepSpeed's ``parallel_state_sp`` (Accelerate builds no ``sp`` device mesh under the DeepSpeed backend).

Route: Accelerate itself, on CPU. ``Accelerator(cpu=True)`` turns DeepSpeed off, so the ranks run with
``DS_ACCELERATOR=cpu`` (DeepSpeed's CPU accelerator) and gloo; both sides share torch.distributed's default group
(``epl.init`` joins first and Accelerate, then DeepSpeed, find it made), each making its own subgroups, in the same
processes. DeepSpeed replaces transformers' ``sdpa`` attention for the whole process; EPL's model attends through
its own registered attention, so the two do not meet.

**Same step first**: from the same weights, one AdamW step each on the same sequence, beside one plain step of the
whole sequence in one process (the reference, before DeepSpeed takes ``sdpa`` over): the losses within 1e-5
(relative); the gradients each optimizer is given (a step pre-hook) within ``GRADIENT_TOLERANCE`` of the reference's,
as a fraction of each parameter's largest gradient; and every parameter after the step within ``RTOL`` relative +
``ATOL`` absolute (float32) of the other side's, on the elements whose gradient is 0 or at least ``SMALL_GRADIENT``
(Adam's first step, ``lr·g/(|g|+eps)``, turns float32's noise on a gradient near ``eps`` into a visible difference;
the detail line says how many elements that leaves out). Else the benchmark fails before timing. The gradients are
checked because AdamW's step hardly depends on the gradient's scale, and Accelerate's is not one process's: its
recipe gives ``sp_size`` (2) times the gradient (the differentiable all-gather's backward sums each rank's loss
gradient over the group, and DeepSpeed then sums the group's parameter gradients, dividing by the data-parallel size,
1), so the check accepts Accelerate's gradients at 1x or 2x the reference's and records which. With AdamW and no
clipping that takes the same step; with gradient clipping (Accelerate fills an ``"auto"`` ``gradient_clipping``
with 1.0) or plain SGD it would not.

Then both train on, timed in alternating rounds with a barrier before each (``benchmarks.harness.race_steps``).
Ratio EPL / Accelerate, target at most 1.0 (reported, not asserted; ``MAX_RATIO`` catches gross regressions only).
Both attend with torch's SDPA here: EPL's Ulysses does for the plain causal mask (any other mask goes block by block,
docs/context.md), DeepSpeed's always.
"""

from __future__ import annotations

from typing import Any

import pytest
from tests.helpers.distributed import run_ranks

from benchmarks.harness import Section, ms, race_steps, record_step_race, short_mode

pytest.importorskip("accelerate", reason="Accelerate's Ulysses needs accelerate (nox -s bench-accelerate)")
pytest.importorskip("deepspeed", reason="Accelerate's Ulysses runs on deepspeed (nox -s bench-accelerate)")

pytestmark = pytest.mark.multiprocess

HIDDEN, LAYERS, HEADS, KV_HEADS, VOCABULARY = 256, 4, 8, 2, 1024
SEQUENCE = 256 if short_mode() else 1024
DEGREE = 2
LR = 1e-3
LOSS_RTOL = 1e-5
RTOL, ATOL = 1e-4, 1e-6  # parameters after one step, float32, where the gradient is at least SMALL_GRADIENT
SMALL_GRADIENT = 1e-5
GRADIENT_TOLERANCE = 1e-4  # of each parameter's largest gradient
MAX_RATIO = 3.0  # gross regressions only: the target (at most 1.0) is reported
#: DeepSpeed's CPU accelerator (else it looks for CUDA) and no GPU: this is the CPU comparison.
RANK_ENV = {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    "zero_optimization": {"stage": 0},
    "fp16": {"enabled": False},
    "bf16": {"enabled": False},
}
SECTION = Section(
    "Context parallelism: EPL's Ulysses against Accelerate's",
    __file__,
    f"transformers' Llama ({LAYERS} layers, hidden {HIDDEN}, GQA {HEADS}/{KV_HEADS}, vocabulary {VOCABULARY}, "
    f"float32), batch 1 x {SEQUENCE} tokens over 2 processes (gloo), AdamW: EPL's `context.mode` `ulysses` against "
    "Accelerate's Ulysses (`ParallelismConfig(sp_backend=\"deepspeed\")`, DeepSpeed's `UlyssesSPAttentionHF` over "
    "`sdpa`, ZeRO stage 0), in the same processes, after checking that both take the same step (losses within "
    f"{LOSS_RTOL:g}, gradients against one process's, parameters within {RTOL:g} relative / {ATOL:g} absolute). "
    "Accelerate's recipe gives 2x the gradient (AdamW takes the same step from it). Target ratio at most 1.0.",
)


def llama() -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCABULARY, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=SEQUENCE,
        attn_implementation="sdpa", use_cache=False,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def adamw(params: Any) -> Any:
    import torch

    return torch.optim.AdamW(params, lr=LR, weight_decay=0.01)


def keep_first_gradients(optimizer: Any, kept: dict[int, Any]) -> Any:
    """``optimizer``, which writes into ``kept`` (by parameter id) the gradients its first step is given."""

    def keep(opt: Any, args: Any, kwargs: Any) -> None:
        if not kept:
            for group in opt.param_groups:
                kept.update({id(p): p.grad.detach().clone() for p in group["params"] if p.grad is not None})

    optimizer.register_step_pre_hook(keep)
    return optimizer


def accelerate_ulysses(tokens: Any, gradients: dict[int, Any]) -> tuple[Any, Any]:
    """Accelerate's Ulysses on ``tokens`` (the whole sequence): its training step, and the DeepSpeed engine."""
    import torch
    import torch.distributed.nn.functional as differentiable
    from accelerate import Accelerator
    from accelerate.utils import (
        DeepSpeedPlugin,
        DeepSpeedSequenceParallelConfig,
        InitProcessGroupKwargs,
        ParallelismConfig,
    )
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    parallelism = ParallelismConfig(
        sp_backend="deepspeed",
        sp_size=DEGREE,
        dp_shard_size=1,
        sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa"),
    )
    accelerator = Accelerator(
        deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=dict(DS_CONFIG)),
        parallelism_config=parallelism,
        kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")],
    )
    base = llama()
    model, optimizer = accelerator.prepare(base, keep_first_gradients(adamw(base.parameters()), gradients))
    group = parallel_state_sp.get_sequence_parallel_group()
    rank, size = parallel_state_sp.get_sequence_parallel_rank(), parallel_state_sp.get_sequence_parallel_world_size()
    length = tokens.shape[1]
    mine = slice(rank * length // size, (rank + 1) * length // size)
    shifted = torch.cat([tokens[:, 1:], torch.full_like(tokens[:, :1], -100)], 1)
    positions = torch.arange(length).expand(tokens.shape[0], length)
    batch = {"input_ids": tokens[:, mine], "position_ids": positions[:, mine]}
    shift_labels = shifted[:, mine]
    good_tokens = (shift_labels != -100).view(-1).sum()

    def step() -> Any:
        optimizer.zero_grad()
        outputs = model(**batch)
        loss = base.loss_function(
            logits=outputs.logits, labels=None, shift_labels=shift_labels, vocab_size=base.config.vocab_size
        )
        losses_per_rank = differentiable.all_gather(loss, group=group)
        good_tokens_per_rank = differentiable.all_gather(good_tokens, group=group)
        total_loss = sum(
            losses_per_rank[r] * good_tokens_per_rank[r] for r in range(size) if good_tokens_per_rank[r] > 0
        )
        loss = total_loss / max(sum(good_tokens_per_rank), 1)
        accelerator.backward(loss)
        optimizer.step()
        return loss.detach()

    return step, model


def one_process(tokens: Any) -> tuple[float, dict[str, Any]]:
    """The loss and gradients of one plain step of the whole sequence in this process (the reference)."""
    model = llama()
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    return float(loss.detach()), {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def gradient_error(found: dict[str, Any], reference: dict[str, Any], factor: float = 1.0) -> float:
    """The largest difference between ``found`` and ``factor`` times ``reference``, over all parameters, as a
    fraction of each parameter's largest reference gradient."""
    return max(float((found[k] - factor * g).abs().max() / (factor * g.abs().max())) for k, g in reference.items())


def same_step(engine: Any, ds_model: Any, grads: dict[str, dict[int, Any]], start: dict[str, Any]) -> dict[str, Any]:
    """The two sides' gradients (as their optimizers got them, by parameter name) and how far apart their parameters
    are after the step, on the elements whose gradient is at least ``SMALL_GRADIENT`` (Adam's first step,
    ``lr·g/(|g|+eps)``, turns float32's noise on a gradient near ``eps`` into a visible difference)."""
    import torch

    epl_params, ds_params = dict(engine.model.named_parameters()), dict(ds_model.named_parameters())
    assert epl_params.keys() == ds_params.keys(), (sorted(epl_params), sorted(ds_params))
    epl_grads = {k: grads["epl"][id(p)] for k, p in epl_params.items()}
    ds_grads = {k: grads["accelerate"][id(p)] for k, p in ds_params.items()}
    used, apart, compared, total = 0.0, 0.0, 0, 0
    for name, p in ds_params.items():
        q, g = epl_params[name].detach(), epl_grads[name]
        kept = (g.abs() >= SMALL_GRADIENT) | (g == 0)
        difference = (q - p.detach()).abs()[kept]
        if difference.numel():
            used = max(used, float((difference / (ATOL + RTOL * p.detach().abs()[kept])).max()))
            apart = max(apart, float(difference.max()))
        compared, total = compared + int(kept.sum()), total + g.numel()
    moved = max(float((p.detach() - start[k]).abs().max()) for k, p in ds_params.items())
    return {
        "epl_grads": epl_grads, "ds_grads": ds_grads, "used": used, "apart": apart, "compared": compared,
        "total": total, "moved": moved, "same": used <= 1.0 and torch.isfinite(torch.tensor(used)).item(),
    }  # fmt: skip


def race(sequence: int, rounds: int, steps: int) -> dict[str, Any]:
    import torch

    import epl

    torch.set_num_threads(1)
    tokens = torch.randint(0, VOCABULARY, (1, sequence), generator=torch.Generator().manual_seed(1))
    reference_loss, reference = one_process(tokens)  # before DeepSpeed takes transformers' sdpa over
    grads: dict[str, dict[int, Any]] = {"epl": {}, "accelerate": {}}
    epl.init(epl.Config({"context.degree": DEGREE, "context.mode": "ulysses"}))
    engine = epl.parallelize(llama(), optimizer=lambda params: keep_first_gradients(adamw(params), grads["epl"]))
    accelerate_step, ds_engine = accelerate_ulysses(tokens, grads["accelerate"])

    def epl_step() -> Any:
        return engine.step({"input_ids": tokens, "labels": tokens})

    # Same step first: one step each from the same weights.
    start = {k: v.detach().clone() for k, v in ds_engine.module.named_parameters()}
    for name, value in engine.model.named_parameters():
        assert torch.equal(value, start[name]), f"the two models start apart at {name}"
    epl_loss, accelerate_loss = float(epl_step()), float(accelerate_step())
    found = same_step(engine, ds_engine.module, grads, start)
    check = {
        "reference_loss": reference_loss,
        "epl_loss": epl_loss,
        "accelerate_loss": accelerate_loss,
        "epl_grad_error": gradient_error(found["epl_grads"], reference),
        # Accelerate's recipe sums the gradients of the SP ranks' shares twice over: the differentiable all-gather's
        # backward sums each share's gradient over the group, and DeepSpeed then sums the group's gradients
        # (it divides by the data-parallel size, 1 here); AdamW takes the same step from DEGREE times the gradient.
        "accelerate_grad_factor": next(
            (f for f in (1, DEGREE) if gradient_error(found["ds_grads"], reference, f) <= GRADIENT_TOLERANCE), None
        ),
        "accelerate_grad_error": min(gradient_error(found["ds_grads"], reference, f) for f in (1, DEGREE)),
        **{k: found[k] for k in ("used", "apart", "compared", "total", "moved")},
    }
    losses = abs(epl_loss - accelerate_loss) / abs(accelerate_loss), abs(epl_loss - reference_loss) / reference_loss
    assert max(losses) <= LOSS_RTOL, f"not the same loss: {check}"
    assert check["epl_grad_error"] <= GRADIENT_TOLERANCE, f"EPL's gradients are not one process's: {check}"
    assert check["accelerate_grad_factor"] is not None, f"Accelerate's gradients are not one process's: {check}"
    assert found["same"], f"not the same step: {check}"

    result = race_steps("context ulysses vs accelerate", accelerate_step, epl_step, rounds=rounds, steps=steps)
    return {**result, "check": check}


@pytest.mark.timeout(1500)
def test_context_ulysses_against_accelerate() -> None:
    rounds, steps = (3, 1) if short_mode() else (11, 2)
    result = run_ranks(race, 2, SEQUENCE, rounds, steps, timeout=1400, env=RANK_ENV)[0]
    check = result["check"]
    factor = check["accelerate_grad_factor"]
    same = (
        f"same step: loss {check['epl_loss']:.6f} both (one process {check['reference_loss']:.6f}); gradients within "
        f"{check['epl_grad_error']:.1e} (EPL) and {check['accelerate_grad_error']:.1e} (Accelerate"
        + (f", {factor}x" if factor != 1 else "")
        + f") of one process's, as fractions of each parameter's largest; parameters after the AdamW step at most "
        f"{check['apart']:.1e} apart ({check['used']:.2f} of {RTOL:g} relative + {ATOL:g} absolute) on the "
        f"{check['compared']:,} of {check['total']:,} elements whose gradient is 0 or at least {SMALL_GRADIENT:g}; "
        f"the step moved them up to {check['moved']:.1e}"
    )
    detail = (
        f"EPL {ms(result['epl_ms'])}, Accelerate {ms(result['torch_ms'])} per step ({SEQUENCE} tokens), "
        f"ratio {result['ratio']:.3f} ({result['rounds']} rounds x {result['steps']} steps); {same}"
    )
    record_step_race(
        "context_ulysses_accelerate",
        result,
        feature="Context parallelism, Ulysses (2 devices)",
        against="Accelerate's Ulysses (DeepSpeed 0.19.x)",
        plot="context: Ulysses vs Accelerate",
        section=SECTION,
        detail=detail,
        max_ratio=MAX_RATIO,
    )
