"""The chunked KDA training path backpropagates: gradients match the naive recurrence's autograd (fp64)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from k3serve.kernels import kda_autograd  # noqa: E402
from k3serve.kernels.gate import kda_gate  # noqa: E402
from k3serve.kernels.kda import chunk_kda  # noqa: E402
from k3serve.kernels.kda_naive import naive_recurrent_kda  # noqa: E402
from k3serve.kernels.kda_torch import chunk_kda_torch  # noqa: E402


def _leaves(B, T, H, K, V, gate, seed, with_h0):
    """fp64 leaves: q, k, v, z (gate pre-activation), beta logits, A_log, dt_bias, h0 (or None)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s, std=1.0: (torch.randn(*s, generator=gen, dtype=torch.float64) * std).requires_grad_()  # noqa: E731
    leaves = dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, H, V), z=r(B, T, H * K, std=2.0),
                  b=r(B, T, H), a_log=torch.log(torch.linspace(1.0, 16.0, H, dtype=torch.float64)).requires_grad_(),
                  dt=r(H * K, std=0.5), h0=r(B, H, K, V) if with_h0 else None)
    return leaves


def _loss(fn, x, gate, **kw):
    """A scalar touching every output and the final state, built like the model does (normalised q, k)."""
    g = kda_gate(x["z"], x["a_log"], x["dt"], -5.0 if gate == "k3" else None, backend="torch")
    q, k = F.normalize(x["q"], dim=-1), F.normalize(x["k"], dim=-1)
    o, s = fn(q, k, x["v"], g.to(torch.float64), torch.sigmoid(x["b"]), initial_state=x["h0"],
              output_final_state=True, **kw)
    w = torch.linspace(-1, 1, o.numel(), dtype=torch.float64).view_as(o)
    return (o * w).sum() + (s.to(torch.float64) ** 2).sum() * 0.1


def _grads(fn, leaves, gate, **kw):
    names = [n for n, t in leaves.items() if t is not None]
    loss = _loss(fn, leaves, gate, **kw)
    return dict(zip(names, torch.autograd.grad(loss, [leaves[n] for n in names])))


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


@pytest.mark.parametrize("gate", ["k3", "kl"])
@pytest.mark.parametrize("with_h0", [False, True])
def test_chunk_grad_matches_naive_recurrence_fp64(gate, with_h0):
    B, T, H, K, V = 2, 37, 2, 8, 8   # T not a multiple of the chunk: exercises the padding
    leaves = _leaves(B, T, H, K, V, gate, seed=11, with_h0=with_h0)
    ref = _grads(naive_recurrent_kda, leaves, gate)
    got = _grads(chunk_kda, leaves, gate, backend="torch")
    for name in ref:
        assert _rel(got[name], ref[name]) <= 1e-6, name


def test_pairwise_scores_path_grad(monkeypatch):
    """Large decays take the exact pairwise scores; force it and check its gradients too."""
    monkeypatch.setattr(kda_autograd, "MAX_HALF_SPAN", -1.0)
    leaves = _leaves(1, 21, 2, 8, 4, "kl", seed=5, with_h0=True)
    ref = _grads(naive_recurrent_kda, leaves, "kl")
    got = _grads(kda_autograd.chunk_kda_autograd, leaves, "kl")
    for name in ref:
        assert _rel(got[name], ref[name]) <= 1e-6, name


@pytest.mark.parametrize("gate", ["k3", "kl"])
def test_training_forward_matches_serving_kernel_fp32(kda_inputs_fp32, gate):
    """The differentiable path computes what the inference kernel computes (fp32 rounding)."""
    q, k, v, g, beta, h0 = kda_inputs_fp32(gate)
    ref_o, ref_s = chunk_kda_torch(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, s = kda_autograd.chunk_kda_autograd(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(o, ref_o, atol=1e-5, rtol=0)
    torch.testing.assert_close(s, ref_s, atol=1e-5, rtol=0)


def test_dispatch_only_under_grad(kda_inputs_fp32, monkeypatch):
    """Inference (no grad) keeps the serving kernel; inputs that need grad take the autograd path."""
    calls = []
    orig = kda_autograd.chunk_kda_autograd
    import k3serve.kernels.kda as kda_mod
    monkeypatch.setattr(kda_mod, "chunk_kda_autograd", lambda *a, **kw: calls.append(1) or orig(*a, **kw))
    q, k, v, g, beta, h0 = kda_inputs_fp32("k3")
    with torch.no_grad():
        chunk_kda(q.requires_grad_(), k, v, g, beta, backend="torch")
    assert not calls
    o, _ = chunk_kda(q, k, v, g, beta, backend="torch")
    assert calls and o.requires_grad


@pytest.fixture
def kda_inputs_fp32():
    def make(gate):
        gen = torch.Generator().manual_seed(3)
        B, T, H, K, V = 2, 70, 2, 16, 16
        q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
        k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
        v = torch.randn(B, T, H, V, generator=gen)
        beta = torch.rand(B, T, H, generator=gen)
        z = torch.randn(B, T, H * K, generator=gen) * 2.0
        g = kda_gate(z, torch.log(torch.linspace(1.0, 16.0, H)), torch.zeros(H * K), -5.0 if gate == "k3" else None,
                     backend="torch")
        return q, k, v, g, beta, torch.randn(B, H, K, V, generator=gen)
    return make
