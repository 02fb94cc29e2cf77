"""Triton KDA kernels under TRITON_INTERPRET=1 (set in conftest) on CPU tensors.

The interpreter is slow: sizes and the number of cases are kept small.
"""

import pytest
import torch

from k3serve.kernels.kda import chunk_kda, recurrent_kda
from k3serve.kernels.kda_naive import naive_recurrent_kda

CASES = [  # (T, with_h0, gate)
    (1, True, "k3"),
    (17, False, "kl"),
    (70, True, "k3"),
    (70, False, "kl"),
]


@pytest.mark.parametrize("fn", [recurrent_kda, chunk_kda])
@pytest.mark.parametrize("T,with_h0,gate", CASES)
def test_triton_matches_naive(kda_inputs, fn, T, with_h0, gate):
    B, H, K, V = 2, 2, 16, 32
    q, k, v, g, beta = kda_inputs(B, T, H, K, V, gate, seed=T)
    pool = torch.randn(B, 2, H, K, V)
    h0 = pool[:, 1] if with_h0 else None            # strided view, must stay untouched
    before = pool.clone()
    ref_o, ref_s = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, s = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, backend="triton")
    torch.testing.assert_close(o, ref_o, atol=1e-5, rtol=0)
    torch.testing.assert_close(s, ref_s, atol=1e-5, rtol=0)
    assert torch.equal(pool, before)


@pytest.mark.parametrize("fn", [recurrent_kda, chunk_kda])
def test_triton_odd_dims_and_bf16(kda_inputs, fn):
    """K, V not powers of two (masked padding) with bf16 q/k/v/beta and no final state."""
    q, k, v, g, beta = kda_inputs(1, 21, 2, 12, 20, "kl", seed=3, dtype=torch.bfloat16)
    ref_o, _ = naive_recurrent_kda(q, k, v, g, beta, scale=0.7)
    o, s = fn(q, k, v, g, beta, scale=0.7, backend="triton")
    assert s is None and o.dtype == torch.bfloat16
    torch.testing.assert_close(o.float(), ref_o.float(), atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("chunk_size,T", [(16, 40), (64, 70)])
def test_triton_chunk_sizes(kda_inputs, chunk_size, T):
    from k3serve.kernels.kda_triton import chunk_kda_triton

    q, k, v, g, beta = kda_inputs(1, T, 2, 16, 16, "k3", seed=chunk_size)
    h0 = torch.randn(1, 2, 16, 16)
    ref_o, ref_s = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, s = chunk_kda_triton(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                            chunk_size=chunk_size)
    torch.testing.assert_close(o, ref_o, atol=1e-5, rtol=0)
    torch.testing.assert_close(s, ref_s, atol=1e-5, rtol=0)


def test_triton_chunk_wide_heads_launch(kda_inputs):
    """Head size 128 takes the wide-head launch (16-token chunks, 32-wide V blocks: 4 V programs per head)."""
    from k3serve.kernels.kda_triton import WIDE_HEAD_LAUNCH, chunk_kda_triton, chunk_launch

    assert chunk_launch(128) == WIDE_HEAD_LAUNCH and chunk_launch(64) != WIDE_HEAD_LAUNCH
    q, k, v, g, beta = kda_inputs(1, 19, 1, 128, 128, "k3", seed=11)
    h0 = torch.randn(1, 1, 128, 128)
    ref_o, ref_s = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, s = chunk_kda_triton(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(o, ref_o, atol=1e-5, rtol=0)
    torch.testing.assert_close(s, ref_s, atol=1e-5, rtol=0)
