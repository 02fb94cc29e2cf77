"""Numerics mode ``deterministic``: every serving path gives the reference's logits bit for bit (torch.equal).

The reference runs the same deterministic operators (a TP=1 model built with DETERMINISTIC); the serving paths
run through the real engines, with the executors' outputs recorded on the way (the real executors run; the
recorder only keeps what they return): every chosen token's logits, prefill's last-chunk logits and each
decode step's rows, mapped to their requests by state slot.
"""

from __future__ import annotations

import pytest
import torch

from k3serve.contracts.numerics import DETERMINISTIC
from k3serve.contracts.requests import PrefillRequest
from k3serve.contracts.sampling import SamplingParams
from k3serve.disagg.pipeline import LocalPipeline
from k3serve.engine.ops import DecodeBatch, PoolConfig, PrefillChunk
from k3serve.contracts.prefix_policy import PrefixCachePolicy
from k3serve.model.loader import load_model
from k3serve.model.reference import reference_generate
from k3serve.prefill.engine import PrefillConfig
from tests.exactness import SEEDS, random_prompt

GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)


def _seeded(seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=50 + seed, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def det_ref(tiny_ckpt):
    """(prompt, params) -> the deterministic reference (tokens and the logits that chose them), cached."""
    model, done = load_model(tiny_ckpt, numerics=DETERMINISTIC), {}

    def get(prompt: list[int], params: SamplingParams):
        key = (tuple(prompt), params)
        if key not in done:
            done[key] = reference_generate(model, prompt, params, keep_logits=True)
        return done[key]

    return get


class Recorder:
    """Wraps a real executor: keeps the logits of every PrefillChunk that returns them and of every
    DecodeBatch row, by request id (`owner(slot)` names the request that holds a state slot)."""

    def __init__(self, inner, owner) -> None:
        self.inner, self.owner, self.tp = inner, owner, inner.tp
        self.logits: dict[str, list[torch.Tensor]] = {}

    def run(self, op):
        out = self.inner.run(op)
        if isinstance(op, PrefillChunk) and op.want_logits:
            self.logits.setdefault(self.owner(op.slot), []).append(out[0])
        elif isinstance(op, DecodeBatch):
            for i, slot in enumerate(op.slots):
                self.logits.setdefault(self.owner(slot), []).append(out[0][i])
        return out

    def run_each(self, ops):
        return self.inner.run_each(ops)

    def close(self):
        self.inner.close()


def _recorded(pipe: LocalPipeline) -> tuple[Recorder, Recorder]:
    pre = Recorder(pipe.prefill.executor,
                   lambda slot: next(r.req.request_id for r in pipe.prefill.running if r.slot == slot))
    dec = Recorder(pipe.decode.executor,
                   lambda slot: next(rid for rid, r in pipe.decode.running.items() if r.slot == slot))
    pipe.prefill.executor, pipe.decode.executor = pre, dec
    return pre, dec


class _Out:
    def __init__(self, tokens: list[int]) -> None:
        self.token_ids, self.error = tokens, None


def _serve(pipe: LocalPipeline, reqs: list[PrefillRequest], together: bool = False):
    """Outputs and chosen-token logits per request. together: every prefill before any decode, so each decode
    step batches all the requests (the batch composition shrinks only as requests finish)."""
    pre, dec = _recorded(pipe)
    try:
        if together:
            for r in reqs:
                pipe.prefill.add_request(r)
            handoffs = pipe.prefill.run_to_completion()
            outs = {h.request_id: _Out([h.first_token]) for h in handoffs}
            for h in handoffs:
                pipe.decode.submit(h)
            assert len(pipe.decode.running) == len(reqs)
            while pipe.decode.has_work:
                for ev in pipe.decode.step():
                    outs[ev.request_id].token_ids += list(ev.token_ids)
        else:
            outs = pipe.generate(reqs)
    finally:
        pipe.prefill.executor, pipe.decode.executor = pre.inner, dec.inner
    logits = {r.request_id: pre.logits.get(r.request_id, []) + dec.logits.get(r.request_id, []) for r in reqs}
    return outs, logits


def _assert_bitwise(det_ref, reqs, outs, logits, label):
    for r in reqs:
        out = outs[r.request_id]
        assert out.error is None, out.error
        ref = det_ref(list(r.prompt_ids), r.params)
        assert out.token_ids == ref.token_ids, f"{label} {r.request_id}: tokens differ"
        got = logits[r.request_id][: len(ref.logits)]
        assert len(got) == len(ref.logits), f"{label} {r.request_id}: {len(got)} logits recorded"
        for i, (a, b) in enumerate(zip(got, ref.logits)):
            assert torch.equal(a, b), (f"{label} {r.request_id}: logits of step {i} differ by "
                                       f"{float((a - b).abs().max()):.3g}")


def _requests(lengths, seed: int, tag: str) -> list[PrefillRequest]:
    out = []
    for i, n in enumerate(lengths):
        params = GREEDY if i % 2 == 0 else _seeded(seed)
        out.append(PrefillRequest(f"{tag}-{i}", tuple(random_prompt(n, 7000 + 100 * seed + i)), params))
    return out


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("budget", [64, 100, 512, 4096])  # 4096: every prompt in one shot
def test_prefill_chunk_budgets_give_the_reference_bits(tiny_ckpt, det_ref, budget, seed):
    reqs = _requests([1, 150, 300], seed, f"b{budget}")  # 300: chunk ends move with the budget
    pools = PoolConfig(kda_slots=16, mla_pages=64)
    cfg = PrefillConfig(pools, step_token_budget=budget, enable_prefix_cache=False)
    with LocalPipeline(tiny_ckpt, prefill=cfg, numerics=DETERMINISTIC) as pipe:
        outs, logits = _serve(pipe, reqs)
    _assert_bitwise(det_ref, reqs, outs, logits, f"budget {budget}")


@pytest.mark.parametrize("seed", SEEDS)
def test_prefix_hits_at_every_checkpoint_depth_give_the_reference_bits(tiny_ckpt, det_ref, seed):
    # 128-token hash blocks with a checkpoint at every block end: a 520-token prompt leaves checkpoints at
    # 128, 256, 384, 512; each follow-up shares the first d tokens and must resume at exactly d
    policy = PrefixCachePolicy(hash_block_size=128, checkpoint_every_blocks=1, max_checkpoints_per_session=8)
    pools = PoolConfig(kda_slots=24, mla_pages=96)
    cfg = PrefillConfig(pools, cache=policy, step_token_budget=256)
    base = random_prompt(520, 9000 + seed)
    with LocalPipeline(tiny_ckpt, prefill=cfg, numerics=DETERMINISTIC) as pipe:
        first = [PrefillRequest(f"base-{seed}", tuple(base), GREEDY, session_id="S")]
        outs, logits = _serve(pipe, first)
        _assert_bitwise(det_ref, first, outs, logits, "cold")
        assert {c.num_tokens for c in pipe.prefill.cache.checkpoints()} >= {128, 256, 384, 512}
        for d in (128, 256, 384, 512):
            tail = random_prompt(70, 9100 + 10 * seed + d)
            req = [PrefillRequest(f"hit{d}-{seed}", tuple(base[:d] + tail), _seeded(seed) if d % 256 else GREEDY,
                                  session_id="S")]
            outs, logits = _serve(pipe, req)
            assert outs[req[0].request_id].cached_tokens == d
            _assert_bitwise(det_ref, req, outs, logits, f"hit at {d}")


@pytest.mark.parametrize("size", [1, 7, 32])
def test_batch_compositions_give_the_reference_bits(tiny_ckpt, det_ref, size):
    g = torch.Generator().manual_seed(size)
    lengths = torch.randint(1, 120, (size,), generator=g).tolist()
    reqs = _requests(lengths, size, f"n{size}")
    pools = PoolConfig(kda_slots=40, mla_pages=160)
    with LocalPipeline(tiny_ckpt, prefill=PrefillConfig(pools), numerics=DETERMINISTIC) as pipe:
        outs, logits = _serve(pipe, reqs, together=True)
    _assert_bitwise(det_ref, reqs, outs, logits, f"batch of {size}")


@pytest.mark.parametrize("p,d", [(1, 1), (2, 1), (1, 2), (4, 2)])
def test_prefill_tp_to_decode_tp_gives_the_reference_bits(tiny_ckpt, det_ref, p, d):
    reqs = [r for s in SEEDS for r in _requests([1, 130, 200], s, f"tp{p}{d}-s{s}")]
    with LocalPipeline(tiny_ckpt, prefill_tp=p, decode_tp=d, numerics=DETERMINISTIC) as pipe:
        outs, logits = _serve(pipe, reqs)
    _assert_bitwise(det_ref, reqs, outs, logits, f"P={p} D={d}")


@pytest.mark.parametrize("seed", SEEDS)
def test_resume_replays_streamed_tokens_through_decode_bit_for_bit(tiny_ckpt, det_ref, seed):
    """A failover resume (prompt + the k tokens already streamed, as the router resubmits it), split by the
    front in deterministic mode: the prompt is prefilled, the k tokens replayed by decode steps (not streamed
    again), and the remaining tokens and their logits are the uninterrupted reference's bits."""
    from k3serve.cluster.front import split_resumed

    prompt = random_prompt(140, 9500 + seed)
    n, k = 8, 3
    for params in (SamplingParams(max_tokens=n, ignore_eos=True), _seeded(seed).with_max_tokens(n)):
        ref = det_ref(prompt, params)
        resubmitted = tuple(prompt) + tuple(ref.token_ids[:k])
        head, replay = split_resumed(resubmitted, k, DETERMINISTIC)
        assert head == tuple(prompt) and replay == tuple(ref.token_ids[:k])
        req = PrefillRequest(f"resume-{seed}-{params.greedy}", head, params.with_max_tokens(n - k),
                             replay_ids=replay)
        with LocalPipeline(tiny_ckpt, numerics=DETERMINISTIC) as pipe:
            outs, logits = _serve(pipe, [req])
            assert pipe.decode.slots.num_used == 0 and pipe.decode.pages.num_used == 0
        assert outs[req.request_id].error is None
        assert outs[req.request_id].token_ids == list(ref.token_ids[k:])
        # recorded: prefill's last logits (unused: the first token is replayed), then one row per decode step;
        # the rows that chose new tokens are the last n - k
        got = logits[req.request_id][-(n - k):]
        for i, (a, b) in enumerate(zip(got, ref.logits[k:])):
            assert torch.equal(a, b), f"new token {i}: logits differ by {float((a - b).abs().max()):.3g}"
