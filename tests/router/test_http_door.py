"""The OpenAI-compatible HTTP door over a real RouterService, redis-server and gRPC fake cluster fronts
(fake_cluster.py: token i of a request is (offset + i) % 251, a byte, so its text is known exactly)."""

from __future__ import annotations

import json
import socket
import time

import httpx2 as httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from k3serve.cluster.redis_server import connect
from k3serve.router.chat_template import ChatTemplate
from k3serve.router.gate import AdmissionGate
from k3serve.router.http_server import HttpDoor
from k3serve.router.membership import BreakerConfig, CircuitBreaker, Membership, MembershipView
from k3serve.router.pins import PinStore
from k3serve.router.server import RouterService
from k3serve.router.validate import ModelLimits
from k3serve.tokenizer import BYTE_VOCAB_SIZE, ByteTokenizer
from k3serve.v1 import router_pb2 as pb
from tests.router.fake_cluster import SECRET, Behaviour, Rig, default_classes, expected_logprob, expected_tokens

MODEL = "tiny-test"


def _door(rig: Rig, api_keys=(), max_streams: int = 16, tokenizer: bool = True):
    client = connect(rig.url, timeout_s=2.0)
    view = MembershipView(Membership(client, rig.ns, SECRET), refresh_interval_s=0.1,
                          breaker=CircuitBreaker(BreakerConfig(cool_down_s=30.0)))
    gate = AdmissionGate(client, rig.ns, default_classes(), lease_ttl_s=3.0, renew_interval_s=0.2)
    svc = RouterService(view, PinStore(client, rig.ns), ModelLimits(BYTE_VOCAB_SIZE, 4096, tokenizer), SECRET,
                        api_keys, gate=gate, max_streams=max_streams)
    door = HttpDoor(svc, MODEL, ChatTemplate() if tokenizer else None)
    addr = door.start()
    rig.routers.append((svc, _Stopper(door), addr))
    return svc, f"http://{addr}"


class _Stopper:  # Rig.close stops its routers' servers: here the HTTP door
    def __init__(self, door: HttpDoor) -> None:
        self.door = door

    def stop(self, _grace) -> None:
        self.door.stop()


def _text(n: int, offset: int = 0) -> str:
    return ByteTokenizer().decode(expected_tokens(n, offset))


def _wait(cond, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def test_completions_and_chat_streamed_and_not_with_the_openai_client(rig):
    rig.add_cluster("c0")
    svc, url = _door(rig)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    out = client.completions.create(model=MODEL, prompt="hello", max_tokens=40, temperature=0)
    assert out.choices[0].text == _text(40) and out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == 6 and out.usage.completion_tokens == 40  # BOS + 5 bytes
    chunks = list(client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=30, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == _text(30)
    assert chunks[-1].usage.completion_tokens == 30 and chunks[-1].usage.prompt_tokens == 3
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=9)
    assert chat.choices[0].message.content == _text(9) and chat.choices[0].message.role == "assistant"
    deltas = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=12, stream=True))
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(d.choices[0].delta.content or "" for d in deltas) == _text(12)
    assert deltas[-1].choices[0].finish_reason == "length"
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_a_stop_string_across_token_boundaries_ends_the_text_and_the_request_on_its_cluster(rig):
    fc = rig.add_cluster("c0", Behaviour(delay_s=0.02))
    svc, url = _door(rig)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    stop = _text(3, 40)  # tokens 40, 41, 42: a match spanning three pieces
    out = client.completions.create(model=MODEL, prompt="x", max_tokens=200, stop=["zzz", stop])
    assert out.choices[0].text == _text(40) and out.choices[0].finish_reason == "stop"
    assert _wait(lambda: not fc.running, 5.0)
    assert fc.tokens_sent < 100  # cancelled on its cluster: it did not run to max_tokens
    s = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="x", max_tokens=200, stop=stop, stream=True))
    assert s == _text(40)
    assert _wait(lambda: not fc.running and svc.inflight == 0, 2.0)


def test_unseeded_requests_draw_distinct_seeds_and_a_given_seed_is_kept(rig):
    fc = rig.add_cluster("c0")
    svc, _ = _door(rig)
    _, stub = rig.add_router()
    sampled = pb.SamplingParams(max_tokens=2, temperature=1.0)
    for _ in range(3):  # gRPC, unseeded: proto3 used to send seed 0 for all
        list(stub.Generate(pb.GenerateRequest(prompt_token_ids=[1, 2], sampling=sampled), timeout=30))
    list(stub.Generate(pb.GenerateRequest(prompt_token_ids=[1, 2], sampling=pb.SamplingParams(
        max_tokens=2, temperature=1.0, seed=0)), timeout=30))
    assert len({s.seed for s in fc.seen[:3]}) == 3 and fc.seen[3].seed == 0
    unseeded = pb.GenerateRequest(prompt_token_ids=[1, 2], sampling=pb.SamplingParams(max_tokens=2, temperature=1))
    seeds = {svc.validated(unseeded).sampling.seed for _ in range(8)}
    assert len(seeds) == 8
    seeded = pb.GenerateRequest(prompt_token_ids=[1, 2], sampling=pb.SamplingParams(max_tokens=2, seed=0))
    assert svc.validated(seeded).sampling.seed == 0


def test_closing_the_connection_mid_stream_cancels_the_request_everywhere(rig):
    fc = rig.add_cluster("c0", Behaviour(delay_s=0.05))
    svc, url = _door(rig)
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", f"{url}/v1/completions", json={"model": MODEL, "prompt": [5], "max_tokens": 400,
                                                              "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data:")
            assert fc.running
    assert _wait(lambda: not fc.running and svc.inflight == 0 and svc.slots.active() == 0, 5.0)


BAD = [  # (body or raw bytes, status, param)
    (b"{not json", 400, "body"),
    (b'{"model": "tiny-test", "prompt": "\xff\xfe"}', 400, "body"),
    ([1, 2], 400, "body"),
    ({"model": "other", "prompt": "x"}, 404, "model"),
    ({"prompt": "x"}, 400, "model"),
    ({"model": MODEL}, 400, "prompt"),
    ({"model": MODEL, "prompt": 7}, 400, "prompt"),
    ({"model": MODEL, "prompt": [1, 99999]}, 400, "prompt"),
    ({"model": MODEL, "prompt": [1] * 5000}, 400, "prompt"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 5000}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "prompt": "x", "top_k": -2}, 400, "top_k"),
    ({"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
    ({"model": MODEL, "prompt": "x", "n": 1000}, 400, "n"),
    ({"model": MODEL, "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"model": MODEL, "prompt": "x", "stop": [""]}, 400, "stop"),
    ({"model": MODEL, "prompt": "x", "seed": -1}, 400, "seed"),
    ({"model": MODEL, "prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"model": MODEL, "prompt": "x", "stop_token_ids": [100000]}, 400, "stop_token_ids"),
    ({"model": MODEL, "prompt": "x", "cache_salt": "s" * 300}, 400, "cache_salt"),
    ({"model": MODEL, "prompt": "x", "frequency_penalty": 0.5}, 400, "frequency_penalty"),
    ({"model": MODEL, "prompt": "x", "bogus": 1}, 400, "bogus"),
    ({"model": MODEL, "prompt": "\ud800"}, 400, "prompt"),
    ({"model": MODEL, "messages": []}, 400, "messages"),
    ({"model": MODEL, "prompt": "x", "logprobs": 1}, 400, "logprobs"),
    ({"model": MODEL, "prompt": "x", "logprobs": True}, 400, "logprobs"),
    ({"model": MODEL, "prompt": "x", "logprobs": -1}, 400, "logprobs"),
    ({"model": MODEL, "prompt": "x", "top_logprobs": 2}, 400, "top_logprobs"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": 1}, 400, "logprobs"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 2}, 400,
     "top_logprobs"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 0}, 400, "top_logprobs"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": False, "top_logprobs": 1}, 400,
     "top_logprobs"),
]


@pytest.mark.parametrize("body,status,param", BAD)
def test_bad_input_is_an_openai_error_naming_the_parameter(rig, body, status, param):
    rig.add_cluster("c0")
    _, url = _door(rig)
    path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(url + path, content=raw, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"]
    ok = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200  # the service keeps serving


def test_keys_health_metrics_and_a_full_router_is_429_with_retry_after(rig):
    rig.add_cluster("c0", Behaviour(delay_s=0.05))
    svc, url = _door(rig, api_keys=("k1",), max_streams=1)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 3}
    assert httpx.post(url + "/v1/completions", json=body).status_code == 401
    assert httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer k2"}).status_code == 401
    auth = {"Authorization": "Bearer k1"}
    assert httpx.post(url + "/v1/completions", json=body, headers=auth).status_code == 200
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", f"{url}/v1/completions", headers=auth,
                      json={**body, "max_tokens": 100, "stream": True}) as r:
            lines = r.iter_lines()  # held: a closed iterator would close the stream
            assert next(lines).startswith("data:")
            full = httpx.post(url + "/v1/completions", json=body, headers=auth)
    assert full.status_code == 429 and int(full.headers["Retry-After"]) >= 1
    assert full.json()["error"]["type"] == "rate_limit_error"
    assert httpx.get(url + "/health").status_code == 200
    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)}
    ttft = next(s.value for s in fams["k3serve_time_to_first_token_seconds"].samples if s.name.endswith("_count"))
    assert ttft >= 2
    refused = {s.labels["by"]: s.value for s in fams["k3serve_refusals"].samples if s.name.endswith("_total")}
    assert refused["router"] >= 1
    svc.drain(0.0)
    assert httpx.get(url + "/health").status_code == 503
    assert httpx.post(url + "/v1/completions", json=body, headers=auth).status_code == 503


def test_a_stream_that_fails_over_stays_one_stream_without_repeated_text(rig):
    once = Behaviour(fail_after=7)  # shared: whichever cluster serves first fails once, the other takes over
    rig.add_cluster("c0", once)
    rig.add_cluster("c1", once)
    svc, url = _door(rig)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    chunks = list(client.completions.create(model=MODEL, prompt="abc", max_tokens=30, stream=True, logprobs=0,
                                            extra_body={"return_token_ids": True}))
    assert "".join(c.choices[0].text for c in chunks) == _text(30)
    assert [t for c in chunks for t in (c.choices[0].model_extra.get("token_ids") or [])] == expected_tokens(30)
    assert [lp for c in chunks if c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs] == [
        expected_logprob(t) for t in expected_tokens(30)]  # none repeated, none missing across the failover
    assert svc.counters["failovers"] == 1
    end = chunks[-1].choices[0]
    assert end.finish_reason == "length" and end.model_extra["failovers"] == 1
    assert end.model_extra["cluster_id"] in ("c0", "c1")


def test_stop_matcher_holds_back_a_possible_stop_and_finds_the_earliest():
    from k3serve.router.stop_strings import StopMatcher

    m = StopMatcher(["END", "ab"])
    assert m.feed("xxE") == ("xx", False)
    assert m.feed("N") == ("", False)
    assert m.feed("Dzz") == ("", True)
    m = StopMatcher(["END", "ab"])
    assert m.feed("qE") == ("q", False)
    assert m.feed("x") == ("Ex", False)
    assert m.feed("a") == ("", False) and m.flush() == "a"
    assert StopMatcher(["ab", "cab"]).feed("zcabz") == ("z", True)


def test_n_choices_get_consecutive_seeds_and_the_chat_template_comes_from_the_checkpoint(tmp_path):
    from k3serve.router.chat_template import DEFAULT_CHAT_TEMPLATE, load_chat_template
    from k3serve.router.openai_requests import parse

    plan = parse({"model": MODEL, "prompt": ["a", [1, 2]], "n": 3, "seed": 7}, False, MODEL, None)
    assert [r.sampling.seed for r in plan.requests] == [7, 8, 9] * 2
    assert [r.prompt_text for r in plan.requests[:3]] == ["a"] * 3 and list(plan.requests[3].prompt_token_ids) == [1, 2]
    unseeded = parse({"model": MODEL, "prompt": "a", "n": 2}, False, MODEL, None)
    assert not any(r.sampling.HasField("seed") for r in unseeded.requests)
    assert load_chat_template(tmp_path) == DEFAULT_CHAT_TEMPLATE
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "default", "template": "{% for m in messages %}[{{ m.content }}]{% endfor %}"}]}))
    tpl = ChatTemplate(load_chat_template(tmp_path))
    assert tpl.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]) == "[hi][yo]"


def _completion_logprobs(n: int, offset: int = 0) -> tuple[list[str], list[float], list[int]]:
    """tokens, token_logprobs and text_offset of the fake cluster's first n tokens (ASCII: one character each)."""
    ids = expected_tokens(n, offset)
    return [chr(t) for t in ids], [expected_logprob(t) for t in ids], list(range(n))


def test_logprobs_are_served_in_openai_shapes_streamed_and_not_and_are_off_by_default(rig):
    fc = rig.add_cluster("c0")
    _, url = _door(rig)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    out = client.completions.create(model=MODEL, prompt="hello", max_tokens=40, logprobs=0,
                                    extra_body={"return_token_ids": True})
    lp = out.choices[0].logprobs
    assert (lp.tokens, lp.token_logprobs, lp.text_offset) == _completion_logprobs(40) and lp.top_logprobs is None
    assert out.choices[0].model_extra["token_ids"] == expected_tokens(40) and fc.seen[-1].logprobs
    chunks = list(client.completions.create(model=MODEL, prompt="hello", max_tokens=30, logprobs=0, stream=True))
    got = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    assert ([t for g in got for t in g.tokens], [x for g in got for x in g.token_logprobs],
            [x for g in got for x in g.text_offset]) == _completion_logprobs(30)
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].choices[0].logprobs is None
    ids = expected_tokens(140)  # 128 on: bytes that are no UTF-8 character of their own
    want = [(bytes([t]).decode("utf-8", errors="replace"), expected_logprob(t), [t], []) for t in ids]
    msgs = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=140, logprobs=True, top_logprobs=0)
    assert [(e.token, e.logprob, e.bytes, e.top_logprobs) for e in chat.choices[0].logprobs.content] == want
    assert want[130][0] == "\ufffd" and chat.choices[0].message.content == _text(140)
    deltas = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=140, logprobs=True,
                                                 stream=True))
    assert [(e.token, e.logprob, e.bytes, e.top_logprobs) for d in deltas if d.choices[0].logprobs
            for e in d.choices[0].logprobs.content] == want
    assert deltas[0].choices[0].logprobs is None  # the role chunk carries no token
    # off by default: null, and the cluster is not asked for them
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=3).choices[0].logprobs is None
    assert client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3).choices[0].logprobs is None
    assert all(c.choices[0].logprobs is None for c in client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=3, stream=True, logprobs=False))
    assert not fc.seen[-1].logprobs and not fc.seen[-2].logprobs


def test_logprobs_refusals_say_only_the_sampled_token_is_served(rig):
    rig.add_cluster("c0")
    _, url = _door(rig)
    for path, body, param in [
            ("/v1/completions", {"prompt": "x", "logprobs": 5}, "logprobs"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                                      "top_logprobs": 5}, "top_logprobs")]:
        r = httpx.post(url + path, json={"model": MODEL, **body}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param
        assert "only the sampled token's log-probability" in r.json()["error"]["message"]
    ok = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x", "logprobs": None}, timeout=30)
    assert ok.status_code == 200 and ok.json()["choices"][0]["logprobs"] is None


def test_a_token_id_model_names_each_logprob_token_by_its_id(rig):
    rig.add_cluster("c0")
    _, url = _door(rig, tokenizer=False)
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 5,
                                                   "logprobs": 0}, timeout=30).json()
    assert r["choices"][0]["text"] == ""
    assert r["choices"][0]["logprobs"] == {"tokens": [f"token_id:{t}" for t in range(5)],
                                           "token_logprobs": [expected_logprob(t) for t in range(5)],
                                           "top_logprobs": None, "text_offset": [0] * 5}


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_keeps_tokens_logprobs_and_usage_up_to_the_token_that_completed_it(rig, stream):
    """Several tokens a message (speculative decoding): the choice ends at the token that completed the stop,
    inside its message, not at the message's end."""
    rig.add_cluster("c0", Behaviour(per_message=4))  # messages: tokens 0-3, 4-7, ...
    _, url = _door(rig)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    # "12" (tokens 49, 50) completes inside message 48-51; "234" (50, 51, 52) across two messages: the first
    # completed wins. With "234" alone: tokens up to 52, text up to 50
    for stop, kept, text in ([["234", "12"], 51, 49], [["234"], 53, 50]):
        kw = dict(model=MODEL, prompt="x", max_tokens=200, stop=stop, logprobs=0, stream=stream,
                  extra_body={"return_token_ids": True})
        if stream:
            chunks = list(client.completions.create(**kw, stream_options={"include_usage": True}))
            usage = chunks[-1].usage
            chs = [c.choices[0] for c in chunks if c.choices]
            assert chs[-1].finish_reason == "stop"
        else:
            out = client.completions.create(**kw)
            usage, chs = out.usage, out.choices
            assert chs[0].finish_reason == "stop"
        assert "".join(c.text for c in chs) == _text(text)
        assert [t for c in chs for t in (c.model_extra.get("token_ids") or [])] == expected_tokens(kept)
        lps = [c.logprobs for c in chs if c.logprobs]
        assert [t for g in lps for t in g.tokens] == _completion_logprobs(kept)[0]
        assert [x for g in lps for x in g.token_logprobs] == _completion_logprobs(kept)[1]
        assert usage.completion_tokens == kept
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=200,
                                          stop="234", logprobs=True)
    assert chat.choices[0].message.content == _text(50) and chat.choices[0].finish_reason == "stop"
    assert [e.logprob for e in chat.choices[0].logprobs.content] == [expected_logprob(t) for t in range(53)]
