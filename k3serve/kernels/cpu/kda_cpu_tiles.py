"""Register tiles of the fused CPU KDA kernel (``kda_cpu_kernel``): a block of output rows x 16-lane columns held
in vector registers across a reduction, as tuples of ``_simd`` vectors (inlined into the kernel's stages).

* wide, 8 rows x 32 columns (16 accumulators: 16 of AVX-512's 32 vector registers): ``_tile_*``;
* narrow, 4 rows x 16 columns (4 accumulators: 8 of AVX2's 16 registers, each 16-lane vector taking two there):
  ``_q_*``, for CPUs without AVX-512 (``kda_cpu.narrow_tiles``).

Both do one ``llvm.fma`` per output element per reduction step, in the caller's order: an element's bits do not
depend on the tile it sits in. numba inlines these into ``kda_cpu_kernel``'s cached machine code, whose cache
is invalidated by edits to that file only: it records this file's sha256 (``TILES_SHA256``, pinned by
tests/kernels/test_kda_cpu.py), so an edit here fails that test until the hash there is updated.
"""

from __future__ import annotations

import numpy as np

try:  # a pinned dependency; kda_cpu reports NUMBA_ERROR and the dispatch keeps the torch path without it
    import numba

    from ._simd import vfma, vload, vmul, vsplat, vstore, vzero
except ImportError:  # kda_cpu records why
    numba = None


def _njit(f=None, **kw):
    """numba.njit(cache=True, nogil=True), strict IEEE (no fast-math); the plain function without numba."""
    if f is None:
        return lambda g: _njit(g, **kw)
    return f if numba is None else numba.njit(cache=True, nogil=True, **kw)(f)


@_njit(inline="always")
def _tile_load(M, i, e):
    """The 8 x 32 tile M[i:i + 8, e:e + 32] as 16 vectors (row r: items 2r, 2r + 1)."""
    return (vload(M, i, e), vload(M, i, e + 16), vload(M, i + 1, e), vload(M, i + 1, e + 16),
            vload(M, i + 2, e), vload(M, i + 2, e + 16), vload(M, i + 3, e), vload(M, i + 3, e + 16),
            vload(M, i + 4, e), vload(M, i + 4, e + 16), vload(M, i + 5, e), vload(M, i + 5, e + 16),
            vload(M, i + 6, e), vload(M, i + 6, e + 16), vload(M, i + 7, e), vload(M, i + 7, e + 16))


@_njit(inline="always")
def _tile_zero():
    z = vzero()
    return z, z, z, z, z, z, z, z, z, z, z, z, z, z, z, z


@_njit(inline="always")
def _tile_store(M, i, e, acc):
    """M[i:i + 8, e:e + 32] = the 16 vectors of acc (row r: items 2r, 2r + 1)."""
    a0, b0, a1, b1, a2, b2, a3, b3, a4, b4, a5, b5, a6, b6, a7, b7 = acc
    vstore(M, i, e, a0)
    vstore(M, i, e + 16, b0)
    vstore(M, i + 1, e, a1)
    vstore(M, i + 1, e + 16, b1)
    vstore(M, i + 2, e, a2)
    vstore(M, i + 2, e + 16, b2)
    vstore(M, i + 3, e, a3)
    vstore(M, i + 3, e + 16, b3)
    vstore(M, i + 4, e, a4)
    vstore(M, i + 4, e + 16, b4)
    vstore(M, i + 5, e, a5)
    vstore(M, i + 5, e + 16, b5)
    vstore(M, i + 6, e, a6)
    vstore(M, i + 6, e + 16, b6)
    vstore(M, i + 7, e, a7)
    vstore(M, i + 7, e + 16, b7)


@_njit(inline="always")
def _tile_scale(acc, DEC, d):
    """Row r of the tile times DEC[0, d + r]."""
    a0, b0, a1, b1, a2, b2, a3, b3, a4, b4, a5, b5, a6, b6, a7, b7 = acc
    w = vsplat(DEC[0, d])
    a0, b0 = vmul(a0, w), vmul(b0, w)
    w = vsplat(DEC[0, d + 1])
    a1, b1 = vmul(a1, w), vmul(b1, w)
    w = vsplat(DEC[0, d + 2])
    a2, b2 = vmul(a2, w), vmul(b2, w)
    w = vsplat(DEC[0, d + 3])
    a3, b3 = vmul(a3, w), vmul(b3, w)
    w = vsplat(DEC[0, d + 4])
    a4, b4 = vmul(a4, w), vmul(b4, w)
    w = vsplat(DEC[0, d + 5])
    a5, b5 = vmul(a5, w), vmul(b5, w)
    w = vsplat(DEC[0, d + 6])
    a6, b6 = vmul(a6, w), vmul(b6, w)
    w = vsplat(DEC[0, d + 7])
    a7, b7 = vmul(a7, w), vmul(b7, w)
    return a0, b0, a1, b1, a2, b2, a3, b3, a4, b4, a5, b5, a6, b6, a7, b7


@_njit(inline="always")
def _tile_fma(W, i0, j0, di, dj, s, t, acc, neg):
    """Row r of the tile += w_r * (s | t) (or -= where neg), w_r = W[i0 + r*di, j0 + r*dj]: one step of the
    reduction for 8 output rows sharing the 32-column operand row (s | t); 16 independent FMAs."""
    a0, b0, a1, b1, a2, b2, a3, b3, a4, b4, a5, b5, a6, b6, a7, b7 = acc
    m = np.float32(-1.0) if neg else np.float32(1.0)   # exact: the FMAs of a - w s
    w = vsplat(W[i0, j0] * m)
    a0, b0 = vfma(w, s, a0), vfma(w, t, b0)
    w = vsplat(W[i0 + di, j0 + dj] * m)
    a1, b1 = vfma(w, s, a1), vfma(w, t, b1)
    w = vsplat(W[i0 + 2 * di, j0 + 2 * dj] * m)
    a2, b2 = vfma(w, s, a2), vfma(w, t, b2)
    w = vsplat(W[i0 + 3 * di, j0 + 3 * dj] * m)
    a3, b3 = vfma(w, s, a3), vfma(w, t, b3)
    w = vsplat(W[i0 + 4 * di, j0 + 4 * dj] * m)
    a4, b4 = vfma(w, s, a4), vfma(w, t, b4)
    w = vsplat(W[i0 + 5 * di, j0 + 5 * dj] * m)
    a5, b5 = vfma(w, s, a5), vfma(w, t, b5)
    w = vsplat(W[i0 + 6 * di, j0 + 6 * dj] * m)
    a6, b6 = vfma(w, s, a6), vfma(w, t, b6)
    w = vsplat(W[i0 + 7 * di, j0 + 7 * dj] * m)
    a7, b7 = vfma(w, s, a7), vfma(w, t, b7)
    return a0, b0, a1, b1, a2, b2, a3, b3, a4, b4, a5, b5, a6, b6, a7, b7


@_njit(inline="always")
def _q_load(M, i, e):
    """The 4 x 16 tile M[i:i + 4, e:e + 16] as 4 vectors (the narrow tiles, ``narrow`` in _sequences)."""
    return vload(M, i, e), vload(M, i + 1, e), vload(M, i + 2, e), vload(M, i + 3, e)


@_njit(inline="always")
def _q_store(M, i, e, acc):
    a0, a1, a2, a3 = acc
    vstore(M, i, e, a0)
    vstore(M, i + 1, e, a1)
    vstore(M, i + 2, e, a2)
    vstore(M, i + 3, e, a3)


@_njit(inline="always")
def _q_scale(acc, DEC, d):
    a0, a1, a2, a3 = acc
    return (vmul(a0, vsplat(DEC[0, d])), vmul(a1, vsplat(DEC[0, d + 1])), vmul(a2, vsplat(DEC[0, d + 2])),
            vmul(a3, vsplat(DEC[0, d + 3])))


@_njit(inline="always")
def _q_fma(W, i0, j0, di, dj, s, acc, neg):
    """_tile_fma for a 4 x 16 tile: row r += w_r * s (or -=), w_r = W[i0 + r*di, j0 + r*dj]."""
    a0, a1, a2, a3 = acc
    m = np.float32(-1.0) if neg else np.float32(1.0)
    a0 = vfma(vsplat(W[i0, j0] * m), s, a0)
    a1 = vfma(vsplat(W[i0 + di, j0 + dj] * m), s, a1)
    a2 = vfma(vsplat(W[i0 + 2 * di, j0 + 2 * dj] * m), s, a2)
    a3 = vfma(vsplat(W[i0 + 3 * di, j0 + 3 * dj] * m), s, a3)
    return a0, a1, a2, a3
