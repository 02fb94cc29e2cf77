"""Learning-rate schedule: linear warm-up, then cosine decay to a floor, over a step or time budget."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Schedule:
    peak_lr: float
    warmup_steps: int
    floor: float = 0.1  # final lr as a fraction of the peak

    def lr(self, step: int, progress: float) -> float:
        """lr for `step` (0-based) at `progress` in [0, 1] of the budget (steps done or time spent)."""
        if step < self.warmup_steps:
            return self.peak_lr * (step + 1) / self.warmup_steps
        p = min(1.0, max(0.0, progress))
        return self.peak_lr * (self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * p)))
