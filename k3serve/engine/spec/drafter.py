"""The drafter interface: what a speculative decode engine asks of any drafter (n-gram, EAGLE-3, ...).

```
 DecodeEngine                 Drafter (one per engine: weights, config)
   install(request) ────────▶ drafter.open(request_id, prompt_ids) ──▶ DraftSession (per-request state)
   each step:
     session.propose(context, k) ─▶ DraftProposal(tokens x_1..x_k')
     VerifyBatch: [x_0 | x_1 .. x_k'] at positions p .. p+k'  (x_0 = last token, not yet in the state)
     accept (engine/spec/accept.py) ─▶ a drafts accepted, one correction / bonus token t
     CommitBatch: x_0 .. x_a enter the target state
     session.observe(VerifyOutcome(...)) ◀── features of the rows whose tokens entered the state
   finish / cancel ──────────▶ session.close()
```

The feature hook (for drafters that read the target's hidden states, e.g. EAGLE-3): a drafter names the layers
it needs in ``Drafter.feature_layers``; the verify forward then returns, per request, the hidden state after
each of those layers for every verified row (``ForwardBatch.capture_layers`` / ``VerifyBatch.capture_layers``,
see ``model/model.py``), and the engine hands the rows whose tokens entered the state (x_0 .. x_a, i.e. rows
0 .. a) to ``DraftSession.observe`` as ``VerifyOutcome.features``. Rows past ``a`` were computed from rejected
tokens and are never passed on. A request whose drafter proposed nothing in a step is decoded plainly and its
session sees ``features=None`` for that step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from k3serve.contracts.handoff import DraftCapture, DraftFeatures


@dataclass(frozen=True)
class DraftProposal:
    """Up to k drafted tokens for positions p+1 .. p+len(tokens) (p: the position of the last context token).

    tokens: the drafts, possibly fewer than asked (none: the request is decoded plainly this step); the engine
        takes them as given (q one-hot on each: engine/spec/accept.py).
    """

    tokens: tuple[int, ...] = ()


@dataclass(frozen=True)
class VerifyOutcome:
    """What one speculative step did for one request (handed to its session after the commit).

    start_position: absolute position of row 0 (x_0, the last committed token).
    committed: the tokens that entered the target state this step, x_0 .. x_a (a + 1 tokens).
    emitted: the tokens streamed to the client this step: x_1 .. x_a then the correction / bonus token.
    features: layer index -> `[a + 1, d]` fp32 hidden states of rows 0 .. a, for the layers the drafter asked
        for (empty dict when it asked for none; None when the step was a plain decode step).
    """

    start_position: int
    committed: tuple[int, ...]
    emitted: tuple[int, ...]
    features: dict[int, torch.Tensor] | None = field(default=None)


class DraftSession(Protocol):
    """One request's drafter state (n-gram index, EAGLE-3 hidden features and KV, ...)."""

    def propose(self, context: Sequence[int], k: int) -> DraftProposal:
        """Draft up to k tokens after `context` (prompt + every generated token; its last token is x_0)."""

    def observe(self, outcome: VerifyOutcome) -> None:
        """The step's result: called once per engine step the request took part in, in order."""

    def close(self) -> None:
        """The request left (finished, failed or cancelled): drop what the session holds."""


class Drafter(Protocol):
    """A drafting method; one instance per decode engine.

    name: the method as the deploy file and the CLI spell it ("ngram", "eagle3").
    feature_layers: target layers whose hidden states the verify forward must return (empty: none).
    capture: what prefill must capture for a warm start (``PrefillConfig.draft_capture``), None: nothing.
    """

    name: str
    feature_layers: tuple[int, ...]
    capture: DraftCapture | None

    def open(self, request_id: str, prompt_ids: Sequence[int], draft: DraftFeatures | None = None) -> DraftSession:
        """Start a request's session (its prompt is already in the target state); ``draft``: what prefill
        captured for this drafter (``Handoff.draft``), None: start cold."""
