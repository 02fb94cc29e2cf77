"""Benchmarks run end to end at toy sizes and report the documented keys (no timing assertions)."""

import pytest

from benchmarks.decode import run_decode_bench, step_bytes
from benchmarks.prefix import agentic_trace, run_prefix_bench
from k3serve.model.presets import preset


def test_prefix_bench_reports_both_schemes():
    out = run_prefix_bench("tiny", sessions=2, turns=3, system_len=1024, increment=(20, 40), reply=16,
                           ttft_prefix=1024, ttft_increment=16)
    for scheme in ("k3", "naive"):
        assert 0.0 <= out[scheme]["reuse_ratio"] <= 1.0
        assert "checkpoint_to_page_bytes" in out[scheme]
    # short turns under a 4096-token chunk: the naive scheme never hits, the K3 scheme does
    assert out["naive"]["reused_tokens"] == 0 and out["k3"]["reused_tokens"] > 0
    ttft = out["ttft"]
    assert ttft["hit_cached_tokens"] == 1024 and "hit_speedup" in out
    # medians of the rounds after the warm-up request, every round's figure alongside
    assert ttft["repeats"] == 3 and ttft["first_request_ttft_s"] > 0
    for key in ("cold", "hit", "cold_short"):
        samples = ttft[f"{key}_samples_s"]
        assert len(samples) == 3 and ttft[f"{key}_ttft_s"] == sorted(samples)[1]
    # the hit's floor on this machine: above 1 (the hit does more work than the short prompt), and the fraction of
    # the matmul peak the hit's extra work ran at (at most 1: the floor is the peak)
    assert ttft["hit_extra_gflop"] > 0 and ttft["matmul_peak_gflops"] > 0
    assert 1.0 < ttft["hit_over_cold_short_floor"] and 0 < ttft["hit_extra_achieved_fraction"] <= 1.0


def test_prefix_bench_rejects_zero_ttft_rounds():
    with pytest.raises(ValueError, match="repeats"):
        run_prefix_bench("tiny", sessions=1, turns=1, system_len=64, increment=(4, 8), reply=4,
                         ttft_prefix=64, ttft_increment=8, ttft_repeats=0)


def test_prefix_bench_side_by_side_at_the_modes_thread_count():
    import torch

    from k3serve.contracts.numerics import DETERMINISTIC

    before = torch.get_num_threads()
    torch.set_num_threads(DETERMINISTIC.threads + 1)
    try:
        out = run_prefix_bench("tiny", sessions=2, turns=2, system_len=256, increment=(20, 40), reply=16,
                               ttft_prefix=256, ttft_increment=16, deterministic=True)
    finally:
        torch.set_num_threads(before)
    num = out["numerics"]
    keys = {"trace_wall_s", "cold_ttft_s", "hit_ttft_s"}
    assert set(num["default"]) == set(num["deterministic"]) == set(num["slowdown"]) == keys
    assert num["threads"] == DETERMINISTIC.threads
    assert num["default_at_bench_threads"]["threads"] == DETERMINISTIC.threads + 1
    assert num["default_at_bench_threads"]["default"]["cold_ttft_s"] == out["ttft"]["cold_ttft_s"]
    assert 0.0 <= num["deterministic_reuse_ratio"] <= 1.0


def test_agentic_trace_grows_each_session():
    trace = agentic_trace(2, 3, 100, (5, 5), 7)
    by_session = {}
    for sid, prompt in trace:
        if sid in by_session:
            assert prompt[: len(by_session[sid])] == by_session[sid]
        by_session[sid] = prompt
    assert [len(p) for s, p in trace if s == "s0"] == [105, 117, 129]


def test_decode_bench_keys_and_byte_model():
    out = run_decode_bench("tiny", batches=(1, 2), context=16, steps=2)
    assert set(out["tokens_per_s"]) == {"1", "2"} and out["copy_gbps"] > 0
    assert set(out["achieved_gbps"]) == {"1", "2"}
    cfg = preset("tiny")
    assert step_bytes(cfg, 8, 100) > step_bytes(cfg, 1, 100)
    # batch 1's ceiling on this BLAS: the step's GEMVs alone are faster than the whole step
    floor = out["gemv_floor"]
    assert floor["s"] > 0 and floor["fraction_of_copy"] > 0 and floor["step_over_floor"] > 1.0


def test_quant_bench_keys_side_by_side(tmp_path):
    from benchmarks.quant import run_quant_bench, weight_bytes_per_token
    from k3serve.model.presets import write_preset_checkpoint
    from k3serve.model.quantize import quantize_checkpoint

    # any MXFP4 checkpoint of the preset stands in for a `train qat` output (the QAT run itself: tests/train)
    qat = quantize_checkpoint(write_preset_checkpoint("tiny-trained", tmp_path / "tt"), tmp_path / "q", "round-up")
    import functools

    from k3serve.train.quant_eval import quality, run_qat

    text = tmp_path / "code.py"  # a small corpus: the stdlib's takes long to read
    text.write_text("".join(f"def f{i}(x):\n    return x + {i % 10}\n\n" for i in range(400)))
    out = run_quant_bench(functools.partial(quality, corpus=str(text)), run_qat, str(qat), eval_bytes=256, context=64, batches=(1,), decode_context=8,
                          decode_steps=1, repeats=1, matmul_iters=2)
    assert out["expert_bytes_ratio"] == 4.25 / 16
    assert 0 < out["checkpoint_bytes_ratio"] < 1
    assert set(out["bits_per_byte"]) == {"fp32", "bf16", "ptq", "qat"} and set(out["kl_to_bf16"]) == {"ptq", "qat"}
    assert all(v >= 0 for v in out["kl_to_bf16"].values())
    for form in ("bf16", "mxfp4"):
        assert set(out["decode_tokens_per_s"][form]) == {"1"} and set(out["expert_matmul_us"]["1"]) >= {form}
        assert set(out["decode_tokens_per_cpu_s"][form]) == {"1"} and out["decode_tokens_per_cpu_s"][form]["1"] > 0
    assert set(out["routed_experts_us"]["1"]) == {"bf16", "mxfp4", "mxfp4_unfused"}
    assert all(v > 0 for v in out["routed_experts_us"]["1"].values())
    inter = out["decode_interleaved"]["1"]
    assert inter["mxfp4_over_bf16"] == pytest.approx(inter["bf16_cpu_ms_per_step"] / inter["mxfp4_cpu_ms_per_step"])
    assert inter["mxfp4_over_bf16"] > 0
    mx = out["decode_weight_bytes_per_token"]
    assert mx["mxfp4"]["1"] < mx["bf16"]["1"]
    cfg = preset("tiny-trained")
    assert weight_bytes_per_token(cfg, 1) > weight_bytes_per_token(cfg, 8)


def test_decode_bench_reports_both_numerics_modes_side_by_side():
    import torch

    from k3serve.contracts.numerics import DETERMINISTIC

    before = torch.get_num_threads()
    torch.set_num_threads(DETERMINISTIC.threads + 1)  # a bench run at another thread count than the mode's
    try:
        out = run_decode_bench("tiny", batches=(1, 2), context=16, steps=2, deterministic=True)
        assert torch.get_num_threads() == DETERMINISTIC.threads + 1  # restored after the side-by-side runs
    finally:
        torch.set_num_threads(before)
    num = out["numerics"]
    assert set(num["default"]) == set(num["deterministic"]) == set(num["slowdown"]) == {"1", "2"}
    assert num["max_slowdown"] == max(num["slowdown"].values()) and num["target_max_slowdown"] == 1.5
    # the modes alternate round by round; each keeps its best round
    for b in ("1", "2"):
        assert len(num["rounds"][b]) == 3
        assert num["default"][b] == pytest.approx(max(r[0] for r in num["rounds"][b]), rel=1e-3)
        assert num["deterministic"][b] == pytest.approx(max(r[1] for r in num["rounds"][b]), rel=1e-3)
    # the ratio is taken at the mode's own thread count; the bench's threads' default figures are beside it
    assert num["threads"] == DETERMINISTIC.threads
    other = num["default_at_bench_threads"]
    assert other["threads"] == DETERMINISTIC.threads + 1 and other["default"] == out["tokens_per_s"]
    assert other["slowdown"]["1"] == other["default"]["1"] / num["deterministic"]["1"]


def test_paired_modes_each_get_what_they_get_alone(tmp_path):
    """The side by side alternates the two modes' engines request by request (trace) and round by round (TTFT):
    each engine still sees its own sequence, so every count is the one a run of that mode alone gives."""
    from benchmarks.prefix import run_trace, run_traces, ttft_hit_vs_cold, ttft_paired
    from k3serve.contracts.numerics import DEFAULT_NUMERICS, DETERMINISTIC
    from k3serve.contracts.prefix_policy import PrefixCachePolicy
    from k3serve.model.checkpoint import load_config
    from k3serve.model.presets import write_preset_checkpoint

    ckpt = str(write_preset_checkpoint("tiny", str(tmp_path)))
    cfg = load_config(ckpt)
    modes = (DEFAULT_NUMERICS, DETERMINISTIC)
    trace = agentic_trace(2, 2, 600, (20, 40), 16)
    counts = ("reused_tokens", "ideal_reusable_tokens", "prefill_tokens_computed", "checkpoints", "pages_held")
    paired = run_traces(ckpt, cfg, PrefixCachePolicy(scheme="k3"), trace, modes)
    for got, mode in zip(paired, modes):
        alone = run_trace(ckpt, cfg, PrefixCachePolicy(scheme="k3"), trace, mode)
        assert {k: got[k] for k in counts} == {k: alone[k] for k in counts}
        assert got["wall_s"] > 0
    assert paired[0]["reused_tokens"] > 0
    ttft = ttft_paired(ckpt, cfg, 640, 16, modes, repeats=2)
    for got, mode in zip(ttft, modes):
        assert len(got["cold_samples_s"]) == len(got["hit_samples_s"]) == len(got["cold_short_samples_s"]) == 2
        assert got["hit_cached_tokens"] == ttft_hit_vs_cold(ckpt, cfg, 640, 16, mode, repeats=1)["hit_cached_tokens"]
    assert ttft[0]["hit_cached_tokens"] > 0
