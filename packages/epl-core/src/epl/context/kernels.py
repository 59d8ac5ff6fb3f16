"""torch's fused attention kernels, one call at a time, with the log-sum-exp a blockwise merge needs.

The forward returns ``(output, log-sum-exp)`` and the backward takes them back (the merged ones, as
FlashAttention's backward does), as torch's own context parallelism calls them:

- CPU, float32, float64, bfloat16 and float16: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its
  backward, which take grouped-query attention's keys and values as they are (``h_kv`` heads);
- CUDA, bfloat16 and float16, head size a multiple of 8 up to 256, compute capability 8.0 or newer:
  ``aten._scaled_dot_product_flash_attention`` (FlashAttention 2) and its backward, which also take ``h_kv`` heads;
- CUDA otherwise (float32, other head sizes): ``aten._scaled_dot_product_efficient_attention`` and its backward,
  which take the query heads only: keys and values are expanded for the call and their gradients summed back.

Tensors are ``[b, h, t, d]``; the log-sum-exp is ``[b, h, t]`` in float32 (the input's dtype for float64).
"""

from __future__ import annotations

import functools

import torch

aten = torch.ops.aten

#: The dtypes each device's kernels take.
DTYPES = {
    "cpu": (torch.float64, torch.float32, torch.bfloat16, torch.float16),
    "cuda": (torch.float32, torch.bfloat16, torch.float16),
}


def supported(query: torch.Tensor) -> bool:
    """Whether a kernel here takes tensors like ``query`` (its device and dtype; read on the host)."""
    return query.dtype in DTYPES.get(query.device.type, ())


#: What a kernel's forward hands its backward beside the output and log-sum-exp (its random state: unused
#: without dropout, passed back as torch's own autograd does).
State = tuple[torch.Tensor, ...]


def forward(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor, State]:
    """``(output, log-sum-exp, state for the backward)`` of ``query`` over ``key``/``value`` (``h_kv`` heads),
    causal (aligned at the first token) or not."""
    if query.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, causal, scale=scale)
        return out, lse, ()
    if _flash(query):
        out, lse, _, _, _, _, seed, offset, _ = aten._scaled_dot_product_flash_attention(
            query, key, value, 0.0, causal, False, scale=scale
        )
        return out, lse, (seed, offset)
    heads = query.shape[1]
    out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
        query, _expanded(key, heads), _expanded(value, heads), None, True, 0.0, causal, scale=scale
    )
    return out, lse[..., : query.shape[2]], (seed, offset)


def backward(
    dout: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
    state: State = (),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of ``query``, ``key`` and ``value`` (``h_kv`` heads) from the merged ``out`` and ``lse``;
    ``state``: what :func:`forward` returned for this call."""
    if query.device.type == "cpu":
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, query, key, value, out, lse, 0.0, causal, scale=scale
        )
        return dq, dk, dv
    seed, offset = state or (torch.zeros((), dtype=torch.int64),) * 2
    if _flash(query):
        dout = dout if dout.stride(-1) == 1 else dout.contiguous()  # a sum's gradient is expanded: no stride
        t, s = query.shape[2], key.shape[2]
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            dout, query, key, value, out, lse.contiguous(), None, None, t, s, 0.0, causal, seed, offset, scale=scale
        )
        return dq, dk, dv
    return _efficient_backward(dout, query, key, value, out, lse, causal, scale, seed, offset)


def _efficient_backward(
    dout: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
    seed: torch.Tensor,
    offset: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    heads, kv_heads = query.shape[1], key.shape[1]
    # The kernel takes its tensors laid out as its forward made them: [b, t, h, d] in memory ...
    dout, query, key, value, out = (
        x.transpose(1, 2).contiguous().transpose(1, 2)
        for x in (dout, query, _expanded(key, heads), _expanded(value, heads), out)
    )
    # ... and its log-sum-exp padded to a multiple of 32 tokens, as its forward returns it.
    padded = lse.new_zeros((*lse.shape[:-1], -(-lse.shape[-1] // 32) * 32), dtype=torch.float32)
    padded[..., : lse.shape[-1]] = lse
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        dout, query, key, value, None, out, padded, seed, offset, 0.0, [True, True, True, False], causal, scale=scale
    )
    if heads != kv_heads:  # each key/value head's gradient sums over the query heads that share it
        dk, dv = (x.unflatten(1, (kv_heads, heads // kv_heads)).sum(2) for x in (dk, dv))
    return dq, dk, dv


def _flash(query: torch.Tensor) -> bool:
    """Whether FlashAttention 2 takes ``query`` on its CUDA device (16-bit, head size, the device's generation)."""
    size = query.shape[-1]
    return query.dtype in (torch.bfloat16, torch.float16) and size % 8 == 0 and size <= 256 and _ampere(query.device)


@functools.cache
def _ampere(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 0)


def _expanded(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """Keys or values ``[b, h_kv, s, d]`` repeated for the ``heads`` query heads (for a kernel that needs them)."""
    groups = heads // tensor.shape[1]
    return tensor if groups == 1 else tensor.repeat_interleave(groups, dim=1)
