"""One training forward: next-token cross-entropy of the serving model over a batch of windows."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from k3serve.model.model import HybridModel
from k3serve.model.state import DenseLatentCache, ForwardBatch


def window_logits(model: HybridModel, tokens: torch.Tensor, grad: bool) -> torch.Tensor:
    """tokens `[B, L]` int64 -> logits fp32 `[B, L, vocab]`, every window from a zero state.

    grad: build the autograd graph (:meth:`HybridModel.logits`); else the serving forward (inference mode).
    """
    cfg = model.cfg
    b = tokens.shape[0]
    batch = ForwardBatch(model.new_kda_state(b), DenseLatentCache(cfg.num_mla_layers, b), [0] * b)
    if grad:
        return model.logits(tokens, batch, all_logits=True)
    return model.forward(tokens, batch, all_logits=True)


@dataclass(frozen=True)
class TokenNLL:
    """Summed next-token negative log-likelihood (nats) over byte targets, and how many there were."""

    nats: float
    bytes: int

    @property
    def bits_per_byte(self) -> float:
        return self.nats / max(1, self.bytes) / 0.6931471805599453


def byte_nll(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Per-target NLL: logits `[..., L, V]` for tokens `[..., L]` -> `[..., L-1]` fp32 (NaN-free), where
    position t scores token t+1. Special-token targets (BOS between documents) get 0: bits per byte count
    bytes only."""
    nll = F.cross_entropy(logits[..., :-1, :].flatten(0, -2).float(), tokens[..., 1:].reshape(-1),
                          reduction="none").view(tokens[..., 1:].shape)
    return torch.where(tokens[..., 1:] < 256, nll, torch.zeros_like(nll))


def count_bytes(tokens: torch.Tensor) -> int:
    """Byte targets in windows `[..., L]` (positions 1..L-1 holding ids < 256)."""
    return int((tokens[..., 1:] < 256).sum())


def attach_route_recorder(model: HybridModel) -> list[tuple[int, torch.Tensor]]:
    """Record each MoE layer's router input `[N, d]` (detached) as (layer, x) on every forward.

    Wraps the instance's ``route`` (this model object only) so the load-balancing update sees exactly what the
    router saw, without a second forward.
    """
    seen: list[tuple[int, torch.Tensor]] = []
    for layer in model.layers:
        ffn = layer.ffn
        if not hasattr(ffn, "route"):
            continue

        def route(x: torch.Tensor, _orig=ffn.route, _layer=layer.layer):
            seen.append((_layer, x.detach()))
            return _orig(x)

        ffn.route = route
    return seen
