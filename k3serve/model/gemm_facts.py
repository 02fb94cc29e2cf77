"""A load-time check that this CPU and torch build have the GEMM fact numerics mode ``deterministic`` rests on.

The mode gives a row of a linear layer the bits of its ``MIN_TILE``-row tile GEMM by running every call as one
GEMM of at least ``MIN_TILE`` rows (model/deterministic.py). That holds only if, from ``MIN_TILE`` rows on, a
GEMM row's bits do not depend on how many rows share the call: a property of the BLAS kernels, not of the
model. It held from 4 rows on an AVX2 Xeon and only from 16 on an AVX-512 Xeon with AMX (docs/numerics.md);
another CPU may differ again. Rather than serve tokens that silently stop being the reference's, a
deterministic model checks the fact for its own linear shapes when it is built and refuses to start where it
does not hold (``NumericsError`` naming the shape)::

    x  [M_max, K] random, w [n, K] random (fixed seed), at the mode's thread count
    want = the 16-row tile GEMMs of x, concatenated          (the bits the mode promises)
    for M in MIN_TILE, MIN_TILE + 1, 2 MIN_TILE + 5, M_max:  torch.mm(x[:M], w^T) == want[:M] bit for bit

Only the CPU is checked (the mode's Triton paths are not deterministic, docs/numerics.md). The shapes are the
2-D floating-point weights' (K, n) and their shard-unit splits, those with n >= BMM_MIN_OUT (narrower weights
run fixed-shape tiles, which need no such fact); the attention's per-head GEMMs are pinned by
tests/model/test_numerics_invariants.py instead. Cost: a few GEMMs of at most 2 MIN_TILE + 5 rows per distinct
shape, milliseconds for the tiny preset.

The shapes the mode runs on oneDNN's packed GEMM (model/packed_gemm.py) are checked by ``check_packed_rows``
against that kernel's own facts instead (rows from 2 on, columns whatever the width).
"""

from __future__ import annotations

import contextlib
import platform

import torch

from k3serve.contracts.numerics import NumericsError
from k3serve.model.packed_gemm import PACKED_MIN_ROWS, PackedWeights, pack_weight, packed_mm

# how many rows the largest probe GEMM has (above 2 MIN_TILE, not a multiple of the tile)
_EXTRA_ROWS = 5


def cpu_name() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else what the platform says, for error messages."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass  # not Linux: fall back below
    return platform.processor() or platform.machine() or "unknown CPU"


def linear_shapes(weights: dict[str, torch.Tensor], units: int, min_out: int) -> list[tuple[int, int]]:
    """Distinct (K, n) GEMM shapes of the 2-D floating-point weights `[n, K]` in `weights`, with their column
    splits `[n / units, K]` and reduction splits `[n, K / units]` (deterministic.py's shard units), n >= min_out.
    Sorted, so the check is the same on every run."""
    shapes: set[tuple[int, int]] = set()
    for w in weights.values():
        if w.dim() != 2 or not w.is_floating_point() or w.device.type != "cpu":
            continue
        n, k = w.shape
        for kk, nn in ((k, n), (k, n // units if n % units == 0 else 0), (k // units if k % units == 0 else 0, n)):
            if kk > 0 and nn >= min_out:
                shapes.add((kk, nn))
    return sorted(shapes)


@contextlib.contextmanager
def _threads(n: int):
    """torch's intra-op thread count set to `n` for the block (the mode's count), then put back."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def check_row_floor(shapes: list[tuple[int, int]], min_tile: int, threads: int, tile: int = 16) -> None:
    """Raise NumericsError if a GEMM row of one of `shapes` (K, n) changes bits with the row count from
    `min_tile` rows on, at `threads` intra-op threads (module docstring)."""
    with _threads(threads):
        g = torch.Generator().manual_seed(0)
        rows = 2 * min_tile + _EXTRA_ROWS
        padded = -(-rows // tile) * tile
        for k, n in shapes:
            x = torch.zeros(padded, k)
            x[:rows] = torch.randn(rows, k, generator=g)
            w = torch.randn(n, k, generator=g)
            want = torch.cat([torch.mm(x[i: i + tile], w.t()) for i in range(0, padded, tile)])
            for m in (min_tile, min_tile + 1, rows):
                if not torch.equal(torch.mm(x[:m], w.t()), want[:m]):
                    raise NumericsError(
                        f"numerics: deterministic cannot hold on this CPU ({cpu_name()}, "
                        f"torch {torch.__version__}, {threads} thread(s)): a row of a [{m}, {k}] x [{k}, {n}] GEMM "
                        f"has other bits than in its {tile}-row tile, so a row's result would depend on how many "
                        f"rows share the call (docs/numerics.md); use numerics: default here")


def check_packed_rows(shapes: list[tuple[int, int]], threads: int) -> None:
    """Raise NumericsError if oneDNN's packed GEMM (model/packed_gemm.py) breaks one of its facts for a (K, n)
    of `shapes` at `threads` threads: a row's bits the same for 1 (padded), 2, 3, 17 and 37 rows and at another
    place in x, and a column's the same in a GEMM of half the width (a shard unit's slice) and of twice the width
    (two weights stacked, ``DeterministicOps.linear_pair``)."""
    with _threads(threads):
        g = torch.Generator().manual_seed(0)
        rows = 2 * 16 + _EXTRA_ROWS
        for k, n in shapes:
            x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
            want = packed_mm(x, pack_weight(w))
            ops = PackedWeights()
            probes = [(f"[{m}, {k}] x [{k}, {n}]", ops.linear(x[:m], w), want[:m]) for m in (1, PACKED_MIN_ROWS, 3, 17)]
            probes.append((f"rows 5..21 of [{rows}, {k}] x [{k}, {n}]", ops.linear(x[5:22], w), want[5:22]))
            probes.append((f"the first {n} columns of [{rows}, {k}] x [{k}, {2 * n}] (a stacked pair)",
                           ops.linear_stacked(x, (w, w))[:, :n], want))
            half = max(n // 2, 1)
            probes.append((f"the first {half} columns of [{rows}, {k}] x [{k}, {n}]", ops.linear(x, w[:half]),
                           want[:, :half]))
            for what, got, ref in probes:
                if not torch.equal(got, ref):
                    raise NumericsError(
                        f"numerics: deterministic cannot hold on this CPU ({cpu_name()}, torch {torch.__version__}, "
                        f"{threads} thread(s)): oneDNN's packed GEMM gives {what} other bits than the {rows}-row "
                        f"GEMM (docs/numerics.md); use MKL tiles only (numerics: {{mode: deterministic, packed_min_k: 0, "
                        f"packed_min_elements: 0}}) or numerics: default")
