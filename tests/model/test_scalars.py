"""The 0-dim fp32 constants of the hot path (model/scalars.py) give the bits of the Python numbers they replace,
and serve autograd even when first made under inference mode."""

from __future__ import annotations

import pytest
import torch

from k3serve.model.layers.norm import glu, rms_norm
from k3serve.model.scalars import fp32


@pytest.mark.parametrize("value", [1e-5, 1e-6, 4.0, 25.0, 256, 0.1])
def test_ops_with_the_constant_equal_ops_with_the_number(value: float) -> None:
    x = torch.randn(7, 300, generator=torch.Generator().manual_seed(1)) * 3
    c = fp32(value)
    assert c.dtype == torch.float32 and c.dim() == 0
    assert torch.equal(x / c, x / value) and torch.equal(x + c, x + value) and torch.equal(x * c, x * value)
    assert torch.equal(x.clone().div_(c), x.clone().div_(value))


def test_the_constant_is_cached_and_not_an_inference_tensor() -> None:
    with torch.inference_mode():
        c = fp32(12345.5)
    assert fp32(12345.5) is c and not c.is_inference()


def test_training_after_inference_backpropagates_through_norm_and_situ() -> None:
    x = torch.randn(3, 64)
    w = torch.ones(64)
    with torch.inference_mode():  # the first use (and the cache entry) under inference mode
        served = glu(rms_norm(x, w, 1e-5), x, "situ")
    xg = x.clone().requires_grad_()
    trained = glu(rms_norm(xg, w, 1e-5), xg, "situ")
    trained.sum().backward()
    assert xg.grad is not None and torch.isfinite(xg.grad).all()
    assert torch.equal(trained.detach(), served)  # the autograd branch gives the serving branch's bits
