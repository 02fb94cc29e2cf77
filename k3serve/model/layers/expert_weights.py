"""A routed expert's weight as an object that knows how to multiply, whatever form the checkpoint stores it in.

The MoE layer calls ``lin(x)`` for each of an expert's three matrices and never looks at the storage, so
full-precision and MXFP4 experts run the same routing, grouping and summation code (docs/mxfp4.md):

* :class:`DenseLinear`  ``...w1.weight``                       -> ``F.linear(x, W)``
* :class:`MXFP4Linear`  ``...w1.weight_packed`` + ``_scale``    -> :func:`k3serve.kernels.mxfp4.mxfp4_linear`
  (the packed bytes are what is held, plus on CPU the scale values in fp32, 4 bytes per 32 inputs; the CPU
  path dequantises a small row block at a time, the Triton kernel in registers).

On the CPU a MoE layer whose experts are all MXFP4 does not call these objects per expert: it runs one fused
kernel call for all of them (``moe_mxfp4.py``); the objects (views of its stacks) remain for numerics mode
``deterministic`` (``tiled``) and for a process without numba.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from k3serve.kernels._dispatch import resolve_backend
from k3serve.kernels.mxfp4 import CpuMatrix, mxfp4_linear, mxfp4_linear_blocks
from k3serve.kernels.mxfp4_format import check_packed
from k3serve.model.names import mxfp4_names


@dataclass(frozen=True)
class DenseLinear:
    weight: torch.Tensor  # [out, in]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x `[N, in]` -> `[N, out]`."""
        return F.linear(x, self.weight)

    @property
    def shape(self) -> tuple[int, int]:
        """`(out, in)`."""
        return tuple(self.weight.shape)

    def tiled(self, x: torch.Tensor, ops) -> torch.Tensor:
        """x `[N, in]` -> `[N, out]` through the numerics mode's ``ops.linear`` (model/deterministic.py:
        fixed row tiles, or the packed GEMM for a large expert)."""
        return ops.linear(x, self.weight)


@dataclass(frozen=True)
class MXFP4Linear:
    packed: torch.Tensor  # uint8 [out, in / 2]
    scale: torch.Tensor  # uint8 [out, in / 32]

    backend: str = ""  # resolved once from the weights' device (a decode step makes ~50 of these calls)
    # CPU ("torch") path: the pair prepared once (kernels/mxfp4.py CpuMatrix: scale values in fp32, 0.125 byte
    # per weight next to the pair's 17/32; still no weight in full precision); None on other backends
    cpu: CpuMatrix | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_packed(self.packed, self.scale)
        if not self.backend:
            object.__setattr__(self, "backend", resolve_backend(None, self.packed.device))
        if self.backend == "torch" and self.packed.device.type == "cpu" and self.packed.dim() == 2:
            object.__setattr__(self, "cpu", CpuMatrix(self.packed, self.scale))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x `[N, in]` -> `[N, out]` in x's dtype."""
        cpu = self.cpu
        if cpu is not None:
            return cpu(x)
        return mxfp4_linear(x, self.packed, self.scale, backend=self.backend)

    def tiled(self, x: torch.Tensor, ops) -> torch.Tensor:
        """x `[N, in]` -> `[N, out]` through ``ops.transient_linear(x, W_block)`` over fixed blocks of dequantised
        weight rows (made per call, so never packed: model/packed_gemm.py caches model weights)
        (numerics mode deterministic: every call has a shape independent of N, so bits do not depend on how many
        tokens share the expert). fp32 math, like the torch path."""
        whole = self.shape

        def block_linear(xf: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
            return ops.transient_linear(xf, block, whole)  # decided by the whole weight's shape, as a dense one's

        return mxfp4_linear_blocks(x, self.packed, self.scale, block_linear, self.cpu.svals if self.cpu else None)

    @property
    def shape(self) -> tuple[int, int]:
        """The weight's logical `(out, in)`."""
        return self.packed.shape[0], self.packed.shape[1] * 2


def expert_linear(weights: dict[str, torch.Tensor], name: str) -> DenseLinear | MXFP4Linear:
    """The weight `name` (``...experts.{e}.w1.weight``) from `weights`, in the form present there."""
    if name in weights:
        return DenseLinear(weights[name])
    packed, scale = mxfp4_names(name)
    if packed in weights and scale in weights:
        return MXFP4Linear(weights[packed], weights[scale])
    raise KeyError(f"routed expert weight {name!r} is missing (neither it nor {packed!r} + {scale!r} is loaded)")
