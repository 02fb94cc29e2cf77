"""The EAGLE-3 drafter behind the speculative engine's Drafter interface (engine/spec/drafter.py).

Per request the session keeps a :class:`~k3serve.model.eagle3.window.DrafterWindow`: the last W committed
(next token, fused feature) pairs. Each step::

    propose(context, k):  chain-draft k tokens (argmax) from the window; its anchor pair's token is x_0 =
                          context[-1] (the last emitted token, not yet in the target state)
    observe(outcome):     rows 0..a of the verify forward entered the target state at positions p..p+a; their
                          captured (low, mid, high) features are fused and committed as pairs
                          (x_1, g_p) .. (x_a, g_{p+a-1}), (t, g_{p+a}), t the correction/bonus token

Drafts are greedy (argmax of q) whatever the request's temperature and the proposal carries no q: the engine
then applies the one-hot form of the lossless rule, so sampled output keeps the target's distribution.

Warm start: prefill captures the feature layers for the prompt's last W positions when its config asks
(``PrefillConfig.draft_capture = method.capture``) and the ticket carries them (``Handoff.draft``); ``open(...,
draft=handoff.draft)`` turns them into the window, so the first step drafts like any later one.

Cold start: a session opened without a window (``open`` from the prompt only) drafts its first step from the
anchor pair (x_0, 0); the verify's features then replace it and the window fills from verified rows. A step
that ran as plain decode (``features=None``) leaves the window without that position, so the session goes
cold again rather than draft from a window that skips a position. Output is exact either way (the verify
decides every token); a warm window only raises acceptance.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from k3serve.contracts.handoff import DraftCapture, DraftFeatures
from k3serve.engine.spec.drafter import DraftProposal, VerifyOutcome
from k3serve.model.config import ConfigError, ModelConfig
from k3serve.model.eagle3.drafter import Eagle3Drafter
from k3serve.model.eagle3.features import feature_layers, split_captured
from k3serve.model.eagle3.weights import load_drafter_weights
from k3serve.model.eagle3.window import DrafterWindow, stack_windows


class Eagle3Session:
    """One request's drafter state: its window (cold until the first verified features arrive)."""

    def __init__(self, method: "Eagle3Method", window: DrafterWindow | None) -> None:
        self.method = method
        self.window = window if window is not None and window.count else None

    def propose(self, context: Sequence[int], k: int) -> DraftProposal:
        if k <= 0 or not context:
            return DraftProposal()
        dr = self.method.drafter
        win = self.window
        if win is None or int(win.tokens[-1]) != context[-1]:  # cold: the anchor pair (x_0, zero feature)
            win = DrafterWindow.empty(dr.cfg.window, dr.cfg.hidden_size).extended(
                torch.tensor([context[-1]]), torch.zeros(1, dr.cfg.hidden_size))
            self.window = None
        drafts, _ = dr.draft(*stack_windows([win]), k)
        return DraftProposal(tuple(int(t) for t in drafts[0].tolist()))

    def observe(self, outcome: VerifyOutcome) -> None:
        if outcome.features is None:  # a plain step: no features for this position
            self.window = None
            return
        low, mid, high = split_captured(self.method.drafter.cfg, outcome.features)
        g = self.method.drafter.fuse(low, mid, high)  # [a + 1, d]
        nxt = torch.tensor(outcome.committed[1:] + outcome.emitted[-1:], dtype=torch.long)
        base = self.window or DrafterWindow.empty(self.method.drafter.cfg.window, self.method.drafter.cfg.hidden_size)
        self.window = base.extended(nxt, g)

    def close(self) -> None:
        self.window = None


class Eagle3Method:
    """The drafter a decode engine holds (weights loaded once); ``open`` makes per-request sessions."""

    name = "eagle3"

    def __init__(self, drafter: Eagle3Drafter) -> None:
        self.drafter = drafter
        self.feature_layers: tuple[int, ...] = feature_layers(drafter.cfg)

    @property
    def capture(self) -> DraftCapture:
        """What prefill must capture for this drafter (PrefillConfig.draft_capture): its layers, W rows."""
        return DraftCapture(self.feature_layers, self.drafter.cfg.window)

    def window_of(self, draft: DraftFeatures | None) -> DrafterWindow | None:
        """The start window from prefill's rows (Handoff.draft): pairs (next token, fused feature)."""
        if draft is None or not draft.next_tokens:
            return None
        cfg = self.drafter.cfg
        low, mid, high = split_captured(cfg, draft.features)
        g = self.drafter.fuse(low, mid, high)
        empty = DrafterWindow.empty(cfg.window, cfg.hidden_size)
        return empty.extended(torch.tensor(draft.next_tokens, dtype=torch.long)[-cfg.window:], g[-cfg.window:])

    def open(self, request_id: str, prompt_ids: Sequence[int], draft: DraftFeatures | None = None) -> Eagle3Session:
        """draft: the rows the prefill handed over (Handoff.draft, made with :attr:`capture`); None: cold start."""
        return Eagle3Session(self, self.window_of(draft))


def load_eagle3_drafter(drafter_dir: str | Path, model_cfg: ModelConfig | None) -> Eagle3Method:
    """The drafter in `drafter_dir` (k3serve train drafter's output), checked against the target's config."""
    if not drafter_dir:
        raise ValueError("speculative.method eagle3 needs speculative.drafter_dir (a drafter checkpoint)")
    try:
        cfg, weights = load_drafter_weights(drafter_dir)
        if model_cfg is not None:
            cfg.check_target(model_cfg)
    except ConfigError as e:
        raise ValueError(f"speculative.drafter_dir {drafter_dir}: {e}") from e
    return Eagle3Method(Eagle3Drafter(cfg, weights))
