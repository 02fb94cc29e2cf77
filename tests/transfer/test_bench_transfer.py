"""The transfer bench runs end to end at toy sizes and reports the documented keys (no timing assertions)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from benchmarks.transfer import TransferBenchConfig, run_transfer_bench
from benchmarks.transfer_handoff import HandoffBenchConfig
from k3serve.cli.main import app
from k3serve.transfer.mooncake.plane import mooncake_available

KEYS = {"p", "d", "bytes", "grpc_gbps", "socket_gbps", "ratio", "crc_share", "reshard_share", "framing_share",
        "bare_grpc_gbps", "ours_over_bare_grpc", "mooncake_gbps", "raw_mooncake_gbps", "ours_mooncake_over_raw",
        "cpu_s_per_gb", "bare_grpc_keep_gbps", "ours_over_bare_grpc_keep", "ours_over_bare_grpc_crc_ceiling"}


def test_bench_reports_grpc_and_socket_side_by_side():
    out = run_transfer_bench(TransferBenchConfig(pairs=((2, 1), (1, 2)), tokens=300, preset="tiny",
                                                 chunk_bytes=8192, reps=1, layerwise=True,
                                                 handoff=HandoffBenchConfig(tokens=256, last_chunk_tokens=64,
                                                                            prefill_tp=2, decode_tp=1, reps=1,
                                                                            chunk_bytes=8192)))
    assert [(r["p"], r["d"]) for r in out["runs"]] == [(2, 1), (1, 2)]
    for r in out["runs"]:
        assert KEYS <= set(r) and r["verified"] and r["grpc_gbps"] > 0 and r["socket_gbps"] > 0
        assert r["ratio"] > 0 and 0 <= r["crc_share"] <= 1 and r["ours_over_bare_grpc"] > 0
        assert r["ours_over_bare_grpc_keep"] > 0 and r["cpu_s_per_gb"]["bare_grpc_keep"] > 0
        # the CRC32C the guarantees need, over bare gRPC's CPU: a ceiling below 1
        assert 0 < r["ours_over_bare_grpc_crc_ceiling"] < 1 and out["crc32c_s_per_gb"] > 0
        if mooncake_available():  # the wheel is absent: the report says so and the Mooncake columns are empty
            assert r["mooncake_gbps"] is None and out["mooncake"].startswith("not measured")
        else:
            assert r["mooncake_gbps"] > 0 and r["raw_mooncake_gbps"] > 0 and r["ours_mooncake_over_raw"] > 0
            assert r["cpu_s_per_gb"]["mooncake"] > 0
    # the same bytes: KDA once, MLA rows once per decode rank
    mla = out["mla_bytes_per_decode_rank"]
    assert out["runs"][0]["bytes"] == out["kda_bytes"] + mla and out["runs"][1]["bytes"] == out["kda_bytes"] + 2 * mla
    # a real prefill (TP 2) and decode (TP 1) group: last chunk -> first decode token, layer-wise off and on
    h = out["layerwise_handoff"]
    assert h["first_decode_token_equal"] and h["last_chunk_tokens"] == 64
    for mode in ("off", "on"):
        assert h[mode]["last_chunk_to_first_decode_s"] >= h[mode]["last_step_s"] > 0


def test_cli_json_and_bad_layouts():
    runner = CliRunner()
    res = runner.invoke(app, ["bench", "transfer", "--pairs", "1x1", "--tokens", "128", "--preset", "tiny",
                              "--chunk-kib", "8", "--reps", "1", "--no-mooncake", "--no-handoff",
                              "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert KEYS <= set(out["runs"][0]) and out["runs"][0]["mooncake_gbps"] is None  # --no-mooncake: said so
    assert out["mooncake"].startswith("not measured") and out["layerwise_handoff"] is None
    res = runner.invoke(app, ["bench", "transfer", "--pairs", "3x1", "--preset", "tiny", "--json"])
    assert res.exit_code == 2 and "divisible" in res.output


def test_overlap_bench_interleaves_overlap_inline_and_bare_on_the_same_bytes():
    """`bench transfer-overlap` at toy size: every path verified (the bench raises otherwise), documented keys."""
    res = CliRunner().invoke(app, ["bench", "transfer-overlap", "--pairs", "1x2", "--tokens", "300", "--preset",
                                   "tiny", "--reps", "3", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    (r,) = out["runs"]
    assert (r["p"], r["d"]) == (1, 2) and out["reps"] == 3
    for key in ("gbps_best", "gbps_median", "cpu_s_per_gb", "s_per_rep"):
        assert set(r[key]) == {"overlap", "inline", "bare"}
    assert all(len(v) == 3 for v in r["s_per_rep"].values())
    assert min(r["overlap_over_bare_median"], r["inline_over_bare_median"], r["overlap_over_inline_median"]) > 0
