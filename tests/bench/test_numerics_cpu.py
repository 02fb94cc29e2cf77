"""`python -m benchmarks.numerics_cpu`: both modes measured by the real worker ops, side by side."""

from benchmarks.numerics_cpu import measure


def test_measures_both_modes_side_by_side(tiny_ckpt):
    out = measure(tiny_ckpt, context=64, batches=(1, 2), rounds=1, steps=1)
    for block, keys in (("prefill_ms", {"prefill"}), ("decode_step_ms", {"1", "2"})):
        side = out[block]
        assert set(side["default"]) == set(side["deterministic"]) == keys
        assert all(v > 0 for v in side["default"].values()) and all(v > 0 for v in side["deterministic"].values())
        assert side["max_slowdown"] == max(side["slowdown"].values()) and side["target_max_slowdown"] == 1.5
