"""Labels for torch.profiler that cost nothing when no profiler runs.

``bench decode`` sums the time under each sublayer's label (model.PROFILE_LABELS) to report its per-step breakdown.
``record_function`` enters and leaves two profiler ops even with no profiler active (~9 us a label, 19 labels in
every decode step), so a label is only opened while a profiler is collecting.
"""

from __future__ import annotations

import contextlib

import torch.autograd.profiler as autograd_profiler
from torch.profiler import record_function

_NO_LABEL = contextlib.nullcontext()


def profile_label(name: str) -> contextlib.AbstractContextManager:
    """``record_function(name)`` while a torch profiler is active, else a no-op context."""
    # the flag torch.autograd.profiler keeps while a profiler (torch.profiler.profile included) is entered
    if getattr(autograd_profiler, "_is_profiler_enabled", True):
        return record_function(name)
    return _NO_LABEL
