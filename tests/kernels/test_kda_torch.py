import pytest
import torch

from k3serve.kernels import kda_torch
from k3serve.kernels.kda import chunk_kda, recurrent_kda
from k3serve.kernels.kda_naive import naive_recurrent_kda
from k3serve.kernels.kda_torch import chunk_kda_torch, recurrent_kda_torch

TOL = dict(atol=1e-5, rtol=0)


def _close(a, b, **tol):
    torch.testing.assert_close(a.float(), b.float(), **(tol or TOL))


@pytest.mark.parametrize("gate", ["k3", "kl"])
@pytest.mark.parametrize("with_h0", [False, True])
@pytest.mark.parametrize("T", [1, 63, 64, 65, 300])
def test_torch_paths_match_naive(kda_inputs, T, with_h0, gate):
    B, H, K, V = 2, (2 if T == 300 else 3), 16, 32
    q, k, v, g, beta = kda_inputs(B, T, H, K, V, gate, seed=T)
    h0 = torch.randn(B, H, K, V) if with_h0 else None
    ref_o, ref_s = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    for fn in (chunk_kda_torch, recurrent_kda_torch):
        o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True)
        assert o.shape == (B, T, H, V) and o.dtype == v.dtype
        assert s.shape == (B, H, K, V) and s.dtype == torch.float32
        _close(o, ref_o)
        _close(s, ref_s)


@pytest.mark.parametrize("gate", ["k3", "kl"])
def test_square_head_dim_32(kda_inputs, gate):
    q, k, v, g, beta = kda_inputs(2, 100, 2, 32, 32, gate, seed=1)
    h0 = torch.randn(2, 2, 32, 32)
    ref_o, ref_s = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    for fn in (chunk_kda, recurrent_kda):
        o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, backend="torch")
        _close(o, ref_o)
        _close(s, ref_s)


@pytest.mark.parametrize("path", ["centred", "pairwise"])
def test_both_diagonal_block_paths(kda_inputs, monkeypatch, path):
    """K3 gates take the centred fast path; force the exact pairwise path and check both."""
    calls = []
    for name in ("_own_centred", "_own_pairwise"):
        orig = getattr(kda_torch, name)
        monkeypatch.setattr(kda_torch, name, lambda *a, _o=orig, _n=name: calls.append(_n) or _o(*a))
    if path == "pairwise":
        monkeypatch.setattr(kda_torch, "_MAX_HALF_SPAN", -1.0)
    q, k, v, g, beta = kda_inputs(2, 130, 2, 16, 16, "k3", seed=3)
    ref_o, ref_s = naive_recurrent_kda(q, k, v, g, beta, output_final_state=True)
    o, s = chunk_kda_torch(q, k, v, g, beta, output_final_state=True)
    assert set(calls) == {f"_own_{path}"}
    _close(o, ref_o)
    _close(s, ref_s)


def check_huge_unbounded_decays(kda_inputs, fn):
    """g down to ~ -1e3 per step: nothing may overflow, turn NaN, or lose the fresh tokens (also run on the fused
    CPU kernel by test_kda_cpu.py)."""
    A_log = torch.tensor([0.0, 3.0, 6.0])          # exp(A_log) up to ~400
    q, k, v, g, beta = kda_inputs(1, 150, 3, 16, 16, "kl", seed=4, A_log=A_log)
    assert g.min() < -300
    h0 = torch.randn(1, 3, 16, 16)
    ref_o, ref_s = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    _close(o, ref_o)
    _close(s, ref_s)


@pytest.mark.parametrize("fn", [chunk_kda_torch, recurrent_kda_torch])
def test_huge_unbounded_decays(kda_inputs, fn):
    check_huge_unbounded_decays(kda_inputs, fn)


def check_bf16_inputs(kda_inputs, fn):
    """bf16 inputs (also run on the fused CPU kernel by test_kda_cpu.py)."""
    q, k, v, g, beta = kda_inputs(2, 90, 2, 16, 16, "k3", seed=5, dtype=torch.bfloat16)
    h0 = torch.randn(2, 2, 16, 16)
    ref_o, ref_s = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    # Same bf16 inputs, fp32 math on both sides: the state agrees to fp32 rounding, the
    # output to one bf16 rounding of O(1) values.
    _close(o, ref_o, atol=2e-2, rtol=1e-2)
    _close(s, ref_s, atol=1e-4, rtol=0)


@pytest.mark.parametrize("fn", [chunk_kda_torch, recurrent_kda_torch])
def test_bf16_inputs(kda_inputs, fn):
    check_bf16_inputs(kda_inputs, fn)


def check_state_carry_and_no_mutation(kda_inputs, fn):
    """Splitting a sequence and carrying the state equals one pass; initial_state may be a
    non-contiguous view of a pool and is never written; inputs are never written (also run on the fused CPU
    kernel by test_kda_cpu.py)."""
    B, T, H, K, V = 2, 150, 2, 16, 32
    q, k, v, g, beta = kda_inputs(B, T, H, K, V, "kl", seed=6)
    pool = torch.randn(B, 3, H, K, V)
    h0 = pool[:, 1]                                   # strided view into a "state pool"
    assert not h0.is_contiguous()
    snapshot = [x.clone() for x in (pool, q, k, v, g, beta)]
    o_full, s_full = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    cut = 77
    o1, s1 = fn(q[:, :cut], k[:, :cut], v[:, :cut], g[:, :cut], beta[:, :cut],
                initial_state=h0, output_final_state=True)
    o2, s2 = fn(q[:, cut:], k[:, cut:], v[:, cut:], g[:, cut:], beta[:, cut:],
                initial_state=s1, output_final_state=True)
    _close(torch.cat((o1, o2), dim=1), o_full)
    _close(s2, s_full)
    for before, after in zip(snapshot, (pool, q, k, v, g, beta)):
        assert torch.equal(before, after)


@pytest.mark.parametrize("fn", [chunk_kda_torch, recurrent_kda_torch])
def test_state_carry_and_no_mutation(kda_inputs, fn):
    check_state_carry_and_no_mutation(kda_inputs, fn)


def test_single_head_aliasing_inputs_untouched(kda_inputs):
    # B = H = 1 with T a multiple of 64: the chunk layout can be a view of q; q must survive.
    q, k, v, g, beta = kda_inputs(1, 64, 1, 16, 16, "k3", seed=7)
    q0 = q.clone()
    chunk_kda_torch(q, k, v, g, beta, scale=0.5)
    assert torch.equal(q, q0)


def test_final_state_optional_and_scale(kda_inputs):
    q, k, v, g, beta = kda_inputs(1, 40, 2, 16, 16, "k3", seed=8)
    ref_o, _ = naive_recurrent_kda(q, k, v, g, beta, scale=1.0)
    for fn in (chunk_kda_torch, recurrent_kda_torch):
        o, s = fn(q, k, v, g, beta, scale=1.0)
        assert s is None
        _close(o, ref_o)


def test_rejects_bad_shapes(kda_inputs):
    q, k, v, g, beta = kda_inputs(1, 8, 2, 16, 16, "k3")
    with pytest.raises(ValueError):
        chunk_kda_torch(q, k, v, g, beta[..., :1])
    with pytest.raises(ValueError):
        recurrent_kda_torch(q, k, v, g, beta, initial_state=torch.zeros(1, 2, 16, 8))
