import pytest
import torch

from k3serve.kernels.mla_decode import mla_decode

Dl, R, PS = 32, 16, 4


def _setup(seed=0, dtype=torch.float32, index_dtype=torch.int32, H=5):
    gen = torch.Generator().manual_seed(seed)
    num_pages, num_layers = 24, 3
    pool = torch.randn(num_pages, num_layers, PS, Dl + R, generator=gen).to(dtype)
    kv_pages = pool[:, 1]                       # one layer's strided view of the pool
    lens = torch.tensor([1, 4, 9, 14, 0])       # ragged: 1 token, exact page, partial pages, empty
    B = lens.numel()
    perm = torch.randperm(num_pages, generator=gen)
    table = torch.full((B, 5), -1, dtype=index_dtype)   # -1 past each request's pages
    used = 0
    for b, L in enumerate(lens.tolist()):
        n = -(-L // PS)
        table[b, :n] = perm[used:used + n].to(index_dtype)   # scattered, non-monotone pages
        used += n
    q_lat = torch.randn(B, H, Dl, generator=gen)
    q_pe = torch.randn(B, H, R, generator=gen)
    return q_lat, q_pe, kv_pages, table, lens


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_matches_naive(backend, index_dtype):
    q_lat, q_pe, kv, table, lens = _setup(index_dtype=index_dtype)
    assert not kv.is_contiguous()
    scale = (Dl + R) ** -0.5
    ref = mla_decode(q_lat, q_pe, kv, table, lens, scale, backend="naive")
    out = mla_decode(q_lat, q_pe, kv, table, lens, scale, backend=backend)
    assert out.shape == q_lat.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.count_nonzero(out[-1]) == 0                  # seq_len 0 -> zeros


def test_naive_is_dense_attention():
    q_lat, q_pe, kv, table, lens = _setup(seed=1)
    b = 3                                                     # 14 tokens over 4 pages
    rows = torch.cat([kv[int(p)] for p in table[b, :4]])[:14]
    s = (q_lat[b] @ rows[:, :Dl].T + q_pe[b] @ rows[:, Dl:].T) * 0.3
    ref = torch.softmax(s, -1) @ rows[:, :Dl]
    out = mla_decode(q_lat, q_pe, kv, table, lens, 0.3, backend="naive")
    torch.testing.assert_close(out[b], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bf16_pages_many_heads(backend):
    # H = 20 spans two head blocks of the Triton kernel when BH = 16.
    q_lat, q_pe, kv, table, lens = _setup(seed=2, dtype=torch.bfloat16, H=20)
    ref = mla_decode(q_lat, q_pe, kv, table, lens, 0.2, backend="naive")
    out = mla_decode(q_lat, q_pe, kv, table, lens, 0.2, backend=backend)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_torch_path_groups_requests(monkeypatch):
    """A tiny gather budget forces one request per group; results are unchanged."""
    from k3serve.kernels import mla_decode as mod

    q_lat, q_pe, kv, table, lens = _setup(seed=3)
    ref = mla_decode(q_lat, q_pe, kv, table, lens, 0.25, backend="torch")
    monkeypatch.setattr(mod, "_GATHER_BUDGET", 1)
    torch.testing.assert_close(mla_decode(q_lat, q_pe, kv, table, lens, 0.25, backend="torch"), ref)


@pytest.mark.parametrize("lens", [[4, 8], [8, 8], [3, 8]])
def test_torch_path_full_and_partial_last_pages(lens):
    """The torch path skips the length mask when every request's pages are full, and the empty-row guard when no
    request is empty: both against the oracle (the masked case beside them)."""
    q_lat, q_pe, kv, table, _ = _setup(seed=4)
    q_lat, q_pe, table = q_lat[2:4], q_pe[2:4], table[2:4]  # requests with 3 and 4 pages of their own
    seq = torch.tensor(lens)
    scale = (Dl + R) ** -0.5
    ref = mla_decode(q_lat, q_pe, kv, table, seq, scale, backend="naive")
    torch.testing.assert_close(mla_decode(q_lat, q_pe, kv, table, seq, scale, backend="torch"), ref,
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 64])
@pytest.mark.parametrize("heads", [5, 20])
def test_triton_context_splits(num_splits, heads):
    """The split-context Triton kernel (flash-decoding) at any split count: splits past a request's length, a
    request of length 0, tokens of one BN block on several pages (page size 4 < BN), two head blocks."""
    from k3serve.kernels.mla_decode_triton import mla_decode_triton

    q_lat, q_pe, kv, table, lens = _setup(seed=5, H=heads)
    scale = (Dl + R) ** -0.5
    ref = mla_decode(q_lat, q_pe, kv, table, lens, scale, backend="naive")
    out = mla_decode_triton(q_lat, q_pe, kv, table, lens, scale, num_splits=num_splits)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert torch.count_nonzero(out[-1]) == 0


def test_triton_split_choice_fills_the_device_and_keeps_blocks_whole():
    from k3serve.kernels.mla_decode_triton import BN, MAX_SPLITS, choose_splits

    cpu = torch.device("cpu")   # one "multiprocessor": the count only scales the target
    assert choose_splits(1, 8, 4096, cpu) == 4                    # 4 programs per SM, 1 request x 1 head block
    assert choose_splits(64, 8, 4096, cpu) == 1                   # enough requests already
    assert choose_splits(1, 8, BN, cpu) == 1                      # never a split shorter than a block
    assert choose_splits(1, 8, 1 << 20, cpu) <= MAX_SPLITS
