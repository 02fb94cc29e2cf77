"""The target's features the drafter fuses, read through the forward's capture hook (``ForwardBatch``).

Capture keys are layer indices: layer l's hidden state after it (with Block AttnRes the running partial sum of
its block, which at a block's last layer is the block's output), and ``L = num_hidden_layers`` for the final
hidden state (before the final norm). :func:`feature_layers` maps the drafter's (low, mid, high) blocks to
keys: low and mid are their blocks' last layers, high is L.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from k3serve.model.eagle3.config import DrafterConfig, block_size
from k3serve.model.model import HybridModel
from k3serve.model.state import ForwardBatch


def feature_layers(cfg: DrafterConfig) -> tuple[int, int, int]:
    """Capture keys of (low, mid, high) for the target's forward."""
    s, n = block_size(cfg.target), cfg.target.num_hidden_layers
    return (min(n, (cfg.blocks[0] + 1) * s) - 1, min(n, (cfg.blocks[1] + 1) * s) - 1, n)


@dataclass(frozen=True)
class TargetFeatures:
    """One forward of the target over T tokens: logits fp32 `[B, T, V]`, features fp32 `[B, T, d]` each."""

    logits: torch.Tensor
    low: torch.Tensor
    mid: torch.Tensor
    high: torch.Tensor


def split_captured(cfg: DrafterConfig, captured: dict[int, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """captured {layer: `[..., d]`} -> (low, mid, high)."""
    keys = feature_layers(cfg)
    missing = [k for k in keys if k not in captured]
    if missing:
        raise ValueError(f"the target forward did not capture layers {missing} the drafter needs")
    return tuple(captured[k] for k in keys)


def target_features(model: HybridModel, cfg: DrafterConfig, token_ids: torch.Tensor,
                    batch: ForwardBatch) -> TargetFeatures:
    """token_ids `[B, T]` -> :class:`TargetFeatures`, advancing `batch` by T (as :meth:`HybridModel.forward`).

    Runs without autograd (the target is frozen wherever the drafter is trained or served).
    """
    b = replace(batch, capture_layers=feature_layers(cfg), captured={})
    with torch.no_grad():
        logits = model.logits(token_ids, b, all_logits=True)
    return TargetFeatures(logits, *split_captured(cfg, b.captured))
