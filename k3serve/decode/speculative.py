"""The decode engine's speculative step (docs/speculative.md): draft, verify, accept, commit, emit.

```
 running requests ─┬─ session proposed >= 1 draft ──▶ buckets by window length T (<= spec_slots each)
                   │      VerifyBatch (records, state untouched) ─▶ accept_drafts per request (keyed like
                   │      plain sampling) ─▶ CommitBatch (a+1 tokens into the state) ─▶ emit a+1 tokens
                   └─ no drafts / plain request ──▶ the engine's DecodeBatch, in the same step
```
A request drafts at most ``min(k, remaining budget - 1, context room)`` tokens, so a verify never writes an MLA
row outside the pages reserved for prompt + max_tokens, and never emits past max_tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from k3serve.engine.ops import CommitBatch, VerifyBatch
from k3serve.engine.spec.accept import Acceptance, accept_drafts
from k3serve.engine.spec.drafter import DraftProposal, DraftSession, VerifyOutcome


FAILED_ROW = Acceptance(0, ())  # the acceptance of a request whose own acceptance raised (it is failed)


@dataclass
class SpecUsage:
    """Per request (and summed per engine): drafted tokens verified, drafts accepted, verify steps run."""

    drafted_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0

    def add(self, drafted: int, accepted: int) -> None:
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        self.verify_steps += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0


@dataclass
class Draft:
    """One request's part of a verify: its window x_0..x_m and the proposal."""

    run: object  # decode.engine._Decoding
    proposal: DraftProposal
    window: tuple[int, ...] = field(default=())


def draft_limit(new: int, max_tokens: int, position: int, max_positions: int, k: int) -> int:
    """Drafts a request may verify this step: emits at most drafts + 1 tokens within max_tokens, and every
    emitted token's position stays below the context (the last allowed position is max_positions - 1).
    ``new``: tokens generated that max_tokens counts; after a failover, less the replayed ones still to be fed
    (negative while replaying: a step's first tokens feed the replay, only the rest are new)."""
    return max(0, min(k, max_tokens - new - 1, max_positions - 2 - position))


def propose(session: DraftSession, context: Sequence[int], limit: int) -> DraftProposal:
    if limit <= 0:
        return DraftProposal()
    prop = session.propose(context, limit)
    if len(prop.tokens) > limit:  # a drafter that over-delivers is cut, never trusted past its budget
        prop = DraftProposal(prop.tokens[:limit])
    return prop


def buckets(drafts: list[Draft], max_rows: int) -> list[list[Draft]]:
    """Group by window length (one verify call per length), at most max_rows requests per call."""
    by_len: dict[int, list[Draft]] = {}
    for d in drafts:
        by_len.setdefault(len(d.window), []).append(d)
    out = []
    for t in sorted(by_len, reverse=True):
        group = by_len[t]
        out += [group[i: i + max_rows] for i in range(0, len(group), max_rows)]
    return out


def verify_ops(bucket: list[Draft], capture_layers: tuple[int, ...]) -> VerifyBatch:
    return VerifyBatch(tuple(d.run.slot for d in bucket), tuple(range(len(bucket))),
                       tuple(d.window for d in bucket), tuple(d.run.next_position for d in bucket),
                       tuple(tuple(d.run.pages) for d in bucket), capture_layers)


def accept_bucket(bucket: list[Draft], logits: torch.Tensor, guard) -> list:
    """Acceptance per request of a verified bucket: logits `[B, T, vocab]`. ``guard(run, what, fn, *args)`` runs
    one request's acceptance and returns None when it raised (that request failed alone); its row then commits
    x_0 only, so the bucket's commit keeps its shape."""
    out = []
    for i, d in enumerate(bucket):
        acc = guard(d.run, "sampling", accept_drafts, logits[i], d.proposal.tokens, d.run.handoff.params,
                    d.run.next_position)
        out.append(acc if acc is not None else FAILED_ROW)
    return out


def commit_op(bucket: list[Draft], acceptances: list) -> CommitBatch:
    return CommitBatch(tuple(d.run.slot for d in bucket), tuple(range(len(bucket))),
                       tuple(a.accepted + 1 for a in acceptances), len(bucket[0].window))


def outcome(d: Draft, acc, features: dict[int, torch.Tensor], row: int) -> VerifyOutcome:
    return VerifyOutcome(d.run.next_position, d.window[: acc.accepted + 1], acc.tokens,
                         {layer: h[row, : acc.accepted + 1] for layer, h in features.items()})

