"""The drafter's attention: a sliding window over target-fed rows plus the diagonal rows of its own unroll.

One function serves training (all positions at once, EAGLE-3's training-time test) and serving (one query per
request), so both compute the same thing. For a chain anchored at committed position a (the drafter's step 1
reads the target's feature at a), step j queries position p = a + j - 1 and sees W keys::

    teacher rows (step 1, fed the target's fused features)     own rows (steps 2..j, fed its own outputs)
    positions a - W + j .. a                                    positions a + 1 .. a + j - 1 (one per step)

In training the teacher rows of every position form one ``[T, T]`` banded mask and the own rows of step i are
the step-i rows shifted by j - i positions (the row of the same anchor), so each query sees exactly what the
serving chain will see. NoPE (as the target's MLA): order comes from the features, not from positions.
"""

from __future__ import annotations

import torch


def shift_right(x: torch.Tensor, n: int) -> torch.Tensor:
    """x `[B, T, ...]` -> y with y[:, p] = x[:, p - n] (zeros for p < n)."""
    if n == 0:
        return x
    pad = x.new_zeros(x.shape[0], n, *x.shape[2:])
    return torch.cat([pad, x[:, : x.shape[1] - n]], dim=1)


def teacher_mask(t: int, window: int, step: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """bool `[T, T]`: query position p sees teacher row s iff p - W + 1 <= s <= p - step + 1."""
    p = torch.arange(t, device=device).unsqueeze(1)
    s = torch.arange(t, device=device).unsqueeze(0)
    return (s <= p - step + 1) & (s >= p - window + 1)


def attend(q: torch.Tensor, k1: torch.Tensor, v1: torch.Tensor, mask1: torch.Tensor,
           k_own: list[torch.Tensor], v_own: list[torch.Tensor]) -> torch.Tensor:
    """Softmax attention over teacher rows (masked) and per-query own rows, in fp32.

    q `[B, T, H, Dq]` (scale folded in); k1 `[B, H, S, Dq]`, v1 `[B, H, S, Dv]` teacher rows; mask1 bool
    `[T, S]` or `[B, T, S]` (True: visible); k_own / v_own: lists of `[B, T, H, Dq]` / `[B, T, H, Dv]`, one
    row per query (already aligned to it). Returns `[B, T, H, Dv]`. Every query must see at least one key.
    """
    qh = q.float().transpose(1, 2)  # [B, H, T, Dq]
    scores = torch.matmul(qh, k1.float().transpose(-1, -2))  # [B, H, T, S]
    m = mask1 if mask1.dim() == 3 else mask1.unsqueeze(0)
    scores = scores.masked_fill(~m.unsqueeze(1), float("-inf"))
    own = [(q.float() * k.float()).sum(-1).transpose(1, 2).unsqueeze(-1) for k in k_own]  # [B, H, T, 1] each
    w = torch.cat([scores, *own], dim=-1).softmax(-1)
    s = scores.shape[-1]
    out = torch.matmul(w[..., :s], v1.float())  # [B, H, T, Dv]
    for i, v in enumerate(v_own):
        out = out + w[..., s + i: s + i + 1] * v.float().transpose(1, 2)
    return out.transpose(1, 2)
