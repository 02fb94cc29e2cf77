"""Validation of public GenerateRequests: every problem is an INVALID_ARGUMENT naming the field.

Every repeated or variable-size field has a bound, checked by length *before* any element is looked at, so
a 4 MB message cannot cost more than a length comparison: prompt_token_ids (the model's context),
sampling.stop_token_ids (MAX_STOP_TOKEN_IDS), cache_salt (MAX_CACHE_SALT_BYTES), prompt_text (the context, and
the 4 MB message limit), the ids (128 characters).

Sampling is validated to what the sampler can do: temperature finite and >= 0 (below
GREEDY_BELOW_TEMPERATURE it is greedy: dividing logits by it would overflow), top_p in (0, 1] (0 = unset), top_k
>= 0, max_tokens within the context, stop ids within the vocabulary; seed is any uint64.
"""

from __future__ import annotations

import math
import re
import uuid
from dataclasses import dataclass

from k3serve.contracts.sampling import MAX_CACHE_SALT_BYTES, MAX_STOP_TOKEN_IDS, MAX_TOKENS_LIMIT, SamplingParams
from k3serve.tokenizer import ByteTokenizer

_ID = re.compile(r"[A-Za-z0-9._:@/-]{1,128}")  # whole string (fullmatch): `$` would let a trailing newline by


class InvalidRequest(ValueError):
    """Raised with a message that names the offending field."""


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int
    max_context: int
    byte_tokenizer: bool  # prompt_text is accepted only when the model uses the byte tokenizer


@dataclass(frozen=True)
class ValidRequest:
    request_id: str
    session_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    cache_salt: str = ""  # as the client sent it (the router mixes in the tenant before it reaches a cluster)
    tenant: str = ""  # set by the router from the API key (tenancy.tenant_id); request_id is then scoped by it


def validate_generate(req, limits: ModelLimits) -> ValidRequest:
    """Check a k3serve.v1.GenerateRequest; returns plain data or raises InvalidRequest."""
    rid = req.request_id or uuid.uuid4().hex
    if not _ID.fullmatch(rid):
        raise InvalidRequest("request_id must be 1-128 characters of [A-Za-z0-9._:@/-]")
    if req.session_id and not _ID.fullmatch(req.session_id):
        raise InvalidRequest("session_id must be 1-128 characters of [A-Za-z0-9._:@/-]")
    if len(req.cache_salt.encode("utf-8")) > MAX_CACHE_SALT_BYTES:
        raise InvalidRequest(f"cache_salt has {len(req.cache_salt.encode('utf-8'))} bytes; at most "
                             f"{MAX_CACHE_SALT_BYTES} are allowed")
    n_stop = len(req.sampling.stop_token_ids)
    if n_stop > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(f"sampling.stop_token_ids has {n_stop} ids; at most {MAX_STOP_TOKEN_IDS} are allowed")
    if len(req.prompt_token_ids) >= limits.max_context:
        raise InvalidRequest(f"prompt_token_ids has {len(req.prompt_token_ids)} tokens; the model's context is "
                             f"{limits.max_context}")
    has_ids, has_text = len(req.prompt_token_ids) > 0, bool(req.prompt_text)
    if has_ids == has_text:
        raise InvalidRequest("give exactly one of prompt_token_ids and prompt_text")
    if has_text:
        if not limits.byte_tokenizer:
            raise InvalidRequest("prompt_text needs a tokenizer; this model takes prompt_token_ids")
        ids = tuple(ByteTokenizer().encode(req.prompt_text, add_bos=True))
    else:
        ids = tuple(req.prompt_token_ids)
        bad = next((i for i, t in enumerate(ids) if t >= limits.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"prompt_token_ids[{bad}] = {ids[bad]} is outside the vocabulary "
                                 f"(size {limits.vocab_size})")
    if len(ids) >= limits.max_context:
        raise InvalidRequest(f"prompt has {len(ids)} tokens; the model's context is {limits.max_context}")
    s = req.sampling
    if not math.isfinite(s.temperature) or s.temperature < 0:
        raise InvalidRequest(f"sampling.temperature must be a finite number >= 0, got {s.temperature}")
    top_p = s.top_p if s.top_p != 0 else 1.0  # proto3 has no presence: 0 means "not set"
    if not (0.0 < top_p <= 1.0) or not math.isfinite(top_p):
        raise InvalidRequest(f"sampling.top_p must be in (0, 1], got {s.top_p}")
    if s.top_k < 0:
        raise InvalidRequest(f"sampling.top_k must be >= 0, got {s.top_k}")
    if s.max_tokens == 0:
        raise InvalidRequest("sampling.max_tokens must be >= 1")
    room = limits.max_context - len(ids)
    if s.max_tokens > min(MAX_TOKENS_LIMIT, room):
        raise InvalidRequest(f"sampling.max_tokens = {s.max_tokens} exceeds what the context leaves "
                             f"({min(MAX_TOKENS_LIMIT, room)})")
    bad_stop = [t for t in s.stop_token_ids if t >= limits.vocab_size]
    if bad_stop:
        raise InvalidRequest(f"sampling.stop_token_ids {bad_stop[:3]} are outside the vocabulary")
    return ValidRequest(rid, req.session_id, ids, SamplingParams.from_proto(s), req.cache_salt)
