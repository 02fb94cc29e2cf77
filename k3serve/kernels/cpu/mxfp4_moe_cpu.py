"""Fused CPU kernel for the routed experts of one MoE layer on MXFP4 weights (numba, compiled once and cached).

One call per MoE layer and rank does what the per-expert loop of ``MoE._routed_partial`` does with 3 matmul
objects, a glu and an ``index_add_`` per active expert (about 15 torch ops per expert, each costing more than
its arithmetic on the small decode matrices, docs/mxfp4.md)::

    assignments (n, s) with ids[n, s] in [e0, e1)     counting sort by expert, rows ascending within an expert
    for each local expert e with rows R_e:
        for each weight row i of w1 / w3:  wrow = dequant(W[e, i, :])    (exact: E2M1 value * 2^(s - 127))
            G[r, i] = dot(z[r], wrow), U[r, i] = dot(z[r], wrow3)         for r in R_e
        h = glu(G, U)                                                     (silu or situ, fp32)
        for each weight row t of w2:       Y[r, t] = dot(h[r], dequant(W2[e, t, :]))
    out[n] = (0 + Y[n, e_a] * w[n, a]) + Y[n, e_b] * w[n, b] + ...      in ascending expert order

Numerics (why the result of a token never depends on its batch): every dot product of a row with a weight row
is one fp32 sum in input order, ``((0 + x_0 w_0) + x_1 w_1) + ... + x_{K-1} w_{K-1}``, with ``w_j`` the exact
dequantised weight. A row alone (``_mv4_packed``: decoded on the fly, four weight rows as four add chains)
and a row among m sharing the expert (``_dequant_row`` once per weight row, then ``_mv_rows``: vectorised
across the m rows, each lane its own row's sum) do the same operations in the same order, so nothing depends
on how many rows share the expert or the call, nor on the machine's vector width: numba compiles without
fast-math, so LLVM may not reassociate or contract to FMA (the dot products' bits are those of the source on
every CPU; the glu's exp / tanh are the platform libm's, the same on one machine image). The
weights are the exact values of :func:`k3serve.kernels.mxfp4.dequantize_mxfp4`; against ``F.linear`` on them
(the unfused path) only the summation order differs: equal within fp32 rounding, not bit for bit. With
``round_bf16`` the intermediates are rounded to bf16 where the unfused path casts to the activations' dtype
(after w1 / w3, after the glu, after w2), round to nearest even, so a bf16 model keeps its rounding points.
The glu's tanh / exp are libm's (fp32), not torch's vectorised ones: a last-ulp difference to ``norm.glu``.

Compile time: 5-7 s on the first call of a process without a cache (10-18 s on the loaded 2-core machine);
``cache=True`` writes the machine code next to this file (``__pycache__``), later processes load it in ~0.4 s;
``scripts/setup.sh`` compiles it once (:func:`warm_up`). numba is a pinned dependency; where it
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
def _mv_rows(xt, w4, m, acc4):
    """acc4[q, r] = sum_j xt[j, r] * w4[q, j] for r < m and the 4 weight rows q, each sum in input order
    j = 0, 1, ... (see the module doc). xt fp32 [K, >= m] (rows transposed), w4 fp32 [4, K] (decoded).
    The inner loop runs over rows: a plain elementwise loop, which LLVM vectorises across rows without
    reassociating anything, so a row gets the same bits in a vector lane as in the scalar remainder; four
    weight rows per pass share each load of x."""
    acc0, acc1, acc2, acc3 = acc4[0], acc4[1], acc4[2], acc4[3]
    for r in range(m):
        acc0[r] = acc1[r] = acc2[r] = acc3[r] = np.float32(0.0)
    for j in range(w4.shape[1]):
        w0, w1, w2, w3 = w4[0, j], w4[1, j], w4[2, j], w4[3, j]
        xj = xt[j]  # 1-D views: LLVM vectorises these loops (2-D indexing kept them scalar, 2x slower)
        for r in range(m):
            x = xj[r]
            acc0[r] += x * w0
            acc1[r] += x * w1
            acc2[r] += x * w2
            acc3[r] += x * w3


@_njit(inline="always")
def _mv4_packed(x, packed, scodes, e, i, pairs, stab, out, o):
    """out[o + q] = sum_j x[j] * W[e, i + q, j] for q < 4, weights decoded on the fly (one row sharing the
    expert): the same products (x * (E2M1 value * scale)) added in the same input order as _dequant_row then
    _mv_rows give, so bit for bit the same; four weight rows at once are four independent add chains."""
    a0 = a1 = a2 = a3 = np.float32(0.0)
    for b in range(packed.shape[2]):
        xl, xh = x[2 * b], x[2 * b + 1]
        g = b >> 4
        s0, s1, s2, s3 = stab[scodes[e, i, g]], stab[scodes[e, i + 1, g]], stab[scodes[e, i + 2, g]], \
            stab[scodes[e, i + 3, g]]
        c0, c1, c2, c3 = packed[e, i, b], packed[e, i + 1, b], packed[e, i + 2, b], packed[e, i + 3, b]
        a0 += xl * (pairs[c0, 0] * s0)
        a1 += xl * (pairs[c1, 0] * s1)
        a2 += xl * (pairs[c2, 0] * s2)
        a3 += xl * (pairs[c3, 0] * s3)
        a0 += xh * (pairs[c0, 1] * s0)
        a1 += xh * (pairs[c1, 1] * s1)
        a2 += xh * (pairs[c2, 1] * s2)
        a3 += xh * (pairs[c3, 1] * s3)
    out[o], out[o + 1], out[o + 2], out[o + 3] = a0, a1, a2, a3


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
    zt = np.empty((k_in, most), dtype=np.float32)  # the expert's rows, transposed
    gt = np.empty((inter, most), dtype=np.float32)  # w1 products, then the glu, transposed
    ut = np.empty((inter, most), dtype=np.float32)  # w3 products, transposed
    y = np.empty((total, k_in), dtype=np.float32)
    w4 = np.empty((4, k_in), dtype=np.float32)  # 4 decoded weight rows of w1 / w3
    h4 = np.empty((4, inter), dtype=np.float32)  # of w2
    acc4 = np.empty((4, most), dtype=np.float32)
    vg = np.empty(inter, dtype=np.float32)  # one row (m == 1): w1 / glu products, w3 products, w2 products
    vu = np.empty(inter, dtype=np.float32)
    vy = np.empty(k_in, dtype=np.float32)
    for e in range(n_exp):
        a0, a1 = count[e], count[e + 1]
        m = a1 - a0
        if m == 0:
            continue
        if m == 1:  # decode on the fly, four weight rows at a time
            x = z[a_row[a0]]
            for i in range(0, inter, 4):
                _mv4_packed(x, p1, s1, e, i, pairs, stab, vg, i)
                _mv4_packed(x, p3, s3, e, i, pairs, stab, vu, i)
            for i in range(inter):
                g, u = vg[i], vu[i]
                if round_bf16:
                    g, u = _bf16(g), _bf16(u)
                h = _glu(g, u, act, beta1, beta2)
                vg[i] = _bf16(h) if round_bf16 else h
            for t in range(0, k_in, 4):
                _mv4_packed(vg, p2, s2, e, t, pairs, stab, vy, t)
            for t in range(k_in):
                y[a0, t] = _bf16(vy[t]) if round_bf16 else vy[t]
            continue
        for r in range(m):  # decode each weight row once, multiply it with all m rows
            n = a_row[a0 + r]
            for j in range(k_in):
                zt[j, r] = z[n, j]
        for i in range(0, inter, 4):
            for q in range(4):
                _dequant_row(p1, s1, e, i + q, pairs, stab, w4[q])
            _mv_rows(zt, w4, m, acc4)
            for q in range(4):
                gt[i + q, :m] = acc4[q, :m]
            for q in range(4):
                _dequant_row(p3, s3, e, i + q, pairs, stab, w4[q])
            _mv_rows(zt, w4, m, acc4)
            for q in range(4):
                ut[i + q, :m] = acc4[q, :m]
        for i in range(inter):
            for r in range(m):
                g, u = gt[i, r], ut[i, r]
                if round_bf16:
                    g, u = _bf16(g), _bf16(u)
                h = _glu(g, u, act, beta1, beta2)
                gt[i, r] = _bf16(h) if round_bf16 else h
        for t in range(0, k_in, 4):
            for q in range(4):
                _dequant_row(p2, s2, e, t + q, pairs, stab, h4[q])
            _mv_rows(gt, h4, m, acc4)
            for q in range(4):
                for r in range(m):
                    y[a0 + r, t + q] = _bf16(acc4[q, r]) if round_bf16 else acc4[q, r]
    for a in range(total):  # in expert order: a row's contributions are added in ascending expert order
        n, wa = a_row[a], a_w[a]
        for t in range(k_in):
            out[n, t] += y[a, t] * wa
    return out


def warm_up() -> None:
    """Compile (or load from the cache) the one signature the MoE layer calls, on tiny inputs, so that the
    first model forward of a fresh checkout, or several Ray rank actors starting at once, do not each spend
    seconds compiling it (``scripts/setup.sh`` runs this once)."""
    if numba is None:
        raise RuntimeError(NUMBA_ERROR)
    pairs = np.zeros((256, 2), dtype=np.float32)
    stab = np.ones(256, dtype=np.float32)
    p13, s13 = np.zeros((1, 4, 16), dtype=np.uint8), np.zeros((1, 4, 1), dtype=np.uint8)
    p2, s2 = np.zeros((1, 32, 2), dtype=np.uint8), np.zeros((1, 32, 1), dtype=np.uint8)
    routed_moe_kernel(np.zeros((1, 32), dtype=np.float32), np.zeros((1, 1), dtype=np.int64),
                      np.ones((1, 1), dtype=np.float32), 0, p13, s13, p13, s13, p2, s2, pairs, stab,
                      ACT_SITU, np.float32(4.0), np.float32(25.0), True)
