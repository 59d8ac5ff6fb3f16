"""Data parallelism: start from identical weights, and reduce gradients over every copy of a parameter.

Inside ``Engine.step`` (between ``start`` and ``finish``), bucket reductions start
during backward: a post-accumulate-grad hook counts each
parameter's gradients, and once every parameter of a bucket has received its last
micro-batch's gradient, its all-reduce starts, on the communicators in turn. Buckets
always start in bucket order, so every rank issues the same collectives in the same order.
Each bucket keeps one flat buffer, and each gradient is a view into it (like DDP's
``gradient_as_bucket_view``): the hook moves a gradient autograd made into its place in
the buffer as soon as it lands (later micro-batches then accumulate there in place), so
the gradients cost their size once, during backward as between steps, plus one
parameter's fresh gradient at a time.

Parameters whose gradients another plugin reduces inside the backward (ZeRO's chunks,
``ParallelContext.reduced_in_backward``) are not given to this reducer.

A reducer that averages every trainable parameter over every rank of the job (plain data
parallelism) also carries the job's verdict on non-finite steps (``carries_verdict``,
:class:`epl.plugin_api.NonFiniteVerdict`) without a collective or a buffer of its own. A rank
whose loss was not finite writes a NaN into the first element of its last bucket, and the mean's
division checks the averaged gradients as it goes (one fused kernel where dividing by the
number of copies is exact, a power of two; else the division and one sum). A NaN or Inf in any
rank's gradient or loss is then in the average, which every rank holds the same, so every rank
reaches the same verdict.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from epl.plugin_api import Communicator, CompletedWork, NonFiniteVerdict, ReduceOp, Work, amp_unscale_
from epl_comm.buckets import plan_buckets
from epl_comm.step_check import StepCheck


@dataclass(frozen=True, kw_only=True)
class ReducePolicy:
    """How gradients are reduced: the manual's ``communication.*`` keys."""

    #: The mean's divisor: how many device losses the reduced gradient sums over.
    copies: int
    num_micro_batch: int = 1
    max_splits: int = 5
    #: The most bytes of gradients one bucket holds where ``max_splits`` buckets would hold more.
    bucket_bytes: float = 25 * 2**20
    mean: bool = True
    fp16: bool = False
    fp16_scale: float = 128.0
    clip_after_allreduce: bool = False
    sparse_as_dense: bool = False


@dataclass(eq=False)
class _Bucket:
    params: list[nn.Parameter]
    communicator: Communicator
    waiting: int = 0
    buffer: torch.Tensor | None = None
    wire: torch.Tensor | None = None
    work: Work | None = None
    started: bool = False
    #: Each parameter's piece of ``buffer`` (a flat view), by ``id``, in the order of ``params``.
    pieces: dict[int, torch.Tensor] = field(default_factory=dict)


class DataParallelReducer:
    """Reduces the gradients of ``params`` over ``policy.copies`` copies (implements GradientReducer).

    ``carries_verdict``: ``params`` are every trainable parameter of the job's model and the
    communicators every rank of the job, so the reduction also decides whether the step's loss
    and gradients were finite everywhere (:meth:`observe_loss`, :meth:`nonfinite_verdict`).
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        communicators: Sequence[Communicator],
        policy: ReducePolicy,
        *,
        sparse: Sequence[nn.Parameter] = (),
        defer_until_finish: bool = False,
        step_check: StepCheck | None = None,
        carries_verdict: bool = False,
    ) -> None:
        self.policy = policy
        #: Checks every step that the copies' ranks are at the same step (None: no check).
        self.step_check = step_check
        self.communicators = list(communicators)
        sparse_ids = set() if policy.sparse_as_dense else {id(p) for p in sparse}
        dense = [p for p in params if p.requires_grad and id(p) not in sparse_ids]
        self.sparse = [p for p in params if p.requires_grad and id(p) in sparse_ids]
        self.buckets = [
            _Bucket(params=group, communicator=self.communicators[i % len(self.communicators)])
            for i, group in enumerate(plan_buckets(dense, policy.max_splits, policy.bucket_bytes))
        ]
        self._bucket_of = {id(p): bucket for bucket in self.buckets for p in bucket.params}
        self.carries_verdict = carries_verdict and bool(self.buckets) and not self.sparse
        device = dense[0].device if dense else torch.device("cpu")
        self._loss_bad = torch.zeros((), dtype=torch.bool, device=device)
        self._found = torch.zeros(1, dtype=torch.float32, device=device)
        self._verdict: NonFiniteVerdict | None = None
        self._arrivals: dict[int, int] = {}
        self._next = 0
        self._defer = defer_until_finish
        self._armed = False
        for param in dense:
            param.register_post_accumulate_grad_hook(self._on_gradient)
        self._reset()

    @property
    def bytes_per_step(self) -> int:
        """Bytes this rank puts on the wire for the dense buckets of one step."""
        element = 2 if self.policy.fp16 else None
        return sum(sum(p.numel() * (element or p.element_size()) for p in b.params) for b in self.buckets)

    # -- GradientReducer -------------------------------------------------------------
    def start(self) -> None:
        """Arm the gradient hooks for one step (after completing what an aborted step started)."""
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
        self._reset()
        self._armed = True
        self._loss_bad = torch.zeros_like(self._loss_bad)
        self._found.zero_()
        self._verdict = None
        if self.step_check is not None:
            self.step_check.start()

    def observe_loss(self, loss: torch.Tensor) -> None:
        """A micro-batch's loss, before its backward: a NaN or Inf poisons the last bucket (no host sync)."""
        if self.carries_verdict:
            self._loss_bad = self._loss_bad | ~torch.isfinite(loss.detach()).all().to(self._loss_bad.device)

    def nonfinite_verdict(self) -> NonFiniteVerdict | None:
        """After :meth:`finish`: whether some rank's loss or the averaged gradients were not finite, the same on
        every rank of the job (None: this reducer does not carry the verdict)."""
        return self._verdict

    def finish(self, clip: Callable[[], None] | None) -> None:
        """Finish this step's reduction; clip before it (per replica) or after it, as configured."""
        if self.step_check is not None:  # posted first, so complete first: the peers are at this step
            self.step_check.finish()
        if clip is not None and not self.policy.clip_after_allreduce:
            clip()
        while self._next < len(self.buckets):
            self._start(self.buckets[self._next])
        sparse_results = [self._reduce_sparse(p) for p in self.sparse]
        for bucket in self.buckets:
            self._complete(bucket)
        for param, grad in zip(self.sparse, sparse_results, strict=True):
            param.grad = grad
        if clip is not None and self.policy.clip_after_allreduce:
            clip()
        self._reset()
        self._armed = False

    # -- during backward ---------------------------------------------------------------
    def _reset(self) -> None:
        self._arrivals = {id(p): 0 for b in self.buckets for p in b.params}
        self._next = 0
        for bucket in self.buckets:
            bucket.waiting = len(bucket.params)
            bucket.started = False
            bucket.work = None

    def _on_gradient(self, param: nn.Parameter) -> None:
        if not self._armed:  # a backward outside Engine.step: plain local gradients
            return
        key = id(param)
        self._seat(self._bucket_of[key], param)
        self._arrivals[key] += 1
        if self._arrivals[key] != self.policy.num_micro_batch:
            return
        bucket = self._bucket_of[key]
        bucket.waiting -= 1
        if self._defer:
            return
        while self._next < len(self.buckets) and self.buckets[self._next].waiting == 0:
            self._start(self.buckets[self._next])

    def _buffer(self, bucket: _Bucket) -> torch.Tensor:
        """``bucket``'s flat buffer (made on first use, kept between steps)."""
        if bucket.buffer is None:
            first = bucket.params[0]
            sizes = [p.numel() for p in bucket.params]
            bucket.buffer = torch.empty(sum(sizes), dtype=first.dtype, device=first.device)
            if self.policy.fp16:
                bucket.wire = torch.empty(sum(sizes), dtype=torch.float16, device=first.device)
            bucket.pieces = dict(zip((id(p) for p in bucket.params), bucket.buffer.split(sizes), strict=True))
        return bucket.buffer

    def _seat(self, bucket: _Bucket, param: nn.Parameter) -> None:
        """Make ``param.grad`` its piece of ``bucket``'s buffer: a gradient autograd just made is moved there (and
        freed), so that the next micro-batch accumulates in place and the bucket's reduction copies nothing."""
        grad = param.grad
        if grad is None or grad.is_sparse:
            return
        self._buffer(bucket)
        piece = bucket.pieces[id(param)]
        if grad.data_ptr() == piece.data_ptr() and grad.is_contiguous():
            return
        with torch.no_grad():
            piece.copy_(grad.reshape(-1))
        param.grad = piece.view_as(param)

    def _start(self, bucket: _Bucket) -> None:
        buffer = self._buffer(bucket)
        with torch.no_grad():
            for param, piece in zip(bucket.params, bucket.pieces.values(), strict=True):
                if param.grad is None:
                    piece.zero_()
                elif param.grad.is_sparse or param.grad.data_ptr() != piece.data_ptr():
                    grad = param.grad.to_dense() if param.grad.is_sparse else param.grad
                    piece.copy_(grad.reshape(-1))
            if self.carries_verdict and bucket is self.buckets[-1]:  # a loss that is not finite: NaN in the sum
                buffer.narrow(0, 0, 1).masked_fill_(self._loss_bad, float("nan"))
            wire = buffer
            if self.policy.fp16:
                assert bucket.wire is not None
                wire = bucket.wire
                torch.mul(buffer, self.policy.fp16_scale, out=wire)
        communicator = bucket.communicator
        if communicator.world_size == 1:  # nothing to add; the mean's divisor still applies
            bucket.work = CompletedWork()
        else:
            bucket.work = communicator.all_reduce(wire, ReduceOp.SUM)
        bucket.started = True
        self._next += 1

    def _complete(self, bucket: _Bucket) -> None:
        assert bucket.work is not None and bucket.buffer is not None
        bucket.work.wait()
        buffer, wire = bucket.buffer, bucket.wire
        with torch.no_grad():
            if self.policy.fp16:
                assert wire is not None
                buffer.copy_(wire).div_(self.policy.fp16_scale)
            if self.carries_verdict:
                self._average_and_check(buffer)
            elif self.policy.mean:
                buffer.div_(self.policy.copies)
            for param, piece in zip(bucket.params, bucket.pieces.values(), strict=True):
                param.grad = piece.view_as(param)  # a view: the bucket's memory is the gradients' memory
            if self.carries_verdict and bucket is self.buckets[-1]:
                self._verdict = NonFiniteVerdict(found=self._found)

    def _average_and_check(self, buffer: torch.Tensor) -> None:
        """The mean's division of a reduced bucket, noting in ``_found`` whether it holds a NaN or Inf.

        One fused pass (AMP's unscale kernel) where multiplying by 1/copies equals dividing by copies (a power of
        two); otherwise the division as before and one sum (a NaN or Inf anywhere makes it non-finite).
        """
        copies = self.policy.copies if self.policy.mean else 1
        if copies & (copies - 1) == 0:
            scale = torch.full((1,), 1.0 / copies, dtype=torch.float32, device=buffer.device)
            amp_unscale_([buffer], self._found, scale)
            return
        buffer.div_(copies)
        self._found += (~torch.isfinite(buffer.sum())).to(self._found.dtype)

    def _reduce_sparse(self, param: nn.Parameter) -> torch.Tensor | None:
        """Gather every copy's sparse gradient as indices and values; sum (or mean) them."""
        communicator = self.communicators[0]
        members = communicator.world_size
        grad = param.grad
        if grad is None:
            grad = torch.sparse_coo_tensor(
                torch.empty(1, 0, dtype=torch.long, device=param.device),
                torch.empty(0, *param.shape[1:], dtype=param.dtype, device=param.device),
                param.shape,
            )
        grad = grad.coalesce()
        indices, values = grad.indices()[0], grad.values()
        row = math.prod(param.shape[1:])
        counts = torch.tensor([indices.numel()], device=param.device)
        all_counts = torch.empty(members, dtype=counts.dtype, device=param.device)
        communicator.all_gather(all_counts, counts).wait()
        longest = int(all_counts.max())
        padded_indices = torch.zeros(longest, dtype=torch.long, device=param.device)
        padded_values = torch.zeros(longest * row, dtype=param.dtype, device=param.device)
        padded_indices[: indices.numel()] = indices
        padded_values[: values.numel()] = values.reshape(-1)
        gathered_indices = torch.empty(longest * members, dtype=torch.long, device=param.device)
        gathered_values = torch.empty(longest * row * members, dtype=param.dtype, device=param.device)
        communicator.all_gather(gathered_indices, padded_indices).wait()
        communicator.all_gather(gathered_values, padded_values).wait()
        keep = [slice(m * longest, m * longest + int(all_counts[m])) for m in range(members)]
        all_indices = torch.cat([gathered_indices[k] for k in keep])
        all_values = torch.cat([gathered_values.view(-1, row)[k] for k in keep]).view(-1, *param.shape[1:])
        total = torch.sparse_coo_tensor(all_indices.unsqueeze(0), all_values, param.shape).coalesce()
        if total._nnz() == 0 and param.grad is None:
            return None
        return total / self.policy.copies if self.policy.mean else total


class ReducerSet:
    """Several reducers, one per group of copies, finished together (implements GradientReducer).

    A rank holds tensors with different copies when a split TaskGraph shares its
    devices with a replicate one: the replicated tensors are reduced over every
    device, each shard over the same shard of the other replicas.
    """

    def __init__(self, reducers: Sequence[DataParallelReducer], clip_after_allreduce: bool) -> None:
        self.reducers = list(reducers)
        self.clip_after_allreduce = clip_after_allreduce

    @property
    def bytes_per_step(self) -> int:
        """Bytes this rank puts on the wire for the dense buckets of one step."""
        return sum(reducer.bytes_per_step for reducer in self.reducers)

    def start(self) -> None:
        """Arm every reducer for one step."""
        for reducer in self.reducers:
            reducer.start()

    def finish(self, clip: Callable[[], None] | None) -> None:
        """Finish every reduction; clip once, before or after all of them, as configured."""
        if clip is not None and not self.clip_after_allreduce:
            clip()
        for reducer in self.reducers:
            reducer.finish(None)
        if clip is not None and self.clip_after_allreduce:
            clip()
