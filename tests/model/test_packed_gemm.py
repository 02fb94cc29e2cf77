"""oneDNN's packed GEMM as the deterministic mode uses it (model/packed_gemm.py): a row's bits whatever the row
count (one row padded to two) and place, a column's whatever the width, and a cache that follows the weight."""

import pytest
import torch

from k3serve.contracts.numerics import NumericsError
from k3serve.model.gemm_facts import check_packed_rows
from k3serve.model.packed_gemm import PackedWeights, packed_gemm_available

pytestmark = pytest.mark.skipif(not packed_gemm_available(), reason="torch built without MKL-DNN")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("k,n", [(1024, 1024), (2048, 128), (1024, 4232), (4096, 64)])
def test_rows_keep_their_bits_from_one_row_to_many(one_thread, k, n, threads):
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(k + n)
    x, w = torch.randn(300, k, generator=g), torch.randn(n, k, generator=g)
    ops = PackedWeights()
    full = ops.linear(x, w)
    for m in (1, 2, 3, 15, 16, 17, 64, 129):
        assert torch.equal(ops.linear(x[:m], w), full[:m]), f"[{m}, {k}] x [{k}, {n}]"
    assert torch.equal(ops.linear(x[7:40], w), full[7:40])
    assert torch.equal(ops.linear(x, w[n // 4: n // 2]), full[:, n // 4: n // 2])
    w2 = torch.randn(n, k, generator=g)
    assert torch.equal(ops.linear_stacked(x[:3], (w, w2)), torch.cat([full[:3], ops.linear(x[:3], w2)], dim=1))
    torch.testing.assert_close(full, x @ w.t(), rtol=1e-4, atol=1e-3)


def test_the_load_time_check_passes_here_for_the_bench_shapes():
    check_packed_rows([(1024, 1024), (1024, 128), (2048, 1024)], threads=1)


def test_an_in_place_update_of_the_weight_is_seen():
    w, x = torch.randn(64, 1024), torch.randn(3, 1024)
    ops = PackedWeights()
    before = ops.linear(x, w)
    w.mul_(2.0)
    assert torch.equal(ops.linear(x, w), 2.0 * before)
    assert len(ops) == 1  # the entry was made anew, not added


def test_a_forward_that_needs_gradients_is_refused_naming_the_mode():
    w = torch.randn(32, 1024, requires_grad=True)
    with pytest.raises(NumericsError, match="numerics: default"):
        PackedWeights().linear(torch.randn(2, 1024), w)
    with torch.no_grad():
        PackedWeights().linear(torch.randn(2, 1024), w)
