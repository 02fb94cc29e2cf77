"""The one comparison every exactness test uses: served tokens against the single-process reference.

In the default numerics mode the serving paths compute the same maths as the reference in another rounding
order (other GEMM shapes, chunk boundaries, TP sums, the absorbed MLA decode), so logits agree to ~1e-5, not
bit for bit. Equal tokens then hold except where the reference itself sits on a knife edge. This helper says
which: the served tokens must equal the reference's, or the FIRST divergence must be explained by a near-tie
of the reference, and in that case the logits must still agree (within ``LOGIT_ATOL``) up to that step::

    step:        0    1    2  ...  d-1   d          d+1 ...
    tokens:      ==   ==   ==      ==    differ      (not compared: a different history from here)
    logits:      |got - ref| <= LOGIT_ATOL up to d  (when the test has the served logits)
    explained:   at step d, moving two reference logits by EPS_LOGIT / 2 each (served token up, reference
                 token down) makes the sampler draw the served token; OR a MoE router's top-k margin
                 (k-th minus (k+1)-th biased score) at some position <= the forward of step d is < EPS_ROUTER

The logit rule is exact for both samplers: greedy is an argmax, and torch's CPU multinomial draws
``argmax(p / q)`` with ``q ~ Exp(1)`` from the position-keyed generator (a Gumbel-max), so the draw changes only
if a perturbation of the logits can reorder the top two of ``logits / T - log q``. A router near-tie turns
rounding into a different expert choice, after which logits may differ by much more than ``LOGIT_ATOL``, so the
logit check stops at the first step whose forward saw such a position. Anything else fails, with where and by
how much. ``numerics: deterministic`` (docs/numerics.md) is tested with ``torch.equal`` instead.

Seeds are parameters of the tests (at least 3 per case); never change one to make a test pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3serve.contracts.sampling import SamplingParams
from k3serve.model.layers.ffn import MoE
from k3serve.model.reference import reference_generate
from k3serve.model.sampling import sample_token

LOGIT_ATOL = 1e-4  # the default mode's promise on logits (fp32 rounding of another operation order)
EPS_LOGIT = 2 * LOGIT_ATOL  # a near-tie: both logits may move by LOGIT_ATOL, so a gap below 2x can flip
EPS_ROUTER = 1e-4  # a near-tie of the router's biased sigmoid scores (the flip was at 7.7e-7)
SEEDS = (0, 1, 2)  # every exactness case runs over these (prompt seeds; sampling seeds where sampled)


def random_prompt(n: int, seed: int, vocab: int = 256) -> list[int]:
    """`n` token ids in [0, vocab) drawn from a generator seeded by `seed` alone."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


@dataclass(frozen=True)
class RefTrace:
    """The reference run of one (prompt, params), with what a comparison needs to explain a divergence.

    router_margin: `[P]` fp32, per absolute position 0 .. P-1 (every position the reference forwarded: the
    prompt and all generated tokens but the last), the smallest top-k margin over the model's MoE layers
    (+inf without MoE); router_layer: `[P]` int64, the layer where that smallest margin is.
    """

    prompt: tuple[int, ...]
    params: SamplingParams
    token_ids: tuple[int, ...]
    logits: tuple[torch.Tensor, ...]  # per generated token: `[vocab]` fp32
    router_margin: torch.Tensor
    router_layer: torch.Tensor


class _RouterMargins:
    """Records, per MoE layer and call, the k-th minus (k+1)-th biased score of every routed row.

    Wraps the instances' bound ``route`` (the real method runs unchanged) and restores it on exit."""

    def __init__(self, model) -> None:
        self.moes = [(layer.layer, layer.ffn) for layer in model.layers if isinstance(layer.ffn, MoE)]
        self.rows: dict[int, list[torch.Tensor]] = {li: [] for li, _ in self.moes}

    def __enter__(self) -> "_RouterMargins":
        for li, moe in self.moes:
            moe.route = self._recording(li, moe)
        return self

    def __exit__(self, *exc) -> None:
        for _, moe in self.moes:
            del moe.route  # back to the class's method

    def _recording(self, li: int, moe: MoE):
        real, k = MoE.route.__get__(moe), moe.cfg.num_experts_per_token

        def route(x: torch.Tensor):
            scores = torch.sigmoid(torch.nn.functional.linear(x.float(), moe.w_router)) + moe.score_bias
            top = torch.topk(scores, min(k + 1, scores.shape[-1]), dim=-1).values
            gap = top[:, k - 1] - top[:, k] if top.shape[-1] > k else torch.full_like(top[:, 0], float("inf"))
            self.rows[li].append(gap)
            return real(x)

        return route

    def per_position(self, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.moes:
            return torch.full((positions,), float("inf")), torch.full((positions,), -1, dtype=torch.long)
        layers = [li for li, _ in self.moes]
        m = torch.stack([torch.cat(self.rows[li]) for li in layers])  # [n_moe, P]
        if m.shape[1] != positions:
            raise RuntimeError(f"router saw {m.shape[1]} rows, expected {positions} positions")
        best, where = m.min(0)
        return best, torch.tensor(layers)[where]


def reference_trace(model, prompt: list[int], params: SamplingParams) -> RefTrace:
    """Run the reference generator on (prompt, params), keeping logits and router margins."""
    with _RouterMargins(model) as rec:
        ref = reference_generate(model, list(prompt), params, keep_logits=True)
        positions = len(prompt) + len(ref.token_ids) - 1
        margin, layer = rec.per_position(positions)
    return RefTrace(tuple(prompt), params, tuple(ref.token_ids), tuple(ref.logits), margin, layer)


@dataclass(frozen=True)
class Verdict:
    """exact: tokens equal. Otherwise `explained` says which near-tie let them diverge (never None then)."""

    exact: bool
    divergence: int | None = None  # the first differing step
    explained: str | None = None


def _router_tie(ref: RefTrace, upto: int) -> tuple[int, float, int] | None:
    """(position, margin, layer) of the smallest router margin at positions 0..upto, or None if none < EPS."""
    if upto < 0 or not len(ref.router_margin):
        return None
    m = ref.router_margin[: upto + 1]
    p = int(m.argmin())
    return (p, float(m[p]), int(ref.router_layer[p])) if float(m[p]) < EPS_ROUTER else None


def _smallest_router(ref: RefTrace, upto: int) -> str:
    m = ref.router_margin[: upto + 1]
    if not len(m) or torch.isinf(m.min()):
        return "no MoE router"
    p = int(m.argmin())
    return f"the smallest router top-k margin up to position {upto} is {float(m[p]):.3g} at position {p} " \
           f"(layer {int(ref.router_layer[p])}; eps {EPS_ROUTER})"


def compare(ref: RefTrace, got_tokens: list[int], got_logits: list[torch.Tensor] | None = None,
            label: str = "", prefix: bool = False) -> Verdict:
    """Check served tokens (and, when given, the logits `[vocab]` per step that chose them) against `ref`.

    prefix: the served stream may stop early (a cancelled request): its tokens are checked as a prefix.
    Raises AssertionError naming the step, position and sizes when the served run is not the reference's up
    to an explained near-tie; returns a :class:`Verdict` otherwise."""
    got = [int(t) for t in got_tokens]
    n, want = len(ref.prompt), list(ref.token_ids)
    tag = f"{label}: " if label else ""
    d = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if d is None and len(got) != len(want) and not (prefix and len(got) < len(want)):
        raise AssertionError(f"{tag}served {len(got)} tokens, the reference {len(want)}; equal up to the shorter")
    last = len(got) - 1 if d is None else d
    if got_logits is not None:
        for i in range(min(last + 1, len(got_logits))):
            if _router_tie(ref, n - 1 + i) is not None:
                break  # past a router near-tie the logits may legitimately differ
            err = float((got_logits[i].float().cpu() - ref.logits[i]).abs().max())
            if err > LOGIT_ATOL:
                raise AssertionError(f"{tag}logits of step {i} (position {n + i}) differ from the reference's by "
                                     f"{err:.3g} > {LOGIT_ATOL} ({_smallest_router(ref, n - 1 + i)})")
    if d is None:
        return Verdict(True)
    tie = _router_tie(ref, n - 1 + d)
    if tie is not None:
        p, m, layer = tie
        return Verdict(False, d, f"router near-tie {m:.3g} < {EPS_ROUTER} at position {p} (layer {layer})")
    logits, pos = ref.logits[d], n + d
    nudged = logits.clone()
    nudged[got[d]] += EPS_LOGIT / 2
    nudged[want[d]] -= EPS_LOGIT / 2
    gap = float(logits[want[d]] - logits[got[d]])
    if sample_token(nudged, ref.params, pos) == got[d]:
        return Verdict(False, d, f"logit near-tie at step {d}: reference gap {gap:.3g} (eps {EPS_LOGIT})")
    raise AssertionError(
        f"{tag}tokens diverge at step {d} (position {pos}): reference {want[d]}, served {got[d]}; not a near-tie: "
        f"the reference prefers {want[d]} by {gap:.3g} in logits and moving each by {EPS_LOGIT / 2:g} does not "
        f"flip the draw; {_smallest_router(ref, pos - 1)}. reference {want}, served {got}")


class References:
    """Reference traces of one model, computed once per (prompt, params) and shared by a test module."""

    def __init__(self, model) -> None:
        self.model = model
        self._traces: dict[tuple, RefTrace] = {}

    def trace(self, prompt: list[int], params: SamplingParams) -> RefTrace:
        key = (tuple(prompt), params)
        if key not in self._traces:
            self._traces[key] = reference_trace(self.model, prompt, params)
        return self._traces[key]

    def check(self, prompt: list[int], params: SamplingParams, got_tokens: list[int],
              got_logits: list[torch.Tensor] | None = None, label: str = "", prefix: bool = False) -> Verdict:
        """:func:`compare` the served tokens of (prompt, params) against the reference's."""
        return compare(self.trace(prompt, params), got_tokens, got_logits, label, prefix)
