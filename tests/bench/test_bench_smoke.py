"""Benchmarks run end to end at toy sizes and report the documented keys (no timing assertions)."""

from k3serve.bench.decode import run_decode_bench, step_bytes
from k3serve.bench.prefix import agentic_trace, run_prefix_bench
from k3serve.model.presets import preset


def test_prefix_bench_reports_both_schemes():
    out = run_prefix_bench("tiny", sessions=2, turns=3, system_len=1024, increment=(20, 40), reply=16,
                           ttft_prefix=1024, ttft_increment=16)
    for scheme in ("k3", "naive"):
        assert 0.0 <= out[scheme]["reuse_ratio"] <= 1.0
        assert "checkpoint_to_page_bytes" in out[scheme]
    # short turns under a 4096-token chunk: the naive scheme never hits, the K3 scheme does
    assert out["naive"]["reused_tokens"] == 0 and out["k3"]["reused_tokens"] > 0
    assert out["ttft"]["hit_cached_tokens"] == 1024 and "hit_speedup" in out


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


def test_decode_bench_reports_both_numerics_modes_side_by_side():
    out = run_decode_bench("tiny", batches=(1, 2), context=16, steps=2, deterministic=True)
    num = out["numerics"]
    assert set(num["default"]) == set(num["deterministic"]) == set(num["slowdown"]) == {"1", "2"}
    assert num["max_slowdown"] == max(num["slowdown"].values()) and num["target_max_slowdown"] == 1.5
