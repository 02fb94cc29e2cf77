"""`k3serve bench spec` runs end to end at a tiny size and reports its fields (no timing is asserted)."""

from benchmarks.spec import K3_GEOMETRY, memory_report, run_spec_bench


def test_bench_spec_reports_runs_and_memory():
    out = run_spec_bench("tiny-trained", max_k=1, batches=(1, 2), sessions=1, max_tokens=6,
                         methods=("ngram", "eagle3-lk"))
    runs = out["runs"]
    assert [(r["method"], r["batch"], r["k"]) for r in runs] == [("ngram", 1, 1), ("eagle3-lk", 1, 1),
                                                                 ("ngram", 2, 1), ("eagle3-lk", 2, 1)]
    assert all(r["speedup_vs_ngram"] > 0 for r in runs)
    for r in runs:
        assert {"method", "k", "batch", "tokens_per_verify", "tokens_per_s", "plain_tokens_per_s", "speedup"} <= set(r)
        assert r["mismatches"] == 0  # greedy: speculative tokens equal the plain run's
        assert r["verify_steps"] == 0 or 1.0 <= r["tokens_per_verify"] <= r["k"] + 1
    assert out["memory"]["k3"]["records_over_snapshot"] <= 1 / 16


def test_memory_report_at_k3_geometry():
    m = memory_report(**K3_GEOMETRY, k=7)
    # 69 layers x 12 heads x (128 x 128 + 9 x 128) fp32 = 58,079,232 B per state; records 8 x 768 floats per head
    assert m["state_bytes"] == 69 * 12 * (128 * 128 + 9 * 128) * 4
    assert m["records_bytes"] == 69 * 12 * 8 * 6 * 128 * 4
    assert m["snapshot_per_draft_bytes"] == 8 * m["state_bytes"]


def test_bench_spec_refuses_an_unknown_method():
    import pytest

    with pytest.raises(ValueError, match="method must be"):
        run_spec_bench("tiny-trained", max_k=1, batches=(1,), sessions=1, max_tokens=2, methods=("medusa",))


def test_bench_spec_heldout_section_has_ngram_and_the_runs_eagle3_rows(one_thread):
    from benchmarks.heldout_accept import ContinuationFilter
    from k3serve.train.corpus import load_corpus

    out = run_spec_bench("tiny-trained", max_k=1, batches=(1,), sessions=1, max_tokens=2, methods=("eagle3-kl",),
                         heldout=load_corpus(None).heldout, heldout_prompts=1, heldout_seeds=(0,),
                         heldout_filter=ContinuationFilter(min_distinct_4grams=0.0))
    section = out["heldout"]
    assert section["kept"] == 1 and section["scanned"] >= 1 and "whitespace" in section["filter"]
    assert list(section["rows"]) == ["ngram", "eagle3-kl"]
    for row in section["rows"].values():
        assert 0.0 <= row["t1_alpha"][0] <= 1.0 and 1.0 <= row["t1_tokens_per_verify"][0] <= 4.0  # k_t1 = 3
