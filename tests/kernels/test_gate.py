import pytest
import torch

from k3serve.kernels.gate import kda_gate


def _params(H, K, seed=0):
    gen = torch.Generator().manual_seed(seed)
    A_log = torch.log(torch.linspace(1.0, 16.0, H))
    dt_bias = torch.randn(H * K, generator=gen)
    return gen, A_log, dt_bias


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_gate_matches_naive(backend, lower_bound):
    H, K = 3, 8
    gen, A_log, dt_bias = _params(H, K)
    z = torch.randn(4, 5, H * K, generator=gen) * 8      # flat [..., H*K] with 2 leading dims
    ref = kda_gate(z, A_log, dt_bias, lower_bound, backend="naive")
    g = kda_gate(z, A_log, dt_bias, lower_bound, backend=backend)
    assert g.shape == (4, 5, H, K) and g.dtype == torch.float32
    torch.testing.assert_close(g, ref, atol=1e-5, rtol=1e-5)
    assert (g <= 0).all()
    if lower_bound is not None:
        assert (g >= lower_bound).all()


@pytest.mark.parametrize("backend", ["naive", "torch", "triton"])
def test_gate_split_layout_bf16_and_extremes(backend):
    H, K = 2, 16
    gen, A_log, dt_bias = _params(H, K, seed=1)
    z = torch.randn(7, H, K, generator=gen) * 30        # [N, H, K]; saturates both forms
    z[0, 0, :4] = torch.tensor([-200.0, 200.0, -1e4, 1e4])
    for lb in (None, -5.0):
        ref = kda_gate(z.double(), A_log, dt_bias, lb, backend="naive")
        g = kda_gate(z, A_log, dt_bias, lb, backend=backend)
        assert g.shape == (7, H, K) and torch.isfinite(g).all()
        torch.testing.assert_close(g, ref, atol=1e-5, rtol=1e-5)
        gb = kda_gate(z.bfloat16(), A_log, dt_bias, lb, backend=backend)
        assert gb.dtype == torch.float32
        torch.testing.assert_close(gb, kda_gate(z.bfloat16(), A_log, dt_bias, lb, backend="naive"),
                                   atol=1e-5, rtol=1e-5)


def test_gate_formulas():
    """Spot-check both closed forms against hand-written values."""
    A_log = torch.tensor([0.5])
    dt_bias = torch.tensor([0.25, -1.0])
    z = torch.tensor([[1.0, 2.0]])
    x = z + dt_bias
    kl = -torch.exp(torch.tensor(0.5)) * torch.log1p(torch.exp(x))
    k3 = -5.0 * torch.sigmoid(torch.exp(torch.tensor(0.5)) * x)
    torch.testing.assert_close(kda_gate(z, A_log, dt_bias, None).view(1, 2), kl)
    torch.testing.assert_close(kda_gate(z, A_log, dt_bias, -5.0).view(1, 2), k3)


def test_gate_rejects_bad_shapes():
    with pytest.raises(ValueError):
        kda_gate(torch.zeros(2, 10), torch.zeros(2), torch.zeros(8), None)
