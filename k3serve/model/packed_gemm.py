"""oneDNN's packed fp32 GEMM for the deterministic mode's wide linears (model/deterministic.py).

MKL's fp32 GEMM gives a row the bits of its 16-row tile only from 16 rows on (AVX-512 CPUs; docs/numerics.md), so
the mode would pad a decode step's one row to 16 and pay ~3x the GEMV. oneDNN's fp32 matmul
(``mkldnn::_linear_pointwise``, the brgemm kernels) accumulates every output element over K in one fixed order
whatever the row count (checked for every bench / tiny preset shape, 1 and 2 threads)::

    rows      a row of an [M, K] x [K, n] GEMM has the same bits for every M >= 2 and at any place in x
              (M = 1 takes another kernel when K > 1024, so one row is zero-padded to PACKED_MIN_ROWS)
    columns   a column has the same bits whatever n (a weight's column slice, a stack of weights)
    packing   the weight reordered once (``_reorder_linear_weight``) gives the bits of the plain weight

and it runs one row near the GEMV's time and many rows faster than MKL. Each call has a fixed cost that small
weights do not repay, so the mode uses it only for long reductions and large
fixed-shape units (``DeterministicGemm.takes``: ``numerics.packed_min_k``, ``numerics.packed_min_elements``,
both decided from TP-invariant shapes). The facts are checked for the model's own shapes when it is built
(model/gemm_facts.py) and pinned for the bench preset's shapes by tests/model/test_packed_gemm.py.

The packed copies are cached per weight view (its data pointer, shape and strides; remade after an in-place
update, seen by the version counter), holding a reference to the weight so its memory cannot be reused under
the key; they add one copy of every packed weight to the process's memory. A forward that needs gradients through a packed
weight is refused (the op has no backward); the deterministic mode is a serving mode.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3serve.contracts.numerics import Numerics, NumericsError

# A one-row call takes another kernel for K > 1024; two rows and more the same one.
PACKED_MIN_ROWS = 2


def packed_gemm_available() -> bool:
    """Whether this torch build has oneDNN's fp32 linear (CPU builds with MKL-DNN)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def packed_mm(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x `[M, K]` (M >= PACKED_MIN_ROWS, fp32) times a packed weight of `[n, K]` -> `[M, n]`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """w `[n, K]` fp32 (any strides) -> oneDNN's reordered copy for :func:`packed_mm`."""
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), None)


class PackedWeights:
    """The packed copies of the weights one model's deterministic operators multiply by (module docstring)."""

    def __init__(self) -> None:
        self._cache: dict[tuple, tuple[torch.Tensor, object]] = {}

    def _lookup(self, w: torch.Tensor, extra, make):
        # data_ptr (storage + offset), shape and strides name the view; the version names its contents
        key = (w.data_ptr(), w.shape, w.stride(), extra)  # fp32 only (DeterministicGemm.takes)
        hit = self._cache.get(key)
        if hit is None or hit[0]._version != hit[2]:
            hit = self._cache[key] = (w, make(w.detach()), w._version)  # made anew after an in-place update
        return hit[1]

    def get(self, w: torch.Tensor) -> torch.Tensor:
        """The packed copy of w `[n, K]` (made on first use)."""
        return self._lookup(w, None, pack_weight)

    def get_stacked(self, ws: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """One packed copy of the weights `ws` (each `[n_i, K]`) stacked by rows, `[sum n_i, K]`."""
        head, rest = ws[0], tuple((t.data_ptr(), t.shape, t.stride(), t._version) for t in ws[1:])
        return self._lookup(head, rest, lambda d: pack_weight(torch.cat([d] + [t.detach() for t in ws[1:]])))

    def get_units(self, w: torch.Tensor, units: int) -> list[torch.Tensor]:
        """The packed copies of w `[n, K]`'s `units` column blocks `[n, K / units]`, in order."""
        width = w.shape[1] // units
        return self._lookup(w, units, lambda d: [pack_weight(d[:, u * width: (u + 1) * width]) for u in range(units)])

    @staticmethod
    def _check_grad(x: torch.Tensor, w: torch.Tensor) -> None:
        if (x.requires_grad or w.requires_grad) and torch.is_grad_enabled():
            raise NumericsError("numerics: deterministic runs its wide linears on oneDNN's packed GEMM, which has "
                                "no backward; run a forward that needs gradients with numerics: default")

    @staticmethod
    def _mm(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """packed_mm for any row count: fewer than PACKED_MIN_ROWS rows are zero-padded, then cut off."""
        rows = x.shape[0]
        if rows < PACKED_MIN_ROWS:
            return packed_mm(F.pad(x, (0, 0, 0, PACKED_MIN_ROWS - rows)), packed)[:rows]
        return packed_mm(x.contiguous(), packed)

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x `[N, K]` (any N) times w `[n, K]`^T -> `[N, n]`, each row with the bits of any other row count's."""
        self._check_grad(x, w)
        return self._mm(x, self.get(w))

    def linear_stacked(self, x: torch.Tensor, ws: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """x `[N, K]` times the weights `ws` stacked by rows -> `[N, sum n_i]` (columns: each weight's GEMM's)."""
        for t in ws:
            self._check_grad(x, t)
        return self._mm(x, self.get_stacked(ws))

    def unit_partials(self, x: torch.Tensor, w: torch.Tensor, units: int) -> torch.Tensor:
        """x `[N, K]`, w `[n, K]` -> `[units, N, n]`: the partial products of the `units` column blocks
        (x[:, K_u] W[:, K_u]^T, a row-parallel layer's shard units), each one packed GEMM."""
        self._check_grad(x, w)
        rows, width = x.shape[0], x.shape[1] // units
        if rows < PACKED_MIN_ROWS:
            x = F.pad(x, (0, 0, 0, PACKED_MIN_ROWS - rows))
        xu = x.view(x.shape[0], units, width).transpose(0, 1).contiguous()  # [units, M, K / units]: one copy
        parts = torch.stack([packed_mm(xu[u], p) for u, p in enumerate(self.get_units(w, units))])
        return parts[:, :rows] if rows < PACKED_MIN_ROWS else parts

    def __len__(self) -> int:
        return len(self._cache)


class DeterministicGemm:
    """Numerics mode deterministic's GEMM library choice: which linears run on the packed GEMM (the others on MKL
    tiles, model/deterministic.py) and their packed copies. The choice is made from shapes that are the same on
    every TP, so every TP takes the same kernel for a weight; which shapes those are is the caller's to say."""

    def __init__(self, numerics: Numerics, min_out: int) -> None:
        """min_out: the narrowest weight that runs as a GEMM at all (narrower ones are row-local sums)."""
        self.min_k, self.min_elements, self.min_out = numerics.packed_min_k, numerics.packed_min_elements, min_out
        self.packed = PackedWeights() if numerics.packs and packed_gemm_available() else None

    def takes(self, k: int, n: int, dtype: torch.dtype, sized: bool = False) -> bool:
        """Whether a GEMM unit of reduction `k` and width `n` runs on the packed GEMM.

        Both numbers must be TP-invariant, so that every TP picks the same kernel: K against
        ``numerics.packed_min_k`` always, and with `sized` (a shard unit of a column- or row-parallel weight, a
        replicated weight, a routed expert: shapes that do not change with TP) also the size k x n against
        ``numerics.packed_min_elements``; a rank's stack of input projections changes width with TP and decides
        by K alone."""
        if self.packed is None or n < self.min_out or dtype != torch.float32:
            return False
        return bool(self.min_k and k >= self.min_k) or bool(sized and self.min_elements and k * n >= self.min_elements)

    def takes_weight(self, w: torch.Tensor) -> bool:
        """Whether the CPU weight w `[n, K]`, whose shape is the same on every TP (a routed expert, a replicated
        projection), runs on the packed GEMM."""
        return w.is_cpu and self.takes(w.shape[1], w.shape[0], w.dtype, sized=True)

    def prepack(self, ws: list[torch.Tensor], pairs: list[tuple[torch.Tensor, torch.Tensor]] = ()) -> None:
        """Pack now the weights `ws` and the stacked pairs that the first calls would (a MoE layer's experts)."""
        # a decode step routes to experts it has not seen for dozens of steps: packing each on its first token
        # would slow the first deterministic steps by a third
        for a, b in pairs:
            if a.shape == b.shape and self.takes_weight(a):
                self.packed.get_stacked((a, b))
        for w in ws:
            if self.takes_weight(w):
                self.packed.get(w)
