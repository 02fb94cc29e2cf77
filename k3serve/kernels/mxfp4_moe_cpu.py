"""Fused CPU kernel for the routed experts of one MoE layer on MXFP4 weights (numba, compiled once and cached).

One call per MoE layer and rank does what the per-expert loop of ``MoE._routed_partial`` does with 3 matmul
objects, a glu and an ``index_add_`` per active expert (about 15 torch ops per expert, each costing more than
its arithmetic on the small decode matrices, docs/mxfp4.md)::

    assignments (n, s) with ids[n, s] in [e0, e1)     counting sort by expert, rows ascending within an expert
    for each local expert e with rows R_e:
        for each weight row i of w1 / w3:  wrow = dequant(W[e, i, :])    (exact: E2M1 value * 2^(s - 127))
            G[r, i] = dot8(z[r], wrow), U[r, i] = dot8(z[r], wrow3)       for r in R_e
        h = glu(G, U)                                                     (silu or situ, fp32)
        for each weight row t of w2:       Y[r, t] = dot8(h[r], dequant(W2[e, t, :]))
    out[n] = (0 + Y[n, e_a] * w[n, a]) + Y[n, e_b] * w[n, b] + ...      in ascending expert order

Numerics (why the result of a token never depends on its batch): every product is computed by one code path
per (row, weight row) pair, ``dot8`` below: 8 fp32 partial sums over the inputs j = 0..7 mod 8, added as
((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)). Nothing in it depends on how many rows share the expert or
the call, nor on the machine's vector width: numba compiles without fast-math, so LLVM may not reassociate,
contract to FMA, or pick a different order (the bits are those of the source, on every x86/ARM CPU). The
weights are the exact values of :func:`k3serve.kernels.mxfp4.dequantize_mxfp4`; against ``F.linear`` on them
(the unfused path) only the summation order differs: equal within fp32 rounding, not bit for bit. With
``round_bf16`` the intermediates are rounded to bf16 where the unfused path casts to the activations' dtype
(after w1 / w3, after the glu, after w2), round to nearest even, so a bf16 model keeps its rounding points.
The glu's tanh / exp are libm's (fp32), not torch's vectorised ones: a last-ulp difference to ``norm.glu``.

Compile time: ~2-4 s on the first call of a process without a cache; ``cache=True`` writes the machine code
next to this file (``__pycache__``), later processes load it in ~0.1 s. numba is a pinned dependency; where it
cannot be imported, :data:`NUMBA_ERROR` says why and the MoE layer keeps the unfused path (``moe_mxfp4.py``).
"""

from __future__ import annotations

import numpy as np

try:  # a pinned dependency (pyproject.toml); a platform without its wheel keeps the unfused torch path
    import numba

    NUMBA_ERROR = ""
except ImportError as err:  # recorded and reported by k3serve.model.layers.moe_mxfp4, not swallowed
    numba = None
    NUMBA_ERROR = f"numba could not be imported ({err})"

ACT_SILU, ACT_SITU = 0, 1
ACTS = {"silu": ACT_SILU, "situ": ACT_SITU}


def _njit(**kw):
    """numba.njit(cache=True, nogil=True, no fast-math) where numba imports; the plain function otherwise (never
    called then: the layer checks :data:`NUMBA_ERROR` first)."""
    if numba is None:
        return lambda f: f
    return numba.njit(cache=True, nogil=True, **kw)


@_njit(inline="always")
def _bf16(v):
    """fp32 -> the nearest bf16 (ties to even), kept as fp32; NaN stays NaN (a quiet NaN's payload is kept)."""
    if v != v:
        return v
    u = np.float32(v).view(np.uint32)
    u = np.uint32((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000))
    return u.view(np.float32)


@_njit(inline="always")
def _dequant_row(packed, scodes, e, i, pairs, stab, out):
    """Row i of expert e: packed uint8 [E, O, K/2], scodes uint8 [E, O, K/32] -> out fp32 [K], exact values."""
    half = packed.shape[2]
    for b in range(half):
        s = stab[scodes[e, i, b >> 4]]
        byte = packed[e, i, b]
        out[2 * b] = pairs[byte, 0] * s
        out[2 * b + 1] = pairs[byte, 1] * s


@_njit(inline="always")
def _dot8(x, r, wrow):
    """sum_j x[r, j] * wrow[j] in the fixed order of the module doc (len a multiple of 8)."""
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
    for j in range(0, wrow.shape[0], 8):
        a0 += x[r, j] * wrow[j]
        a1 += x[r, j + 1] * wrow[j + 1]
        a2 += x[r, j + 2] * wrow[j + 2]
        a3 += x[r, j + 3] * wrow[j + 3]
        a4 += x[r, j + 4] * wrow[j + 4]
        a5 += x[r, j + 5] * wrow[j + 5]
        a6 += x[r, j + 6] * wrow[j + 6]
        a7 += x[r, j + 7] * wrow[j + 7]
    return ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))


@_njit(inline="always")
def _dot8_packed(x, r, packed, scodes, e, i, pairs, stab):
    """:func:`_dot8` of x's row r with row i of expert e decoded on the fly (one row sharing the expert: the
    decoded row is not stored). The same products (x * (E2M1 value * scale)) into the same lanes, added in the
    same order: bit for bit what _dequant_row then _dot8 give."""
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
    for b in range(0, packed.shape[2], 4):  # 4 bytes = inputs j .. j + 7, lane l takes input j + l
        j = 2 * b
        s = stab[scodes[e, i, b >> 4]]
        c0, c1, c2, c3 = packed[e, i, b], packed[e, i, b + 1], packed[e, i, b + 2], packed[e, i, b + 3]
        a0 += x[r, j] * (pairs[c0, 0] * s)
        a1 += x[r, j + 1] * (pairs[c0, 1] * s)
        a2 += x[r, j + 2] * (pairs[c1, 0] * s)
        a3 += x[r, j + 3] * (pairs[c1, 1] * s)
        a4 += x[r, j + 4] * (pairs[c2, 0] * s)
        a5 += x[r, j + 5] * (pairs[c2, 1] * s)
        a6 += x[r, j + 6] * (pairs[c3, 0] * s)
        a7 += x[r, j + 7] * (pairs[c3, 1] * s)
    return ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))


@_njit(inline="always")
def _glu(g, u, act, beta1, beta2):
    """norm.glu on one element, fp32: (g / (1 + exp(-g))) * u, or (b1 tanh(g / b1) sigmoid(g)) (b2 tanh(u / b2))."""
    one = np.float32(1.0)
    if act == 0:
        return (g / (one + np.exp(-g))) * u
    sig = one / (one + np.exp(-g))
    return ((np.tanh(g / beta1) * beta1) * sig) * (np.tanh(u / beta2) * beta2)


@_njit()
def routed_moe_kernel(z, ids, w, e0, p1, s1, p3, s3, p2, s2, pairs, stab, act, beta1, beta2, round_bf16):
    """The module doc's loop. z fp32 [N, K]; ids int64 [N, k]; w fp32 [N, k]; e0: global id of local expert 0;
    p1, p3 uint8 [E, I, K/2], s1, s3 uint8 [E, I, K/32] (w1, w3); p2 uint8 [E, K, I/2], s2 uint8 [E, K, I/32]
    (w2); pairs fp32 [256, 2] (a byte's low / high E2M1 value); stab fp32 [256] (2^(s - 127), NaN at 255);
    act 0 silu / 1 situ; beta1, beta2 fp32 -> out fp32 [N, K] (rows routed to no local expert are 0)."""
    n_rows, k_in = z.shape
    slots = ids.shape[1]
    n_exp, inter = p1.shape[0], p1.shape[1]
    out = np.zeros((n_rows, k_in), dtype=np.float32)
    count = np.zeros(n_exp + 1, dtype=np.int64)
    for n in range(n_rows):
        for s in range(slots):
            e = ids[n, s] - e0
            if 0 <= e < n_exp:
                count[e + 1] += 1
    for e in range(n_exp):
        count[e + 1] += count[e]
    total = count[n_exp]
    if total == 0:
        return out
    fill = count[:n_exp].copy()
    a_row = np.empty(total, dtype=np.int64)  # assignments sorted by expert, rows ascending (a counting sort)
    a_w = np.empty(total, dtype=np.float32)
    for n in range(n_rows):
        for s in range(slots):
            e = ids[n, s] - e0
            if 0 <= e < n_exp:
                a_row[fill[e]] = n
                a_w[fill[e]] = w[n, s]
                fill[e] += 1
    most = 0
    for e in range(n_exp):
        most = max(most, count[e + 1] - count[e])
    zr = np.empty((most, k_in), dtype=np.float32)  # the expert's rows, contiguous
    gate = np.empty((most, inter), dtype=np.float32)
    up = np.empty((most, inter), dtype=np.float32)
    y = np.empty((total, k_in), dtype=np.float32)
    wrow = np.empty(k_in, dtype=np.float32)
    hrow = np.empty(inter, dtype=np.float32)
    for e in range(n_exp):
        a0, a1 = count[e], count[e + 1]
        m = a1 - a0
        if m == 0:
            continue
        for r in range(m):
            zr[r, :] = z[a_row[a0 + r], :]
        for i in range(inter):
            if m == 1:
                gate[0, i] = _dot8_packed(zr, 0, p1, s1, e, i, pairs, stab)
                up[0, i] = _dot8_packed(zr, 0, p3, s3, e, i, pairs, stab)
                continue
            _dequant_row(p1, s1, e, i, pairs, stab, wrow)
            for r in range(m):
                gate[r, i] = _dot8(zr, r, wrow)
            _dequant_row(p3, s3, e, i, pairs, stab, wrow)
            for r in range(m):
                up[r, i] = _dot8(zr, r, wrow)
        for r in range(m):
            for i in range(inter):
                g, u = gate[r, i], up[r, i]
                if round_bf16:
                    g, u = _bf16(g), _bf16(u)
                h = _glu(g, u, act, beta1, beta2)
                gate[r, i] = _bf16(h) if round_bf16 else h
        for t in range(k_in):
            if m == 1:
                v = _dot8_packed(gate, 0, p2, s2, e, t, pairs, stab)
                y[a0, t] = _bf16(v) if round_bf16 else v
                continue
            _dequant_row(p2, s2, e, t, pairs, stab, hrow)
            for r in range(m):
                v = _dot8(gate, r, hrow)
                y[a0 + r, t] = _bf16(v) if round_bf16 else v
    for a in range(total):  # in expert order: a row's contributions are added in ascending expert order
        n, wa = a_row[a], a_w[a]
        for t in range(k_in):
            out[n, t] += y[a, t] * wa
    return out
