"""Acceptance: prefill(P) -> gRPC on loopback -> decode(D), receivers and senders in their own processes.

The state installed in the decode pools is byte-identical to the in-process reshard_kda of the same handoff,
and greedy decode from it equals the single-process reference.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from k3serve.decode.engine import DecodeConfig, DecodeEngine
from k3serve.engine.block_hash import model_fingerprint, prefix_key
from k3serve.engine.executor import WorkerSpec, make_executor
from k3serve.engine.ops import ExportState, PoolConfig
from k3serve.contracts.handoff import StagedState
from k3serve.contracts.requests import PrefillRequest
from k3serve.contracts.sampling import SamplingParams
from k3serve.model.checkpoint import load_config
from k3serve.prefill.engine import PrefillConfig, PrefillEngine
from k3serve.transfer.client import ReceiverClient
from k3serve.transfer.handoff_send import GrpcChannel
from k3serve.transfer.decode_host import ReceivingExecutor
from k3serve.transfer.plan import reshard_kda
from benchmarks.transfer_procs import SenderProc, SendJob
from k3serve.transfer.receiver import ReceiverConfig
from k3serve.transfer.sender import SendResult
from k3serve.transfer.spec import StateGeometry, TransferSpec
from tests.exactness import compare

PAIRS = [(1, 1), (2, 1), (1, 2), (2, 4), (4, 2), (4, 1)]
PARAMS = SamplingParams(max_tokens=5, ignore_eos=True)
PROMPT = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(11)).tolist()
POOLS = PoolConfig(kda_slots=4, mla_pages=32)


@pytest.fixture(scope="module")
def handoffs(tiny_ckpt):
    """A real prefill handoff for each prefill TP."""
    cfg, out = load_config(tiny_ckpt), {}
    for p in sorted({p for p, _ in PAIRS}):
        ex = make_executor(WorkerSpec(tiny_ckpt, p, POOLS))
        try:
            eng = PrefillEngine(cfg, ex, PrefillConfig(POOLS), prefix_key(model_fingerprint(cfg.to_hf_dict()), ""))
            eng.add_request(PrefillRequest(f"req-p{p}", tuple(PROMPT), PARAMS))
            (out[p],) = eng.run_to_completion()
        finally:
            ex.close()
    return out


@pytest.fixture(scope="module")
def reference(tiny_refs):
    """The reference trace of PROMPT (tests/exactness.py)."""
    return tiny_refs.trace(PROMPT, PARAMS)


@pytest.fixture(scope="module")
def senders():
    procs = [SenderProc() for _ in range(max(p for p, _ in PAIRS))]
    yield procs
    for s in procs:
        s.close()


@pytest.fixture(scope="module")
def decode_groups(tiny_ckpt, auth):
    """d -> (ReceivingExecutor, DecodeEngine), made on first use."""
    cfg, groups = load_config(tiny_ckpt), {}

    def get(d: int):
        if d not in groups:
            ex = ReceivingExecutor(WorkerSpec(tiny_ckpt, d, POOLS), ReceiverConfig(auth))
            channel = GrpcChannel("acc", cfg, ex.endpoints, auth.secret, 1, d, POOLS.page_size)
            groups[d] = (ex, DecodeEngine(cfg, ex, DecodeConfig(POOLS), channel))
        return groups[d]

    yield get
    for ex, _ in groups.values():
        ex.close()


@pytest.mark.parametrize("p,d", PAIRS)
def test_grpc_transfer_is_byte_identical_and_decodes_like_the_reference(
        p, d, handoffs, reference, senders, decode_groups, auth, fast_sender):
    h = handoffs[p]
    ex, engine = decode_groups(d)
    tid = f"acc-{p}-{d}"
    spec = TransferSpec(tid, h.request_id, StateGeometry.of_state(h.kda, h.mla), p, d, page_tokens=64,
                        chunk_bytes=8192)
    for r in range(p):
        senders[r].call("load", f"p{p}", h.kda[r], h.mla)
    for r in range(p):
        senders[r].post("send", SendJob(spec, r, ex.endpoints, fast_sender, f"p{p}", layerwise=(r % 2 == 0)))
    results = [senders[r].wait() for r in range(p)]
    assert all(isinstance(res, SendResult) for res in results), results
    assert set().union(*(res.verified_ranks for res in results)) == set(range(d))

    with ReceiverClient(ex.endpoints, auth) as client:
        assert [s.state for s in client.status(tid)] == ["verified"] * d
        engine.submit(replace(h, state=StagedState(tid)))
        run = engine.running[h.request_id]
        n_pages = -(-h.num_tokens // POOLS.page_size)
        exported = ex.run(ExportState(run.slot, tuple(run.pages[:n_pages]), h.num_tokens))
        want = reshard_kda(list(h.kda), d)
        for r, (kda, mla) in enumerate(exported):
            assert torch.equal(kda, want[r]), f"decode rank {r}: KDA differs from reshard_kda"
            assert torch.equal(mla, h.mla), f"decode rank {r}: MLA rows differ"
        tokens = [h.first_token]
        while engine.has_work:
            for ev in engine.step():
                tokens += ev.token_ids
        compare(reference, tokens, label=f"P={p} D={d}")
        assert engine.slots.num_used == 0 and engine.pages.num_used == 0
        assert all(s.staged_transfers == 0 and s.staged_bytes == 0 and s.state == "installed"
                   for s in client.status(tid))
