"""model/profiling.py: sublayer labels reach a running torch profiler and cost nothing without one."""

from __future__ import annotations

import contextlib

import torch
from torch.profiler import ProfilerActivity, profile

from k3serve.model.profiling import profile_label


def test_a_label_is_a_no_op_without_a_profiler() -> None:
    assert isinstance(profile_label("k3serve.test"), contextlib.nullcontext)


def test_a_label_reaches_a_running_profiler() -> None:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with profile_label("k3serve.test.label"):
            torch.ones(4).sum()
    assert "k3serve.test.label" in {ev.name for ev in prof.events()}
