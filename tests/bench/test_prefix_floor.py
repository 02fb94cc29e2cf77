"""The hit's floor of ``bench prefix`` (benchmarks/prefix_floor.py): the extra attention FLOPs a prefix hit does
over a cold prompt of its increment alone, and the ratio they bound at a given matmul rate."""

import pytest

from benchmarks.prefix_floor import hit_extra_flops, hit_floor
from k3serve.model.presets import preset


def test_extra_flops_by_hand_for_the_tiny_preset():
    cfg = preset("tiny")  # 4 heads, latent rank 64, d_nope 32, d_rope 16, d_v 32, 3 MLA layers
    decompress = 2 * 8192 * 64 * 4 * (32 + 32)
    scores = 2 * 4 * 128 * 8192 * (32 + 16)
    values = 2 * 4 * 128 * 8192 * 32
    assert hit_extra_flops(cfg, 8192, 128) == 3 * (decompress + scores + values)
    # a TP rank does its heads' share; no cached rows, no extra work
    assert hit_extra_flops(cfg, 8192, 128, tp=2) == hit_extra_flops(cfg, 8192, 128) / 2
    assert hit_extra_flops(cfg, 0, 128) == 0


def test_floor_is_the_short_prompt_plus_the_extra_work_at_the_peak():
    cfg = preset("tiny")
    extra = hit_extra_flops(cfg, 8192, 128)
    out = hit_floor(cfg, 8192, 128, short_s=0.04, hit_s=0.04 + 2 * extra / 100e9, peak=100.0)
    assert out["hit_extra_gflop"] == pytest.approx(extra / 1e9)
    assert out["hit_extra_at_peak_s"] == pytest.approx(extra / 100e9)
    assert out["hit_over_cold_short_floor"] == pytest.approx((0.04 + extra / 100e9) / 0.04)
    # the hit took twice the extra work's time at the peak beyond the short prompt: half the peak
    assert out["hit_extra_achieved_fraction"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="short_s"):
        hit_floor(cfg, 8192, 128, short_s=0.0, hit_s=0.1, peak=100.0)
