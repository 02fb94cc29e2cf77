"""The drafter's per-request state: the last W committed (next token, fused feature) pairs.

Why this and not a KV cache: the drafter is one layer, so the key/value row of a position depends only on
that position's (next token, fused feature) pair; its attention is a window of W rows. The last W pairs
therefore determine every draft exactly, take a fixed ``W * (d + 1)`` values per request whatever the
sequence length (like a KDA state), and never need rolling back: drafting works on scratch rows and only
target-verified positions (fused from the target's own features) are committed. Layout, right-aligned::

    index      0 ........ W - count - 1 | W - count ........ W - 1
    content    padding (zeros, masked)  | pairs of positions n - count .. n - 1 (n - 1: the anchor)
    pair t     (x_{t+1}, g_t): the token after position t and the target's fused feature at t

Position t's pair needs x_{t+1}, so the prefill that samples x_n can commit positions up to n - 1: the handoff
carries a complete window (the decode side never needs the target's features of the prompt).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DrafterWindow:
    """tokens `[W]` int64, feats `[W, d]` fp32, count valid pairs (right-aligned)."""

    tokens: torch.Tensor
    feats: torch.Tensor
    count: int

    @classmethod
    def empty(cls, window: int, hidden: int, device: torch.device | str = "cpu") -> "DrafterWindow":
        return cls(torch.zeros(window, dtype=torch.long, device=device),
                   torch.zeros(window, hidden, dtype=torch.float32, device=device), 0)

    @property
    def window(self) -> int:
        return self.tokens.shape[0]

    def extended(self, next_tokens: torch.Tensor, feats: torch.Tensor) -> "DrafterWindow":
        """Commit m more positions: next_tokens `[m]` (x_{t+1} for each), feats `[m, d]` (g_t) -> new window."""
        m, w = next_tokens.shape[0], self.window
        if feats.shape[0] != m:
            raise ValueError(f"window commit: {m} tokens but {feats.shape[0]} features")
        toks = torch.cat([self.tokens, next_tokens.to(self.tokens)])[-w:]
        fs = torch.cat([self.feats, feats.to(self.feats)])[-w:]
        return DrafterWindow(toks.clone(), fs.clone(), min(w, self.count + m))

    def to_tensor(self) -> torch.Tensor:
        """One fp32 `[W, d + 1]` block for the state channel: the feature columns, then the token id (exact in
        fp32 for ids < 2^24). The count travels beside it as an integer."""
        return torch.cat([self.feats, self.tokens.to(torch.float32).unsqueeze(1)], dim=1)

    @classmethod
    def from_tensor(cls, block: torch.Tensor, count: int) -> "DrafterWindow":
        """Inverse of :meth:`to_tensor`; block `[W, d + 1]` fp32."""
        if not 0 <= count <= block.shape[0]:
            raise ValueError(f"drafter window count {count} outside [0, {block.shape[0]}]")
        return cls(block[:, -1].round().long(), block[:, :-1].float().clone(), count)


def stack_windows(windows: list[DrafterWindow]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """B windows -> (tokens `[B, W]`, feats `[B, W, d]`, counts `[B]`), the batch :meth:`Eagle3Drafter.draft` takes."""
    return (torch.stack([w.tokens for w in windows]), torch.stack([w.feats for w in windows]),
            torch.tensor([w.count for w in windows], dtype=torch.long, device=windows[0].tokens.device))
