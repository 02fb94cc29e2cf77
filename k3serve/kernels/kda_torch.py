"""Vectorised torch KDA for the CPU: a chunked (WY) form for prefill and a token loop.

Chunked form (MODEL.md section 2, "Chunked form"), per head and chunk of C tokens with
state S at the chunk start, G_i = sum_{s<=i} g_s (cumulative within the chunk):
    Gamma_ij = exp(G_i - G_j)                         (j <= i only; masked BEFORE exp)
    L_ij     = beta_i sum_d k_i[d] k_j[d] Gamma_ij[d]  (j < i)
    Aqk_ij   =        sum_d q_i[d] k_j[d] Gamma_ij[d]  (j <= i)
    W = (I + L)^-1 Diag(beta) (exp(G) * K),  U = (I + L)^-1 Diag(beta) V
    Vn = U - W S;  O = (Q * exp(G)) S + Aqk Vn
    S <- Diag(exp(G_last)) S + (K * exp(G_last - G))^T Vn

The chunk is split into sub-chunks of ``sub_chunk`` rows for the decayed scores (Gamma):
  * row i in sub-chunk I against an EARLIER column j (j < r, r = first row of I):
    exp(G_i - G_j) = exp(G_i - G_r) * exp(G_r - G_j), both exponents <= 0 (G is
    non-increasing), so this is one batched matmul;
  * inside sub-chunk I (the diagonal block), either
      - "centred" (fast): exp(G_i - G_m) * exp(G_m - G_j) through the middle row m, used
        when every |G_i - G_m| <= _MAX_HALF_SPAN (always true for the K3 gate, g > -5, at
        sub_chunk = 16: at most 8 steps * 5 = 40), or
      - "pairwise" (exact for any decay, e.g. large Kimi-Linear decays): the [sub, sub, K]
        Gamma tensor with the upper triangle masked before exp.

Numerics:
  * G and all its differences are fp64 and drop to fp32 just before exp: in fp32,
    G_i - G_j loses |G| * 2^-24 (|G| reaches hundreds per chunk), ~1e-5 relative error.
  * Decay factors <= 1 below _TINY (1e-15) are flushed to exactly 0, and exp never sees
    arguments below log(_TINY) - 1. x86 CPUs handle subnormal operands and underflowing
    products in microcode: without the flush, exps of -300 and matmuls on products like
    1e-20 * 1e-20 ran 20-60x slower. Dropped terms are < 1e-15 relative.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ._kda_common import check_kda_inputs, default_scale

# Upper bound on fp32 elements of the intra-chunk temporaries processed at once; bounds peak
# memory for long prompts.
_INTRA_BUDGET = 1 << 23
# Centred diagonal blocks need every factor exp(+-(G_i - G_m)) inside fp32's normal range with
# room for the product with q, k: exp(60) = 1.1e26, exp(-60) = 8.8e-27.
_MAX_HALF_SPAN = 60.0
# Upper bound on fp32 elements of the per-chunk states kept for one group of the sequential pass
# (chunk_kda_torch): small enough to stay in cache until the group's batched Q e^G S matmul reads them back.
_STATE_BUDGET = 1 << 20
_LOG_TINY = -34.5
_TINY = math.exp(_LOG_TINY)   # ~1.0e-15: products of two flushed factors stay >= 1e-30


def _to_chunks(x: torch.Tensor, NT: int, C: int) -> torch.Tensor:
    """[B, T, H, D] -> fp32 [NT, B*H, C, D] (a new tensor), zero-padded along T (zeros are
    inert in KDA). Chunk-major so the sequential inter-chunk pass slices contiguous blocks."""
    B, T, H, D = x.shape
    x = x.to(torch.float32)
    if NT * C != T:
        x = F.pad(x, (0, 0, 0, 0, 0, NT * C - T))
    return x.view(B, NT, C, H, D).permute(1, 0, 3, 2, 4).contiguous().view(NT, B * H, C, D)


def _exp_flush(e: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 exp(e) for e <= 0 (fp64 in), with results < _TINY and entries where ~keep set to 0.

    Clamped before exp (exp of very negative numbers or -inf takes a slow path) and
    thresholded after it, so no subnormal reaches a matmul.
    """
    f = e.to(torch.float32, copy=True)
    if keep is not None:
        f.masked_fill_(~keep, _LOG_TINY - 1.0)
    f.clamp_(min=_LOG_TINY - 1.0).exp_()
    return F.threshold_(f, _TINY, 0.0)


def _flush(x: torch.Tensor) -> torch.Tensor:
    """Entries with |x| <= _TINY become 0 (see module docstring): one fused pass (``hardshrink``) instead
    of abs + compare + masked_fill. Returns a new tensor, so it is safe under autograd."""
    return F.hardshrink(x, _TINY)


def _own_centred(qs, ks, dm):
    """Diagonal blocks through the middle row m. Args: qs, ks [n, NS, sub, K] fp32, dm [n, NS, sub, K] fp32
    = G - G_m (fp64 difference, rounded once; exp(-dm) is then exactly the former exp(G_m - G)).
    Returns [n, NS, 2 sub, sub]: q rows then k rows (unmasked)."""
    kc = ks * dm.neg().exp_()
    fr = dm.exp()
    return torch.cat((qs * fr, ks * fr), dim=2) @ kc.transpose(-1, -2)


def _own_pairwise(qs, ks, Gs):
    """Diagonal blocks with the exact pairwise Gamma [n, NS, i, j, K], j > i masked before
    exp. Same shapes as ``_own_centred``."""
    n, NS, sub, K = qs.shape
    tri = torch.ones(sub, sub, dtype=torch.bool, device=qs.device).tril()
    gam = _exp_flush(Gs[:, :, :, None, :] - Gs[:, :, None, :, :], keep=tri[:, :, None])
    own = gam.mul_(ks[:, :, None, :, :]) @ torch.stack((qs, ks), dim=-1)   # [n, NS, i, j, 2]
    return own.permute(0, 1, 4, 2, 3).reshape(n, NS, 2 * sub, sub)


def _earlier(qs, ks, k, Gs, G):
    """Rows of sub-chunks 1..NS-1 against columns of earlier sub-chunks.

    Args: qs, ks [n, NS, sub, K]; k [n, C, K]; Gs [n, NS, sub, K], G [n, C, K] fp64.
    Returns: [n, NS-1, 2 sub, C - sub] (q rows then k rows), zero for j >= r.

    Row i of sub-chunk I (first row r_I) against column j of an earlier sub-chunk J (J < I):
    exp(G_i - G_j) = exp(G_i - G_{r_I}) * exp(G_{r_I} - G_j), and the column factor is composed from the
    column's own sub-chunk boundary r_{J+1} (the first row after J) so no [I, j] exponent is ever formed::

        exp(G_{r_I} - G_j) = P[I, J] * colf[j],   P[I, J] = exp(G_{r_I} - G_{r_{J+1}})   (1 when J+1 = I)
                                                  colf[j] = exp(G_{r_{J+1}} - G_j)

    Every exponent is <= 0 (G is non-increasing); P is [NS-1, NS-1] per channel and zero for J >= I (that
    is the j < r_I mask). The composed factor is thresholded again, so operands of the matmul stay >= _TINY
    or exactly 0 (module docstring).
    """
    n, NS, sub, K = qs.shape
    C = NS * sub
    Gref = Gs[:, 1:, :1]                                             # [n, NS-1, 1, K]: G_{r_I}, I = 1..NS-1
    rowf = _exp_flush(Gs[:, 1:] - Gref)                              # [n, NS-1, sub, K]
    lhs = torch.cat((qs[:, 1:] * rowf, ks[:, 1:] * rowf), dim=2)     # [n, NS-1, 2 sub, K]
    # colf for columns of sub-chunks J = 0..NS-2 against their next boundary G_{r_{J+1}} = Gref[:, J].
    colf = _exp_flush(Gref - Gs[:, :-1])                             # [n, NS-1 (J), sub, K]
    if NS == 2:  # one earlier sub-chunk: P[1, 0] = exp(0) = 1, so the factor is colf itself (bit for bit)
        return lhs @ (colf.squeeze(1) * k[:, :sub]).unsqueeze(1).transpose(-1, -2)
    later = torch.ones(NS - 1, NS - 1, dtype=torch.bool, device=k.device).tril()   # [I-1, J]: J <= I-1
    P = _exp_flush(Gref - Gref.transpose(1, 2), keep=later[None, :, :, None])      # [n, NS-1 (I), NS-1 (J), K]
    fac = F.threshold_(colf.unsqueeze(1) * P.unsqueeze(3), _TINY, 0.0)             # [n, I, J, sub, K]
    kref = fac.mul_(k[:, None, :C - sub].view(n, 1, NS - 1, sub, K)).view(n, NS - 1, C - sub, K)
    return lhs @ kref.transpose(-1, -2)


def _intra_chunk(q, k, v, g, beta, sub: int, out=None):
    """Chunk-local quantities for n independent chunks (no dependence on the state).

    Args:
        q: [n, C, K] (already scaled), k: [n, C, K], v: [n, C, V], g: [n, C, K],
        beta: [n, C, 1]; out: optional buffers (Aqk, WU, Qg, Kd) of the returned shapes, written in place
        (no copy of the results into the caller's arrays).
    Returns:
        Aqk [n, C, C], WU [n, C, K + V] (= [W | U]), Qg [n, C, K] (= q * exp(G)),
        Kd [n, C, K] (= k * exp(G_last - G)), decay [n, K] (= exp(G_last)).
    """
    n, C, K = q.shape
    NS = C // sub
    G = g.to(torch.float64).cumsum(1)
    Gs = G.view(n, NS, sub, K)
    qs, ks = q.view(n, NS, sub, K), k.view(n, NS, sub, K)

    Aqk = q.new_zeros(n, C, C) if out is None else out[0].zero_()
    Akk = q.new_zeros(n, C, C)
    if NS > 1:
        off = _earlier(qs, ks, k, Gs, G)
        Aqk[:, sub:, :C - sub] = off[:, :, :sub].reshape(n, C - sub, C - sub)
        Akk[:, sub:, :C - sub] = off[:, :, sub:].reshape(n, C - sub, C - sub)
        del off
    dm = (Gs - Gs[:, :, sub // 2:sub // 2 + 1]).to(torch.float32)
    # The centred / pairwise choice is made per chunk, so a chunk's bits never depend on the other chunks of
    # the call (a long prompt's one-shot prefill and its grid-chunked prefill agree: numerics deterministic).
    centred = dm.abs().amax(dim=(1, 2, 3)) <= _MAX_HALF_SPAN if n else torch.ones(0, dtype=torch.bool)
    if bool(centred.all()):
        own = _own_centred(qs, ks, dm)
    elif not bool(centred.any()):
        own = _own_pairwise(qs, ks, Gs)
    else:
        c_idx, p_idx = centred.nonzero().squeeze(1), (~centred).nonzero().squeeze(1)
        oc = _own_centred(qs[c_idx], ks[c_idx], dm[c_idx])
        own = oc.new_empty((n, *oc.shape[1:]))
        own[c_idx] = oc
        own[p_idx] = _own_pairwise(qs[p_idx], ks[p_idx], Gs[p_idx])
    del dm
    # diagonal(dim1=1, dim2=3) of [n, NS, sub, NS, sub] is [n, sub, sub, NS].
    Aqk.view(n, NS, sub, NS, sub).diagonal(dim1=1, dim2=3).copy_(own[:, :, :sub].permute(0, 2, 3, 1))
    Akk.view(n, NS, sub, NS, sub).diagonal(dim1=1, dim2=3).copy_(own[:, :, sub:].permute(0, 2, 3, 1))
    del own
    torch.ops.aten.hardshrink.out(Aqk.tril_(), _TINY, out=Aqk)   # _flush in place
    # L is strictly lower, rows scaled by beta_i; the solve treats the diagonal as 1
    # (unitriangular), so this yields (I + L)^-1.
    L = _flush(Akk.tril_(-1).mul_(beta))
    eye = torch.eye(C, device=q.device).expand(n, C, C)
    # Invert then multiply: the RHS width stays C whatever K + V is, and the inverse is
    # flushed like the other matmul operands (about as fast as a direct wide-RHS solve).
    Tinv = _flush(torch.linalg.solve_triangular(L, eye, upper=False, unitriangular=True))

    eG = _exp_flush(G)
    o_wu, o_qg, o_kd = (None, None, None) if out is None else out[1:]
    X = torch.matmul(Tinv, torch.cat((k * eG, v), dim=-1).mul_(beta), out=o_wu)  # (I+L)^-1 Diag(beta)[eG*K | V]
    G_last = G[:, -1:, :]
    Kd = torch.mul(k, _exp_flush(G_last - G), out=o_kd)
    return Aqk, X, torch.mul(q, eG, out=o_qg), Kd, _exp_flush(G_last.squeeze(1))


def chunk_kda_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 32,
    sub_chunk: int = 16,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA forward in torch (all chunks' intra-chunk work batched together).

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K] log-decay; beta: [B, T, H].
        scale: multiplies q (default K**-0.5).
        initial_state: [B, H, K, V] (any strides; read only).
        output_final_state: also return the final state.
        chunk_size: C (multiple of ``sub_chunk``).
        sub_chunk: rows per sub-chunk of the decayed scores (module docstring); the centred
            fast path's K3 guarantee (half span <= 8 * 5 = 40) assumes 16.
    Returns:
        o [B, T, H, V] in v's dtype; final_state [B, H, K, V] fp32 or None.
    """
    B, T, H, K, V = check_kda_inputs(q, k, v, g, beta, initial_state)
    if chunk_size % sub_chunk:
        raise ValueError("chunk_size must be a multiple of sub_chunk")
    scale = default_scale(scale, K)
    C = chunk_size
    NT = -(-T // C)
    BH = B * H
    qc = (_to_chunks(q, NT, C) * scale).view(NT * BH, C, K)   # not in place: may alias q
    kc = _to_chunks(k, NT, C).view(NT * BH, C, K)
    vc = _to_chunks(v, NT, C).view(NT * BH, C, V)
    gc = _to_chunks(g, NT, C).view(NT * BH, C, K)
    bc = _to_chunks(beta.unsqueeze(-1), NT, C).view(NT * BH, C, 1)

    N = NT * BH
    dev = qc.device
    Aqk = torch.empty(N, C, C, device=dev)
    WU = torch.empty(N, C, K + V, device=dev)     # [W | U]; U becomes Vn in place below
    Qg = torch.empty(N, C, K, device=dev)
    Kd = torch.empty(N, C, K, device=dev)
    decay = torch.empty(N, K, 1, device=dev)
    per_chunk = C * sub_chunk * K * 2 + (C // sub_chunk) * C * K * 2 + 6 * C * C
    step = max(1, _INTRA_BUDGET // per_chunk)
    for s in range(0, N, step):
        e = min(N, s + step)
        outs = (Aqk[s:e], WU[s:e], Qg[s:e], Kd[s:e])
        decay[s:e] = _intra_chunk(qc[s:e], kc[s:e], vc[s:e], gc[s:e], bc[s:e], sub_chunk, outs)[-1].unsqueeze(-1)
    del qc, kc, gc

    if initial_state is not None:
        S0 = initial_state.to(torch.float32).reshape(BH, K, V)
    else:
        S0 = torch.zeros(BH, K, V, device=dev)
    # The only sequential part, per chunk n with state S_n at its start (two matmuls, in place):
    #     Vn = U - W S_n                     (U_n.baddbmm_(W_n, S_n, alpha=-1))
    #     S_{n+1} = Diag(decay) S_n + Kd^T Vn
    # The states of a group of chunks are kept, so Q e^G S_n for the whole group is one batched matmul after
    # the group's sequential pass (it is not on the dependency chain). Groups bound the stored states to
    # about _STATE_BUDGET floats.
    O = torch.empty(NT, BH, C, V, device=dev)
    grp = max(1, min(NT, _STATE_BUDGET // (BH * K * V)))
    Sg = torch.empty(grp + 1, BH, K, V, device=dev)
    Sg[0] = S0
    WU4, Qg4, Kd4, dec4 = (x.view(NT, BH, *x.shape[1:]) for x in (WU, Qg, Kd, decay))
    for g0 in range(0, NT, grp):
        g1 = min(NT, g0 + grp)
        for i, n in enumerate(range(g0, g1)):
            W_n, U_n = WU4[n, :, :, :K], WU4[n, :, :, K:]
            U_n.baddbmm_(W_n, Sg[i], alpha=-1.0)
            torch.mul(Sg[i], dec4[n], out=Sg[i + 1]).baddbmm_(Kd4[n].transpose(-1, -2), U_n)
        m = g1 - g0
        torch.matmul(Qg4[g0:g1], Sg[:m], out=O[g0:g1])
        if g1 < NT:
            Sg[0] = Sg[m]
    S = Sg[NT - g0]
    Vn = WU[:, :, K:]
    O = O.view(N, C, V).baddbmm_(Aqk, Vn)

    o = O.view(NT, B, H, C, V).permute(1, 0, 3, 2, 4).reshape(B, NT * C, H, V)[:, :T]
    final = S.reshape(B, H, K, V).clone() if output_final_state else None
    return o.to(v.dtype).contiguous(), final


def recurrent_kda_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    inplace_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token KDA, vectorised over batch and heads (decode and short inputs).

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K] log-decay; beta: [B, T, H].
        scale: multiplies q (default K**-0.5).
        initial_state: [B, H, K, V] (any strides); read only unless ``inplace_state``.
        output_final_state: also return the final state.
        inplace_state: update ``initial_state`` (fp32, required) in place and return it as the final state:
            no private copy of the state and no copy back (decode moves the state once per step).
    Returns:
        o [B, T, H, V] in v's dtype; final_state [B, H, K, V] fp32 or None.

    Per token, with a = exp(g) and S the state before the token, the step reads S once and then updates
    it in place (two passes) instead of materialising Diag(a) S and the outer product k u^T::

        [k a ; q a]^T S          one batched matmul over the OLD state: kS = (k a)^T S, qS = (q a)^T S
        u = beta (v - kS)
        o = qS + (q . k) u       (= S'^T q, since S' = Diag(a) S + k u^T)
        S <- Diag(a) S;  S += k u^T
    """
    B, T, H, K, V = check_kda_inputs(q, k, v, g, beta, initial_state)
    scale = default_scale(scale, K)
    # Time-major so each step reads contiguous [B, H, D] slices.
    qt = (q.to(torch.float32) * scale).transpose(0, 1).contiguous()
    kt = k.to(torch.float32).transpose(0, 1).contiguous()
    vt = v.to(torch.float32).transpose(0, 1).contiguous()
    at = _exp_flush(g).transpose(0, 1).contiguous()       # no subnormal decays (see top)
    bt = beta.to(torch.float32).transpose(0, 1).unsqueeze(-1).contiguous()
    if inplace_state:
        if initial_state is None or initial_state.dtype != torch.float32:
            raise ValueError("inplace_state needs an fp32 initial_state")
        S = initial_state
    elif initial_state is not None:
        S = initial_state.to(torch.float32).clone()   # private copy: updated in place below
    else:
        S = torch.zeros(B, H, K, V, device=q.device)
    o = torch.empty(T, B, H, V, device=q.device)
    qk = (qt * kt).sum(-1, keepdim=True)                   # [T, B, H, 1]
    for t in range(T):
        a = at[t]
        kq = torch.stack((kt[t] * a, qt[t] * a), dim=-2)   # [B, H, 2, K]
        kS, qS = (kq @ S).unbind(-2)                       # each [B, H, V]
        u = (vt[t] - kS).mul_(bt[t])
        o[t] = qS.addcmul_(qk[t], u)
        S.mul_(a.unsqueeze(-1)).addcmul_(kt[t].unsqueeze(-1), u.unsqueeze(-2))
    final = S if (output_final_state or inplace_state) else None
    return o.transpose(0, 1).to(v.dtype).contiguous(), final
