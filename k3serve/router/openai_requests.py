"""OpenAI request bodies (``/v1/completions``, ``/v1/chat/completions``) -> the router's GenerateRequests.

Only the HTTP shape is checked here (types, names, OpenAI's own limits), each problem an ApiError naming the
parameter; ranges that gRPC clients share (context length, vocabulary, max_tokens) are the one shared
validation's (validate.py), reached through RouterService.validated. Unknown parameters are refused, as OpenAI
does; ones OpenAI has but k3serve does not implement are accepted only at their no-op values. Log-probabilities
are the sampled token's only (SamplingParams.logprobs): chat's ``logprobs: true`` (``top_logprobs`` 0), completions'
``logprobs: 0``.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass

from k3serve.router.chat_template import ROLES, ChatTemplate, ChatTemplateError
from k3serve.router.http_errors import ApiError, bad
from k3serve.v1 import router_pb2

MAX_N = 16  # completions per prompt (each is a request of its own)
MAX_PROMPTS = 64  # prompts in one /v1/completions body
MAX_STOPS = 4  # stop strings, as OpenAI allows
MAX_STOP_CHARS = 256
MAX_USER_CHARS = 256
CHAT_MAX_TOKENS = 256  # a chat request's max_tokens when it gives none (completions: OpenAI's 16)

_SAMPLING = {"max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream", "stream_options", "user",
             "top_k", "stop_token_ids", "ignore_eos", "cache_salt", "return_token_ids", "model"}
# OpenAI parameters without an implementation: allowed at the value that changes nothing
_NO_OP = {"frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0),
          "logit_bias": (None,), "best_of": (None, 1), "echo": (False,), "suffix": (None, ""),
          "top_logprobs": (None, 0), "parallel_tool_calls": (None,), "tools": (None,), "tool_choice": (None, "none"),
          "response_format": (None,), "service_tier": (None, "auto"), "store": (None, False), "metadata": (None,)}
_COMPLETION = _SAMPLING | {"prompt", "logprobs"}  # top_logprobs is no completions parameter: a no-op there
_CHAT = _SAMPLING | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}
_ONLY_SAMPLED = "k3serve serves only the sampled token's log-probability"


@dataclass(frozen=True)
class Plan:
    """What one HTTP call runs: len(prompts) * n router requests, choice index = prompt * n + sample."""

    chat: bool
    model: str
    requests: tuple[router_pb2.GenerateRequest, ...]
    n: int
    stream: bool
    include_usage: bool
    stops: tuple[str, ...]
    return_token_ids: bool
    prompt_param: str  # the parameter a prompt problem is reported under: "prompt" or "messages"
    max_tokens_param: str = "max_tokens"  # or "max_completion_tokens" (chat)
    logprobs: bool = False  # each choice carries its tokens' log-probabilities (sampling.logprobs)


def _int(body: dict, name: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(name, f"{name} must be an integer, got {type(v).__name__}")
    if v < lo or (hi is not None and v > hi):
        raise bad(name, f"{name} must be in [{lo}, {hi if hi is not None else 'inf'}], got {v}")
    return v


def _num(body: dict, name: str, lo: float, hi: float, lo_open: bool = False) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad(name, f"{name} must be a finite number, got {v!r}")
    if v > hi or v < lo or (lo_open and v == lo):
        raise bad(name, f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}")
    return float(v)


def _bool(body: dict, name: str) -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad(name, f"{name} must be true or false, got {v!r}")
    return v


def _str(body: dict, name: str, limit: int) -> str:
    v = body.get(name)
    if v is None:
        return ""
    if not isinstance(v, str) or len(v) > limit:
        raise bad(name, f"{name} must be a string of at most {limit} characters")
    return v


def _check_names(body: dict, allowed: set[str]) -> None:
    for k, v in body.items():
        if k in allowed:
            continue
        if k in _NO_OP:
            if not any(v == ok and type(v) is type(ok) for ok in _NO_OP[k]):
                raise bad(k, f"{k} is not supported by k3serve (only {_NO_OP[k][0]!r} is accepted)")
            continue
        raise bad(k, f"unrecognized request argument supplied: {k}")


def _stops(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("stop", "stop must be a string or a list of strings")
    if len(stops) > MAX_STOPS:
        raise bad("stop", f"stop has {len(stops)} strings; at most {MAX_STOPS} are allowed")
    if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise bad("stop", f"each stop string must have 1 to {MAX_STOP_CHARS} characters")
    return tuple(stops)


def _logprobs(body: dict, chat: bool) -> bool:
    """Whether the sampled tokens' log-probabilities are asked for, in the endpoint's own shape."""
    if chat:
        on = _bool(body, "logprobs")
        top = _int(body, "top_logprobs", 0)
        if top:
            raise bad("top_logprobs", f"top_logprobs must be 0: {_ONLY_SAMPLED} (logprobs: true), got {top}")
        if top is not None and not on:
            raise bad("top_logprobs", "top_logprobs needs logprobs: true")
        return on
    v = body.get("logprobs")
    if v is None or v is False:  # false: the no-op value accepted before logprobs were served
        return False
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise bad("logprobs", f"logprobs must be an integer >= 0 (the number of top log-probabilities), got {v!r}")
    if v > 0:
        raise bad("logprobs", f"logprobs must be 0: {_ONLY_SAMPLED} (logprobs: 0), got {v}")
    return True


def _prompts(v) -> list[str | list[int]]:
    """A string, a token-id list, or a list of either (OpenAI's four shapes)."""
    def ids(x) -> bool:
        return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(v, str):
        out = [v]
    elif ids(v):
        out = [v]
    elif isinstance(v, list) and v and all(isinstance(p, str) or ids(p) for p in v):
        out = list(v)
    else:
        raise bad("prompt", "prompt must be a string, a list of token ids, or a non-empty list of either")
    if len(out) > MAX_PROMPTS:
        raise bad("prompt", f"prompt has {len(out)} prompts; at most {MAX_PROMPTS} are allowed")
    for p in out:
        if isinstance(p, str) and not p:
            raise bad("prompt", "prompt must not be empty")
        if isinstance(p, list) and any(t < 0 for t in p):
            raise bad("prompt", "prompt token ids must be >= 0")
    return out


def _messages(v) -> list[dict]:
    if not isinstance(v, list) or not v:
        raise bad("messages", "messages must be a non-empty list of {role, content}")
    out = []
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise bad("messages", f"{where}.role must be one of {', '.join(ROLES)}")
        c = m.get("content")
        if isinstance(c, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in c):
                raise bad("messages", f"{where}.content parts must be {{type: text, text: string}} (text only)")
            c = "".join(p["text"] for p in c)
        if not isinstance(c, str):
            raise bad("messages", f"{where}.content must be a string or a list of text parts")
        out.append({"role": m["role"], "content": c})
    return out


def parse(body, chat: bool, model: str, template: ChatTemplate | None, session_id: str = "") -> Plan:
    """An HTTP body (decoded JSON) -> the Plan; raises ApiError (400 naming the parameter, 404 unknown model)."""
    if not isinstance(body, dict):
        raise bad("body", "the request body must be a JSON object")
    _check_names(body, _CHAT if chat else _COMPLETION)
    if body.get("model") != model:
        if not isinstance(body.get("model"), str):
            raise bad("model", f"model must be a string (this service serves {model!r})")
        raise ApiError(404, f"the model {body['model']!r} does not exist (this service serves {model!r})", "model",
                       "not_found_error", "model_not_found")
    if chat:
        if "messages" not in body:
            raise bad("messages", "messages is required")
        if template is None:
            raise bad("messages", "chat needs a tokenizer; this model takes token ids (use /v1/completions)")
        try:
            prompts: list = [template.render(_messages(body["messages"]))]
        except ChatTemplateError as e:
            raise bad("messages", str(e)) from None
    else:
        if "prompt" not in body:
            raise bad("prompt", "prompt is required")
        prompts = _prompts(body["prompt"])
    name = "max_tokens"
    max_tokens = _int(body, "max_tokens", 1)
    if chat and body.get("max_completion_tokens") is not None:
        name, max_tokens = "max_completion_tokens", _int(body, "max_completion_tokens", 1)
    n = _int(body, "n", 1, MAX_N) or 1
    seed = _int(body, "seed", 0, (1 << 63) - 1)
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and (not stream or not isinstance(opts, dict) or set(opts) - {"include_usage"}
                             or not isinstance(opts.get("include_usage", False), bool)):
        raise bad("stream_options", "stream_options is {include_usage: bool}, and only with stream: true")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                 for t in stop_ids):
        raise bad("stop_token_ids", "stop_token_ids must be a list of token ids (integers >= 0)")
    _str(body, "user", MAX_USER_CHARS)
    sp = dict(temperature=_num(body, "temperature", 0.0, 2.0) if body.get("temperature") is not None else 1.0,
              top_p=_num(body, "top_p", 0.0, 1.0, lo_open=True) or 1.0, top_k=_int(body, "top_k", 0, 1 << 30) or 0,
              max_tokens=max_tokens if max_tokens is not None else 16, stop_token_ids=stop_ids,
              ignore_eos=_bool(body, "ignore_eos"))
    if max_tokens is None and chat:
        sp["max_tokens"] = CHAT_MAX_TOKENS
    cache_salt = _str(body, "cache_salt", 1 << 16)
    logprobs = _logprobs(body, chat)
    base = uuid.uuid4().hex
    reqs = []
    for p, prompt in enumerate(prompts):
        for i in range(n):
            sampling = router_pb2.SamplingParams(**sp, logprobs=logprobs)
            if seed is not None:
                sampling.seed = (seed + i) % (1 << 64)
            r = router_pb2.GenerateRequest(request_id=f"{base}-{p}-{i}", session_id=session_id, sampling=sampling,
                                           cache_salt=cache_salt)
            if isinstance(prompt, str):
                r.prompt_text = prompt
            else:
                r.prompt_token_ids.extend(prompt)
            reqs.append(r)
    return Plan(chat, model, tuple(reqs), n, stream, bool(opts and opts.get("include_usage")), _stops(body),
                _bool(body, "return_token_ids"), "messages" if chat else "prompt", name, logprobs)
