"""Drafter losses against the frozen target's distribution p, at temperature 1.

LK (the acceptance objective): the probability that a draft from q is accepted by the lossless rule is
``sum_x min(p(x), q(x))`` (1 - total variation), so the loss is ``-log sum_x min(p, q)``, with no
cross-entropy term. KL (the baseline distillation): ``KL(p || q) = sum_x p (log p - log q)``. For a drafter
that cannot match p everywhere the two disagree: KL spends capacity on p's tail, LK only on the overlap.
"""

from __future__ import annotations

from enum import Enum

import torch

# sum_x min(p, q) floor inside the log: a drafter that puts no mass where p does still gets a finite gradient
_OVERLAP_FLOOR = 1e-6


class DrafterLoss(str, Enum):
    LK = "lk"
    KL = "kl"


def acceptance(p: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """sum_x min(p, q): p `[..., V]` probabilities, q_logits `[..., V]` -> `[...]` fp32."""
    return torch.minimum(p.float(), q_logits.float().softmax(-1)).sum(-1)


def drafter_loss(kind: DrafterLoss, p: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """Per-position loss `[...]` fp32 for target probabilities p `[..., V]` and drafter logits `[..., V]`."""
    if kind is DrafterLoss.LK:
        return -acceptance(p, q_logits).clamp_min(_OVERLAP_FLOOR).log()
    if kind is DrafterLoss.KL:
        pf = p.float()
        return (pf * (pf.clamp_min(1e-30).log() - q_logits.float().log_softmax(-1))).sum(-1)
    raise ValueError(f"unknown drafter loss {kind!r}")
