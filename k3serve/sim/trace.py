"""Request traces in the Mooncake FAST'25 format, and the prompts they stand for.

One JSON object per line: ``timestamp`` (ms from the trace's start), ``input_length``, ``output_length`` (tokens)
and ``hash_ids`` (the prompt's 512-token blocks; equal ids at equal positions are a shared prefix; the last block
may be partial). A hash id stands for 512 fixed tokens derived from the id alone, so equal ids give equal tokens
and the prefix cache sees exactly the sharing the trace records (``prompt_tokens``). The simulator and
``k3serve bench trace`` both read traces through here, so they replay the same prompts.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

BLOCK = 512  # tokens per hash id in the Mooncake traces


class TraceError(ValueError):
    """A trace line that is not a request of the format above (the line and the field are named)."""


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    @property
    def blocks(self) -> int:
        return len(self.hash_ids)


def parse_line(line: str, where: str) -> TraceRequest:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceError(f"{where}: not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: not a JSON object")
    for name in ("timestamp", "input_length", "output_length", "hash_ids"):
        if name not in obj:
            raise TraceError(f"{where}: missing field {name!r}")
    ts, n_in, n_out, ids = obj["timestamp"], obj["input_length"], obj["output_length"], obj["hash_ids"]
    if not isinstance(ts, (int, float)) or ts < 0:
        raise TraceError(f"{where}: timestamp must be a number of ms >= 0, got {ts!r}")
    for name, v in (("input_length", n_in), ("output_length", n_out)):
        if not isinstance(v, int) or v < 1:
            raise TraceError(f"{where}: {name} must be an integer >= 1, got {v!r}")
    if not isinstance(ids, list) or not all(isinstance(h, int) and h >= 0 for h in ids):
        raise TraceError(f"{where}: hash_ids must be a list of integers >= 0")
    if not (len(ids) - 1) * BLOCK < n_in <= len(ids) * BLOCK:
        raise TraceError(f"{where}: input_length {n_in} does not fit {len(ids)} hash_ids of {BLOCK} tokens")
    return TraceRequest(ts / 1000.0, n_in, n_out, tuple(ids))


def load_trace(path: str | Path, max_requests: int = 0, max_blocks: int = 0) -> list[TraceRequest]:
    """The trace at ``path`` in arrival order; the first ``max_requests`` (0: all), prompts cut to ``max_blocks``
    blocks (0: whole). TraceError names the line and field of a malformed request."""
    out: list[TraceRequest] = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            out.append(parse_line(line, f"{path}:{i}"))
            if max_requests and len(out) >= max_requests:
                break
    if not out:
        raise TraceError(f"{path}: no requests")
    out.sort(key=lambda r: r.arrival_s)  # stable: equal timestamps keep the file's (turn) order
    return [cut(r, max_blocks) for r in out] if max_blocks else out


def with_system_prompt(reqs: Sequence[TraceRequest], blocks: int) -> list[TraceRequest]:
    """Every request prefixed by the same ``blocks`` blocks (ids above every id of the trace): the chat hour's
    shape, whose every request begins with one system-prompt block, on a trace that lacks it."""
    if blocks < 0:
        raise ValueError(f"system blocks must be >= 0, got {blocks}")
    top = 1 + max((h for r in reqs for h in r.hash_ids), default=0)
    system = tuple(range(top, top + blocks))
    return [replace(r, input_length=r.input_length + blocks * BLOCK, hash_ids=system + r.hash_ids) for r in reqs]


def cut(req: TraceRequest, max_blocks: int) -> TraceRequest:
    if len(req.hash_ids) <= max_blocks:
        return req
    return replace(req, input_length=max_blocks * BLOCK, hash_ids=req.hash_ids[:max_blocks])


_POS = np.arange(BLOCK, dtype=np.uint64)


def block_tokens(hash_id: int, vocab: int, salt: int = 0) -> np.ndarray:
    """The 512 tokens hash id ``hash_id`` stands for, in [1, vocab): splitmix64 of (salt, id, position)."""
    return _tokens(np.array([hash_id], dtype=np.uint64), vocab, salt)


def _tokens(ids: np.ndarray, vocab: int, salt: int) -> np.ndarray:
    if vocab < 2:
        raise ValueError(f"vocab must be >= 2, got {vocab}")
    base = (ids & np.uint64((1 << 35) - 1)) << np.uint64(9) | np.uint64((salt & 0xFFFFF) << 44)
    x = (base[:, None] + _POS[None, :]).ravel()
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(31))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(29))
    return (x % np.uint64(vocab - 1) + np.uint64(1)).astype(np.int64)


def prompt_tokens(req: TraceRequest, vocab: int, salt: int = 0) -> list[int]:
    """The prompt ``req`` stands for (``salt`` gives a disjoint copy of the trace: no prefix shared across)."""
    if not req.hash_ids:
        return []
    return _tokens(np.array(req.hash_ids, dtype=np.uint64), vocab, salt)[:req.input_length].tolist()


def ideal_reuse(reqs: Iterable[TraceRequest]) -> tuple[int, int]:
    """(prompt tokens an infinite cache reuses at 512-token block granularity, in arrival order; prompt tokens).

    A request reuses its longest run of leading blocks that some earlier request had as a prefix."""
    seen: set[tuple[int, ...]] = set()
    reused = total = 0
    for r in reqs:
        total += r.input_length
        k = 0
        while k < len(r.hash_ids) and r.hash_ids[:k + 1] in seen:
            k += 1
        reused += min(k * BLOCK, r.input_length)
        seen.update(r.hash_ids[:j] for j in range(k + 1, len(r.hash_ids) + 1))
    return reused, total


def working_set_blocks(reqs: Iterable[TraceRequest]) -> int:
    """Distinct prefix blocks of the trace (what an infinite cache ends up holding)."""
    return len({r.hash_ids[:j] for r in reqs for j in range(1, len(r.hash_ids) + 1)})


def scale_rate(reqs: Sequence[TraceRequest], factor: float, seed: int = 0) -> list[tuple[TraceRequest, int]]:
    """Arrivals sped up ``factor`` times: ``ceil(factor)`` disjoint copies of the trace (copy i's prompts salted
    with i, so copies share no prefix), their arrivals divided by ``factor``; each copy but the first thinned to
    its share so the rate is exactly ``factor`` times. Returns (request, salt) in arrival order."""
    if not factor > 0:
        raise ValueError(f"rate scale must be > 0, got {factor}")
    rng = random.Random(seed)
    out: list[tuple[TraceRequest, int]] = []
    whole = int(factor)
    for copy in range(max(1, -(-int(factor * 1000) // 1000))):
        keep = 1.0 if copy < whole or factor < 1 else factor - whole
        for r in reqs:
            if keep >= 1.0 or rng.random() < keep:
                out.append((replace(r, arrival_s=r.arrival_s / factor), copy))
    out.sort(key=lambda rs: rs[0].arrival_s)
    return out


def shared_prompt_trace(conversations: int, turns: int, system_blocks: int, turn_blocks: int,
                        gap_s: float, seed: int = 0) -> list[TraceRequest]:
    """The generated trace of ``bench trace``'s second workload: ``conversations`` chats under one system prompt of
    ``system_blocks`` blocks, each of ``turns`` turns adding ``turn_blocks`` blocks (the previous turn's prompt is
    the next one's prefix; prompts end at block ends, so the ideal at 512-token blocks is reachable by a block
    cache); conversations start ``gap_s`` apart and a turn follows 4 gaps after the one before."""
    for name, v in (("conversations", conversations), ("turns", turns), ("system_blocks", system_blocks),
                    ("turn_blocks", turn_blocks)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    rng = random.Random(seed)
    system = tuple(range(system_blocks))
    next_id = system_blocks
    out = []
    for c in range(conversations):
        ids = system
        for t in range(turns):
            ids = ids + tuple(range(next_id, next_id + turn_blocks))
            next_id += turn_blocks
            out.append(TraceRequest(round(c * gap_s + t * 4 * gap_s, 3), len(ids) * BLOCK, rng.randrange(4, 16),
                                    ids))
    out.sort(key=lambda r: r.arrival_s)
    return out


def dump(reqs: Iterable[TraceRequest], path: str | Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in reqs:
            f.write(json.dumps({"timestamp": int(round(r.arrival_s * 1000)), "input_length": r.input_length,
                                "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n")
