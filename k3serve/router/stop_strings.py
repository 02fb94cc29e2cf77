"""Stop strings over a streamed, detokenised text: a match may span any number of token pieces.

Text that could still be the start of a stop string is held back until the next piece decides it, so the client
never sees a partial stop, and the text before the earliest match is all it gets.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        self.stops = tuple(stops)
        self._held = ""

    def feed(self, piece: str) -> tuple[str, bool]:
        """(text safe to send now, whether a stop string matched); after a match the text ends before it."""
        text = self._held + piece
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._held = ""
            return text[:min(hits)], True
        keep = max((k for s in self.stops for k in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:k])), default=0)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], False

    def flush(self) -> str:
        """The held-back tail, when the stream ends without a match."""
        out, self._held = self._held, ""
        return out
