"""Bits per byte of a checkpoint on text, with the reference (single-process, inference-mode) forward."""

from __future__ import annotations

import torch

from k3serve.model.model import HybridModel
from k3serve.train.step import TokenNLL, byte_nll, count_bytes, window_logits


def windows_nll(model: HybridModel, windows: torch.Tensor, batch: int = 8) -> TokenNLL:
    """Summed next-byte NLL over windows `[n, L]` int64, each prefilled alone from a zero state (first token
    of a window is context only)."""
    nats, nbytes = 0.0, 0
    for i in range(0, windows.shape[0], batch):
        w = windows[i: i + batch]
        nats += float(byte_nll(window_logits(model, w, grad=False), w).double().sum())
        nbytes += count_bytes(w)
    return TokenNLL(nats, nbytes)
