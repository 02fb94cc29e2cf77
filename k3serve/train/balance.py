"""MoE load balancing without an auxiliary loss: K3's quantile bias update (MODEL.md §10).

Each expert e has a selection bias b_e (``e_score_correction_bias``) added to its sigmoid score s_ne for the
top-k choice only. With the other experts' biases fixed, token n picks e iff s_ne + b_e > t_ne, where t_ne is
the k-th largest biased score among the *other* experts: the (k+1)-th overall when e is in n's top-k, else the
k-th. So e's load under a candidate bias b is #{n : m_ne < b} with margin m_ne = t_ne - s_ne, monotone in b,
and the bias giving e its fair share (N k / E tokens) is the (k / E)-quantile of its margins: computed from one
forward's router inputs, no step size. Here the quantile is exact (one process sees every token; the
histogram at scale is an all-reduce detail). Each update moves the biases halfway to the computed values
(batch noise) and re-centres them (only differences matter).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BalanceStats:
    """Max expert load over the fair share, before the update (1.0 = perfectly balanced)."""

    max_load_over_fair: float


def quantile_bias(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    """scores `[N, E]` fp32 (sigmoid), bias `[E]` -> the bias `[E]` giving every expert N k / E tokens."""
    n, e = scores.shape
    biased = scores + bias
    top = biased.topk(k + 1, dim=-1)
    kth, k1th = top.values[:, k - 1: k], top.values[:, k: k + 1]  # [N, 1] each
    chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, top.indices[:, :k], True)
    threshold = torch.where(chosen, k1th, kth)
    margins = threshold - scores  # [N, E]
    return torch.quantile(margins, k / e, dim=0)


def update_biases(params: dict[str, torch.Tensor], records: list[tuple[int, torch.Tensor]], prefix: str, k: int,
                  momentum: float = 0.5) -> BalanceStats:
    """Set each recorded MoE layer's selection bias from its router inputs (in place, no autograd).

    records: (layer, router input `[N, d]`) from :func:`k3serve.train.step.attach_route_recorder`.
    """
    worst = 0.0
    with torch.no_grad():
        for layer, x in records:
            m = f"{prefix}layers.{layer}.block_sparse_moe.gate."
            bias = params[m + "e_score_correction_bias"]
            scores = torch.sigmoid(x.float() @ params[m + "weight"].float().t())
            e = scores.shape[1]
            load = torch.bincount((scores + bias).topk(k, dim=-1).indices.flatten(), minlength=e).float()
            worst = max(worst, float(load.max() / (scores.shape[0] * k / e)))
            target = quantile_bias(scores, bias, k)
            new = bias + momentum * (target - bias)
            bias.copy_(new - new.mean())
    return BalanceStats(worst)
