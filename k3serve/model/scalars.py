"""0-dim fp32 constants for the elementwise ops of the per-token hot path (norms, activations, mixes).

A Python number in a tensor op (``x / 4.0``, ``x.add_(eps)``) reaches ATen as a wrapped double 0-dim tensor, which
TensorIterator converts to the op's dtype on every call: an ``aten::to`` with its ``_to_copy``, allocation and
copy, four more dispatches (about twice the time of a small op with a 0-dim fp32 operand); a decode step made
~380 such calls (docs/performance.md). A 0-dim fp32
tensor is used as it is, with the same bits: the number is rounded to fp32 once either way.

The constants are cached by value (a few per model: eps, a hidden size, the SiTU betas). They are shared: never
write to one.
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=256)
def fp32(value: float) -> torch.Tensor:
    """`value` as a 0-dim fp32 CPU tensor (also valid as a scalar operand of CUDA tensors). Made outside inference
    mode, so that autograd may save it (training divides by these as well)."""
    with torch.inference_mode(False):
        return torch.tensor(float(value), dtype=torch.float32, device="cpu")


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)``, skipped when x already has it: ``Tensor.to(dtype)`` costs ~2.6 us even as a no-op (the
    per-token norms, activations and mixes call this a few hundred times a decode step)."""
    return x if x.dtype == dtype else x.to(dtype)
