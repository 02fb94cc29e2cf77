"""The fleet simulator and its traces: parsing, the ideal, the runs it reports, its policies' behaviour."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from k3serve.cli.main import app
from k3serve.sim.cost import PRESETS
from k3serve.sim.fleet import FleetSpec, simulate
from k3serve.sim.trace import (BLOCK, TraceError, TraceRequest, dump, ideal_reuse, load_trace, parse_line,
                               prompt_tokens, scale_rate, shared_prompt_trace, working_set_blocks)

RUN_KEYS = {"policy", "clusters", "requests", "reuse", "ideal_reuse", "load_max_over_mean", "ttft_p50_s",
            "ttft_p99_s", "slo_attainment"}


def test_trace_lines_are_checked_field_by_field():
    ok = parse_line('{"timestamp": 1500, "input_length": 600, "output_length": 3, "hash_ids": [4, 5]}', "t:1")
    assert ok == TraceRequest(1.5, 600, 3, (4, 5))
    for line, field in (('{"input_length": 1, "output_length": 1, "hash_ids": [1]}', "timestamp"),
                        ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": [1]}', "input_length"),
                        ('{"timestamp": 0, "input_length": 2000, "output_length": 1, "hash_ids": [1]}',
                         "input_length"),
                        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [-1]}', "hash_ids"),
                        ("[1]", "object")):
        with pytest.raises(TraceError, match=field):
            parse_line(line, "t:1")


def test_prompts_share_exactly_what_the_hash_ids_share():
    a = TraceRequest(0, 1000, 1, (7, 8))
    b = TraceRequest(0, 700, 1, (7, 9))
    pa, pb = prompt_tokens(a, 256), prompt_tokens(b, 256)
    assert len(pa) == 1000 and len(pb) == 700 and pa[:BLOCK] == pb[:BLOCK] and pa[BLOCK:700] != pb[BLOCK:]
    assert all(1 <= t < 256 for t in pa)
    assert prompt_tokens(a, 256, salt=1)[:BLOCK] != pa[:BLOCK]  # a salted copy shares nothing


def test_ideal_reuse_and_working_set():
    reqs = [TraceRequest(0, 1024, 1, (1, 2)), TraceRequest(1, 1500, 1, (1, 2, 3)), TraceRequest(2, 600, 1, (1, 4)),
            TraceRequest(3, 1024, 1, (5, 2))]
    assert ideal_reuse(reqs) == (1024 + 512, 1024 + 1500 + 600 + 1024)
    assert working_set_blocks(reqs) == 6  # (1) (1,2) (1,2,3) (1,4) (5) (5,2)
    scaled = scale_rate(reqs, 2.0)
    assert len(scaled) == 8 and {s for _, s in scaled} == {0, 1} and scaled[-1][0].arrival_s == 1.5


def test_one_system_prompt_first_block_piles_on_one_cluster_prefix_load_spreads():
    """The generated shared-system-prompt trace at 3 clusters: the old routing sends everything to one cluster;
    least expected TTFT spreads the prefill work while keeping the reuse of the replayed prompts."""
    reqs = [(r, 0) for r in shared_prompt_trace(12, 3, 3, 1, gap_s=0.02)]
    spec = FleetSpec(3, pages=64, slots=16)
    cost = PRESETS["k3-8gpu"]
    fb = simulate(reqs, spec, cost, "first-block")
    pl = simulate(reqs, spec, cost, "prefix-load")
    assert fb["load_max_over_mean"] == 3.0  # every prefill token on one of three clusters
    assert pl["load_max_over_mean"] <= 1.5 and pl["reuse"] >= 0.8 * pl["ideal_reuse"]
    assert pl["ttft_p99_s"] < fb["ttft_p99_s"]
    assert pl["completed"] == pl["requests"] == 36 and pl["refused"] == 0


def test_a_dead_cluster_spills_its_queue_by_the_same_policy():
    reqs = [(r, 0) for r in shared_prompt_trace(12, 3, 3, 1, gap_s=0.005)]
    run = simulate(reqs, FleetSpec(3, pages=64, slots=16), PRESETS["k3-8gpu"], "prefix-load", kill=("c0", 0.05))
    assert run["completed"] == run["requests"] and run["spill"]["cluster"] == "c0"


def test_sim_cli_reports_every_policy_and_fleet(tmp_path):
    path = tmp_path / "shared.jsonl"
    dump(shared_prompt_trace(6, 2, 2, 1, gap_s=0.5), path)
    assert len(load_trace(path)) == 12
    res = CliRunner().invoke(app, ["sim", "--trace", str(path), "--clusters", "1,3", "--policy",
                                   "first-block,prefix-load,random", "--cache", "1,0.25", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert [(r["clusters"], r["policy"]) for r in out["runs"][:6]] == [
        (n, p) for n in (1, 3) for p in ("first-block", "prefix-load", "random")]
    assert len(out["runs"]) == 12 and all(RUN_KEYS <= set(r) for r in out["runs"])
    bad = CliRunner().invoke(app, ["sim", "--trace", str(path), "--policy", "nearest"])
    assert bad.exit_code == 2 and "--policy" in bad.output


def test_a_system_prompt_prefixes_every_request():
    from k3serve.sim.trace import with_system_prompt

    reqs = [TraceRequest(0, 600, 1, (1, 2)), TraceRequest(1, 512, 1, (3,))]
    out = with_system_prompt(reqs, 2)
    assert [r.hash_ids for r in out] == [(4, 5, 1, 2), (4, 5, 3)] and [r.input_length for r in out] == [1624, 1536]
    assert ideal_reuse(out)[0] == 1024 and with_system_prompt(reqs, 0) == reqs
