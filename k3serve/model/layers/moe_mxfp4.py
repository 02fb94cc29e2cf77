"""One rank's MXFP4 routed experts on the CPU as stacked packed bytes, run by one fused kernel call per MoE layer.

The unfused path (``MoE._routed_partial``'s per-expert loop over :class:`~.expert_weights.MXFP4Linear`) costs
~15 torch ops per active expert (3 x the six ops of ``CpuMatrix``, a glu, a gather, a weighting), each more
than its arithmetic on decode-sized matrices, and made MXFP4 decode slower than bf16's one GEMV per matrix
(docs/mxfp4.md). Here the rank's experts are stacked once at load, ``[E_local, O, K/2]`` bytes and
``[E_local, O, K/32]`` scale codes per matrix (the same bytes the checkpoint holds: nothing is dequantised
ahead), and a layer's routed part is one call of :func:`k3serve.kernels.cpu.mxfp4_moe_cpu.routed_moe_kernel`:
grouping, the three matmuls decoding nibbles and scales in the loop, the glu and the weighted sum.

Each token's result is computed by the same fixed-order code whatever else is in the call (a prefill chunk,
a decode batch, a verify window), so it is batch-invariant by construction; it equals the unfused path within
fp32 rounding (the summation order differs, the weights are the same exact values). The per-expert objects
stay (views of the stacks) for numerics mode ``deterministic`` (``moe_deterministic`` runs them through its
fixed row tiles) and for the unfused fallback.

Used when every local expert is MXFP4 with the CPU ("torch") backend, the activation is silu or situ and numba
imports; otherwise :func:`fuse_mxfp4_experts` returns None and says why (a warning where numba is missing).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from k3serve.kernels import mxfp4 as mx
from k3serve.kernels.cpu import mxfp4_moe_cpu as fused
from k3serve.model.layers.expert_weights import MXFP4Linear

# activation dtypes the kernel takes (fp32 math; bf16 intermediates rounded where the unfused path casts)
FUSED_DTYPES = (torch.float32, torch.bfloat16)
_PAIRS = mx._pair_table().numpy()  # fp32 [256, 2]: a byte's (low, high) E2M1 values
_STAB = mx._scale_table().numpy()  # fp32 [256]: 2^(s - 127), NaN at 255


@dataclass(frozen=True)
class FusedMXFP4Experts:
    """Local experts e0 .. e0 + E_local - 1, stacked: p1, p3 uint8 `[E_local, I, e_in/2]`, s1, s3 uint8
    `[E_local, I, e_in/32]` (w1, w3); p2 uint8 `[E_local, e_in, I/2]`, s2 uint8 `[E_local, e_in, I/32]` (w2)."""

    e0: int
    p1: torch.Tensor
    s1: torch.Tensor
    p3: torch.Tensor
    s3: torch.Tensor
    p2: torch.Tensor
    s2: torch.Tensor
    act: str
    beta1: float
    beta2: float
    # numpy views of the stacks and the kernel's constant arguments, made once (a call is ~8 us of wrapping)
    _args: tuple = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.act not in fused.ACTS:
            raise ValueError(f"hidden_act {self.act!r}: the fused MXFP4 kernel takes {sorted(fused.ACTS)}")
        arrays = tuple(t.contiguous().numpy() for t in (self.p1, self.s1, self.p3, self.s3, self.p2, self.s2))
        object.__setattr__(self, "_args", (*arrays, _PAIRS, _STAB, fused.ACTS[self.act], np.float32(self.beta1),
                                           np.float32(self.beta2)))

    def views(self) -> list[tuple[MXFP4Linear, MXFP4Linear, MXFP4Linear]]:
        """Per local expert, (w1, w3, w2) as MXFP4Linear over views of the stacks (the bytes are held once)."""
        return [(MXFP4Linear(self.p1[i], self.s1[i]), MXFP4Linear(self.p3[i], self.s3[i]),
                 MXFP4Linear(self.p2[i], self.s2[i])) for i in range(self.p1.shape[0])]

    def takes(self, z: torch.Tensor) -> bool:
        """Whether activations `z` run here: fp32 or bf16, and no gradient wanted through them (the kernel is
        forward only); others keep the unfused path, which autograd follows."""
        return z.dtype in FUSED_DTYPES and not (z.requires_grad and torch.is_grad_enabled())

    def __call__(self, z: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """z `[N, e_in]` (fp32 or bf16), ids `[N, k]` int64 global expert ids, w `[N, k]` routing weights ->
        this rank's weighted expert sum `[N, e_in]` fp32 (rows routed to no local expert are 0)."""
        bf16 = z.dtype == torch.bfloat16
        if not bf16 and z.dtype != torch.float32:
            raise ValueError(f"the fused MXFP4 kernel takes activations in {FUSED_DTYPES}, got {z.dtype}")
        if ids.dtype != torch.int64 or w.dtype != torch.float32:
            raise ValueError(f"ids must be int64 and w float32, got {ids.dtype} and {w.dtype}")
        # C-contiguous arrays only: one compiled signature (a new layout would compile again, seconds)
        zf = (z.float() if bf16 else z).detach().contiguous().numpy()
        out = fused.routed_moe_kernel(zf, ids.detach().contiguous().numpy(), w.detach().contiguous().numpy(),
                                      self.e0, *self._args, bf16)
        return torch.from_numpy(out)


def fused_kernel_error() -> str:
    """Why the fused kernel cannot run in this process ('' when it can)."""
    return fused.NUMBA_ERROR


def fuse_mxfp4_experts(experts: list[tuple[object, object, object]], first_expert: int, act: str,
                       beta1: float, beta2: float) -> FusedMXFP4Experts | None:
    """`experts`: per local expert (w1, w3, w2) linear objects, local expert 0 being global `first_expert`.
    The stacked form, or None where it does not apply (module docstring)."""
    if not experts or not all(isinstance(lin, MXFP4Linear) and lin.cpu is not None for e in experts for lin in e):
        return None
    if act not in fused.ACTS:
        return None
    reason = fused_kernel_error()
    if reason:
        warnings.warn(f"MXFP4 routed experts keep the unfused CPU path (slower at decode): {reason}", stacklevel=2)
        return None
    stacks = [torch.stack([e[j].packed for e in experts]) for j in range(3)]
    codes = [torch.stack([e[j].scale for e in experts]) for j in range(3)]
    return FusedMXFP4Experts(first_expert, stacks[0], codes[0], stacks[1], codes[1], stacks[2], codes[2],
                             act, beta1, beta2)
