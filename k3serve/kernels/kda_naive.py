"""Reference (oracle) KDA: a plain per-token loop, written for obviousness, not speed.

Per token t, batch b, head h (MODEL.md section 2, step 6), with S in R^{K x V}:
    S <- Diag(exp(g_t)) S
    u  = beta_t * (v_t - S^T k_t)
    S <- S + k_t u^T
    o_t = S^T (q_t * scale)          (post-update state: a token sees itself)
"""

from __future__ import annotations

import torch

from ._kda_common import check_kda_inputs, default_scale


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Oracle KDA forward.

    Args:
        q: [B, T, H, K] queries (not normalised here).
        k: [B, T, H, K] keys (not normalised here).
        v: [B, T, H, V] values.
        g: [B, T, H, K] log-decay, alpha = exp(g).
        beta: [B, T, H] write strength, already sigmoided.
        scale: multiplies q; default K**-0.5.
        initial_state: [B, H, K, V] state before token 0 (any strides, not modified).
        output_final_state: return the state after the last token.

    Returns:
        o: [B, T, H, V] in v's dtype.
        final_state: [B, H, K, V] fp32, or None.

    Math runs in fp32 (fp64 if the inputs are fp64, so tests can build a tighter oracle).
    """
    B, T, H, K, V = check_kda_inputs(q, k, v, g, beta, initial_state)
    scale = default_scale(scale, K)
    dt = torch.float64 if v.dtype == torch.float64 else torch.float32
    q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    o = torch.zeros(B, T, H, V, dtype=dt, device=v.device)
    final = torch.zeros(B, H, K, V, dtype=dt, device=v.device)
    for b in range(B):
        for h in range(H):
            if initial_state is not None:
                S = initial_state[b, h].to(dt).clone()
            else:
                S = torch.zeros(K, V, dtype=dt, device=v.device)
            for t in range(T):
                S = torch.exp(g[b, t, h])[:, None] * S
                u = beta[b, t, h] * (v[b, t, h] - S.t() @ k[b, t, h])
                S = S + torch.outer(k[b, t, h], u)
                o[b, t, h] = S.t() @ (q[b, t, h] * scale)
            final[b, h] = S
    final_state = final.to(torch.float32) if output_final_state else None
    return o.to(v.dtype), final_state
