"""Numerics mode ``deterministic`` with speculative decoding (issue #18, point 1): the verify forward runs the
deterministic operators, so every verify row whose window agrees with the reference has the plain
deterministic decode step's logits bit for bit (``torch.equal``), the state after verify + commit is the plain
decode state (every later logit still equal), and drafts are accepted (a non-zero count: a test that rejected
every draft would pass the token check trivially).

The reference is the deterministic reference generator (a TP=1 model built with DETERMINISTIC); the serving
paths run through the real engines; the executors' outputs are recorded on the way (the recorder only keeps
what the real executor returns).
"""

from __future__ import annotations

import pytest
import torch

from k3serve.contracts.numerics import DETERMINISTIC
from k3serve.contracts.requests import PrefillRequest
from k3serve.contracts.sampling import SamplingParams
from k3serve.disagg.pipeline import LocalPipeline
from k3serve.engine.ops import DecodeBatch, PrefillChunk, VerifyBatch
from k3serve.engine.spec.config import SpecConfig
from k3serve.engine.spec.ngram import NgramConfig
from k3serve.model.loader import load_model
from k3serve.model.reference import reference_generate

from tests.spec.drafters import ScriptedDrafter, spec_prompt

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_k=40, seed=5, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def cases(tiny_ckpt):
    """(request id, prompt, params, deterministic reference with its logits)."""
    model = load_model(tiny_ckpt, numerics=DETERMINISTIC)
    out = []
    for i, (n, rep) in enumerate([(7, True), (40, False)]):
        prompt = spec_prompt(n, 400 + i, rep)
        for name, params in (("greedy", GREEDY), ("seeded", SEEDED)):
            out.append((f"{name}-{i}", prompt, params, reference_generate(model, list(prompt), params,
                                                                          keep_logits=True)))
    return out


class Recorder:
    """Wraps the decode group's real executor: keeps (start position, window, logits `[T, vocab]`) of every
    VerifyBatch row and the logits of every DecodeBatch row, by the slot's request id."""

    def __init__(self, inner, owner) -> None:
        self.inner, self.owner, self.tp = inner, owner, inner.tp
        self.verify: dict[str, list[tuple[int, tuple[int, ...], torch.Tensor]]] = {}
        self.decode: dict[str, list[tuple[int, torch.Tensor]]] = {}

    def run(self, op):
        out = self.inner.run(op)
        if isinstance(op, VerifyBatch):
            for i, slot in enumerate(op.slots):
                self.verify.setdefault(self.owner(slot), []).append((op.starts[i], op.token_ids[i], out[0][0][i]))
        elif isinstance(op, DecodeBatch):
            for i, slot in enumerate(op.slots):
                self.decode.setdefault(self.owner(slot), []).append((op.starts[i], out[0][i]))
        return out

    def run_each(self, ops):
        return self.inner.run_each(ops)

    def close(self):
        self.inner.close()


def _serve_and_check(pipe: LocalPipeline, cases) -> tuple[int, int]:
    """Serve every case; assert tokens equal and every comparable logit row `torch.equal` to the reference.
    Returns (verify rows compared, draft rows among them)."""
    dec = Recorder(pipe.decode.executor,
                   lambda slot: next(rid for rid, r in pipe.decode.running.items() if r.slot == slot))
    pipe.decode.executor = dec
    try:
        outs = pipe.generate([PrefillRequest(rid, prompt, params) for rid, prompt, params, _ in cases])
    finally:
        pipe.decode.executor = dec.inner
    compared = drafted_rows = 0
    for rid, prompt, params, ref in cases:
        out = outs[rid]
        assert out.error is None, out.error
        assert out.token_ids == ref.token_ids, f"{rid}: tokens differ"
        # token j sits at position len(prompt) + j; a row at position p predicts token p - len(prompt) + 1
        for start, window, rows in dec.verify.get(rid, []):
            j = start - len(prompt)
            for i in range(len(window)):
                # row i is comparable while the window's drafts 1..i are the reference's tokens
                if j + 1 + i >= len(ref.logits) or tuple(window[1: i + 1]) != tuple(ref.token_ids[j + 1: j + 1 + i]):
                    break
                assert torch.equal(rows[i], ref.logits[j + 1 + i]), (
                    f"{rid}: verify row {i} at position {start + i} differs by "
                    f"{float((rows[i] - ref.logits[j + 1 + i]).abs().max()):.3g}")
                compared += 1
                drafted_rows += i > 0
        for start, row in dec.decode.get(rid, []):
            j = start - len(prompt)
            assert torch.equal(row, ref.logits[j + 1]), f"{rid}: decode step at position {start} differs"
    assert pipe.decode.slots.num_used == 0 and pipe.decode.pages.num_used == 0
    return compared, drafted_rows


# both k in one process, the prefill TP 2 -> decode TP 1 resharding at k = 3 (k changes only the window)
PDK = [(1, 1, 1), (1, 1, 3), (2, 1, 3)]


@pytest.mark.parametrize("p,d,k", PDK)
def test_scripted_drafts_are_accepted_and_bitwise(tiny_ckpt, cases, p, d, k):
    scripts = {prompt: ref.token_ids[1:] for _, prompt, _, ref in cases}  # token 0 comes from prefill
    with LocalPipeline(tiny_ckpt, prefill_tp=p, decode_tp=d, speculative=SpecConfig(num_draft_tokens=k),
                       drafter=ScriptedDrafter(scripts, wrong_every=3), numerics=DETERMINISTIC) as pipe:
        compared, drafted_rows = _serve_and_check(pipe, cases)
        usage = pipe.decode.spec_usage
    # right drafts are accepted (bitwise-equal verify rows), wrong ones rejected
    assert 0 < usage.accepted_tokens < usage.drafted_tokens, usage
    assert drafted_rows >= usage.accepted_tokens > 0


NGRAM = NgramConfig(min_n=1, max_n=3)


@pytest.fixture(scope="module")
def ngram_cases(tiny_ckpt):
    """Greedy cases whose reference continuation the n-gram drafter predicts at least once (the random tiny
    model rarely repeats itself): at each context length the engine visits without a prior acceptance it
    drafts, so a predicted token there means a non-zero accepted count. Chosen among fixed candidates by the
    real NgramSession on the reference's own context."""
    from k3serve.engine.spec.ngram import NgramSession

    model = load_model(tiny_ckpt, numerics=DETERMINISTIC)
    params = GREEDY.with_max_tokens(16)
    candidates = [tuple(b"def add(a, b):\n    return a + b\n\ndef add(a, b):\n"), tuple(b"for i in range(n):\n" * 3)]
    candidates += [spec_prompt(8, 500 + s, True) for s in range(4)]
    out = []
    for i, prompt in enumerate(candidates):
        ref = reference_generate(model, list(prompt), params, keep_logits=True)
        ctx = list(prompt) + ref.token_ids
        session = NgramSession(NGRAM)
        hits = sum(session.propose(ctx[: len(prompt) + j], 1).tokens[:1] == (ctx[len(prompt) + j],)
                   for j in range(1, len(ref.token_ids)))
        if hits:
            out.append((f"ngram-{i}", prompt, params, ref))
    assert out, "no candidate prompt has a continuation the n-gram drafter predicts: add candidates"
    return out


@pytest.mark.parametrize("p,d,k", PDK)
def test_ngram_drafts_are_accepted_and_bitwise(tiny_ckpt, cases, ngram_cases, p, d, k):
    spec = SpecConfig(num_draft_tokens=k, ngram=NGRAM)
    with LocalPipeline(tiny_ckpt, prefill_tp=p, decode_tp=d, speculative=spec, numerics=DETERMINISTIC) as pipe:
        _serve_and_check(pipe, cases + ngram_cases)
        usage = pipe.decode.spec_usage
    assert usage.verify_steps > 0 and usage.accepted_tokens > 0, usage


@pytest.fixture(scope="module")
def drafter_dir(tiny_ckpt, tmp_path_factory):
    from k3serve.model.checkpoint import load_config
    from k3serve.model.eagle3.config import DrafterConfig
    from k3serve.model.eagle3.weights import init_drafter_weights, save_drafter
    from k3serve.model.loader import load_weights

    cfg = DrafterConfig.for_target(load_config(tiny_ckpt), window=8)
    return str(save_drafter(cfg, init_drafter_weights(cfg, load_weights(tiny_ckpt)), tmp_path_factory.mktemp("d")))


@pytest.mark.parametrize("p,d,k", PDK)
def test_eagle3_drafts_are_bitwise(tiny_ckpt, cases, drafter_dir, p, d, k):
    """EAGLE-3 (an untrained drafter: its drafts are rarely right, so acceptance is pinned by the tests above);
    the verify rows it produces and the captured features feed the same bitwise checks."""
    spec = SpecConfig(method="eagle3", num_draft_tokens=k, drafter_dir=drafter_dir)
    with LocalPipeline(tiny_ckpt, prefill_tp=p, decode_tp=d, speculative=spec, numerics=DETERMINISTIC) as pipe:
        compared, _ = _serve_and_check(pipe, cases)
        usage = pipe.decode.spec_usage
    assert usage.verify_steps > 0 and usage.drafted_tokens > 0 and compared >= usage.verify_steps, usage


@pytest.mark.parametrize("k", [1, 3])
def test_verify_commit_state_is_plain_deterministic_decode_bit_for_bit(tiny_ckpt, k):
    """Model level (as tests/spec/test_verify_state.py, without its tolerances): from one prefilled state, n
    plain deterministic decode steps and one verify of x_0..x_k + a commit of n give equal KDA blocks (state
    and conv windows), equal MLA latent rows and equal logits, bit for bit, for every n in 0..k+1."""
    from k3serve.engine.ops import CommitBatch, CopySlot, PoolConfig, PrefillChunk
    from k3serve.engine.worker import ModelWorker

    worker = ModelWorker(load_model(tiny_ckpt, numerics=DETERMINISTIC),
                         PoolConfig(kda_slots=4, mla_pages=8, page_size=16, spec_slots=2, spec_tokens=8))
    g = torch.Generator().manual_seed(k)
    n_prompt = 37
    prompt = torch.randint(0, 256, (n_prompt,), generator=g).tolist()
    window = torch.randint(0, 256, (k + 1,), generator=g).tolist()
    table = (0, 1, 2, 3)
    worker.execute(PrefillChunk(0, tuple(prompt), 0, table, want_logits=False))
    worker.execute(CopySlot(0, 2))  # pristine committed state
    snaps, plain = [worker.kda_store[0].clone()], []
    for t, tok in enumerate(window):
        plain.append(worker.execute(DecodeBatch((0,), (tok,), (n_prompt + t,), (table,)))[0])
        snaps.append(worker.kda_store[0].clone())
    latent_plain = worker.page_store.clone()
    worker.execute(CopySlot(2, 1))
    logits, _ = worker.execute(VerifyBatch((1,), (0,), (tuple(window),), (n_prompt,), (table,)))
    assert torch.equal(logits[0], torch.stack(plain))
    assert torch.equal(worker.page_store, latent_plain)  # the verify rewrote the same rows with the same bits
    for n in range(k + 2):
        worker.execute(CopySlot(2, 1))
        worker.execute(CommitBatch((1,), (0,), (n,), k + 1))
        assert torch.equal(worker.kda_store[1], snaps[n]), f"k={k} n={n}"
