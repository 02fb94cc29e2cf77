"""The packed MXFP4 pair every MXFP4 kernel reads (layout in :mod:`k3serve.kernels.mxfp4`'s docstring): a
``weight_packed`` uint8 ``[..., K / 2]`` and a ``weight_scale`` uint8 ``[..., K / GROUP]``."""

from __future__ import annotations

import torch

GROUP = 32  # inputs sharing one E8M0 scale


def check_packed(packed: torch.Tensor, scales: torch.Tensor, what: str = "weight") -> int:
    """Validate a packed pair and return the unpacked width K.

    packed: uint8 `[..., K / 2]`; scales: uint8 `[..., K / 32]` with the same leading dims.
    """
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{what}: weight_packed and weight_scale must be uint8, got {packed.dtype} and {scales.dtype}")
    k = packed.shape[-1] * 2
    if packed.shape[:-1] != scales.shape[:-1] or scales.shape[-1] * GROUP != k:
        raise ValueError(f"{what}: weight_packed {list(packed.shape)} and weight_scale {list(scales.shape)} do "
                         f"not describe one tensor with groups of {GROUP} inputs")
    return k
