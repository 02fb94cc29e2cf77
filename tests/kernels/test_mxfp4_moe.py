"""The fused CPU kernel of an MoE layer's MXFP4 routed experts (kernels/cpu/mxfp4_moe_cpu.py,
model/layers/moe_mxfp4.py) against the float64 oracle, the unfused torch path and the Triton matmul
(TRITON_INTERPRET=1), and its batch invariance: a token's bits do not depend on which other tokens share the call
or its experts."""

import pytest
import torch

from k3serve.kernels import mxfp4 as mx
from k3serve.kernels.cpu import mxfp4_moe_cpu as fused_kernel
from k3serve.kernels.mxfp4_naive import routed_moe_naive
from k3serve.model.layers.expert_weights import MXFP4Linear
from k3serve.model.layers.moe_mxfp4 import FusedMXFP4Experts, fuse_mxfp4_experts
from k3serve.model.layers.norm import glu

E_LOCAL, FIRST, K_IN, INTER, TOP_K = 6, 6, 64, 32, 2  # rank 1 of 2 over 12 experts
BETAS = (4.0, 25.0)


def _experts(seed: int, nan_expert: int | None = None):
    g = torch.Generator().manual_seed(seed)
    out = []
    for e in range(E_LOCAL):
        mats = []
        for o, k in ((INTER, K_IN), (INTER, K_IN), (K_IN, INTER)):
            w = torch.randn(o, k, generator=g) * torch.exp2(torch.randint(-3, 3, (o, 1), generator=g).float())
            mats.append(mx.quantize_mxfp4(w))
        if e == nan_expert:
            mats[2][1][5, 0] = 0xFF  # one w2 scale is NaN: output 5 of this expert's rows
        out.append(tuple(mats))
    return out


def _routing(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(2 * E_LOCAL, generator=g)[:TOP_K] for _ in range(n)])
    return ids, torch.rand(n, TOP_K, generator=g)


def _fused(packed, act="situ") -> FusedMXFP4Experts:
    lins = [tuple(MXFP4Linear(p, s) for p, s in e) for e in packed]
    f = fuse_mxfp4_experts(lins, FIRST, act, *BETAS)
    assert f is not None
    return f


def _unfused(packed, z, ids, w, act="situ", backend=None):
    """MoE._routed_partial's per-expert loop over MXFP4Linear objects (the unfused CPU path, or Triton)."""
    lins = [tuple(MXFP4Linear(p, s, backend=backend or "") for p, s in e) for e in packed]
    out = torch.zeros(z.shape, dtype=torch.float32)
    for i, (w1, w3, w2) in enumerate(lins):
        rows, slot = (ids == FIRST + i).nonzero(as_tuple=True)
        if len(rows):
            zi = z[rows]
            y = w2(glu(w1(zi), w3(zi), act, *BETAS))
            out.index_add_(0, rows, y.float() * w[rows, slot].unsqueeze(-1))
    return out


@pytest.mark.parametrize("act", ["situ", "silu"])
@pytest.mark.parametrize("n", [1, 3, 40])
def test_fused_equals_the_oracle_and_the_unfused_path_fp32(act, n):
    packed = _experts(seed=n)
    z = torch.randn(n, K_IN, generator=torch.Generator().manual_seed(1))
    ids, w = _routing(n, seed=2)
    got = _fused(packed, act)(z, ids, w)
    assert got.dtype == torch.float32 and got.shape == (n, K_IN)
    ref = routed_moe_naive(z, ids, w, FIRST, packed, act, *BETAS)
    scale = ref.abs().max().item()
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5 * scale)
    torch.testing.assert_close(got, _unfused(packed, z, ids, w, act), rtol=1e-5, atol=1e-5 * scale)
    mine = (ids >= FIRST) & (ids < FIRST + E_LOCAL)
    assert torch.equal(got[~mine.any(1)], torch.zeros_like(got[~mine.any(1)]))  # other ranks' rows: 0


def test_fused_bf16_activations_keep_the_unfused_rounding_points():
    packed = _experts(seed=5)
    z = torch.randn(24, K_IN, generator=torch.Generator().manual_seed(3)).bfloat16()
    ids, w = _routing(24, seed=4)
    got = _fused(packed)(z, ids, w)
    want = _unfused(packed, z, ids, w)
    # the intermediates are bf16 in both; a last-bit difference before a bf16 rounding can move it one bf16 step
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    assert (got == want).float().mean() > 0.9


def test_fused_equals_the_triton_matmul_path():
    packed = _experts(seed=7)
    z = torch.randn(5, K_IN, generator=torch.Generator().manual_seed(8))
    ids, w = _routing(5, seed=9)
    tri = _unfused(packed, z, ids, w, backend="triton")
    got = _fused(packed)(z, ids, w)
    torch.testing.assert_close(got, tri, rtol=1e-5, atol=1e-5 * tri.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tokens_bits_do_not_depend_on_the_other_tokens_of_the_call(dtype):
    packed = _experts(seed=11)
    f = _fused(packed)
    z = torch.randn(33, K_IN, generator=torch.Generator().manual_seed(12)).to(dtype)
    ids, w = _routing(33, seed=13)
    ids[:8] = torch.tensor([FIRST + 1, FIRST + 2])  # 8 rows share two experts (the decode-once path)
    together = f(z, ids, w)
    for n in range(33):  # alone: one row per expert (the decode-on-the-fly path)
        assert torch.equal(f(z[n: n + 1], ids[n: n + 1], w[n: n + 1])[0], together[n]), n
    perm = torch.randperm(33, generator=torch.Generator().manual_seed(14))
    assert torch.equal(f(z[perm], ids[perm], w[perm]), together[perm])
    assert torch.equal(f(z[5:20], ids[5:20], w[5:20]), together[5:20])


def test_nan_scale_reaches_only_the_rows_of_its_expert():
    packed = _experts(seed=15, nan_expert=2)
    z = torch.randn(12, K_IN, generator=torch.Generator().manual_seed(16))
    ids, w = _routing(12, seed=17)
    ids[0] = torch.tensor([FIRST + 2, FIRST + 3])
    ids[1] = torch.tensor([FIRST + 3, FIRST + 4])
    got = _fused(packed)(z, ids, w)
    hit = (ids == FIRST + 2).any(1)
    assert got[hit, 5].isnan().all() and not got[~hit].isnan().any()
    assert not got[hit][:, [0, 1, 2, 3, 4, 6]].isnan().any()


def test_bf16_rounding_is_round_to_nearest_even():
    g = torch.Generator().manual_seed(18)
    vals = torch.cat([torch.randn(2000, generator=g) * torch.exp2(torch.randint(-60, 60, (2000,), generator=g).float()),
                      torch.tensor([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -(1.0 + 2 ** -8), 0.0, -0.0, 3.4e38, 1e-40,
                                    float("inf"), float("-inf")])])
    got = torch.tensor([float(fused_kernel._bf16(fused_kernel.np.float32(v))) for v in vals.tolist()])
    assert torch.equal(got, vals.bfloat16().float())
    nan = float(fused_kernel._bf16(fused_kernel.np.float32("nan")))
    assert nan != nan


def test_what_the_fused_form_refuses_or_leaves_to_the_unfused_path():
    packed = _experts(seed=19)
    f = _fused(packed)
    assert f.takes(torch.zeros(1, K_IN, dtype=torch.bfloat16)) and not f.takes(torch.zeros(1, K_IN).half())
    assert not f.takes(torch.zeros(1, K_IN, requires_grad=True))  # forward only: autograd keeps the loop
    with pytest.raises(ValueError, match="takes activations in"):
        f(torch.zeros(1, K_IN, dtype=torch.float16), torch.tensor([[FIRST, FIRST + 1]]), torch.ones(1, 2))
    with pytest.raises(ValueError, match="ids must be int64"):
        f(torch.zeros(1, K_IN), torch.tensor([[FIRST, FIRST + 1]], dtype=torch.int32), torch.ones(1, 2))
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        FusedMXFP4Experts(FIRST, f.p1, f.s1, f.p3, f.s3, f.p2, f.s2, "gelu", *BETAS)
    lins = [tuple(MXFP4Linear(p, s) for p, s in e) for e in packed]
    assert fuse_mxfp4_experts(lins, FIRST, "gelu", *BETAS) is None  # an activation it lacks: the loop runs
    dense = [tuple(mx.dequantize_mxfp4(p, s) for p, s in e) for e in packed]
    from k3serve.model.layers.expert_weights import DenseLinear

    assert fuse_mxfp4_experts([tuple(DenseLinear(t) for t in e) for e in dense], FIRST, "situ", *BETAS) is None
    # the stacks hold the checkpoint's bytes, and the per-expert views read them
    views = f.views()
    assert torch.equal(views[3][2].packed, packed[3][2][0]) and views[3][2].packed.data_ptr() == f.p2[3].data_ptr()
