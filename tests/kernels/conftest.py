"""Shared fixtures for kernel tests.

TRITON_INTERPRET must be set before any ``triton.jit`` decorator runs (it is read at
decoration time). k3serve.kernels imports its Triton modules lazily, on the first call with
backend="triton", so setting it here, at conftest import, is early enough even when the
whole suite runs.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from k3serve.kernels.gate import kda_gate  # noqa: E402


def make_kda_inputs(B, T, H, K, V, gate, *, seed=0, dtype=torch.float32, A_log=None):
    """Model-like KDA inputs: q, k L2-normalised per head, v ~ N(0, 1), beta in (0, 1), g from
    ``kda_gate`` in the K3 ("k3", lower bound -5) or Kimi-Linear ("kl", unbounded) form.
    Returns q, k, v [B,T,H,*] in ``dtype``, g [B,T,H,K] fp32, beta [B,T,H] in ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    beta = torch.rand(B, T, H, generator=gen)
    z = torch.randn(B, T, H * K, generator=gen) * 2.0
    if A_log is None:
        A_log = torch.log(torch.linspace(1.0, 16.0, H))
    dt_bias = torch.randn(H * K, generator=gen) * 0.5
    g = kda_gate(z, A_log, dt_bias, -5.0 if gate == "k3" else None, backend="torch")
    return q.to(dtype), k.to(dtype), v.to(dtype), g, beta.to(dtype)


@pytest.fixture
def kda_inputs():
    return make_kda_inputs
