"""The numba code of the fused CPU KDA kernel (``kda_cpu`` wraps it): one run of consecutive (batch, head) sequences
per prange task, walked chunk by chunk, each chunk's stages on cache-resident scratch.

Scratch layout (per run, allocated once by ``_sequences``; the state S per sequence); Kp, Vp = K, V rounded up to a
multiple of 32 (padding columns are zero: q = k = g = v = 0 there, which is inert, see ``kda_cpu``)::

    G    fp64 [C, Kp]        cumulative gate within the chunk, G[i] = g[0] + ... + g[i]
    QS   fp32 [C, Kp]        q * scale;   KS [C, Kp] k;   BETA [C] beta (0 on padding rows)
    DM   fp32 [C, Kp]        G[i] - G[m(i)], m(i) = middle row of i's 16-row sub-chunk (fp64 difference, rounded once)
    QF, KF fp32 [16, Kp]     row-factored q, k of the current sub-chunk
    KC   fp32 [C, Kp]        column-factored k;  KCT [Kp, C] the same transposed (columns j contiguous, for tiles over j)
    A    fp32 [C, C]         Aqk (lower triangle incl. diagonal);  L [C, C] beta_i Akk (strictly lower)
    TI   fp32 [C, C]         (I + L)^-1
    X    fp32 [C, Kp + Vp]   [ W | U ], then [ W | Vn ]:   col 0 ........ Kp ........ Kp + Vp
                                                               | beta e^G k  | beta v      |  (right-hand side)
                                                               |      W      |  U -> Vn    |  (after solve, state_step)
    QG   fp32 [C, Kp]        q e^G;   KD [C, Kp] k e^(G_last - G);   DEC [1, Kp] e^(G_last)
    OB   fp32 [C, Vp]        the chunk's output rows
    S    fp32 [Kp, Vp]       the state entering the chunk; updated in place to the state after it

Every stage reads only the chunk's rows and S, in fixed loop orders, so a chunk's bits depend on nothing else
(not on T, B, H, the chunk's position in the call, nor the thread that runs it). The decay factors, the
flush of values <= _TINY and the centred / pairwise choice are those of ``kda_torch`` (its module docstring);
numba compiles without fast-math and every multiply-add is an explicit ``llvm.fma`` (``_simd``).

Register tiles: a block of output rows x 16-lane columns held in vector registers across a reduction, as tuples
of ``_simd`` vectors (inlined into the stages): wide, 8 rows x 32 columns (16 accumulators: 16 of AVX-512's 32
vector registers), ``_tile_*``; narrow, 4 rows x 16 columns (4 accumulators: 8 of AVX2's 16 registers, each
16-lane vector taking two there), ``_q_*``, for CPUs without AVX-512 (``kda_cpu.narrow_tiles``). Both do one
``llvm.fma`` per output element per reduction step, in the caller's order: an element's bits do not depend on the
tile it sits in.

numba's cache (``cache=True``, under ``__pycache__``) is invalidated by changes to THIS file only: machine code
compiled from ``_simd`` (inlined here) or constants copied from elsewhere would go stale silently. So the tiles and
the constants live here (tests/kernels/test_kda_cpu.py pins the constants to kda_torch's) and :data:`SIMD_SHA256`
records the ``_simd.py`` this code was compiled against (the same test fails until it is updated, which edits
this file).
"""

from __future__ import annotations

import math

import numpy as np

try:  # a pinned dependency; kda_cpu reports NUMBA_ERROR and the dispatch keeps the torch path without it
    import numba

    from ._simd import (vcum, vdiff, vexp, vflush, vfma, vfnma, vhmax, vhsum, vload, vloadd, vmaxabs, vmul,
                        vneg, vsplat, vstore, vtranspose, vzero)
except ImportError:  # kda_cpu records why
    numba = None

SIMD_SHA256 = "d8100f525d45a69ca0e70025979a651314ddd01342caa42a3a1aa2ed8c2b4e29"
SUB = 16                      # rows per sub-chunk of the decayed scores (kda_torch's sub_chunk)
PAD = 32                      # K, V padded to a multiple of this inside (the register tiles are 32 columns wide)
# kda_torch's flush threshold, exp clamp and centred-span bound (same values, pinned by a test)
_LOG_TINY = -34.5
_TINY = math.exp(_LOG_TINY)
_MAX_HALF_SPAN = 60.0
_LO = np.float32(_LOG_TINY - 1.0)   # exp arguments are clamped here before the flush (kda_torch._exp_flush)
_FTINY = np.float32(_TINY)
_CENTRED_LO = np.float32(-87.0)     # centred factors: |arguments| <= _MAX_HALF_SPAN, never clamped nor flushed


def _njit(f=None, **kw):
    """numba.njit(cache=True, nogil=True), strict IEEE (no fast-math); the plain function without numba."""
    if f is None:
        return lambda g: _njit(g, **kw)
    return f if numba is None else numba.njit(cache=True, nogil=True, **kw)(f)


# ------------------------------------------------------------------------------------------------ register tiles
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


# ------------------------------------------------------------------------------------------------ the stages
@_njit
def load_rows(c, b, h, H, T, q, k, v, g, beta, scale, G, QS, KS, X, BETA):
    """Chunk c of sequence (b, h) into the scratch rows (zero rows past T; G keeps its last value there).

    q, k, g: fp32 [B*T*H, Ki], v: [B*T*H, Vi] (Ki, Vi multiples of 16), beta: [B*T*H]; token t of (b, h) is
    row (b*T + t)*H + h. Writes G, QS, KS, X[:, Kp:Kp + Vi] (= beta v), BETA.
    """
    C, Kp = G.shape
    Ki, Vi = q.shape[1], v.shape[1]
    sc = vsplat(scale)
    for i in range(C):
        t = c * C + i
        if t < T:
            row = (b * T + t) * H + h
            BETA[i] = beta[row]
            bv = vsplat(beta[row])
            for d in range(0, Ki, 16):
                vstore(QS, i, d, vmul(vload(q, row, d), sc))
                vstore(KS, i, d, vload(k, row, d))
                vcum(G, i, max(i - 1, 0), i == 0, g, row, d)
            for e in range(0, Vi, 16):
                vstore(X, i, Kp + e, vmul(vload(v, row, e), bv))
        else:  # zero padding of the last chunk: inert (k = v = beta = 0, g = 0 keeps G and so G_last)
            BETA[i] = 0.0
            for d in range(Ki):
                QS[i, d] = 0.0
                KS[i, d] = 0.0
                G[i, d] = G[i - 1, d] if i > 0 else 0.0
            for e in range(Vi):
                X[i, Kp + e] = 0.0


@_njit
def _score_tile(QF, KF, KCT, j0, A, L, r, BETA, last):
    """A[r + ii, j0:j0 + 16] = sum_d QF[ii, d] KCT[d, j0:j0 + 16] and L[r + ii, j0:j0 + 16] = beta_{r+ii} x the same
    from KF, for the 16 rows ii of a sub-chunk (two passes of 8 rows: 16 accumulators + the shared KCT row in
    registers). Lane l of row ii is kept where l <= last + ii (A) or l < last + ii (L) and |value| > _TINY, else
    0: last = 0 is the diagonal block's triangle, last = 16 keeps every lane (columns of earlier sub-chunks)."""
    Kp = QF.shape[1]
    for i0 in range(0, SUB, 8):
        a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = vzero()
        l0 = l1 = l2 = l3 = l4 = l5 = l6 = l7 = vzero()
        for d in range(Kp):
            kc = vload(KCT, d, j0)
            a0, l0 = vfma(vsplat(QF[i0, d]), kc, a0), vfma(vsplat(KF[i0, d]), kc, l0)
            a1, l1 = vfma(vsplat(QF[i0 + 1, d]), kc, a1), vfma(vsplat(KF[i0 + 1, d]), kc, l1)
            a2, l2 = vfma(vsplat(QF[i0 + 2, d]), kc, a2), vfma(vsplat(KF[i0 + 2, d]), kc, l2)
            a3, l3 = vfma(vsplat(QF[i0 + 3, d]), kc, a3), vfma(vsplat(KF[i0 + 3, d]), kc, l3)
            a4, l4 = vfma(vsplat(QF[i0 + 4, d]), kc, a4), vfma(vsplat(KF[i0 + 4, d]), kc, l4)
            a5, l5 = vfma(vsplat(QF[i0 + 5, d]), kc, a5), vfma(vsplat(KF[i0 + 5, d]), kc, l5)
            a6, l6 = vfma(vsplat(QF[i0 + 6, d]), kc, a6), vfma(vsplat(KF[i0 + 6, d]), kc, l6)
            a7, l7 = vfma(vsplat(QF[i0 + 7, d]), kc, a7), vfma(vsplat(KF[i0 + 7, d]), kc, l7)
        i, n = r + i0, last + i0
        for rr, a, l in ((0, a0, l0), (1, a1, l1), (2, a2, l2), (3, a3, l3),
                         (4, a4, l4), (5, a5, l5), (6, a6, l6), (7, a7, l7)):
            vstore(A, i + rr, j0, vflush(a, _FTINY, n + rr))
            vstore(L, i + rr, j0, vflush(vmul(l, vsplat(BETA[i + rr])), _FTINY, n + rr - 1))


@_njit
def _score_tile_narrow(QF, KF, KCT, j0, A, L, r, BETA, last):
    """_score_tile in passes of 2 rows (4 accumulators, 8 ymm registers: its 8-row passes hold 16, 32 on AVX2):
    the same FMAs per element in the same order, the same bits."""
    Kp = QF.shape[1]
    for i0 in range(0, SUB, 2):
        a0 = a1 = l0 = l1 = vzero()
        for d in range(Kp):
            kc = vload(KCT, d, j0)
            a0, l0 = vfma(vsplat(QF[i0, d]), kc, a0), vfma(vsplat(KF[i0, d]), kc, l0)
            a1, l1 = vfma(vsplat(QF[i0 + 1, d]), kc, a1), vfma(vsplat(KF[i0 + 1, d]), kc, l1)
        i, n = r + i0, last + i0
        vstore(A, i, j0, vflush(a0, _FTINY, n))
        vstore(L, i, j0, vflush(vmul(l0, vsplat(BETA[i])), _FTINY, n - 1))
        vstore(A, i + 1, j0, vflush(a1, _FTINY, n + 1))
        vstore(L, i + 1, j0, vflush(vmul(l1, vsplat(BETA[i + 1])), _FTINY, n))


@_njit
def scores(G, QS, KS, DM, QF, KF, KC, KCT, A, L, BETA, narrow):
    """A (Aqk) and L (beta Akk, strictly lower) of the chunk, with kda_torch's decay factors:

    * rows of sub-chunk I >= 1 against columns j of earlier sub-chunks (r = first row of I):
      exp(G_i - G_j) = exp(G_i - G_r) * exp(G_r - G_j), both exponents <= 0, each factor flushed;
    * the diagonal blocks "centred" through the middle row m when every |G_i - G_m| of the chunk is
      <= _MAX_HALF_SPAN (one decision per chunk, as kda_torch): exp(G_i - G_m) * exp(G_m - G_j);
    * otherwise "pairwise": exp(G_i - G_j) per pair and channel (exact for any decay), lanes over K.
    """
    C, Kp = G.shape
    mx = vzero()
    for i in range(C):
        m = (i // SUB) * SUB + SUB // 2
        for d in range(0, Kp, 16):
            dm = vdiff(G, i, d, m)
            vstore(DM, i, d, dm)
            mx = vmaxabs(mx, dm)
    centred = vhmax(mx) <= _MAX_HALF_SPAN
    for I in range(1, C // SUB):
        r = I * SUB
        for ii in range(SUB):
            for d in range(0, Kp, 16):
                f = vexp(vdiff(G, r + ii, d, r), _LO, _FTINY)
                vstore(QF, ii, d, vmul(vload(QS, r + ii, d), f))
                vstore(KF, ii, d, vmul(vload(KS, r + ii, d), f))
        for j in range(r):
            for d in range(0, Kp, 16):
                vstore(KC, j, d, vmul(vload(KS, j, d), vexp(vdiff(G, r, d, j), _LO, _FTINY)))
        for j0 in range(0, r, SUB):
            for d in range(0, Kp, 16):
                vtranspose(KC, j0, d, KCT, d, j0)
            if narrow:
                _score_tile_narrow(QF, KF, KCT, j0, A, L, r, BETA, SUB)
            else:
                _score_tile(QF, KF, KCT, j0, A, L, r, BETA, SUB)
    for r in range(0, C, SUB):
        if centred:
            for ii in range(SUB):
                for d in range(0, Kp, 16):
                    dm = vload(DM, r + ii, d)
                    f = vexp(dm, _CENTRED_LO, np.float32(0.0))
                    ks = vload(KS, r + ii, d)
                    vstore(QF, ii, d, vmul(vload(QS, r + ii, d), f))
                    vstore(KF, ii, d, vmul(ks, f))
                    vstore(KC, r + ii, d, vmul(ks, vexp(vneg(dm), _CENTRED_LO, np.float32(0.0))))
            for d in range(0, Kp, 16):
                vtranspose(KC, r, d, KCT, d, r)
            if narrow:
                _score_tile_narrow(QF, KF, KCT, r, A, L, r, BETA, 0)
            else:
                _score_tile(QF, KF, KCT, r, A, L, r, BETA, 0)
            continue
        for ii in range(SUB):
            i = r + ii
            for jj in range(SUB):
                j = r + jj
                sa = sl = np.float32(0.0)
                if jj <= ii:
                    a = lk = vzero()
                    for d in range(0, Kp, 16):
                        f = vmul(vexp(vdiff(G, i, d, j), _LO, _FTINY), vload(KS, j, d))
                        a = vfma(vload(QS, i, d), f, a)
                        lk = vfma(vload(KS, i, d), f, lk)
                    sa, sl = vhsum(a), vhsum(lk) * BETA[i]
                A[i, j] = sa if abs(sa) > _TINY else np.float32(0.0)
                L[i, j] = sl if jj < ii and abs(sl) > _TINY else np.float32(0.0)


@_njit
def gates(G, QS, KS, X, QG, KD, DEC, BETA):
    """QG = q e^G, X[:, :Kp] = beta (k e^G), KD = k e^(G_last - G), DEC = e^(G_last) (all factors flushed)."""
    C, Kp = G.shape
    last = C - 1
    for d in range(0, Kp, 16):
        vstore(DEC, 0, d, vexp(vloadd(G, last, d), _LO, _FTINY))
    for i in range(C):
        bi = vsplat(BETA[i])
        for d in range(0, Kp, 16):
            eg = vexp(vloadd(G, i, d), _LO, _FTINY)
            ks = vload(KS, i, d)
            vstore(QG, i, d, vmul(vload(QS, i, d), eg))
            vstore(X, i, d, vmul(vmul(ks, eg), bi))
            vstore(KD, i, d, vmul(ks, vexp(vdiff(G, last, d, i), _LO, _FTINY)))


@_njit
def solve_narrow(TI, X):
    """``solve``'s X <- TI X (TI already formed) in 4 x 16 tiles: the same FMAs per element in the same order
    (a 4-row tile's rows stop at its own block; TI is zero above its diagonal, so the 8-row tile's extra terms
    add exact zeros)."""
    C, W = TI.shape[0], X.shape[1]
    z = vzero()
    for i in range(C - 4, -1, -4):   # bottom-up, in place: rows j <= i + 3 still hold the right-hand side
        for e in range(0, W, 16):
            acc = (z, z, z, z)
            for j in range(i + 4):
                acc = _q_fma(TI, i, j, 1, 0, vload(X, j, e), acc, False)
            _q_store(X, i, e, acc)


@_njit
def state_step_narrow(S, X, QG, KD, DEC, A, OB):
    """``state_step`` in 4 x 16 tiles (8 accumulator registers of AVX2's 16), per 16-column block of V: every
    element's FMAs and their order are ``state_step``'s (A is zero above its diagonal: see solve_narrow)."""
    C, Kp = QG.shape
    z = vzero()
    for e in range(0, S.shape[1], 16):
        ue = Kp + e
        for i in range(0, C, 4):
            acc = _q_load(X, i, ue)
            for d in range(Kp):
                acc = _q_fma(X, i, d, 1, 0, vload(S, d, e), acc, True)
            _q_store(X, i, ue, acc)
        for i in range(0, C, 4):
            acc = (z, z, z, z)
            for d in range(Kp):
                acc = _q_fma(QG, i, d, 1, 0, vload(S, d, e), acc, False)
            for j in range(i + 4):
                acc = _q_fma(A, i, j, 1, 0, vload(X, j, ue), acc, False)
            _q_store(OB, i, e, acc)
        for d in range(0, Kp, 4):
            acc = _q_scale(_q_load(S, d, e), DEC, d)
            for i in range(C):
                acc = _q_fma(KD, i, d, 0, 1, vload(X, i, ue), acc, False)
            _q_store(S, d, e, acc)


@_njit
def solve(L, TI, X, narrow):
    """X <- (I + L)^-1 X.

    TI = (I + L)^-1 row by row (forward substitution: TI_i = e_i - sum_{j<i} L_ij TI_j), each row flushed as
    soon as it is formed, then X = TI X. Forward substitution straight on X was not kept: its rows feed the
    next rows without a flush, and chains of products of tiny factors went subnormal (x86 runs those in
    microcode: 2-3x slower on the unbounded gate, and at C = 64 on the bounded one). TI's flushed
    entries are >= _TINY like kda_torch's flushed inverse, so X's products stay normal.
    """
    C, W = L.shape[0], X.shape[1]
    for i in range(C):
        for c0 in range(0, C, 16):
            acc = vzero()
            for j in range(i):
                acc = vfnma(vsplat(L[i, j]), vload(TI, j, c0), acc)
            vstore(TI, i, c0, vflush(acc, _FTINY, 15))
        TI[i, i] = 1.0
    if narrow:
        solve_narrow(TI, X)
        return
    zero = _tile_zero()
    for i in range(C - 8, -1, -8):   # bottom-up, in place: rows j <= i + 7 still hold the right-hand side
        for e in range(0, W, 32):
            acc = zero
            for j in range(i + 8):
                acc = _tile_fma(TI, i, j, 1, 0, vload(X, j, e), vload(X, j, e + 16), acc, False)
            _tile_store(X, i, e, acc)


@_njit
def state_step(S, X, QG, KD, DEC, A, OB):
    """The sequential part, per 32-column block e of V (the block of S stays in cache for all three):

        Vn = U - W S            (X[:, Kp + e..] in place)
        O  = (Q e^G) S + A Vn   (OB[:, e..]; A is zero above the diagonal, so its rows stop at their block)
        S  = Diag(DEC) S + KD^T Vn

    Each is an 8-row x 32-column register tile (16 accumulators: enough independent FMAs to hide their
    latency; 4-row tiles were 3-16% slower on AVX-512) over the reduction, in fixed order. Without AVX-512 those
    16 accumulators take 32 registers of 16: ``state_step_narrow`` (4 x 16 tiles) runs instead, same bits.
    """
    C, Kp = QG.shape
    zero = _tile_zero()
    for e in range(0, S.shape[1], 32):
        ue = Kp + e
        for i in range(0, C, 8):
            acc = _tile_load(X, i, ue)
            for d in range(Kp):
                acc = _tile_fma(X, i, d, 1, 0, vload(S, d, e), vload(S, d, e + 16), acc, True)
            _tile_store(X, i, ue, acc)
        for i in range(0, C, 8):
            acc = zero
            for d in range(Kp):
                acc = _tile_fma(QG, i, d, 1, 0, vload(S, d, e), vload(S, d, e + 16), acc, False)
            for j in range(i + 8):
                acc = _tile_fma(A, i, j, 1, 0, vload(X, j, ue), vload(X, j, ue + 16), acc, False)
            _tile_store(OB, i, e, acc)
        for d in range(0, Kp, 8):
            acc = _tile_load(S, d, e)
            acc = _tile_scale(acc, DEC, d)
            for i in range(C):
                acc = _tile_fma(KD, i, d, 0, 1, vload(X, i, ue), vload(X, i, ue + 16), acc, False)
            _tile_store(S, d, e, acc)


@_njit
def _sequences(s0, s1, T, H, q, k, v, g, beta, scale, final, out, C, narrow):
    """Sequences s0 .. s1 - 1 (bh = b*H + h), chunk by chunk in lockstep: chunk c of each, then chunk c + 1, so
    the rows of a token's adjacent heads are read together (one pass over memory; a head at a time re-read the
    other heads' lines of every row, 1.5-2x slower at 2 threads). final: fp32 [B, H, K, V], initial
    states in, final states out; out: fp32 [B*T*H, Vi] (row of token t: (b*T + t)*H + h). Each sequence has its
    own state S; the per-chunk scratch is shared (every chunk rewrites what it reads, see the module docstring)."""
    K, V = final.shape[2], final.shape[3]
    Kp, Vp = -(-K // PAD) * PAD, -(-V // PAD) * PAD
    S = np.zeros((s1 - s0, Kp, Vp), dtype=np.float32)
    for j in range(s1 - s0):
        S[j, :K, :V] = final[(s0 + j) // H, (s0 + j) % H]
    G = np.zeros((C, Kp), dtype=np.float64)
    DM, QS, KS = np.zeros((C, Kp), np.float32), np.zeros((C, Kp), np.float32), np.zeros((C, Kp), np.float32)
    QG, KD = np.zeros((C, Kp), np.float32), np.zeros((C, Kp), np.float32)
    QF, KF = np.zeros((SUB, Kp), dtype=np.float32), np.zeros((SUB, Kp), dtype=np.float32)
    KC, KCT = np.zeros((C, Kp), dtype=np.float32), np.zeros((Kp, C), dtype=np.float32)
    # A and L above the sub-chunk blocks are never written: zero once, for every chunk
    A, L, TI = np.zeros((C, C), np.float32), np.zeros((C, C), np.float32), np.zeros((C, C), np.float32)
    X = np.zeros((C, Kp + Vp), dtype=np.float32)
    DEC, BETA = np.zeros((1, Kp), dtype=np.float32), np.zeros(C, dtype=np.float32)
    OB = np.zeros((C, Vp), dtype=np.float32)
    for c in range((T + C - 1) // C):
        for j in range(s1 - s0):
            b, h = (s0 + j) // H, (s0 + j) % H
            load_rows(c, b, h, H, T, q, k, v, g, beta, scale, G, QS, KS, X, BETA)
            scores(G, QS, KS, DM, QF, KF, KC, KCT, A, L, BETA, narrow)
            gates(G, QS, KS, X, QG, KD, DEC, BETA)
            solve(L, TI, X, narrow)
            if narrow:
                state_step_narrow(S[j], X, QG, KD, DEC, A, OB)
            else:
                state_step(S[j], X, QG, KD, DEC, A, OB)
            for i in range(min(C, T - c * C)):
                row = (b * T + c * C + i) * H + h
                for e in range(0, out.shape[1], 16):
                    vstore(out, row, e, vload(OB, i, e))
    for j in range(s1 - s0):
        final[(s0 + j) // H, (s0 + j) % H] = S[j, :K, :V]


@_njit(parallel=True)
def chunk_kda_kernel(T, H, q, k, v, g, beta, scale, final, out, C, tasks, narrow):
    """q, k, g fp32 [B*T*H, Ki], v [B*T*H, Vi], beta [B*T*H] (Ki, Vi multiples of 16, row (b*T + t)*H + h),
    scale fp32, final fp32 [B, H, K, V] (initial state in, final state out), out fp32 [B*T*H, Vi], C the chunk
    size (a multiple of 16). The B*H sequences are cut into ``tasks`` runs of consecutive sequences (one prange
    task each: the caller passes its thread count; reading numba.get_num_threads() here would make the function
    uncacheable); a sequence's bits do not depend on the run it is in. narrow: the narrow register tiles
    (kda_cpu.narrow_tiles: CPUs without AVX-512), the same bits."""
    BH = final.shape[0] * final.shape[1]
    n = max(1, min(tasks, BH))
    for task in numba.prange(n):
        _sequences(task * BH // n, (task + 1) * BH // n, T, H, q, k, v, g, beta, scale, final, out, C, narrow)
