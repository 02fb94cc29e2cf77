"""The default mode's CPU GEMM choice (model/cpu_gemm.py): which calls take oneDNN, that they give the plain
product's values, the padded one-row call's bits, the plain-weight (transient) call's bits, and a model that
serves the same tokens on either library."""

import pytest
import torch

from k3serve.contracts.numerics import GemmLibrary, Numerics, NumericsError
from k3serve.model import cpu_gemm
from k3serve.model.cpu_gemm import CpuGemm
from k3serve.model.packed_gemm import packed_gemm_available

pytestmark = pytest.mark.skipif(not packed_gemm_available(), reason="torch built without MKL-DNN")


def _gemm(library: GemmLibrary, vendor: str, monkeypatch) -> CpuGemm:
    monkeypatch.setattr(cpu_gemm, "cpu_vendor", lambda: vendor)
    return CpuGemm(library)


@pytest.mark.parametrize("library,vendor,one_row,few_rows", [
    (GemmLibrary.AUTO, "AuthenticAMD", True, True),
    (GemmLibrary.AUTO, "GenuineIntel", False, True),  # MKL's GEMV is the faster one-row call there
    (GemmLibrary.ONEDNN, "GenuineIntel", True, True),
    (GemmLibrary.MKL, "AuthenticAMD", False, False),
])
def test_which_calls_take_onednn(library, vendor, one_row, few_rows, monkeypatch):
    g = _gemm(library, vendor, monkeypatch)
    big, small = torch.randn(512, 1024), torch.randn(256, 256)  # 2 MiB (FEW_ROWS_MIN_ELEMENTS); 256 KiB
    assert g.takes(torch.randn(1, 1024), big) is one_row
    assert g.takes(torch.randn(2, 3, 1024), big) is few_rows  # rows counted over the leading dims
    many = library is not GemmLibrary.MKL
    assert g.takes(torch.randn(cpu_gemm.MANY_ROWS, 256), small) is many
    assert g.takes(torch.randn(8, 256), small) is (library is GemmLibrary.ONEDNN)  # cached weights: MKL's
    assert not g.takes(torch.randn(4, 1024).bfloat16(), big.bfloat16())  # fp32 only
    trained = big.clone().requires_grad_(True)
    assert not g.takes(torch.randn(4, 1024), trained)  # training keeps F.linear (no backward)
    with torch.no_grad():
        assert g.takes(torch.randn(4, 1024), trained) is few_rows


def test_row_buckets_bound_the_row_counts_and_waste_at_most_a_quarter():
    buckets = {cpu_gemm.row_bucket(r) for r in range(1, 8193)}
    assert len(buckets) <= 45 and cpu_gemm.row_bucket(1) == 2
    assert all(r <= cpu_gemm.row_bucket(r) <= max(2, r * 1.25, r + 7) for r in range(1, 8193))


def test_products_equal_f_linear_to_rounding_and_one_row_has_the_bits_of_two(monkeypatch):
    g = _gemm(GemmLibrary.ONEDNN, "AuthenticAMD", monkeypatch)
    gen = torch.Generator().manual_seed(3)
    x, w, w2 = (torch.randn(*s, generator=gen) for s in ((9, 1024), (300, 1024), (300, 1024)))
    full = g.linear(x, w)
    torch.testing.assert_close(full, torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-4)
    assert torch.equal(g.linear(x[4:5], w), full[4:5])  # padded to two rows: a row of any larger call
    assert torch.equal(g.linear(x.view(3, 3, 1024), w), full.view(3, 3, 300))
    a, b = g.linear_pair(x, w, w2)
    assert torch.equal(a, full) and torch.equal(b, g.linear(x, w2))
    for m in (1, 2, 9):  # a weight made per call, in row blocks: the packed weight's bits
        blocks = torch.cat([g.transient(x[:m], w[r: r + 64], (300, 1024)) for r in range(0, 300, 64)], dim=1)
        assert torch.equal(blocks, full[:m])
    assert len(g.packed) == 3  # w, w2 and their stack; the transient blocks are not cached


def test_mkl_holds_no_packed_copies_and_is_f_linear(monkeypatch):
    g = _gemm(GemmLibrary.MKL, "AuthenticAMD", monkeypatch)
    x, w = torch.randn(5, 256), torch.randn(32, 256)
    assert g.packed is None and torch.equal(g.linear(x, w), torch.nn.functional.linear(x, w))


def test_the_setting_is_validated_by_name():
    assert Numerics(default_gemm="mkl").default_gemm is GemmLibrary.MKL
    assert Numerics.parse({"mode": "default", "default_gemm": "onednn"}).default_gemm is GemmLibrary.ONEDNN
    with pytest.raises(NumericsError, match="numerics.default_gemm"):
        Numerics(default_gemm="blas")


def test_a_model_on_either_library_serves_the_same_greedy_tokens(tmp_path):
    from k3serve.contracts.sampling import SamplingParams
    from k3serve.model.checkpoint import make_checkpoint
    from k3serve.model.loader import load_model
    from k3serve.model.presets import preset
    from k3serve.model.reference import reference_generate

    ckpt = make_checkpoint(preset("tiny"), tmp_path / "ck", seed=1)
    prompt, params = [5, 17, 99, 3, 250, 41, 7, 7, 12], SamplingParams(max_tokens=8)
    runs = {}
    for lib in ("mkl", "onednn"):
        model = load_model(ckpt, numerics=Numerics(default_gemm=lib))
        runs[lib] = reference_generate(model, prompt, params, keep_logits=True)
    assert runs["onednn"].token_ids == runs["mkl"].token_ids
    for a, b in zip(runs["onednn"].logits, runs["mkl"].logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert not all(torch.equal(a, b) for a, b in zip(runs["onednn"].logits, runs["mkl"].logits))  # it ran
