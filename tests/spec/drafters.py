"""A drafter for tests: proposes a known continuation (e.g. the reference's tokens), wrong at chosen offsets,
so verify/commit runs long accepted prefixes and rejections at every depth. Written to the Drafter protocol."""

from __future__ import annotations

import torch

from k3serve.engine.spec.drafter import DraftProposal, VerifyOutcome


def spec_prompt(n: int, seed: int, repeat: bool) -> tuple[int, ...]:
    """`n` random byte tokens from `seed`; `repeat`: three times over (gives the n-gram drafter matches)."""
    base = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return tuple(base * 3 if repeat else base)


class ScriptedSession:
    def __init__(self, prompt_len: int, script: list[int], wrong_every: int) -> None:
        self.prompt_len, self.script, self.wrong_every = prompt_len, script, wrong_every
        self.observed: list[VerifyOutcome] = []

    def propose(self, context, k):
        at = len(context) - self.prompt_len - 1  # the script starts after the first (prefill) token
        out = []
        for i in range(k):
            if at + i >= len(self.script):
                break
            tok = self.script[at + i]
            if self.wrong_every and (at + i) % self.wrong_every == self.wrong_every - 1:
                tok = (tok + 1) % 256
            out.append(tok)
        return DraftProposal(tuple(out))

    def observe(self, outcome):
        self.observed.append(outcome)

    def close(self):
        pass


class ScriptedDrafter:
    name = "scripted"
    capture = None

    def __init__(self, scripts: dict[tuple[int, ...], list[int]], wrong_every: int = 3,
                 feature_layers: tuple[int, ...] = ()) -> None:
        self.scripts, self.wrong_every, self.feature_layers = scripts, wrong_every, feature_layers
        self.sessions: list[ScriptedSession] = []

    def open(self, request_id, prompt_ids, draft=None):
        s = ScriptedSession(len(prompt_ids), self.scripts.get(tuple(prompt_ids), []), self.wrong_every)
        self.sessions.append(s)
        return s
