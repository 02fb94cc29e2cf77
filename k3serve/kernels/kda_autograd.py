"""Chunked KDA written for autograd: the training path of ``chunk_kda``.

Same WY chunk form as :mod:`k3serve.kernels.kda_torch` (see its docstring for the algebra), per head and chunk
of C tokens with state S at the chunk start and G_i = sum_{s<=i} g_s within the chunk::

    Aqk_ij = sum_d q_i[d] k_j[d] exp(G_i - G_j)[d]   (j <= i)
    L_ij   = beta_i sum_d k_i[d] k_j[d] exp(G_i - G_j)[d]   (j < i)
    W = (I + L)^-1 Diag(beta) (exp(G) * K),  U = (I + L)^-1 Diag(beta) V
    Vn = U - W S;  O = (Q * exp(G)) S + Aqk Vn;  S <- Diag(exp(G_last)) S + (K * exp(G_last - G))^T Vn

The serving kernel is tuned for inference (in-place ops, ``out=`` buffers, flushed subnormals), which autograd
cannot differentiate; this one is out-of-place throughout, so ``torch.autograd`` backpropagates through the
chunk form itself (no hand-written backward), in the inputs' dtype (fp64 in the gradient tests). The decayed
scores use the centred factorisation ``exp(G_i - G_m) exp(G_m - G_j)`` through the chunk's middle row m when
every factor stays inside fp32's range (always for the K3 gate, g > -5, at C = 16: |G_i - G_m| <= 40), else the
exact pairwise ``[C, C, K]`` form with the upper triangle masked before exp (large Kimi-Linear decays).
``chunk_kda`` dispatches here only when gradients are needed; inference never takes this path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._kda_common import check_kda_inputs, default_scale

# Centred factors exp(+-(G_i - G_m)) must stay far from fp32 overflow once multiplied together and with q, k.
MAX_HALF_SPAN = 40.0
CHUNK = 16


def _chunks(x: torch.Tensor, nt: int, c: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, T, H, D] -> [B*H, NT, C, D] in `dtype`, zero-padded along T (zero tokens are inert in KDA)."""
    b, t, h, d = x.shape
    x = x.to(dtype)
    if nt * c != t:
        x = F.pad(x, (0, 0, 0, 0, 0, nt * c - t))
    return x.view(b, nt, c, h, d).permute(0, 3, 1, 2, 4).reshape(b * h, nt, c, d)


def _decayed_scores(q: torch.Tensor, k: torch.Tensor, G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k, G `[n, NT, C, K]` -> (Aqk, Akk) `[n, NT, C, C]`: sum_d x_i[d] k_j[d] exp(G_i - G_j)[d], j <= i kept.

    Entries j > i are zero.
    """
    c = q.shape[2]
    tri = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    mid = G[:, :, c // 2: c // 2 + 1]
    span = (G - mid).abs().amax().item() if G.numel() else 0.0
    if span <= MAX_HALF_SPAN:
        row = torch.exp(G - mid)   # <= exp(40) by the span check
        col = k * torch.exp(mid - G)
        aqk = (q * row) @ col.transpose(-1, -2)
        akk = (k * row) @ col.transpose(-1, -2)
    else:
        diff = G.unsqueeze(-2) - G.unsqueeze(-3)   # [n, NT, i, j, K] = G_i - G_j
        gam = torch.exp(torch.where(tri[:, :, None], diff, torch.full_like(diff, -torch.inf)))
        kg = gam * k.unsqueeze(-3)                  # [n, NT, i, j, K]
        aqk = (kg * q.unsqueeze(-2)).sum(-1)
        akk = (kg * k.unsqueeze(-2)).sum(-1)
    zero = torch.zeros((), dtype=q.dtype, device=q.device)
    return torch.where(tri, aqk, zero), torch.where(tri, akk, zero)


def chunk_kda_autograd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Differentiable chunked KDA forward.

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K] log-decay; beta: [B, T, H] (sigmoided).
        scale: multiplies q (default K**-0.5).
        initial_state: [B, H, K, V] (read only; gradients flow into it when it requires grad).
        output_final_state: also return the final state.
        chunk_size: C; 16 keeps the centred scores in range for the K3 gate.
    Returns:
        o [B, T, H, V] in v's dtype; final_state [B, H, K, V] (fp32, or fp64 for fp64 inputs) or None.
        Math runs in fp32, or fp64 when v is fp64.
    """
    B, T, H, K, V = check_kda_inputs(q, k, v, g, beta, initial_state)
    scale = default_scale(scale, K)
    dt = torch.float64 if v.dtype == torch.float64 else torch.float32
    c = chunk_size
    nt = -(-T // c)
    qc = _chunks(q, nt, c, dt) * scale
    kc, vc, gc = (_chunks(x, nt, c, dt) for x in (k, v, g))
    bc = _chunks(beta.unsqueeze(-1), nt, c, dt)          # [n, NT, C, 1]

    G = gc.cumsum(2)
    aqk, akk = _decayed_scores(qc, kc, G)
    eye = torch.eye(c, dtype=dt, device=q.device)
    lower = torch.tril(akk, -1) * bc                     # L, rows scaled by beta_i
    tinv = torch.linalg.solve_triangular(eye + lower, eye.expand_as(lower), upper=False, unitriangular=True)
    eg = torch.exp(G)
    w = tinv @ (bc * kc * eg)                            # [n, NT, C, K]
    u = tinv @ (bc * vc)                                 # [n, NT, C, V]
    g_last = G[:, :, -1:]
    kd_t = (kc * torch.exp(g_last - G)).transpose(-1, -2)  # [n, NT, K, C]
    decay = torch.exp(g_last).transpose(-1, -2)          # [n, NT, K, 1]
    qg = qc * eg

    if initial_state is not None:
        # A private copy: the model writes its final state back into the block this view reads, and matmuls
        # below save S for the backward.
        S = initial_state.to(dt).reshape(B * H, K, V).clone()
    else:
        S = torch.zeros(B * H, K, V, dtype=dt, device=q.device)
    outs = []
    for i in range(nt):   # the only sequential part: the state pass
        vn = u[:, i] - w[:, i] @ S
        outs.append(qg[:, i] @ S + aqk[:, i] @ vn)
        S = decay[:, i] * S + kd_t[:, i] @ vn
    o = torch.stack(outs, 1)                             # [B*H, NT, C, V]
    o = o.view(B, H, nt * c, V).transpose(1, 2)[:, :T]
    final = S.view(B, H, K, V) if output_final_state else None
    if final is not None and dt == torch.float32:
        final = final.to(torch.float32)
    return o.to(v.dtype), final
