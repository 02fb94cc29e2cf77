"""MXFP4 format and matmul: grid round trips, packing order, NaN scale, +-0, an independent OCP decoder, and
the three matmul backends (naive, torch row-block scratch, Triton under TRITON_INTERPRET=1) against each other."""

import math

import pytest
import torch

from k3serve.kernels import mxfp4 as mx
from k3serve.kernels.mxfp4_naive import dequantize_naive


# --- an independent decoder, written here from the OCP MX v1.0 spec (section 5.3.3, E2M1; 5.4.1, E8M0) -----
def _ocp_e2m1(nibble: int) -> float:
    # S.EE.M, exponent bias 1; E == 0 is subnormal: (-1)^S * 2^(1 - bias) * 0.M
    s, e, m = nibble >> 3, (nibble >> 1) & 0b11, nibble & 1
    v = 2.0 ** (1 - 1) * (m / 2) if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)
    return -v if s else v


def _ocp_e8m0(bits: int) -> float:
    # an exponent-only format: 2^(bits - 127); all-ones is NaN (no infinity, no zero)
    return float("nan") if bits == 0b1111_1111 else math.ldexp(1.0, bits - 127)


def _ocp_decode(packed_row: bytes, scale_row: bytes) -> list[float]:
    out = []
    for i, byte in enumerate(packed_row):
        for nibble in (byte & 0x0F, byte >> 4):  # first element of a pair in bits 3:0 (compressed-tensors)
            out.append(_ocp_e2m1(nibble) * _ocp_e8m0(scale_row[(2 * i) // 32]))
    return out


def _f32(v: float) -> float:
    # round a Python float to fp32 the IEEE way (6 * 2^127 overflows to inf, as in any fp32 dequantisation)
    return torch.tensor(v, dtype=torch.float64).float().item()


def test_dequant_matches_independent_ocp_decoder_on_every_byte_and_scale():
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (64, 64), dtype=torch.uint8, generator=g)
    packed[0] = torch.arange(64, dtype=torch.uint8)  # every byte value appears
    packed[1] = torch.arange(64, 128, dtype=torch.uint8)
    packed[2] = torch.arange(128, 192, dtype=torch.uint8)
    packed[3] = torch.arange(192, 256, dtype=torch.uint8)
    # every scale code once (0: the subnormal 2^-127, 254: 2^127, 255: NaN), shuffled over rows
    scales = torch.arange(256, dtype=torch.uint8)[torch.randperm(256, generator=g)].reshape(64, 4)
    ours = mx.dequantize_mxfp4(packed, scales, torch.float32)
    for r in range(packed.shape[0]):
        want = [_f32(v) for v in _ocp_decode(bytes(packed[r].tolist()), bytes(scales[r].tolist()))]
        got = ours[r].tolist()
        for k, (a, b) in enumerate(zip(got, want)):
            assert (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b)), \
                (r, k, a, b)
    naive = dequantize_naive(packed, scales)
    assert torch.equal(naive.float().isnan(), ours.isnan())
    assert torch.equal(torch.nan_to_num(naive.float()), torch.nan_to_num(ours))


def test_packing_order_low_nibble_is_the_even_element():
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1] = 1.0, -6.0  # codes 2 and 15 at scale 2^0 (amax 6 -> floor(log2 6) - 2 = 0)
    packed, scales = mx.quantize_mxfp4(w)
    assert packed.shape == (1, 16) and scales.shape == (1, 1)
    assert scales.item() == 127
    assert packed[0, 0].item() == (15 << 4) | 2
    assert torch.equal(mx.dequantize_mxfp4(packed, scales), w)


def test_nan_scale_and_signed_zero():
    packed = torch.tensor([[0x80] + [0] * 15], dtype=torch.uint8)  # element 0: +0, element 1: -0
    got = mx.dequantize_mxfp4(packed, torch.tensor([[127]], dtype=torch.uint8))
    assert got[0, 0].item() == 0 and not math.copysign(1, got[0, 0].item()) < 0
    assert got[0, 1].item() == 0 and math.copysign(1, got[0, 1].item()) < 0
    nan = mx.dequantize_mxfp4(packed, torch.tensor([[0xFF]], dtype=torch.uint8))
    assert nan.isnan().all()
    # quantiser: -0.0 and a small negative keep the sign; a NaN block gets the NaN scale
    w = torch.zeros(2, 32)
    w[0, 0], w[0, 1], w[0, 2] = -0.0, -1e-4, 4.0
    w[1, 3] = float("nan")
    p, s = mx.quantize_mxfp4(w)
    assert p[0, 0].item() == 0x88  # -0 and -1e-4 (rounds to -0) share byte 0
    assert s[1].item() == 0xFF and mx.dequantize_mxfp4(p, s)[1].isnan().all()
    assert s[0].item() == 127 - 0 and mx.dequantize_mxfp4(p, s)[0, 2].item() == 4.0
    zero_p, zero_s = mx.quantize_mxfp4(torch.zeros(1, 32))
    assert zero_s.item() == 0 and torch.equal(mx.dequantize_mxfp4(zero_p, zero_s), torch.zeros(1, 32))


@pytest.mark.parametrize("rule", mx.SCALE_RULES)
def test_quantise_dequantise_is_exact_on_the_grid(rule):
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (24, 64), generator=g)
    codes[:, 0] = 7  # each block holds a +-6 so both rules pick the scale the values were made with
    codes[:, 32] = 15
    exps = torch.randint(-20, 20, (24, 2), generator=g).float()
    vals = mx._e2m1_table()[codes] * torch.exp2(exps).repeat_interleave(32, dim=1)
    p, s = mx.quantize_mxfp4(vals, rule)
    back = mx.dequantize_mxfp4(p, s)
    assert torch.equal(back, vals) and torch.equal(torch.signbit(back), torch.signbit(vals))
    assert torch.equal(s.float() - 127, exps)
    # and quantising the dequantised tensor reproduces the same bytes (idempotent)
    p2, s2 = mx.quantize_mxfp4(back, rule)
    assert torch.equal(p2, p) and torch.equal(s2, s)


def test_rounding_ties_to_even_and_saturation():
    grid = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 6.5, 0.3])
    w = torch.zeros(1, 32)
    w[0, : grid.numel()] = grid
    w[0, 31] = 6.0  # amax 7 -> OCP scale 2^0: 7 saturates to 6
    got = mx.dequantize_mxfp4(*mx.quantize_mxfp4(w, "ocp"))[0, : grid.numel()]
    assert got.tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 0.5]
    # round-up never clips: amax 7 -> scale 2 and 7 / 2 = 3.5 -> ties to 4 -> 8
    up = mx.dequantize_mxfp4(*mx.quantize_mxfp4(w, "round-up"))[0]
    assert up[7].item() == 8.0 and up[:].abs().max().item() == 8.0


def test_fake_quant_is_the_serving_dequant_with_a_straight_through_gradient():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(16, 64, generator=g).requires_grad_(True)
    fq = mx.fake_quant_mxfp4(w)
    serving = mx.dequantize_mxfp4(*mx.quantize_mxfp4(w.detach()), torch.float32)
    assert torch.equal(fq.detach(), serving)
    fq.sum().backward()
    assert torch.equal(w.grad, torch.ones_like(w))


def _packed_case(n_out, k, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n_out, k, generator=g) * torch.exp2(torch.randint(-3, 3, (n_out, 1), generator=g).float())
    return mx.quantize_mxfp4(w)


@pytest.mark.parametrize("m,n_out,k", [(1, 24, 64), (5, 40, 96), (17, 64, 32)])
def test_matmul_backends_agree(m, n_out, k):
    p, s = _packed_case(n_out, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(9))
    ref = mx.mxfp4_linear(x, p, s, backend="naive")
    torch_path = mx.mxfp4_linear(x, p, s, backend="torch")
    tri = mx.mxfp4_linear(x, p, s, backend="triton")
    whole = x @ mx.dequantize_mxfp4(p, s).T
    torch.testing.assert_close(torch_path, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tri, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch_path, whole, rtol=1e-6, atol=1e-6)


def test_torch_path_dequantises_in_row_blocks(monkeypatch):
    p, s = _packed_case(48, 64, seed=4)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(5))
    monkeypatch.setattr(mx, "SCRATCH_ELEMS", 64 * 5)  # 5 rows per block: 10 blocks, the last one partial
    calls = []
    real = mx.decode_rows

    def spy(packed, svals):
        calls.append(packed.shape[0])
        return real(packed, svals)

    monkeypatch.setattr(mx, "decode_rows", spy)
    y = mx.mxfp4_linear_torch(x, p, s)
    assert calls == [5] * 9 + [3]
    torch.testing.assert_close(y, x @ mx.dequantize_mxfp4(p, s).T, rtol=1e-5, atol=1e-5)
    calls.clear()  # the prepared CPU matrix of a serving expert: the same blocks, the same bits
    assert torch.equal(mx.CpuMatrix(p, s)(x), y) and calls == [5] * 9 + [3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n_out,k", [(1, 32, 256), (8, 256, 32), (3, 40, 96)])
def test_prepared_cpu_matrix_equals_the_dequantised_product(m, n_out, k, dtype):
    """The serving CPU path (scale values decoded once at load, one gather per byte and one multiply per group
    per call) is bit for bit F.linear on the one dequantisation, in x's dtype; NaN scales propagate."""
    p, s = _packed_case(n_out, k, seed=m + k)
    s[n_out // 2, 0] = 0xFF
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(11)).to(dtype)
    got = mx.CpuMatrix(p, s)(x)
    want = torch.nn.functional.linear(x.float(), mx.dequantize_mxfp4(p, s)).to(dtype)
    assert got.dtype == dtype and torch.equal(got.isnan(), want.isnan()) and got[:, n_out // 2].isnan().all()
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    assert torch.equal(mx.decode_rows(p, mx.scale_values(s)).nan_to_num(), mx.dequantize_mxfp4(p, s).nan_to_num())
    with pytest.raises(ValueError, match=f"x has {k + 32} inputs"):
        mx.CpuMatrix(p, s)(torch.zeros(m, k + 32))
    from k3serve.model.layers.expert_weights import MXFP4Linear

    lin = MXFP4Linear(p, s)  # a serving expert on CPU takes this path; the unprepared torch path gives the same bits
    assert lin.cpu is not None and torch.equal(lin(x).nan_to_num(), got.nan_to_num())
    assert torch.equal(mx.mxfp4_linear(x, p, s, backend="torch").nan_to_num(), got.nan_to_num())


def test_matmul_triton_nan_scale_and_bf16():
    p, s = _packed_case(16, 32, seed=6)
    s[3, 0] = 0xFF
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(7))
    tri = mx.mxfp4_linear(x, p, s, backend="triton")
    assert tri[:, 3].isnan().all() and not tri[:, [0, 1, 2, 4]].isnan().any()
    xb = x.bfloat16()
    got = mx.mxfp4_linear(xb, p[4:12], s[4:12], backend="triton")
    assert got.dtype == torch.bfloat16
    want = xb.float() @ mx.dequantize_mxfp4(p[4:12], s[4:12]).T
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        mx.quantize_mxfp4(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="uint8"):
        mx.dequantize_mxfp4(torch.zeros(2, 16), torch.zeros(2, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="groups of 32"):
        mx.dequantize_mxfp4(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="scale rule"):
        mx.quantize_mxfp4(torch.ones(1, 32), "nearest")
