"""What numerics mode ``deterministic`` relies on, measured on this CPU, and the model-level identities.

The first tests pin the facts model/deterministic.py is built on (if a CPU or torch build breaks one, this
file says which); the last ones check the whole model: one-shot vs grid-chunked prefill, dense vs paged
latent cache, batched vs single decode, for both presets (K3 and Kimi-Linear flavours), with torch.equal.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3serve.contracts.numerics import DETERMINISTIC, Numerics, NumericsError, NumericsMode
from k3serve.contracts.sampling import SamplingParams
from k3serve.model.deterministic import DeterministicOps
from k3serve.model.loader import load_model
from k3serve.model.reference import reference_generate
from k3serve.model.state import ForwardBatch, PagedLatentCache
from k3serve.model.tp import SINGLE
from tests.exactness import SEEDS, random_prompt

PAGE = 16


def test_a_row_of_a_fixed_shape_gemm_ignores_the_other_rows_and_its_place(one_thread):
    g = torch.Generator().manual_seed(0)
    w, row = torch.randn(384, 256, generator=g), torch.randn(1, 256, generator=g)
    want = F.linear(torch.cat([row, torch.randn(15, 256, generator=g)]), w)[0]
    for place in (0, 7, 15):
        x = torch.randn(16, 256, generator=g)
        x[place] = row
        assert torch.equal(F.linear(x, w)[place], want)


def test_fewer_rows_take_another_kernel(one_thread):
    """Why the tiles: the same row computed alone and among 16 rows differs on this CPU (the issue's ~1e-5)."""
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(384, 96, generator=g), torch.randn(16, 96, generator=g)
    assert not torch.equal(F.linear(x[:1], w)[0], F.linear(x, w)[0])


# (K, n) of the model's GEMMs: tiny and bench presets' projections, expert matrices, attention blocks
GEMM_SHAPES = [(256, 384), (96, 256), (256, 64), (64, 256), (48, 64), (64, 32), (1024, 128), (192, 64), (512, 1)]


@pytest.mark.parametrize("k,n", GEMM_SHAPES)
def test_from_min_tile_rows_a_row_has_the_same_bits_in_every_tile_size(one_thread, k, n):
    """Why a decode step may pad to 4 rows, not 16 (deterministic.tile_rows): a row of a [R, K] x [K, n] GEMM
    (mm, and bmm over any tile count, B transposed as the ops pass it) has the same bits for R = 4, 8, 16."""
    from k3serve.model.deterministic import MIN_TILE

    g = torch.Generator().manual_seed(k + n)
    x, w = torch.randn(20, 16, k, generator=g), torch.randn(n, k, generator=g)
    want = torch.bmm(x, w.t().unsqueeze(0).expand(20, k, n))
    for r in (MIN_TILE, 2 * MIN_TILE):
        assert torch.equal(torch.mm(x[0, :r].contiguous(), w.t()), torch.mm(x[0], w.t())[:r])
        if n < 16:  # narrow weights run one mm per tile (deterministic.BMM_MIN_OUT)
            continue
        for tiles in (1, 3, 20):
            got = torch.bmm(x[:tiles, :r].contiguous(), w.t().unsqueeze(0).expand(tiles, k, n))
            assert torch.equal(got, want[:tiles, :r])


@pytest.mark.parametrize("out", [1, 4, 16, 128, 259])
def test_tiled_linear_is_independent_of_the_row_count(one_thread, out):
    ops = DeterministicOps(SINGLE, DETERMINISTIC, units=4)
    g = torch.Generator().manual_seed(out)
    w, x = torch.randn(out, 256, generator=g), torch.randn(70, 256, generator=g)
    full = ops.linear(x, w)
    for rows in (1, 3, 17, 33):
        assert torch.equal(ops.linear(x[-rows:], w), full[-rows:])


@pytest.mark.parametrize("out", [16, 64, 128, 384])
def test_unit_split_linears_are_independent_of_the_row_count(one_thread, out):
    """Column-parallel (4 units) and row-parallel linears: one tile (one bmm over the units) and many tiles
    (one GEMM loop per unit) give a row the same bits."""
    ops = DeterministicOps(SINGLE, DETERMINISTIC, units=4)
    g = torch.Generator().manual_seed(out)
    w, x = torch.randn(out, 256, generator=g), torch.randn(70, 256, generator=g)
    col, row = ops.linear(x, w, 4), ops.row_linear(x, w)
    for rows in (1, 3, 9, 16, 17, 33):
        assert torch.equal(ops.linear(x[-rows:], w, 4), col[-rows:]), rows
        assert torch.equal(ops.row_linear(x[-rows:], w), row[-rows:]), rows


# (K, n) of the absorbed MLA GEMMs (q_nope W_UK, the score against [c | k_pe] rows, the context p c and
# ctx W_UV^T): tiny and bench presets, K3
ABSORBED_SHAPES = [(32, 64), (80, 64), (64, 64), (64, 32), (48, 512), (576, 64), (512, 128), (128, 512)]


@pytest.mark.parametrize("k,n", ABSORBED_SHAPES)
def test_an_absorbed_mla_row_has_the_same_bits_in_any_gemm_from_min_tile_rows(one_thread, k, n):
    """Why the absorbed blocked attention may batch any rows (layers/mla_blocked.py): a row of [M, K] x [K, n]
    has the bits of a 16-row tile for every M >= MIN_TILE, whether the call is an mm, a bmm over heads or
    groups (any batch count), or takes A or B as a strided view (the score columns of one key block, the
    latent part of a [c | k_pe] row)."""
    from k3serve.model.deterministic import MIN_TILE
    from k3serve.model.layers.mla_blocked import per_head_gemm

    g = torch.Generator().manual_seed(k + n)
    x, w = torch.randn(3, 1024, k, generator=g), torch.randn(3, n, k, generator=g)
    tiles = torch.stack([torch.cat([torch.mm(x[h, i: i + 16], w[h].t()) for i in range(0, 1024, 16)])
                         for h in range(3)])  # [3, 1024, n]
    for rows, at in ((MIN_TILE, 0), (MIN_TILE + 1, 61), (2 * MIN_TILE - 4, 7), (100, 64), (1024, 0)):
        assert torch.equal(per_head_gemm(x[:, at: at + rows], w), tiles[:, at: at + rows]), (rows, at)
        got = torch.bmm(x[:1, at: at + rows], w[:1].transpose(1, 2))
        assert torch.equal(got[0], tiles[0, at: at + rows]), (rows, at)
    wide = torch.randn(3, 1024, k + 16, generator=g)
    wide[..., :k] = x
    assert torch.equal(torch.bmm(wide[..., :k], w.transpose(1, 2)), tiles)  # A a strided view (row stride K + 16)
    b_wide = torch.randn(3, k, n + 48, generator=g)
    b_wide[..., :n] = w.transpose(1, 2)
    assert torch.equal(torch.bmm(x, b_wide[..., :n]), tiles)  # B a strided view


@pytest.mark.parametrize("k,n", GEMM_SHAPES[:-1] + [(128, 64), (64, 128)])
def test_a_wide_linear_row_has_the_same_bits_in_one_gemm_of_any_row_count(one_thread, k, n):
    """Why DeterministicOps._tiled may run all rows of a linear as one GEMM (and the MoE's grouped GEMMs one mm
    per expert run): from MIN_TILE rows on, a row of one [M, K] x [K, n] GEMM has the bits of its 16-row tile
    for M up to 4096 (mm, and the grouped GEMM's per-run mm). Not so for n = 1 (b_proj's unit), which takes
    ``narrow_linear`` instead (next test)."""
    from k3serve.model.deterministic import MIN_TILE

    g = torch.Generator().manual_seed(k * n)
    w, x = torch.randn(n, k, generator=g), torch.randn(4096, k, generator=g)
    want = torch.cat([torch.mm(x[i: i + 16], w.t()) for i in range(0, 4096, 16)])
    for m in (MIN_TILE, MIN_TILE + 1, MIN_TILE + 3, 2 * MIN_TILE - 3, 63, 100, 257, 1000, 4096):
        assert torch.equal(torch.mm(x[:m], w.t()), want[:m]), m
    runs = torch.tensor([MIN_TILE, MIN_TILE, 0, 100, MIN_TILE + 3, 300], dtype=torch.int32)
    grouped = F.grouped_mm(x[: int(runs.sum())], w.t().unsqueeze(0).expand(6, k, n).contiguous(),
                           offs=runs.cumsum(0).to(torch.int32))
    assert torch.equal(grouped, want[: int(runs.sum())])
    narrow = torch.randn(1, k, generator=g)
    assert not all(torch.equal(torch.mm(x[:m], narrow.t()), torch.cat([torch.mm(x[i: i + 16], narrow.t())
                                                                      for i in range(0, m, 16)])[:m])
                   for m in (5, 6, 7, 9, 10, 11))


@pytest.mark.parametrize("k,n", [(256, 1), (256, 4), (1024, 1), (1024, 8), (96, 15)])
def test_a_narrow_linear_output_depends_on_its_row_and_weight_row_only(one_thread, k, n):
    """Why weights narrower than BMM_MIN_OUT (KDA's b_proj units) take deterministic.narrow_linear: an output
    has the same bits for any row count, place, weight-row subset (the unit split of any TP) and input strides,
    across the row chunks of a long call; and it is the dot product to fp32 rounding."""
    from k3serve.model.deterministic import NARROW_BUDGET, narrow_linear

    g = torch.Generator().manual_seed(k + n)
    rows = NARROW_BUDGET // (n * k) * 2 + 5  # three row chunks
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    full = narrow_linear(x, w)
    for m, at in ((1, 0), (1, 9), (2, 3), (5, 0), (7, 40), (16, 1), (17, 0), (100, 33), (rows - 7, 7)):
        assert torch.equal(narrow_linear(x[at: at + m], w), full[at: at + m]), (m, at)
    for j in range(n):
        assert torch.equal(narrow_linear(x, w[j: j + 1]), full[:, j: j + 1]), j
    strided = torch.randn(64, 2 * k, generator=g)[:, 1: k + 1]
    assert torch.equal(narrow_linear(strided, w), narrow_linear(strided.contiguous(), w))
    w_t = torch.randn(k, n, generator=g)  # a transposed weight view
    assert torch.equal(narrow_linear(x[:40], w_t.t()), narrow_linear(x[:40], w_t.t().contiguous()))
    ops = DeterministicOps(SINGLE, DETERMINISTIC, units=n)  # n units of one column each (b_proj's split)
    assert torch.equal(ops.linear(x[:33], w, n), full[:33])
    torch.testing.assert_close(full.double(), x.double() @ w.double().t(), rtol=0, atol=1e-4 * k ** 0.5)


@pytest.mark.parametrize("k", [64, 96, 128, 256, 512])
def test_a_gemm_column_has_the_same_bits_whatever_the_other_columns(one_thread, k):
    """Why deterministic layers may multiply row-stacked weights (KDA, MLA and MoE input projections,
    layers/stacked.py): from MIN_TILE rows on, output column j of [R, K] x [K, n] has the same bits for every
    width n >= 32 and offset of its weight row in the stack (mm and bmm, B transposed)."""
    g = torch.Generator().manual_seed(k)
    w = torch.randn(1100, k, generator=g)
    for r in (4, 8, 16):
        x = torch.randn(3, r, k, generator=g)
        want = torch.bmm(x, w[100:132].t().unsqueeze(0).expand(3, k, 32))
        for n in (132, 133, 200, 400, 1100):
            assert torch.equal(torch.mm(x[0], w[:n].t())[:, 100:132], want[0]), (r, n)
            assert torch.equal(torch.bmm(x, w[:n].t().unsqueeze(0).expand(3, k, n))[..., 100:132], want), (r, n)


def test_padded_elementwise_calls_are_independent_of_the_element_count():
    """A sigmoid over 4 elements (scalar code) differs from the same values inside a long tensor (vector
    code); through ops.unary they agree."""
    ops = DeterministicOps(SINGLE, DETERMINISTIC, units=4)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(2))
    plain = torch.cat([torch.sigmoid(x[i: i + 4]) for i in range(0, 1000, 4)])
    assert not torch.equal(plain, torch.sigmoid(x))
    padded = torch.cat([ops.unary(torch.sigmoid, x[i: i + 4]) for i in range(0, 1000, 4)])
    assert torch.equal(padded, ops.unary(torch.sigmoid, x))


def test_numerics_settings_are_checked():
    with pytest.raises(NumericsError, match="numerics.row_tile"):
        Numerics(NumericsMode.DETERMINISTIC, row_tile=0)
    with pytest.raises(NumericsError, match="numerics.grid"):
        Numerics(NumericsMode.DETERMINISTIC, grid=48)
    with pytest.raises(NumericsError, match="numerics must be one of"):
        Numerics.parse("fast")


@pytest.fixture(scope="module")
def det_models(tiny_ckpt, tiny_linear_ckpt):
    return {"tiny": load_model(tiny_ckpt, numerics=DETERMINISTIC),
            "tiny-linear": load_model(tiny_linear_ckpt, numerics=DETERMINISTIC)}


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", ["tiny", "tiny-linear"])
def test_chunked_paged_prefill_and_batched_decode_are_the_reference_bits(det_models, name, seed):
    model = det_models[name]
    cfg = model.cfg
    lens = [1, 37, 150]
    prompts = [random_prompt(n, 300 + n + 1000 * seed) for n in lens]
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    refs = [reference_generate(model, p, params, keep_logits=True) for p in prompts]
    max_pages = -(-(max(lens) + 3) // PAGE)
    pool = torch.zeros(len(lens) * max_pages + 2, cfg.num_mla_layers, PAGE, cfg.mla_latent_dim)
    perm = torch.randperm(pool.shape[0], generator=torch.Generator().manual_seed(seed))
    tables = perm[: len(lens) * max_pages].view(len(lens), max_pages)
    kda = model.new_kda_state(len(lens))
    for b, p in enumerate(prompts):  # prefill in grid chunks of 64 (the last one ends the prompt)
        blocks = [layer[b: b + 1] for layer in kda]
        for start in range(0, len(p), 64):
            out = model.forward(torch.tensor([p[start: start + 64]]),
                                ForwardBatch(blocks, PagedLatentCache(pool, tables[b: b + 1]), [start]))
        assert torch.equal(out[0], refs[b].logits[0]), f"{name} prompt {lens[b]}: prefill logits"
    positions = list(lens)
    for step in range(1, 3):  # all requests decoded together
        toks = torch.tensor([r.token_ids[step - 1] for r in refs]).unsqueeze(1)
        out = model.forward(toks, ForwardBatch(kda, PagedLatentCache(pool, tables), positions, decode=True))
        for b, r in enumerate(refs):
            assert torch.equal(out[b], r.logits[step]), f"{name} prompt {lens[b]}: decode step {step}"
        positions = [q + 1 for q in positions]
