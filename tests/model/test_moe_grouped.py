"""The stacked forms of the routed experts (model/layers/moe_grouped.py) against the per-expert loop: the grouped
GEMM gives the loop's bits, the padded bmm (decode-sized runs over many experts) its values to rounding."""

from __future__ import annotations

import pytest
import torch

from k3serve.model.init import random_weights
from k3serve.model.layers import ffn
from k3serve.model.layers.ffn import MoE
from k3serve.model.presets import preset
from k3serve.model.tp import TPGroup

LAYER = 1  # first MoE layer of the tiny presets (layer 0 is dense)


def _partials(cfg, weights, tp: TPGroup, rows: int, seed: int,
              decode: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's routed partial through the stacked form, the same through the per-expert loop)."""
    moe = MoE(cfg, weights, f"{cfg.name_prefix}layers.{LAYER}.", tp)
    assert moe.stacked is not None  # full-precision CPU weights without grad: the stacked forms are on
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cfg.hidden_size, generator=g)
    z = torch.nn.functional.linear(x, moe.w_down) if cfg.uses_latent_moe else x
    with torch.inference_mode():
        ids, w = moe.route(x)
        stacked = moe._routed_partial(z, ids, w, decode)
        moe.stacked = None  # the same object through the per-expert loop
        looped = moe._routed_partial(z, ids, w)
    assert looped.abs().sum() > 0
    return stacked, looped


@pytest.mark.parametrize("name", ["tiny", "tiny-linear"])
@pytest.mark.parametrize("rows", [1, 3, 32, 100])
def test_grouped_equals_loop_bitwise(name: str, rows: int) -> None:
    cfg = preset(name)  # not a decode step: the grouped GEMM however many experts are active
    stacked, looped = _partials(cfg, random_weights(cfg, 0), TPGroup(), rows, rows)
    assert torch.equal(stacked, looped)


@pytest.mark.parametrize("rows", [8, 32])
def test_padded_equals_loop_to_rounding(rows: int, monkeypatch) -> None:
    monkeypatch.setattr(ffn, "PADDED_MIN_ACTIVE", 1)  # the padded bmm whenever runs are short
    cfg = preset("tiny")
    stacked, looped = _partials(cfg, random_weights(cfg, 0), TPGroup(), rows, rows, decode=True)
    torch.testing.assert_close(stacked, looped, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("padded", [False, True])
def test_stacked_forms_on_an_expert_parallel_rank(rank: int, padded: bool, monkeypatch) -> None:
    """A TP rank owns a contiguous range of experts; rows routed only elsewhere contribute zero."""
    monkeypatch.setattr(ffn, "PADDED_MIN_ACTIVE", 1 if padded else 10**6)
    cfg = preset("tiny")
    stacked, looped = _partials(cfg, random_weights(cfg, 0), TPGroup(rank, 2), 17, 5, decode=padded)
    torch.testing.assert_close(stacked, looped, rtol=1e-5 if padded else 0, atol=1e-6 if padded else 0)


@pytest.mark.parametrize("counts", [[0, 1, 0, 0, 0, 2, 0, 1], [3, 0, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
def test_looped_active_experts_equal_the_grouped_gemm_bitwise(counts: list[int]) -> None:
    """The decode form for spans that are mostly idle (only the non-empty runs, one mm each) gives the grouped
    GEMM's bits, empty groups and all."""
    from k3serve.model.layers.moe_grouped import StackedExperts, grouped_experts, looped_experts

    g = torch.Generator().manual_seed(len(counts) + sum(counts))
    e, inner, d = len(counts), 64, 96
    st = StackedExperts.of(*(torch.randn(e, a, b, generator=g) for a, b in ((inner, d), (inner, d), (d, inner))))
    z = torch.randn(sum(counts), d, generator=g)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    active = [i for i, n in enumerate(counts) if n]
    want = grouped_experts(z, offs, st, "silu", 1.0, 1.0)
    got = looped_experts(z, [counts[i] for i in active], st, active, "silu", 1.0, 1.0)
    assert torch.equal(got, want)


def test_weights_held_once_and_training_keeps_the_loop() -> None:
    cfg = preset("tiny")
    weights = random_weights(cfg, 0)
    moe = MoE(cfg, weights, f"{cfg.name_prefix}layers.{LAYER}.", TPGroup())
    w1, _, _ = moe.experts[3]
    assert w1.weight.data_ptr() == moe.stacked.w1[3].data_ptr()  # a view of the stack, not a second copy
    trained = {n: t.clone().requires_grad_(True) for n, t in weights.items()}
    assert MoE(cfg, trained, f"{cfg.name_prefix}layers.{LAYER}.", TPGroup()).stacked is None


@pytest.mark.parametrize("name", ["tiny", "tiny-linear"])
@pytest.mark.parametrize("rows", [1, 8, 32, 100])
def test_deterministic_padded_tiles_equal_the_deterministic_loop_bitwise(name: str, rows: int) -> None:
    """Numerics mode deterministic: the experts as three bmm over runs padded to one row tile (many active
    experts, decode-sized runs) or as the grouped GEMMs over runs padded to MIN_TILE rows (few experts: 1 row;
    prefill runs: 100 rows), and the stacked input projections, give the bits of the per-expert tiled loop over
    the separate weights."""
    from k3serve.contracts.numerics import DETERMINISTIC
    from k3serve.model.deterministic import make_ops

    cfg = preset(name)
    weights = random_weights(cfg, 0)
    tp = TPGroup()
    fast = MoE(cfg, weights, f"{cfg.name_prefix}layers.{LAYER}.", tp, make_ops(cfg, tp, DETERMINISTIC, weights))
    plain = MoE(cfg, weights, f"{cfg.name_prefix}layers.{LAYER}.", tp, make_ops(cfg, tp, DETERMINISTIC, weights))
    assert fast.w_in is not None and fast.stacked is not None
    plain.w_in, plain.stacked = None, None  # separate projections, per-expert loop
    x = torch.randn(rows, 1, cfg.hidden_size, generator=torch.Generator().manual_seed(rows))
    with torch.inference_mode(), fast.ops.threads():  # the mode's thread count, as every model forward runs it
        assert torch.equal(fast.forward(x), plain.forward(x))
