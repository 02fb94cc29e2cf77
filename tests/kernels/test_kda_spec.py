"""KDA speculative kernels: verify (state never written) + commit (replay) against plain decode snapshots.

For k drafts the verify window has k+1 tokens; for every n in 0..k+1 (n tokens entering the state) the state
and the conv windows after verify + commit(n) equal those after n plain decode steps (recurrent_kda one token
at a time, short_conv_step), fp32 within 1e-5, for both gate forms and every backend.
"""

import pytest
import torch

from k3serve.kernels.kda import recurrent_kda
from k3serve.kernels.kda_records import record_floats, record_offsets
from k3serve.kernels.kda_spec import kda_commit, kda_verify
from k3serve.kernels.short_conv import short_conv_step

H, K, W = 2, 16, 4
BACKENDS = ["naive", "torch", "triton"]


def _blocks(B, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, K * K + 3 * (W - 1) * K, generator=gen) * 0.5


def _records(q, k, v, g, beta, blocks, raw, backend):
    B, T = q.shape[:2]
    S0 = blocks[..., : K * K].unflatten(-1, (K, K))
    o, u = kda_verify(q, k, v, g, beta, S0, backend=backend)
    rec = torch.zeros(B, H, T, record_floats(K))
    off = record_offsets(K)
    rec[..., off["k"]: off["k"] + K] = k.transpose(1, 2)
    rec[..., off["g"]: off["g"] + K] = g.transpose(1, 2)
    rec[..., off["u"]: off["u"] + K] = u.transpose(1, 2)
    rec[..., off["raw"]:] = raw.transpose(1, 2).flatten(-2)  # raw [B, T, H, 3, K]
    return o, rec


def _plain(q, k, v, g, beta, blocks, raw, n):
    """n plain decode steps on a copy: the snapshot the spec path must reproduce; also each step's output."""
    blk = blocks.clone()
    S = blk[..., : K * K].unflatten(-1, (K, K))
    conv = blk[..., K * K:].unflatten(-1, (3, W - 1, K))
    outs = []
    for t in range(n):
        o, _ = recurrent_kda(q[:, t: t + 1], k[:, t: t + 1], v[:, t: t + 1], g[:, t: t + 1], beta[:, t: t + 1],
                             initial_state=S, inplace_state=True, backend="torch")
        outs.append(o)
        for x in range(3):
            window = conv[:, :, x].permute(0, 2, 1, 3).flatten(2)  # [B, W-1, H*K]
            _, new = short_conv_step(raw[:, t, :, x].flatten(1), torch.ones(H * K, W), window)
            conv[:, :, x].copy_(new.view(-1, W - 1, H, K).permute(0, 2, 1, 3))
    return blk, outs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("gate", ["k3", "kl"])
@pytest.mark.parametrize("k_drafts", [1, 3, 7])
def test_verify_commit_equals_plain_decode(kda_inputs, backend, gate, k_drafts):
    T, B = k_drafts + 1, 2
    q, k, v, g, beta = kda_inputs(B, T, H, K, K, gate, seed=10 * k_drafts + (gate == "kl"))
    raw = torch.randn(B, T, H, 3, K, generator=torch.Generator().manual_seed(k_drafts))
    blocks = _blocks(B, k_drafts)
    before = blocks.clone()
    o, rec = _records(q, k, v, g, beta, blocks, raw, backend)
    assert torch.equal(blocks, before), "verify wrote the state"
    _, outs = _plain(q, k, v, g, beta, blocks, raw, T)
    torch.testing.assert_close(o, torch.cat(outs, 1), atol=1e-5, rtol=0)  # row t = plain decode's output t
    for n in range(T + 1):
        # the two requests of the batch accept different counts (n and its mirror)
        acc = torch.tensor([n, T - n])
        got = blocks.clone()
        kda_commit(got, rec, acc, K, W, backend=backend)
        for b in range(B):
            want, _ = _plain(q[b: b + 1], k[b: b + 1], v[b: b + 1], g[b: b + 1], beta[b: b + 1],
                             blocks[b: b + 1], raw[b: b + 1], int(acc[b]))
            torch.testing.assert_close(got[b: b + 1], want, atol=1e-5, rtol=0, msg=f"n={int(acc[b])} b={b}")


def test_torch_commit_is_bitwise_plain_decode(kda_inputs):
    """The torch replay repeats plain decode's update op for op: the state is bit for bit the same."""
    q, k, v, g, beta = kda_inputs(1, 8, H, K, K, "k3", seed=5)
    raw = torch.randn(1, 8, H, 3, K)
    blocks = _blocks(1, 5)
    _, rec = _records(q, k, v, g, beta, blocks, raw, "torch")
    got = blocks.clone()
    kda_commit(got, rec, torch.tensor([6]), K, W, backend="torch")
    want, _ = _plain(q, k, v, g, beta, blocks, raw, 6)
    assert torch.equal(got, want)


def test_commit_rejects_bad_counts():
    with pytest.raises(ValueError, match="accepted"):
        kda_commit(_blocks(1, 0), torch.zeros(1, H, 2, record_floats(K)), torch.tensor([3]), K, W)
