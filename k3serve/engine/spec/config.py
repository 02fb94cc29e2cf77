"""Speculative decoding settings of a decode group, and the drafter registry.

`SpecConfig` is what the deploy file's ``clusters.speculative`` section and the CLI's ``--speculative`` become
(cluster/deploy.py builds it); the decode engine reads only this.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from k3serve.engine.spec.drafter import Drafter
from k3serve.engine.spec.ngram import NgramConfig, NgramDrafter

METHODS = ("ngram", "eagle3")
MAX_DRAFT_TOKENS = 15


@dataclass(frozen=True)
class SpecConfig:
    """method: the drafter ("ngram" | "eagle3"); num_draft_tokens: k, drafts per verify step (1..15).

    classes: per request class, in the deploy file's order, ``(max_uncached_tokens, enabled)``: a request is
    speculated iff the first class whose bound holds its uncached prompt tokens is enabled (empty: all are).
    drafter_dir: the drafter's checkpoint (eagle3). ngram: the n-gram drafter's settings.
    """

    method: str = "ngram"
    num_draft_tokens: int = 3
    classes: tuple[tuple[int, bool], ...] = ()
    drafter_dir: str = ""
    ngram: NgramConfig = field(default_factory=NgramConfig)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative.method must be one of {METHODS}, got {self.method!r}")
        if not 1 <= self.num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"speculative.num_draft_tokens must be in [1, {MAX_DRAFT_TOKENS}], "
                             f"got {self.num_draft_tokens}")

    def enabled_for(self, uncached_tokens: int) -> bool:
        for bound, enabled in self.classes:
            if uncached_tokens <= bound:
                return enabled
        return not self.classes or self.classes[-1][1]


def make_drafter(config: SpecConfig, model_cfg: object = None) -> Drafter:
    """The drafter a SpecConfig names (EAGLE-3's module is imported only when asked: it loads weights)."""
    if config.method == "ngram":
        return NgramDrafter(config.ngram)
    from k3serve.engine.spec.eagle3 import load_eagle3_drafter

    return load_eagle3_drafter(config.drafter_dir, model_cfg)
