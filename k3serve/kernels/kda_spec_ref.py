"""Naive (loops) and vectorised torch (CPU) forms of the KDA verify and commit kernels (``kda_spec.py``)."""

from __future__ import annotations

import torch

from ._kda_common import default_scale
from .kda_records import record_offsets
from .kda_torch import _exp_flush


# ------------------------------------------------------------------------------------------------- naive
def naive_kda_verify(q, k, v, g, beta, initial_state, *, scale=None):
    """Oracle: per (b, h, t) loop on a private copy of the state (shapes as ``kda_verify``)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = default_scale(scale, K)
    o = torch.zeros(B, T, H, V, dtype=torch.float32)
    u = torch.zeros(B, T, H, V, dtype=torch.float32)
    for b in range(B):
        for h in range(H):
            S = initial_state[b, h].float().clone()
            for t in range(T):
                S = torch.exp(g[b, t, h].float())[:, None] * S
                u[b, t, h] = beta[b, t, h].float() * (v[b, t, h].float() - S.t() @ k[b, t, h].float())
                S = S + torch.outer(k[b, t, h].float(), u[b, t, h])
                o[b, t, h] = S.t() @ (q[b, t, h].float() * scale)
    return o.to(v.dtype), u


def naive_kda_commit(blocks, records, accepted, k, window):
    """Oracle: per (b, h) the serial recurrence over the accepted records, then the window slid by n."""
    off = record_offsets(k)
    B, H, _ = blocks.shape
    w1 = window - 1
    for b in range(B):
        n = int(accepted[b])
        for h in range(H):
            S = blocks[b, h, : k * k].view(k, k).clone()
            rec = records[b, h]
            for t in range(n):
                kt, gt, ut = rec[t, off["k"]: off["k"] + k], rec[t, off["g"]: off["g"] + k], rec[t, off["u"]: off["u"] + k]
                S = torch.exp(gt)[:, None] * S + torch.outer(kt, ut)
            blocks[b, h, : k * k] = S.flatten()
            conv = blocks[b, h, k * k:].view(3, w1, k)
            for x in range(3):
                raw = rec[:, off["raw"] + x * k: off["raw"] + (x + 1) * k]  # [T, K]
                hist = torch.cat([conv[x].clone(), raw[:n]])  # [W-1+n, K], oldest first
                conv[x] = hist[n: n + w1]


# ------------------------------------------------------------------------------------------------- torch
def kda_verify_torch(q, k, v, g, beta, initial_state, *, scale=None):
    """Token loop vectorised over batch and heads; the same update order as ``recurrent_kda_torch`` (so row t
    of o is what plain decode gives for token t), on a private copy of the state."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = default_scale(scale, K)
    qt = (q.to(torch.float32) * scale).transpose(0, 1).contiguous()
    kt = k.to(torch.float32).transpose(0, 1).contiguous()
    vt = v.to(torch.float32).transpose(0, 1).contiguous()
    at = _exp_flush(g).transpose(0, 1).contiguous()
    bt = beta.to(torch.float32).transpose(0, 1).unsqueeze(-1).contiguous()
    S = initial_state.to(torch.float32).clone()
    o = torch.empty(T, B, H, V, device=q.device)
    u = torch.empty(T, B, H, V, device=q.device)
    qk = (qt * kt).sum(-1, keepdim=True)
    for t in range(T):
        a = at[t]
        kq = torch.stack((kt[t] * a, qt[t] * a), dim=-2)
        kS, qS = (kq @ S).unbind(-2)
        ut = (vt[t] - kS).mul_(bt[t])
        u[t] = ut
        o[t] = qS.addcmul_(qk[t], ut)
        S.mul_(a.unsqueeze(-1)).addcmul_(kt[t].unsqueeze(-1), ut.unsqueeze(-2))
    return o.transpose(0, 1).to(v.dtype).contiguous(), u.transpose(0, 1).contiguous()


def kda_commit_torch(blocks, records, accepted, k, window):
    """Serial replay vectorised over (b, h): tokens past a request's count get decay 1 and a zero key, which
    leaves its state bit for bit unchanged. The windows: one gather of rows n .. n+W-2 of [window | raw]."""
    off = record_offsets(k)
    B, H, _ = blocks.shape
    T = records.shape[2]
    w1 = window - 1
    n = accepted.to(blocks.device, torch.long)
    live = (torch.arange(T, device=blocks.device)[None, :] < n[:, None])  # [B, T]
    S = blocks[..., : k * k].unflatten(-1, (k, k))  # view: updated in place
    rk = records[..., off["k"]: off["k"] + k]
    rg = records[..., off["g"]: off["g"] + k]
    ru = records[..., off["u"]: off["u"] + k]
    a = _exp_flush(rg)  # [B, H, T, K]
    m = live[:, None, :, None]
    a = torch.where(m, a, torch.ones_like(a))
    rk = torch.where(m, rk, torch.zeros_like(rk))
    steps = int(n.max()) if B else 0
    for t in range(steps):
        S.mul_(a[:, :, t].unsqueeze(-1)).addcmul_(rk[:, :, t].unsqueeze(-1), ru[:, :, t].unsqueeze(-2))
    conv = blocks[..., k * k:].unflatten(-1, (3, w1, k))  # [B, H, 3, W-1, K] view
    raw = records[..., off["raw"]:].unflatten(-1, (3, k)).permute(0, 1, 3, 2, 4)  # [B, H, 3, T, K]
    hist = torch.cat([conv, raw], dim=3)  # [B, H, 3, W-1+T, K]
    idx = (n[:, None] + torch.arange(w1, device=blocks.device)[None, :])  # [B, W-1]
    idx = idx[:, None, None, :, None].expand(B, H, 3, w1, k)
    conv.copy_(torch.gather(hist, 3, idx))
