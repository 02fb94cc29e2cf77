"""The default numerics mode's fp32 CPU GEMM: oneDNN's packed GEMM or MKL (``F.linear``), chosen per call.

torch's CPU ``F.linear`` runs MKL's sgemm. On CPUs that are not Intel's, MKL takes generic code paths; measured
on an AMD EPYC (Zen 5, AVX-512, 2 cores), weights cycling through 512 MiB so none stays in cache::

    one row (decode GEMV), GB/s of weight read    MKL 15-17     oneDNN packed 29-38 (2 rows: 27-33)
    256-1024 rows (prefill), time                 MKL 1x        oneDNN packed 0.4-0.5x

and on the Intel Xeon (AVX-512 + AMX) of the earlier wave oneDNN ran 16-256 rows 5-25% faster than MKL but one
row at 1.1-1.4x MKL's GEMV time (model/packed_gemm.py). Hence ``numerics.default_gemm``:

    auto     oneDNN for calls of 2 rows and more; for one row too unless the CPU is GenuineIntel
    onednn   oneDNN for every call
    mkl      F.linear everywhere (the former default; no packed copies)

A one-row call on oneDNN is zero-padded to 2 rows (``PACKED_MIN_ROWS``): a row of a oneDNN GEMM has the same bits
for every row count from 2 on (measured, model/packed_gemm.py) but one row alone takes another kernel, so padding
makes a decode row's linears independent of how many requests share the step, and makes a plain-weight call (a
dequantised MXFP4 block, ``transient``) give the packed weight's bits (both measured equal from 2 rows on). Only
fp32 CPU operands without gradients take oneDNN (training keeps ``F.linear`` and its autograd). The packed
copies are one more copy of every fp32 weight a call has used (``PackedWeights``); ``mkl`` holds none.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from k3serve.contracts.numerics import GemmLibrary
from k3serve.model.packed_gemm import PACKED_MIN_ROWS, PackedWeights, packed_gemm_available


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


class CpuGemm:
    """One model's default-mode linears (module docstring); the packed copies are this object's."""

    def __init__(self, library: GemmLibrary = GemmLibrary.AUTO) -> None:
        self.library = library if packed_gemm_available() else GemmLibrary.MKL
        self.packed = None if self.library is GemmLibrary.MKL else PackedWeights()
        self._one_row = self.library is GemmLibrary.ONEDNN or cpu_vendor() != "GenuineIntel"

    def takes(self, x: torch.Tensor, w: torch.Tensor | None = None) -> bool:
        """Whether x `[..., K]` times w `[n, K]`^T runs on oneDNN (w None: any fp32 CPU weight without grad)."""
        w = x.detach() if w is None else w
        if self.packed is None or x.dtype != torch.float32 or w.dtype != torch.float32 or not (x.is_cpu and w.is_cpu):
            return False
        if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
            return False  # the packed op has no backward: training keeps F.linear
        rows = x.numel() // max(x.shape[-1], 1)
        return rows >= PACKED_MIN_ROWS or (rows == 1 and self._one_row)

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x `[..., K]` times a model weight w `[n, K]`^T -> `[..., n]` (packed on first use)."""
        if not self.takes(x, w):
            return F.linear(x, w)
        return self.packed._mm(x.reshape(-1, x.shape[-1]), self.packed.get(w)).view(*x.shape[:-1], w.shape[0])

    def linear_pair(self, x: torch.Tensor, w_a: torch.Tensor, w_b: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x w_a^T, x w_b^T), x `[N, K]`, as one GEMM over the packed stack [w_a; w_b] (a column's bits do not
        depend on the other columns of the call: model/packed_gemm.py)."""
        if w_a.shape != w_b.shape or not self.takes(x, w_a):
            return self.linear(x, w_a), self.linear(x, w_b)
        both = self.packed._mm(x, self.packed.get_stacked((w_a, w_b)))
        return both[:, : w_a.shape[0]], both[:, w_a.shape[0]:]

    def prepack(self, ws: list[torch.Tensor], pairs: list[tuple[torch.Tensor, torch.Tensor]] = ()) -> None:
        """Pack now what the first calls would (a MoE layer's experts: a decode step reaches a new one for dozens
        of steps, each first use paying its packing)."""
        if self.packed is None:
            return
        for a, b in pairs:
            if a.dtype == torch.float32 and a.is_cpu and a.shape == b.shape:
                self.packed.get_stacked((a, b))
        for w in ws:
            if w.dtype == torch.float32 and w.is_cpu:
                self.packed.get(w)

    def transient(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x `[N, K]` times a weight made for this call (a dequantised MXFP4 block; never cached) -> `[N, n]`:
        oneDNN on the plain weight where ``linear`` would take oneDNN (the same bits), else F.linear."""
        if not self.takes(x, w):
            return F.linear(x, w)
        rows = x.shape[0]
        xp = F.pad(x, (0, 0, 0, PACKED_MIN_ROWS - rows)) if rows < PACKED_MIN_ROWS else x.contiguous()
        out = torch.ops.mkldnn._linear_pointwise(xp, w.contiguous(), None, "none", [], "")
        return out[:rows] if rows < PACKED_MIN_ROWS else out
