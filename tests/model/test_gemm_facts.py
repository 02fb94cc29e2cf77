"""The load-time check of numerics mode deterministic's GEMM row fact (model/gemm_facts.py)."""

from __future__ import annotations

import pytest
import torch

from k3serve.contracts.numerics import DETERMINISTIC, NumericsError
from k3serve.model.deterministic import BMM_MIN_OUT, MIN_TILE
from k3serve.model.gemm_facts import check_row_floor, linear_shapes
from k3serve.model.init import random_weights
from k3serve.model.model import HybridModel
from k3serve.model.presets import preset


@pytest.mark.parametrize("name", ["tiny", "tiny-linear"])
def test_a_deterministic_model_checks_its_own_linear_shapes_and_builds(name: str) -> None:
    cfg = preset(name)
    weights = random_weights(cfg, 0)
    model = HybridModel(cfg, weights, numerics=DETERMINISTIC)
    shapes = linear_shapes(weights, model.ops.units, BMM_MIN_OUT)
    # every projection's shape and its shard-unit splits, nothing narrower than the bmm threshold
    assert shapes and all(n >= BMM_MIN_OUT for _, n in shapes)
    assert (cfg.hidden_size, cfg.vocab_size) in shapes  # the head
    check_row_floor(shapes, MIN_TILE, DETERMINISTIC.threads)  # what the build ran: passes on this CPU


def test_a_floor_the_cpu_breaks_is_refused_naming_the_shape() -> None:
    """A floor of 1 row: a 1-row GEMM takes the GEMV kernel, whose bits differ from the 16-row tile's (pinned in
    test_numerics_invariants.test_fewer_rows_take_another_kernel for this shape), so the check must refuse."""
    with pytest.raises(NumericsError, match=r"\[1, 96\] x \[96, 384\]"):
        check_row_floor([(96, 384)], 1, 1)


def test_the_check_leaves_the_thread_count_as_it_was() -> None:
    before = torch.get_num_threads()
    with pytest.raises(NumericsError):
        check_row_floor([(96, 384)], 1, 1)
    check_row_floor([(64, 32)], MIN_TILE, 1)
    assert torch.get_num_threads() == before


def test_a_packed_kernel_that_moves_bits_is_refused_naming_the_shape(monkeypatch) -> None:
    """check_packed_rows compares the mode's packed linear with one reference GEMM; a kernel whose result moved
    with the row count (here: the reference nudged by one ulp) must be refused, the shape and the way out named."""
    import k3serve.model.gemm_facts as facts
    from k3serve.model.packed_gemm import packed_mm

    monkeypatch.setattr(facts, "packed_mm", lambda x, p: torch.nextafter(packed_mm(x, p), torch.tensor(float("inf"))))
    with pytest.raises(NumericsError, match=r"\[1, 1024\] x \[1024, 64\].*packed_min_k: 0"):
        facts.check_packed_rows([(1024, 64)], 1)


def test_a_deterministic_model_with_packed_linears_builds_and_uses_them() -> None:
    import dataclasses

    cfg = preset("tiny")
    model = HybridModel(cfg, random_weights(cfg, 0), numerics=dataclasses.replace(DETERMINISTIC, packed_min_k=64))
    assert model.ops.gemm.takes(cfg.hidden_size, cfg.vocab_size, torch.float32)
    assert not HybridModel(cfg, random_weights(cfg, 0), numerics=DETERMINISTIC).ops.gemm.takes(
        cfg.hidden_size, cfg.vocab_size, torch.float32)  # tiny's K (256) is under the default 1024
