"""The OpenAI-compatible HTTP door against a real deployment (Ray, redis-server, 2 clusters of the trained tiny
model, 2 routers), spoken to with the `openai` package: exact tokens against the single-process reference,
sessions, stop strings, seeds, a failover drill, disconnects, bad input, a full class, drain and /metrics."""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import grpc
import httpx2 as httpx
import openai
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from k3serve.cluster.deploy import RequestClassSpec, load_deploy
from k3serve.cluster.router_actor import served_model_name
from k3serve.contracts.sampling import SamplingParams
from k3serve.router.chat_template import ChatTemplate, load_chat_template
from k3serve.tokenizer import ByteTokenizer
from k3serve.v1 import router_pb2 as pb
from k3serve.v1 import router_pb2_grpc

TOK = ByteTokenizer()
# short: every request here but the long ones of the full-class test and a chat's first turn; long: one at a time
CLASSES = (RequestClassSpec("short", 600, inflight_token_budget=1 << 20, max_concurrent=32, queue_limit=16),
           RequestClassSpec("long", 1 << 30, inflight_token_budget=1 << 20, max_concurrent=1, queue_limit=0,
                            max_wait_s=0.0))
REQUEST_POOLS = ("prefill.kda_slots", "prefill.request_pages", "decode.kda_slots", "decode.mla_pages",
                 "decode.waiting", "decode.staging_bytes")


@pytest.fixture(scope="module")
def dep():
    from k3serve.cluster.deployment import Deployment

    base = load_deploy("configs/local.yaml")
    d = dataclasses.replace(base, request_classes=CLASSES, clusters=dataclasses.replace(
        base.clusters, count=2, prefill_tp=1, decode_tp=1))
    deployment = Deployment(d).start()
    yield deployment
    deployment.stop()


@pytest.fixture(scope="module")
def model(dep):
    return served_model_name(dep.deploy)


@pytest.fixture(scope="module")
def refs(dep):
    from k3serve.model.loader import load_model
    from tests.exactness import References

    return References(load_model(dep.checkpoint))


def _client(dep, i: int = 0, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{dep.http_addresses[i]}/v1", api_key="none", max_retries=0, **kw)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _busy(dep) -> dict:
    out = {}
    for cid, h in dep.clusters.items():
        load = ray.get(h.load.remote(), timeout=30)
        nonzero = {k: load[k] for k in ["running_requests", "inflight_tokens"] + [f"pool.{p}.used"
                                                                               for p in REQUEST_POOLS] if load.get(k)}
        if nonzero:
            out[cid] = nonzero
    return out


def test_completions_streamed_and_not_equal_the_reference(dep, model, refs):
    c = _client(dep)
    text = "The quick brown fox"
    ids = TOK.encode(text, add_bos=True)
    out = c.completions.create(model=model, prompt=text, max_tokens=20, temperature=0, logprobs=0,
                               extra_body={"ignore_eos": True, "return_token_ids": True})
    got = out.choices[0].model_extra["token_ids"]
    refs.check(ids, _greedy(20), got, label="completion", got_logprobs=out.choices[0].logprobs.token_logprobs)
    assert out.choices[0].text == TOK.decode(got) and out.usage.prompt_tokens == len(ids)
    chunks = list(_client(dep, 1).completions.create(model=model, prompt=[ids], max_tokens=20, temperature=0,
                                                     stream=True, extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == out.choices[0].text


def test_chat_streamed_and_not_equal_the_reference_on_the_templates_rendering(dep, model, refs):
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]
    ids = TOK.encode(ChatTemplate(load_chat_template(dep.checkpoint)).render(msgs), add_bos=True)
    out = _client(dep).chat.completions.create(model=model, messages=msgs, max_tokens=16, temperature=0,
                                               logprobs=True, extra_body={"ignore_eos": True, "return_token_ids": True})
    got = out.choices[0].model_extra["token_ids"]
    refs.check(ids, _greedy(16), got, label="chat", got_logprobs=[e.logprob for e in out.choices[0].logprobs.content])
    parts = list(_client(dep, 1).chat.completions.create(model=model, messages=msgs, max_tokens=16, temperature=0,
                                                         stream=True, extra_body={"ignore_eos": True}))
    assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == out.choices[0].message.content


def test_a_second_chat_turn_with_a_session_id_is_served_from_the_cache(dep, model):
    c = _client(dep, default_headers={"X-Session-Id": "http-chat-1"})
    system = "Facts: " + " ".join(f"item {i} is {i * 7 % 13}." for i in range(80))  # > 1024 tokens
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "What is item 3?"}]
    first = c.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0)
    assert first.usage.prompt_tokens > 1024
    msgs += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "And item 4?"}]
    second = _client(dep, 1, default_headers={"X-Session-Id": "http-chat-1"}).chat.completions.create(
        model=model, messages=msgs, max_tokens=8, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= 1024


def test_stop_strings_end_the_text_where_they_match(dep, model):
    c = _client(dep)
    full = c.completions.create(model=model, prompt="Once upon a time", max_tokens=40, temperature=0,
                                extra_body={"ignore_eos": True}).choices[0].text
    stop = full[10:13]
    want = full[:full.find(stop)]
    out = c.completions.create(model=model, prompt="Once upon a time", max_tokens=40, temperature=0, stop=[stop],
                               extra_body={"ignore_eos": True})
    assert out.choices[0].text == want and out.choices[0].finish_reason == "stop"
    streamed = list(c.completions.create(model=model, prompt="Once upon a time", max_tokens=40, temperature=0,
                                         stop=stop, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in streamed) == want


def test_unseeded_samples_differ_and_a_seed_reproduces(dep, model):
    c = _client(dep)
    three = c.completions.create(model=model, prompt="The", max_tokens=24, temperature=1.0, n=3,
                                 extra_body={"ignore_eos": True})
    texts = [ch.text for ch in sorted(three.choices, key=lambda ch: ch.index)]
    assert len(set(texts)) == 3
    kw = dict(model=model, prompt="The", max_tokens=24, temperature=1.0, extra_body={"ignore_eos": True})
    a = c.completions.create(seed=1234, n=2, **kw)
    b = _client(dep, 1).completions.create(seed=1234, **kw)
    c2 = c.completions.create(seed=1235, **kw)
    assert a.choices[0].text == b.choices[0].text and a.choices[1].text == c2.choices[0].text
    assert a.choices[0].text != a.choices[1].text


def test_a_closed_connection_frees_the_request_on_every_cluster_within_5s(dep, model):
    url = f"http://{dep.http_addresses[0]}/v1/completions"
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", url, json={"model": model, "prompt": "Long story:", "max_tokens": 1000,
                                         "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data:")
            assert _busy(dep)
    t0 = time.monotonic()
    while (busy := _busy(dep)) and time.monotonic() - t0 < 5.0:
        time.sleep(0.1)
    assert not busy, f"still held after 5 s: {busy}"


def _bad_inputs(model: str) -> list[tuple[str, object, int, str]]:
    c, ch = "/v1/completions", "/v1/chat/completions"
    ok = {"model": model, "prompt": "x"}
    return [(c, b"{oops", 400, "body"), (c, b'{"model": "m", "prompt": "\xc3\x28"}', 400, "body"),
            (c, {"model": "gpt-4", "prompt": "x"}, 404, "model"), (c, {"model": model}, 400, "prompt"),
            (c, {**ok, "prompt": {"a": 1}}, 400, "prompt"), (c, {**ok, "prompt": [1, 400]}, 400, "prompt"),
            (c, {**ok, "prompt": "x" * 70000}, 400, "prompt"), (c, {**ok, "max_tokens": -3}, 400, "max_tokens"),
            (c, {**ok, "max_tokens": 10 ** 7}, 400, "max_tokens"), (c, {**ok, "temperature": "warm"}, 400,
                                                                     "temperature"),
            (c, {**ok, "top_p": 1.5}, 400, "top_p"), (c, {**ok, "n": 99}, 400, "n"),
            (c, {**ok, "stop": ["a"] * 5}, 400, "stop"), (c, {**ok, "seed": "s"}, 400, "seed"),
            (c, {**ok, "logit_bias": {"1": 5}}, 400, "logit_bias"), (c, {**ok, "wat": True}, 400, "wat"),
            (c, {**ok, "stop_token_ids": [999]}, 400, "stop_token_ids"),
            (ch, {"model": model, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages"),
            (ch, {"model": model, "messages": [{"role": "user", "content": 5}]}, 400, "messages"),
            (ch, {"model": model, "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, 400,
             "max_completion_tokens")]


def test_a_bad_input_sweep_gets_openai_errors_naming_the_parameter_and_service_goes_on(dep, model):
    base = f"http://{dep.http_addresses[0]}"
    cases = _bad_inputs(model)
    assert len(cases) >= 15
    for path, body, status, param in cases:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = httpx.post(base + path, content=raw, headers={"Content-Type": "application/json"}, timeout=30)
        assert (r.status_code, r.json()["error"]["param"]) == (status, param), (body, r.text)
    assert _client(dep).completions.create(model=model, prompt="ok", max_tokens=2).choices[0].finish_reason


def test_a_full_class_is_429_with_retry_after(dep, model):
    long_prompt = "Long: " + "abcdefghij" * 70  # > 600 uncached tokens: the long class, one at a time per cluster
    url = f"http://{dep.http_addresses[0]}/v1/completions"
    hdr = {"X-Session-Id": "http-full"}  # one pin: both land on one cluster
    with httpx.Client(timeout=120) as h:
        with h.stream("POST", url, headers=hdr, json={"model": model, "prompt": long_prompt, "max_tokens": 400,
                                                      "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data:")
            full = httpx.post(url, headers=hdr, json={"model": model, "prompt": long_prompt[::-1], "max_tokens": 4},
                              timeout=60)
    assert full.status_code == 429, full.text
    assert int(full.headers["Retry-After"]) >= 1 and full.json()["error"]["type"] == "rate_limit_error"


def test_metrics_parse_and_count_time_to_first_token(dep, model):
    url = f"http://{dep.http_addresses[0]}/metrics"

    def ttft_count() -> float:
        fams = {f.name: f for f in text_string_to_metric_families(httpx.get(url, timeout=30).text)}
        return next(s.value for s in fams["k3serve_time_to_first_token_seconds"].samples
                    if s.name.endswith("_count"))

    before = ttft_count()
    for i in range(3):
        _client(dep).completions.create(model=model, prompt=f"count {i}", max_tokens=3)
    assert ttft_count() - before == 3


def test_the_docs_examples_run_copy_pasted(dep, tmp_path):
    """README.md's curl and openai examples, against this deployment's endpoints file."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    endpoints = tmp_path / "k3serve.json"
    endpoints.write_text(json.dumps({"routers": dep.router_addresses, "http": dep.http_addresses}))
    doc = Path("README.md").read_text().split("## HTTP (OpenAI-compatible)", 1)[1].split("\n## ", 1)[0]
    bash, py = (re.search(rf"```{lang}\n(.*?)```", doc, re.S).group(1).replace("/tmp/k3serve.json", str(endpoints))
                for lang in ("bash", "python"))
    out = subprocess.run(["bash", "-c", bash], capture_output=True, text=True, timeout=120, check=True).stdout
    assert json.loads(out)["choices"][0]["finish_reason"] == "length"
    out = subprocess.run([sys.executable, "-c", py], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out

def test_bench_http_runs_the_same_streams_through_both_doors(dep):
    from benchmarks.http_door import HttpBenchSetup, run_http_bench_on

    setup = HttpBenchSetup(streams=4, rounds=1, prompt_tokens=16, max_tokens=6)
    out = run_http_bench_on(dep, setup)
    for door in ("grpc", "http"):
        assert out[door]["errors"] == 0 and out[door]["tokens"] == 4 * 6, out[door]
        assert 0 < out[door]["ttft_p50_s"] <= out[door]["ttft_p99_s"]
    assert out["http_over_grpc_ttft_p50"] > 0


def test_streams_through_a_failover_drill_keep_the_reference_tokens(dep, model, refs):
    """The serving cluster is killed mid-stream: every stream completes with the reference tokens, no repeat."""
    prompts = [f"Session {i}: tell me" for i in range(4)]
    out: dict[int, list] = {}

    def run(i: int) -> None:
        chunks = _client(dep, i % 2, default_headers={"X-Session-Id": "http-drill"}).completions.create(
            model=model, prompt=prompts[i], max_tokens=60, temperature=0, stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True})
        out[i] = [ch.choices[0] for ch in chunks if ch.choices]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(dep.router_addresses[0]))
    deadline = time.monotonic() + 60
    serving = None
    while serving is None and time.monotonic() < deadline:  # the cluster the session's pin serves on
        busy = [c for c in stub.ClusterStatus(pb.ClusterStatusRequest()).clusters if c.running_requests]
        serving = busy[0].cluster_id if busy else None
        time.sleep(0.05)
    assert serving
    dep.kill_cluster(serving)
    for t in threads:
        t.join(180)
    for i, choices in out.items():
        ids = [t for ch in choices for t in (ch.model_extra.get("token_ids") or [])]
        refs.check(TOK.encode(prompts[i], add_bos=True), _greedy(60), ids, label=f"stream {i}")
        assert "".join(ch.text for ch in choices) == TOK.decode(ids)  # no repeated or missing text
    assert len(out) == 4


def test_health_is_503_while_draining(dep, model):
    base = f"http://{dep.http_addresses[1]}"
    assert httpx.get(base + "/health", timeout=30).status_code == 200
    ray.get(dep.routers[1].drain.remote(0.0), timeout=60)
    assert httpx.get(base + "/health", timeout=30).status_code == 503
    r = httpx.post(base + "/v1/completions", json={"model": model, "prompt": "x"}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable_error"

