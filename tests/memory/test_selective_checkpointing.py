"""``gradient_checkpoint.type = "selective"``: each repeated block keeps its matrix products' and attention kernels'
outputs and recomputes the rest; training equals the run without checkpointing.

transformers' Llama (tiny config, random weights, float64): losses and parameters within 1e-10 of the run without
checkpointing, in one process and under data parallelism, ZeRO v2, split(2) and a 2-stage pipeline (2 processes);
bit-equal under bfloat16 AMP and with dropout (a tower of MLP blocks). Context parallelism and compiled blocks:
``tests/context/test_context_training.py``, ``tests/compiling/test_compile_layouts.py``.
What autograd keeps lies between whole-block recomputation's and no checkpointing's, and backward runs no more
matrix products than without checkpointing (whole-block recomputation runs each block's forward ones again).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import epl
from epl_memory.checkpointing import CheckpointingState
from epl_memory.selective import MATRIX_PRODUCTS
from tests.helpers.distributed import run_ranks
from tests.memory.test_checkpointing import assert_same_training
from tests.memory.test_checkpointing import train as train_tower
from tests.models.test_transformers_pipeline import (
    MAX_NORM,
    MICRO,
    REPLICA_ROWS,
    adamw,
    batches,
    build,
    token_loss,
    train_here,
)

#: Relative and absolute tolerance of losses and parameters (float64).
TOLERANCE = 1e-10
SELECTIVE = {"gradient_checkpoint.type": "selective"}
BLOCKS = tuple(f"model.layers.{i}" for i in range(4))


def train(config: dict[str, Any], split: int = 1) -> dict[str, Any]:
    """One rank (or this process): the 4-layer Llama trained with EPL, 2 micro-batches, clipped; what
    its losses, gradient norms, whole parameters and checkpointed modules."""
    epl.init(epl.Config({"pipeline.num_micro_batch": MICRO, "optimizer.max_grad_norm": MAX_NORM, **config}))
    engine = epl.parallelize(build("llama", split), optimizer=adamw, loss_fn=token_loss)
    losses, norms = [], []
    groups = list(engine.context.shard_groups.values())
    for tokens in batches(engine.num_replicas):
        rows = tokens[engine.replica_index * REPLICA_ROWS : (engine.replica_index + 1) * REPLICA_ROWS]
        before = sum((g.collectives for g in groups), Counter())
        losses.append(float(engine.step({"input_ids": rows}, rows)))
        norms.append(engine.grad_norm)
    plan = engine.context.state(CheckpointingState).plan
    return {
        "losses": losses,
        "norms": norms,
        "state": engine.state_dict(full=True)["model"],
        "modules": plan.modules if plan else None,
        "collectives": dict(sum((g.collectives for g in groups), Counter()) - before),  # the last step's
    }


def assert_equal(result: dict[str, Any], losses: list[float] | None, state: dict[str, torch.Tensor]) -> None:
    """``result``'s losses (unless None) and parameters equal ``losses`` and ``state`` within :data:`TOLERANCE`."""
    if losses is not None:
        torch.testing.assert_close(result["losses"], losses, rtol=TOLERANCE, atol=TOLERANCE)
    for name, value in result["state"].items():
        torch.testing.assert_close(value, state[name], rtol=TOLERANCE, atol=TOLERANCE, msg=name)


def test_selective_llama_equals_the_run_without_checkpointing() -> None:
    plain = train({})
    selective = train(SELECTIVE)
    assert selective["modules"] == BLOCKS  # the blocks "auto" recomputes
    assert_equal(selective, plain["losses"], plain["state"])
    losses, _, state = train_here("llama")
    assert_equal(selective, losses, state)  # and the plain PyTorch loop


@pytest.mark.parametrize("kind", ["selective", "auto"])
def test_a_model_with_its_key_value_cache_on_is_checkpointed_without_it(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """transformers' Llama built with use_cache=True (its default) writes its cache in each layer's forward: the
    checkpointed layers run without it (as transformers' own checkpointing does), said once, and train as the
    model does without checkpointing."""
    from tests.models.test_transformers_split import batches as token_batches
    from tests.models.test_transformers_split import llama as cached_llama
    from tests.models.test_transformers_split import next_token_loss

    def run(config: dict[str, Any]) -> list[float]:
        epl.init(epl.Config(config))
        torch.manual_seed(0)
        model = cached_llama().double()
        assert model.config.use_cache
        engine = epl.parallelize(model, optimizer=adamw, loss_fn=next_token_loss)
        return [float(engine.step(tokens, tokens)) for tokens in token_batches()]

    plain = run({})
    with caplog.at_level("WARNING", logger="epl.memory"):
        checkpointed = run({"gradient_checkpoint.type": kind})
    torch.testing.assert_close(checkpointed, plain, rtol=TOLERANCE, atol=TOLERANCE)
    warnings = [r for r in caplog.records if "key/value cache" in r.getMessage()]
    assert len(warnings) == 1, caplog.text  # once for the model, not once a layer


def test_selective_under_amp_equals_amp_without_checkpointing() -> None:
    """bfloat16 autocast: the recomputation runs under the forward's autocast state, the kept products in bfloat16:
    bit-equal losses and parameters."""

    def run(config: dict[str, Any]) -> tuple[list[float], dict[str, torch.Tensor]]:
        epl.init(epl.Config({"amp.level": "O1", "amp.dtype": "bfloat16", **config}))
        engine = epl.parallelize(build("llama").float(), optimizer=adamw, loss_fn=token_loss)
        losses = [float(engine.step({"input_ids": tokens}, tokens)) for tokens in batches(1)]
        return losses, {k: v.clone() for k, v in engine.model.state_dict().items()}

    plain_losses, plain_state = run({})
    losses, state = run(SELECTIVE)
    assert losses == plain_losses
    for name, value in state.items():
        torch.testing.assert_close(value, plain_state[name], rtol=0, atol=0, msg=name)


def test_selective_with_dropout_draws_the_same_masks() -> None:
    plain = train_tower({})
    selective = train_tower(SELECTIVE)
    assert selective["plan"] == "4 modules"
    assert_same_training(selective, plain)  # bit for bit: the recomputed dropout draws the same masks
    checked = train_tower({**SELECTIVE, "gradient_checkpoint.check_gradients": True})
    assert set(checked["check"]) == {f"blocks.{i}" for i in range(4)}
    assert all(difference is not None and difference < 1e-12 for difference in checked["check"].values())
    assert_same_training(checked, plain)


class ProductCount(TorchDispatchMode):
    """Counts the matrix products run while it is on."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += func in MATRIX_PRODUCTS
        return func(*args, **(kwargs or {}))


class Kept(TorchDispatchMode):
    """Every storage the operations run while it is on make, by weak reference: :meth:`alive` sums those left.

    What a forward keeps for backward, however it is kept: in autograd's graph (no checkpointing), in the
    checkpoint's inputs, or in selective checkpointing's cache (which saved-tensor hooks do not see). Storages of
    ``exclude`` (parameters, inputs: a weight's transpose is its storage) are not counted."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self.made: dict[int, tuple[StorageWeakRef, int]] = {}
        self.excluded = {t.untyped_storage()._cdata for t in exclude}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                if storage._cdata not in self.excluded:
                    self.made.setdefault(storage._cdata, (StorageWeakRef(storage), storage.nbytes()))
        return out

    def alive(self) -> int:
        return sum(size for ref, size in self.made.values() if not ref.expired())


def measured(config: dict[str, Any]) -> tuple[int, int]:
    """Bytes one forward of the Llama keeps for backward, and the matrix products its backward runs."""
    epl.init(epl.Config(config))
    engine = epl.parallelize(build("llama"), optimizer=adamw, loss_fn=token_loss)
    tokens = batches(1)[0]
    with Kept(exclude=[*engine.model.parameters(), tokens]) as kept:
        loss = token_loss(engine.model(input_ids=tokens), tokens)
    alive = kept.alive()
    with ProductCount() as products:
        loss.backward()
    return alive, products.count


def test_selective_keeps_less_than_no_checkpointing_and_recomputes_no_product() -> None:
    plain_bytes, plain_products = measured({})
    full_bytes, full_products = measured({"gradient_checkpoint.type": "auto"})
    selective_bytes, selective_products = measured(SELECTIVE)
    print(f"kept: none {plain_bytes}, selective {selective_bytes}, full {full_bytes} bytes")
    assert full_bytes < selective_bytes < plain_bytes, (full_bytes, selective_bytes, plain_bytes)
    assert selective_products == plain_products  # each product's output kept: none runs again
    # each of 4 blocks' projections but the last again (torch's recomputation stops once it has what backward needs)
    assert full_products == plain_products + 4 * 6


def every_layout() -> dict[str, dict[str, Any]]:
    """On each of 2 ranks: selective checkpointing under data parallelism, ZeRO v2, split(2) and 2 stages."""
    return {
        "data": train(SELECTIVE),
        "zero v2": train({**SELECTIVE, "zero.level": "v2"}),
        "split": train(SELECTIVE, split=2),
        "split, none": train({}, split=2),
        "split, auto": train({"gradient_checkpoint.type": "auto"}, split=2),
        "pipeline": train({**SELECTIVE, "auto.auto_parallel": True, "pipeline.num_stages": 2}),
    }


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_selective_equals_the_local_run_under_every_layout() -> None:
    ranks = run_ranks(every_layout, 2, timeout=360)
    references = {
        "data": train_here("llama", 2),
        "zero v2": train_here("llama", 2, after_average=True),
        "split": train_here("llama"),
        "pipeline": train_here("llama"),
    }
    for layout, (losses, _, state) in references.items():
        replicated = layout in ("data", "zero v2")  # each replica's loss is its own half's: the parameters tell
        for result in ranks:
            assert result[layout]["modules"], layout
            assert_equal(result[layout], None if replicated else losses, state)
    assert Counter(m for r in ranks for m in r["pipeline"]["modules"]) == Counter(BLOCKS)  # each stage its own
    # split's all-reduces are torch.distributed's, in place: the recomputation runs each block's attention one again
    # (the MLP's is not needed by backward), as whole-block recomputation does
    counts = {name: ranks[0][name]["collectives"]["all_reduce"] for name in ("split", "split, none", "split, auto")}
    assert counts["split"] == counts["split, auto"] == counts["split, none"] + MICRO * len(BLOCKS), counts
