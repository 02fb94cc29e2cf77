"""Offline drafter evaluation on held-out text: greedy chain drafting against the target's greedy continuation.

The eval set (:func:`make_eval_set`) is made once per run, the target being frozen: held-out prompts, the
target's greedy continuation of each (the reference generator, i.e. what plain greedy decode emits) and the
drafter-side fused features of every position (from one target forward over prompt + continuation). A
simulated speculative decode then runs per k, exactly as the engine's greedy verify would::

    n = len(prompt)               x_n (first generated token) known, positions 0 .. n-1 committed
    round: draft k tokens from the window of pairs (x_{t+1}, g_t), t <= n-1
           accepted a = longest prefix of drafts equal to x_{n+1} ..  (the target's greedy tokens)
           tokens this verify = a + 1 (a drafts + the target's correction/bonus);  n += a + 1

tokens/verify = emitted tokens / rounds; per-position acceptance alpha_j = P(draft j accepted | 1..j-1 were).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3serve.contracts.sampling import SamplingParams
from k3serve.model.eagle3.drafter import Eagle3Drafter
from k3serve.model.eagle3.features import target_features
from k3serve.model.model import HybridModel
from k3serve.model.reference import reference_generate
from k3serve.model.state import DenseLatentCache, ForwardBatch


@dataclass(frozen=True)
class EvalSet:
    """prompts + greedy continuations as one `[N, P + M]` int64 sequence each; target features `[N, P + M, d]`."""

    seqs: torch.Tensor
    prompt_len: int
    low: torch.Tensor
    mid: torch.Tensor
    high: torch.Tensor


@dataclass(frozen=True)
class ChainStats:
    """One k: rounds (verifies), tokens emitted, accepted-draft histogram (index a: rounds accepting a)."""

    k: int
    rounds: int
    tokens: int
    accepted_hist: tuple[int, ...]

    @property
    def tokens_per_verify(self) -> float:
        return self.tokens / max(1, self.rounds)

    def position_acceptance(self) -> list[float]:
        """alpha_j for j = 1..k: rounds accepting >= j drafts over rounds accepting >= j - 1."""
        out = []
        for j in range(1, self.k + 1):
            reach = sum(self.accepted_hist[j - 1:])
            out.append(sum(self.accepted_hist[j:]) / reach if reach else 0.0)
        return out


def greedy_continuations(model: HybridModel, heldout: torch.Tensor, starts: list[int], prompt_len: int,
                         gen_len: int) -> torch.Tensor:
    """The held-out prompts at `starts` (`prompt_len` tokens each) with the target's greedy continuation of
    `gen_len` tokens (the reference generator): `[len(starts), prompt_len + gen_len]` int64."""
    if not starts or max(starts) + prompt_len > heldout.numel() or min(starts) < 0:
        raise ValueError(f"held-out text has {heldout.numel()} tokens; prompts of {prompt_len} tokens at {starts}")
    params = SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True)
    seqs = []
    for s in starts:
        prompt = heldout[s: s + prompt_len].long().tolist()
        seqs.append(prompt + reference_generate(model, prompt, params).token_ids)
    return torch.tensor(seqs, dtype=torch.long)


def eval_set_from_seqs(model: HybridModel, drafter_cfg, seqs: torch.Tensor, prompt_len: int) -> EvalSet:
    """An :class:`EvalSet` over given prompt + continuation sequences `[N, P + M]` (one target forward)."""
    b = seqs.shape[0]
    batch = ForwardBatch(model.new_kda_state(b), DenseLatentCache(model.cfg.num_mla_layers, b), [0] * b)
    f = target_features(model, drafter_cfg, seqs, batch)
    return EvalSet(seqs, prompt_len, f.low, f.mid, f.high)


def make_eval_set(model: HybridModel, drafter_cfg, heldout: torch.Tensor, prompts: int, prompt_len: int,
                  gen_len: int, starts: list[int] | None = None) -> EvalSet:
    """`prompts` held-out prompts of `prompt_len` tokens spread over the stream (or at `starts`), each continued
    greedily."""
    span = heldout.numel() - prompt_len
    if span <= 0 or prompts < 1:
        raise ValueError(f"held-out text has {heldout.numel()} tokens; need more than {prompt_len}")
    if starts is None:
        starts = [i * span // prompts for i in range(prompts)]
    seqs = greedy_continuations(model, heldout, starts, prompt_len, gen_len)
    return eval_set_from_seqs(model, drafter_cfg, seqs, prompt_len)


@torch.no_grad()
def chain_stats(drafter: Eagle3Drafter, es: EvalSet, k: int) -> ChainStats:
    """Simulated greedy speculative decode of every eval sequence with k drafts per verify (docstring above)."""
    g = drafter.fuse(es.low, es.mid, es.high)  # [N, L, d]
    seqs, (n_seq, length), win = es.seqs, es.seqs.shape, drafter.cfg.window
    pos = [es.prompt_len] * n_seq
    hist = [0] * (k + 1)
    rounds = tokens = 0
    while True:
        live = [i for i in range(n_seq) if pos[i] + k <= length - 1]
        if not live:
            break
        toks = torch.zeros(len(live), win, dtype=torch.long)
        feats = torch.zeros(len(live), win, g.shape[-1])
        counts = torch.zeros(len(live), dtype=torch.long)
        for r, i in enumerate(live):
            n = pos[i]
            lo = max(0, n - win)
            c = n - lo
            toks[r, win - c:] = seqs[i, lo + 1: n + 1]
            feats[r, win - c:] = g[i, lo:n]
            counts[r] = c
        drafts, _ = drafter.draft(toks, feats, counts, k)
        for r, i in enumerate(live):
            truth = seqs[i, pos[i] + 1: pos[i] + 1 + k]
            match = (drafts[r] == truth).long().cumprod(0)
            a = int(match.sum())
            hist[a] += 1
            rounds += 1
            tokens += a + 1
            pos[i] += a + 1
    return ChainStats(k, rounds, tokens, tuple(hist))
