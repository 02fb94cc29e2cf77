"""The default numerics mode's fp32 CPU GEMM: oneDNN's packed GEMM or MKL (``F.linear``), chosen per call.

torch's CPU ``F.linear`` runs MKL's sgemm. On CPUs that are not Intel's, MKL takes generic code paths: there
oneDNN's packed GEMM reads weights about twice as fast for a decode row and runs prefill-sized calls in half the
time; on Intel CPUs oneDNN wins from a few rows on but loses the one-row GEMV. Hence ``numerics.default_gemm``:

    auto     oneDNN where it is the faster library: weights of 2 MiB and more at any row count, smaller ones
             from 32 rows on (``CpuGemm.takes_shape``); one-row calls stay on MKL on GenuineIntel CPUs
    onednn   oneDNN for every call
    mkl      F.linear everywhere (the former default; no packed copies)

A oneDNN call is zero-padded to a bucket of rows (``row_bucket``; one row to 2): a row of a oneDNN GEMM has the
same bits for every row count from 2 on (model/packed_gemm.py) but one row alone takes another kernel,
and every new row count costs a primitive. So a decode row's oneDNN linears do not depend on how many requests
share the step, and a plain-weight call (a dequantised MXFP4 block, ``transient``) gives the packed weight's bits
(both equal from 2 rows on). Only
fp32 CPU operands without gradients take oneDNN (training keeps ``F.linear`` and its autograd). The packed
copies are one more copy of every fp32 weight a call has used (``PackedWeights``); ``mkl`` holds none.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from k3serve.contracts.numerics import GemmLibrary
from k3serve.model.packed_gemm import PACKED_MIN_ROWS, PackedWeights, packed_gemm_available, packed_mm


@functools.lru_cache(maxsize=1)
def cpu_vendor() -> str:
    """The CPU's vendor id (``GenuineIntel``, ``AuthenticAMD``, ...; "" where /proc/cpuinfo does not say)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        return ""
    return ""


# oneDNN's per-call cost (~20-40 us, and a zero-padded second row) loses to MKL's GEMV on weights that sit in
# cache and wins on weights streamed from memory (a decode step of a model larger than the cache). Calls of fewer
# than MANY_ROWS rows therefore take oneDNN for weights of at least FEW_ROWS_MIN_ELEMENTS (2 MiB fp32: the bench
# preset's experts and projections; none of the tiny preset's), and calls of MANY_ROWS rows and more, where
# oneDNN's kernels are faster whatever the weight, for weights of at least MANY_ROWS_MIN_ELEMENTS.
FEW_ROWS_MIN_ELEMENTS = 1 << 19
MANY_ROWS = 32
MANY_ROWS_MIN_ELEMENTS = 1 << 16


def row_bucket(rows: int) -> int:
    """The row count a oneDNN call is zero-padded to::

        1, 2          -> 2            (one row alone takes another kernel)
        3 .. 64       -> multiple of 8
        65 ..         -> 4 steps per octave: 65..128 by 16, 129..256 by 32, ... (at most +25% rows, +12% typical)

    oneDNN makes (and JIT-compiles) a primitive per row count on its first call (milliseconds per weight shape),
    which a prefill of every new length, or a test suite of many prompt lengths, would pay again; bucketing bounds the primitives to ~40 per weight
    shape up to 8192 rows. A row's bits do not depend on the call's row count from 2 rows on
    (model/packed_gemm.py), so the padding changes no value."""
    if rows <= PACKED_MIN_ROWS:
        return PACKED_MIN_ROWS
    if rows <= 64:
        return -(-rows // 8) * 8
    step = 1 << (rows.bit_length() - 3)
    return -(-rows // step) * step


class CpuGemm:
    """One model's default-mode linears (module docstring); the packed copies are this object's."""

    def __init__(self, library: GemmLibrary = GemmLibrary.AUTO) -> None:
        self.library = library if packed_gemm_available() else GemmLibrary.MKL
        self.packed = None if self.library is GemmLibrary.MKL else PackedWeights()
        self._one_row = self.library is GemmLibrary.ONEDNN or cpu_vendor() != "GenuineIntel"

    def takes_shape(self, x: torch.Tensor, n: int, k: int, weight_grad: bool = False) -> bool:
        """Whether x `[..., K]` times an fp32 CPU weight `[n, k]` runs on oneDNN (weight_grad: the weight requires
        grad). The rule (``auto``: rows and weight size, module constants; ``onednn``: every call)."""
        if self.packed is None or x.dtype != torch.float32 or not x.is_cpu:
            return False
        if torch.is_grad_enabled() and (x.requires_grad or weight_grad):
            return False  # the packed op has no backward: training keeps F.linear
        rows = x.numel() // max(x.shape[-1], 1)
        if rows == 0 or (rows == 1 and not self._one_row):
            return False
        if self.library is GemmLibrary.ONEDNN:
            return True
        return n * k >= (MANY_ROWS_MIN_ELEMENTS if rows >= MANY_ROWS else FEW_ROWS_MIN_ELEMENTS)

    def takes(self, x: torch.Tensor, w: torch.Tensor) -> bool:
        """Whether x `[..., K]` times w `[n, K]`^T runs on oneDNN."""
        return w.dtype == torch.float32 and w.is_cpu and self.takes_shape(x, w.shape[0], w.shape[1], w.requires_grad)

    @staticmethod
    def _mm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x `[N, K]` padded to ``row_bucket(N)`` rows times a packed (or plain) weight -> `[N, n]`."""
        rows = x.shape[0]
        padded = row_bucket(rows)
        xp = F.pad(x, (0, 0, 0, padded - rows)) if padded > rows else x.contiguous()
        out = packed_mm(xp, weight)
        return out[:rows] if padded > rows else out

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x `[..., K]` times a model weight w `[n, K]`^T -> `[..., n]` (packed on first use)."""
        if not self.takes(x, w):
            return F.linear(x, w)
        return self._mm(x.reshape(-1, x.shape[-1]), self.packed.get(w)).view(*x.shape[:-1], w.shape[0])

    def linear_pair(self, x: torch.Tensor, w_a: torch.Tensor, w_b: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x w_a^T, x w_b^T), x `[N, K]`, as one GEMM over the packed stack [w_a; w_b] (a column's bits do not
        depend on the other columns of the call: model/packed_gemm.py)."""
        if w_a.shape != w_b.shape or not self.takes(x, w_a):
            return self.linear(x, w_a), self.linear(x, w_b)
        both = self._mm(x, self.packed.get_stacked((w_a, w_b)))
        return both[:, : w_a.shape[0]], both[:, w_a.shape[0]:]

    def prepack(self, ws: list[torch.Tensor], pairs: list[tuple[torch.Tensor, torch.Tensor]] = ()) -> None:
        """Pack now what the first calls would (a MoE layer's experts: a decode step reaches a new one for dozens
        of steps, each first use paying its packing); weights below every size floor are left to MKL."""
        if self.packed is None:
            return
        floor = 0 if self.library is GemmLibrary.ONEDNN else MANY_ROWS_MIN_ELEMENTS
        for a, b in pairs:
            if a.dtype == torch.float32 and a.is_cpu and a.shape == b.shape and a.numel() >= floor:
                self.packed.get_stacked((a, b))
        for w in ws:
            if w.dtype == torch.float32 and w.is_cpu and w.numel() >= floor:
                self.packed.get(w)

    def transient(self, x: torch.Tensor, w: torch.Tensor, whole: tuple[int, int] | None = None) -> torch.Tensor:
        """x `[N, K]` times a weight made for this call (a block of rows of a dequantised MXFP4 weight of shape
        `whole`, default w's own; never cached) -> `[N, n]`: oneDNN on the plain weight where ``linear`` would
        take oneDNN for the whole weight (the same bits), else F.linear."""
        n, k = whole if whole is not None else w.shape
        if not (w.dtype == torch.float32 and w.is_cpu and self.takes_shape(x, n, k, w.requires_grad)):
            return F.linear(x, w)
        return self._mm(x, w.contiguous())
