"""Drafter acceptance on filtered held-out prompts: greedy chains and temperature-1 speculative sampling, for the
n-gram drafter and EAGLE-3 drafters side by side (the ``heldout`` section of ``bench eagle3`` / ``bench spec``).

Prompts: windows of the held-out stream (`prompt_len` tokens) at `scan` evenly spaced starts, taken in order;
a window is kept when the target's greedy continuation (`gen_len` tokens, the reference generator) passes
:class:`ContinuationFilter` (default: at most 50% whitespace bytes, no run of more than 8 identical tokens, at
least half of its 4-grams distinct, i.e. not a whitespace run, not one repeated token, not a short loop). The
first `prompts` kept are used; ``scanned`` / ``kept`` say how many windows that took.

Greedy: tokens per verify at k = 1..7 by chain_eval's simulated greedy decode (n-gram: :func:`ngram_chain_stats`).

Temperature 1, per seed (one ``torch.Generator`` per seed and measure):

- ``t1_alpha``: the target samples a continuation of each prompt; at each of its `gen_len` positions,
  sum_x min(p(x), q(x)) with p the target's next-token distribution and q the drafter's first-draft
  distribution there (n-gram: a point mass on its proposal, so p(d), and 0 without a proposal); the mean over
  positions and prompts. It is the probability that one sampled draft is accepted (what the LK loss optimises).
- ``t1_tokens_per_verify``: speculative (rejection) sampling simulated at k drafts: each round the drafter
  samples d_1..d_k from q_1..q_k (EAGLE-3 chains on its own sampled drafts; n-gram proposes up to k tokens, q a
  point mass), one plain target forward over context + drafts gives p_1..p_{k+1}, d_i is accepted with
  probability min(1, p_i(d_i) / q_i(d_i)); the first rejection emits a token from norm(max(p_i - q_i, 0)),
  all accepted emits a bonus from p_{k+1}. Tokens per verify = mean over rounds of accepted + 1; rounds run
  while the position plus k stays inside prompt + `gen_len` (as chain_eval).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from k3serve.engine.spec.ngram import NgramConfig, NgramSession
from k3serve.model.eagle3.chain_eval import ChainStats, EvalSet, chain_stats, eval_set_from_seqs, greedy_continuations
from k3serve.model.eagle3.drafter import Eagle3Drafter
from k3serve.model.eagle3.features import target_features
from k3serve.model.eagle3.weights import load_drafter_weights
from k3serve.model.eagle3.window import DrafterWindow, stack_windows
from k3serve.model.model import HybridModel
from k3serve.model.state import DenseLatentCache, ForwardBatch

KS = tuple(range(1, 8))
WHITESPACE = frozenset(b" \t\n\r\x0b\x0c")
Features = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (low, mid, high) `[T, d]` of one sequence


# ------------------------------------------------------------------------------------------------ prompts
def whitespace_fraction(tokens: Sequence[int]) -> float:
    return sum(t in WHITESPACE for t in tokens) / max(1, len(tokens))


def longest_run(tokens: Sequence[int]) -> int:
    return max((len(list(g)) for _, g in itertools.groupby(tokens)), default=0)


def distinct_fraction(tokens: Sequence[int], n: int = 4) -> float:
    """Distinct n-grams over n-grams: near 1 for text, small for a loop of short period."""
    grams = [tuple(tokens[i: i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


@dataclass(frozen=True)
class ContinuationFilter:
    """Which greedy continuations count as text worth drafting (module docstring)."""

    max_whitespace: float = 0.5
    max_run: int = 8
    min_distinct_4grams: float = 0.5

    def passes(self, tokens: Sequence[int]) -> bool:
        return (whitespace_fraction(tokens) <= self.max_whitespace and longest_run(tokens) <= self.max_run
                and distinct_fraction(tokens, 4) >= self.min_distinct_4grams)

    def describe(self) -> str:
        return (f"greedy continuation: whitespace bytes <= {self.max_whitespace:.0%}, no run of more than "
                f"{self.max_run} identical tokens, distinct 4-grams >= {self.min_distinct_4grams:.0%}")


@dataclass(frozen=True)
class HeldoutPrompts:
    """The kept windows: `[N, P + M]` prompt + greedy continuation, their stream starts, windows scanned."""

    seqs: torch.Tensor
    prompt_len: int
    starts: tuple[int, ...]
    scanned: int


def select_prompts(model: HybridModel, heldout: torch.Tensor, prompts: int, prompt_len: int, gen_len: int,
                   scan: int, flt: ContinuationFilter) -> HeldoutPrompts:
    """The first `prompts` of `scan` evenly spaced windows whose greedy continuation passes `flt`."""
    span = heldout.numel() - prompt_len
    if span <= 0 or scan < 1:
        raise ValueError(f"held-out text has {heldout.numel()} tokens; need more than {prompt_len}")
    kept, seqs, scanned = [], [], 0
    for s in (i * span // scan for i in range(scan)):
        if len(kept) == prompts:
            break
        scanned += 1
        seq = greedy_continuations(model, heldout, [s], prompt_len, gen_len)[0]
        if flt.passes(seq[prompt_len:].tolist()):
            kept.append(s)
            seqs.append(seq)
    out = torch.stack(seqs) if seqs else torch.zeros(0, prompt_len + gen_len, dtype=torch.long)
    return HeldoutPrompts(out, prompt_len, tuple(kept), scanned)


# ----------------------------------------------------------------------------------------------- greedy
def ngram_chain_stats(seqs: torch.Tensor, prompt_len: int, k: int, config: NgramConfig | None = None) -> ChainStats:
    """The n-gram drafter in the same simulated greedy decode as :func:`chain_stats` (no draft: a 1-token verify)."""
    hist = [0] * (k + 1)
    rounds = tokens = 0
    for row in seqs.tolist():
        sess, n = NgramSession(config or NgramConfig()), prompt_len
        while n + k <= len(row) - 1:
            drafts = sess.propose(row[: n + 1], k).tokens
            a = 0
            while a < len(drafts) and drafts[a] == row[n + 1 + a]:
                a += 1
            hist[a] += 1
            rounds += 1
            tokens += a + 1
            n += a + 1
    return ChainStats(k, rounds, tokens, tuple(hist))


# ------------------------------------------------------------------------------------- the sampling rule
def overlap(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """sum_x min(p(x), q(x)) over the last dim: the probability a draft sampled from q is accepted against p."""
    return torch.minimum(p, q).sum(-1)


def rejection_round(p: torch.Tensor, q: torch.Tensor, drafts: Sequence[int],
                    gen: torch.Generator) -> tuple[int, int]:
    """One verify of speculative sampling: p `[m + 1, V]` target, q `[m, V]` drafter, drafts d_1..d_m drawn from
    q -> (accepted a, the token emitted after them: the residual draw at the first rejection, else the bonus)."""
    for i, d in enumerate(drafts):
        if float(torch.rand((), generator=gen)) * float(q[i, d]) < float(p[i, d]):  # u < p(d) / q(d)
            continue
        residual = (p[i] - q[i]).clamp(min=0)
        residual = residual if float(residual.sum()) > 0 else p[i]
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=gen))
    return len(drafts), int(torch.multinomial(p[len(drafts)], 1, generator=gen))


# ------------------------------------------------------------------------------------------- the target
def _target_pass(model: HybridModel, capture_cfg, seqs: list[list[int]]) -> tuple[list[torch.Tensor], list[Features]]:
    """One plain forward of the target over each sequence from a zero state (right-padded into one batch; the
    model is causal, so padding changes no valid position): per sequence p `[T, V]` and, when `capture_cfg`
    (a drafter config) is given, its (low, mid, high) features."""
    b, width = len(seqs), max(len(s) for s in seqs)
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs], dtype=torch.long)
    batch = ForwardBatch(model.new_kda_state(b), DenseLatentCache(model.cfg.num_mla_layers, b), [0] * b)
    if capture_cfg is None:
        logits, feats = model.forward(ids, batch, all_logits=True), None
    else:
        f = target_features(model, capture_cfg, ids, batch)
        logits, feats = f.logits, (f.low, f.mid, f.high)
    probs = [logits[i, : len(s)].float().softmax(-1) for i, s in enumerate(seqs)]
    return probs, [tuple(x[i, : len(s)] for x in feats) if feats else () for i, s in enumerate(seqs)]


def sample_continuations(model: HybridModel, prompts: torch.Tensor, gen_len: int, gen: torch.Generator) -> torch.Tensor:
    """prompts `[N, P]` -> `[N, P + gen_len]`: the target's temperature-1 continuations (one batched decode)."""
    b, plen = prompts.shape
    kda, latent = model.new_kda_state(b), DenseLatentCache(model.cfg.num_mla_layers, b)
    logits = model.forward(prompts, ForwardBatch(kda, latent, [0] * b))
    out = [prompts]
    for i in range(gen_len):
        tok = torch.multinomial(logits.float().softmax(-1), 1, generator=gen)  # [N, 1]
        out.append(tok)
        if i + 1 < gen_len:
            logits = model.forward(tok, ForwardBatch(kda, latent, [plen + i] * b, decode=True))
    return torch.cat(out, dim=1)


def _window(drafter: Eagle3Drafter, tokens: Sequence[int] | torch.Tensor, feats: Features, n: int) -> DrafterWindow:
    """The drafter's window anchored at position n: pairs (x_{t+1}, g_t) for the last W positions t <= n - 1."""
    lo = max(0, n - drafter.cfg.window)
    g = drafter.fuse(*(f[lo:n] for f in feats))
    nxt = torch.as_tensor(tokens[lo + 1: n + 1], dtype=torch.long)
    return DrafterWindow.empty(drafter.cfg.window, drafter.cfg.hidden_size).extended(nxt, g)


# ------------------------------------------------------------------------------------------ temperature 1
@dataclass(frozen=True)
class Method:
    """A row: the n-gram drafter (drafter None) or an EAGLE-3 drafter."""

    name: str
    drafter: Eagle3Drafter | None = None


def t1_alpha(method: Method, seqs: torch.Tensor, prompt_len: int, probs: list[torch.Tensor],
             feats: list[Features]) -> float:
    """Mean over the continuation positions n of sum_x min(p_n, q_n) (module docstring); probs: the target's
    `[L, V]` per sequence, feats: its features (EAGLE-3 only)."""
    terms: list[torch.Tensor] = []
    for i, row in enumerate(seqs.tolist()):
        positions = range(prompt_len, len(row))
        p = probs[i][prompt_len:]
        if method.drafter is None:
            sess = NgramSession(NgramConfig())
            for j, n in enumerate(positions):
                d = sess.propose(row[: n + 1], 1).tokens
                terms.append(p[j, d[0]] if d else torch.zeros(()))
            continue
        dr = method.drafter
        wins = [_window(dr, row, feats[i], n) for n in positions]
        _, logits = dr.draft(*stack_windows(wins), 1)
        terms += list(overlap(p, logits[:, 0].softmax(-1)))
    return float(torch.stack(terms).mean()) if terms else 0.0


def _propose(method: Method, ctxs: list[list[int]], feats: list[Features], sessions: list[NgramSession], k: int,
             vocab: int, gen: torch.Generator) -> list[tuple[list[int], torch.Tensor]]:
    """Per context: drafts sampled from the drafter and their q `[m, V]` (n-gram: m <= k, one-hot rows)."""
    if method.drafter is None:
        out = []
        for ctx, sess in zip(ctxs, sessions):
            d = list(sess.propose(ctx, k).tokens)
            out.append((d, F.one_hot(torch.tensor(d, dtype=torch.long), vocab).float()))
        return out
    dr = method.drafter
    wins = [_window(dr, ctx, f, len(ctx) - 1) for ctx, f in zip(ctxs, feats)]

    def sample(lg: torch.Tensor) -> torch.Tensor:
        return torch.multinomial(lg.softmax(-1), 1, generator=gen).squeeze(1)

    drafts, logits = dr.draft(*stack_windows(wins), k, choose=sample)
    return [(drafts[r].tolist(), logits[r].softmax(-1)) for r in range(len(ctxs))]


def t1_tokens_per_verify(model: HybridModel, method: Method, prompts: torch.Tensor, gen_len: int, k: int,
                         gen: torch.Generator) -> float:
    """Simulated speculative sampling of every prompt with k drafts per verify (module docstring)."""
    cfg = method.drafter.cfg if method.drafter is not None else None
    vocab = model.cfg.vocab_size
    end = prompts.shape[1] + gen_len - 1  # the last position a round may fill (as chain_eval)
    ctxs = [row.tolist() for row in prompts]
    probs, feats = _target_pass(model, cfg, ctxs)
    for ctx, p in zip(ctxs, probs):  # the first token, from the prompt's last position (prefill's token)
        ctx.append(int(torch.multinomial(p[-1], 1, generator=gen)))
    sessions = [NgramSession(NgramConfig()) for _ in ctxs]
    emitted: list[int] = []
    while live := [i for i, ctx in enumerate(ctxs) if len(ctx) - 1 + k <= end]:
        props = _propose(method, [ctxs[i] for i in live], [feats[i] for i in live], [sessions[i] for i in live], k,
                         vocab, gen)
        probs, new_feats = _target_pass(model, cfg, [ctxs[i] + d for i, (d, _) in zip(live, props)])
        for i, (d, q), p, f in zip(live, props, probs, new_feats):
            n = len(ctxs[i]) - 1
            a, tok = rejection_round(p[n: n + len(d) + 1], q, d, gen)
            ctxs[i] += d[:a] + [tok]
            feats[i] = tuple(x[: n + a + 1] for x in f) if f else ()
            emitted.append(a + 1)
    return sum(emitted) / len(emitted) if emitted else 0.0


# ------------------------------------------------------------------------------------------------- rows
@dataclass(frozen=True)
class AcceptRow:
    """One method on the kept prompts: greedy tokens per verify at k = ks, and per seed alpha and tokens per
    verify at k_t1 under temperature-1 speculative sampling."""

    method: str
    ks: tuple[int, ...]
    greedy_tokens_per_verify: tuple[float, ...]
    seeds: tuple[int, ...]
    t1_alpha: tuple[float, ...]
    t1_tokens_per_verify: tuple[float, ...]

    def to_json(self) -> dict:
        mean = lambda xs: round(sum(xs) / len(xs), 4) if xs else None  # noqa: E731
        return {"greedy_tokens_per_verify": {k: round(v, 3) for k, v in zip(self.ks, self.greedy_tokens_per_verify)},
                "t1_alpha": {s: round(v, 4) for s, v in zip(self.seeds, self.t1_alpha)},
                "t1_alpha_mean": mean(self.t1_alpha),
                "t1_tokens_per_verify": {s: round(v, 3) for s, v in zip(self.seeds, self.t1_tokens_per_verify)},
                "t1_tokens_per_verify_mean": mean(self.t1_tokens_per_verify)}


def method_row(model: HybridModel, method: Method, sel: HeldoutPrompts, seeds: Sequence[int], k_t1: int,
               ks: Sequence[int] = KS) -> AcceptRow:
    """Greedy and temperature-1 figures of one method on the selected prompts."""
    plen, gen_len = sel.prompt_len, sel.seqs.shape[1] - sel.prompt_len
    if method.drafter is None:
        greedy = [ngram_chain_stats(sel.seqs, plen, k) for k in ks]
        cfg = None
    else:
        cfg = method.drafter.cfg
        es: EvalSet = eval_set_from_seqs(model, cfg, sel.seqs, plen)
        greedy = [chain_stats(method.drafter, es, k) for k in ks]
    alphas, tpvs = [], []
    for seed in seeds:
        gen = torch.Generator().manual_seed(seed)
        sampled = sample_continuations(model, sel.seqs[:, :plen], gen_len, gen)
        probs, feats = _target_pass(model, cfg, sampled.tolist())
        alphas.append(t1_alpha(method, sampled, plen, probs, feats))
        tpvs.append(t1_tokens_per_verify(model, method, sel.seqs[:, :plen], gen_len, k_t1,
                                         torch.Generator().manual_seed(seed)))
    return AcceptRow(method.name, tuple(ks), tuple(s.tokens_per_verify for s in greedy), tuple(seeds),
                     tuple(alphas), tuple(tpvs))


def heldout_section(model: HybridModel, drafters: dict[str, str], heldout: torch.Tensor, prompts: int = 8,
                    prompt_len: int = 128, gen_len: int = 64, scan: int | None = None, seeds: Sequence[int] = (0, 1),
                    k_t1: int = 3, flt: ContinuationFilter = ContinuationFilter()) -> dict:
    """The JSON section: the prompt selection and ``rows``, method name -> row (n-gram first, then `drafters`:
    row name -> EAGLE-3 drafter dir for `model`). scan: candidate windows (default 8 x prompts)."""
    sel = select_prompts(model, heldout, prompts, prompt_len, gen_len, scan or 8 * prompts, flt)
    out = {"filter": flt.describe(), "prompt_len": prompt_len, "gen_len": gen_len, "scanned": sel.scanned,
           "kept": len(sel.starts), "starts": list(sel.starts), "seeds": list(seeds), "k_t1": k_t1, "rows": {}}
    if not sel.starts:
        return out
    methods = [Method("ngram")]
    for name, path in drafters.items():
        cfg, w = load_drafter_weights(path)
        cfg.check_target(model.cfg)
        methods.append(Method(name, Eagle3Drafter(cfg, w)))
    out["rows"] = {m.name: method_row(model, m, sel, seeds, k_t1).to_json() for m in methods}
    return out
