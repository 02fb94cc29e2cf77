"""The target's features the drafter fuses: one target forward yields its logits and (low, mid, high)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3serve.model.eagle3.config import DrafterConfig
from k3serve.model.model import HybridModel
from k3serve.model.state import ForwardBatch


@dataclass(frozen=True)
class TargetFeatures:
    """One forward of the target over T tokens: logits fp32 `[B, T, V]`, features `[B, T, d]` each."""

    logits: torch.Tensor
    low: torch.Tensor
    mid: torch.Tensor
    high: torch.Tensor


def target_features(model: HybridModel, cfg: DrafterConfig, token_ids: torch.Tensor,
                    batch: ForwardBatch) -> TargetFeatures:
    """token_ids `[B, T]` -> :class:`TargetFeatures`, advancing `batch` by T (as :meth:`HybridModel.forward`).

    low/mid: the outputs of blocks cfg.blocks[0], cfg.blocks[1]; high: the final hidden state (config.py).
    Runs without autograd (the target is frozen wherever the drafter is trained or served).
    """
    taps: list[torch.Tensor] = []
    with torch.no_grad():
        h = model.hidden(token_ids, batch, taps)
        if len(taps) != cfg.num_blocks:
            raise ValueError(f"target produced {len(taps)} block outputs, the drafter expects {cfg.num_blocks}")
        return TargetFeatures(model.head(h), taps[cfg.blocks[0]], taps[cfg.blocks[1]], h)
