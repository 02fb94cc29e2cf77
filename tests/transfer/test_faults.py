"""Injected faults end in a verified transfer after retry (identical bytes) or a clean failure; never a
half-installed state, never a leak: staging (and pools) are empty afterwards."""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import replace

import pytest
import torch

from transfer_helpers import make_spec, random_state, send_all
from k3serve.decode.engine import DecodeConfig, DecodeEngine
from k3serve.engine.block_hash import model_fingerprint, prefix_key
from k3serve.engine.executor import LocalExecutor, WorkerSpec
from k3serve.engine.ops import PoolConfig
from k3serve.contracts.handoff import StagedState
from k3serve.contracts.requests import PrefillRequest
from k3serve.contracts.sampling import SamplingParams
from k3serve.model.checkpoint import load_config
from k3serve.prefill.engine import PrefillConfig, PrefillEngine
from k3serve.transfer.chunks import stream_plan
from k3serve.transfer.client import ReceiverClient
from benchmarks.transfer_faults import SenderFaults
from k3serve.transfer.handoff_send import GrpcChannel
from k3serve.transfer.plan import reshard_kda
from benchmarks.transfer_procs import ReceiverProc, SenderProc, SendJob
from k3serve.transfer.decode_host import ReceiverHooks
from k3serve.transfer.receiver import ReceiverConfig, TransferReceiver
from k3serve.transfer.sender import SendResult, TransferFailed, TransferSender
from k3serve.transfer.spec import StateGeometry, TransferSpec
from k3serve.transfer.wire import byte_view, crc32c

RETRIED = {
    "drop": SenderFaults(drop_after_chunks=3),
    "corrupt": SenderFaults(corrupt_chunk=2),
    "delay": SenderFaults(stall_after_chunks=1, stall_s=4.0),
}
DELAY_DEADLINE_S = 2.0  # the stalled attempt runs past it; a clean attempt finishes well within it


def _send_all(endpoints, spec, parts, mla, config, faults):
    """Every prefill rank's sender in its own thread; results (SendResult or TransferFailed) in rank order."""
    return send_all(lambda r: TransferSender(r, endpoints, config, faults), spec, parts, mla)


def _assert_empty(rxs):
    for rx in rxs:
        assert rx.store.occupancy() == (0, 0)


@pytest.mark.parametrize("fault", sorted(RETRIED))
def test_fault_on_first_attempt_is_retried_to_identical_bytes(fault, receivers, fast_sender):
    config = dataclasses.replace(fast_sender, stream_timeout_s=DELAY_DEADLINE_S) if fault == "delay" else fast_sender
    parts, mla = random_state(2, seed=3)
    rxs = receivers(2)
    spec = make_spec(f"retry-{fault}", parts, mla, 2)
    results = _send_all([r.endpoint for r in rxs], spec, parts, mla, config, RETRIED[fault])
    assert all(isinstance(r, SendResult) for r in results), results
    assert all(s.attempts == 2 for r in results for s in r.streams)  # the first attempt failed, the second won
    want = reshard_kda(parts, 2)
    for rank, rx in enumerate(rxs):
        st = rx.store.take(spec.transfer_id)
        assert torch.equal(st.kda, want[rank]) and torch.equal(st.mla, mla)
    if fault == "corrupt":
        assert all(rx.store.counters.crc_failures >= 1 for rx in rxs)
    _assert_empty(rxs)


@pytest.mark.parametrize("fault,code", [("drop", "CANCELLED"), ("corrupt", "DATA_LOSS"),
                                        ("delay", "DEADLINE_EXCEEDED")])
def test_persistent_fault_fails_cleanly_and_frees_staging(fault, code, receivers, fast_sender):
    config = dataclasses.replace(fast_sender, stream_timeout_s=1.0, max_attempts=2)
    faults = dataclasses.replace(RETRIED[fault], attempts=0)  # every attempt
    parts, mla = random_state(2, seed=4)
    rxs = receivers(2)
    spec = make_spec(f"fail-{fault}", parts, mla, 2)
    results = _send_all([r.endpoint for r in rxs], spec, parts, mla, config, faults)
    assert all(isinstance(r, TransferFailed) for r in results), results
    assert any(r.code == code for r in results), [(r.code, r.message) for r in results]
    for rx in rxs:
        assert rx.store.status(spec.transfer_id) == "cancelled"
        with pytest.raises(Exception, match="not verified"):
            rx.store.take(spec.transfer_id)
    _assert_empty(rxs)
    # a late retry of the cancelled transfer is refused, not re-staged
    with TransferSender(0, [r.endpoint for r in rxs], fast_sender) as s:
        with pytest.raises(TransferFailed) as e:
            s.send(spec, parts[0], mla)
    assert e.value.code == "FAILED_PRECONDITION"
    _assert_empty(rxs)


def test_resent_stream_of_a_verified_transfer_is_acknowledged_not_reapplied(receivers, fast_sender):
    parts, mla = random_state(1, seed=5)
    (rx,) = receivers(1)
    spec = make_spec("dup", parts, mla, 1)
    with TransferSender(0, [rx.endpoint], fast_sender) as s:
        first = s.send(spec, parts[0], mla)
        applied = rx.store.counters.chunks
        again = s.send(spec, parts[0], mla)
        assert first.streams[0].state == "verified" and not first.streams[0].duplicate
        assert again.streams[0].duplicate and again.streams[0].chunks_applied == 0
        assert rx.store.counters.chunks == applied
        rx.store.take(spec.transfer_id)
        after_install = s.send(spec, parts[0], mla)
    assert after_install.streams[0].duplicate and after_install.streams[0].state == "installed"
    _assert_empty([rx])


def test_abandoned_transfer_expires(receivers, fast_sender):
    parts, mla = random_state(2, seed=6)
    rxs = receivers(1, ttl_s=0.3)
    spec = make_spec("abandoned", parts, mla, 1)
    with TransferSender(0, [rxs[0].endpoint], fast_sender) as s:  # only one of the two prefill ranks shows up
        (res,) = s.send(spec, parts[0], mla).streams
    assert res.state == "receiving" and rxs[0].store.occupancy()[0] == 1
    deadline = time.monotonic() + 5
    while rxs[0].store.occupancy() != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rxs[0].store.status(spec.transfer_id) == "expired"
    _assert_empty(rxs)


def test_retried_transfer_installs_and_decodes_like_the_reference(tiny_ckpt, tiny_refs, auth, fast_sender):
    """Drop + corrupt on the first attempt; the retried state goes into the pools via InstallStaged."""
    cfg, pools = load_config(tiny_ckpt), PoolConfig(kda_slots=2, mla_pages=16)
    prompt, params = list(range(40, 240)), SamplingParams(max_tokens=4, ignore_eos=True)
    prefill_ex = LocalExecutor(WorkerSpec(tiny_ckpt, 1, pools))
    # the decode rank is built with its receiver (hooks at construction), as a cluster's decode ranks are
    decode_ex = LocalExecutor(WorkerSpec(tiny_ckpt, 1, pools, hooks=ReceiverHooks(ReceiverConfig(auth))))
    prefill = PrefillEngine(cfg, prefill_ex, PrefillConfig(pools), prefix_key(model_fingerprint(cfg.to_hf_dict()), ""))
    prefill.add_request(PrefillRequest("r-install", tuple(prompt), params))
    (h,) = prefill.run_to_completion()
    (endpoint,), store = decode_ex.ready, decode_ex.worker.hooks.staging
    try:
        spec = TransferSpec("install-1", h.request_id, StateGeometry.of_state(h.kda, h.mla), 1, 1,
                            chunk_bytes=8192)
        with TransferSender(0, [endpoint], fast_sender, SenderFaults(drop_after_chunks=4, corrupt_chunk=1)) as s:
            res = s.send(spec, h.kda[0], h.mla)
        assert res.streams[0].attempts == 2 and res.verified_ranks == {0}
        channel = GrpcChannel("faults", cfg, (endpoint,), auth.secret, 1, 1, pools.page_size)
        engine = DecodeEngine(cfg, decode_ex, DecodeConfig(pools), channel)
        (first,) = engine.submit(replace(h, state=StagedState(spec.transfer_id)))
        assert store.occupancy() == (0, 0)  # installed: staging dropped
        out = [h.first_token]
        while engine.has_work:
            for ev in engine.step():
                out += ev.token_ids
        assert first.token_ids == (h.first_token,)
        tiny_refs.check(prompt, params, out, label="retried transfer")  # tests/exactness.py
        assert engine.slots.num_used == 0 and engine.pages.num_used == 0
        # installing a transfer that is not verified fails this request only, leaving nothing behind
        engine.submit(replace(h, state=StagedState("never-sent")))
        (failure,) = engine.take_failures()
        assert failure.code == "UNAVAILABLE" and "not verified" in failure.message
        assert engine.slots.num_used == 0 and engine.pages.num_used == 0 and store.occupancy() == (0, 0)
    finally:
        decode_ex.close()
        prefill_ex.close()


def _wait_receiving(proc: ReceiverProc, tid: str, chunks: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.call("status", tid) == "receiving" and proc.call("counters").chunks >= chunks:
            return
        time.sleep(0.02)
    raise AssertionError("the transfer never got going")


def test_killed_receiver_fails_cleanly_then_a_new_transfer_succeeds(auth, fast_sender):
    parts, mla = random_state(1, seed=7)
    config = ReceiverConfig(auth)
    rx = [ReceiverProc(config.for_rank(r, 2)) for r in range(2)]
    try:
        spec = make_spec("kill-rx-1", parts, mla, 2)
        stall = SenderFaults(stall_after_chunks=2, stall_s=3.0, dst_ranks=frozenset({1}))
        out: list[object] = []
        t = threading.Thread(target=lambda: out.extend(_send_all([p.endpoint for p in rx], spec, parts, mla,
                                                                 fast_sender, stall)))
        t.start()
        _wait_receiving(rx[1], spec.transfer_id, 2)
        rx[1].kill()  # mid-stream
        t.join(60)
        (failed,) = out
        assert isinstance(failed, TransferFailed) and failed.code in ("UNAVAILABLE", "CANCELLED")
        assert rx[0].call("occupancy") == (0, 0) and rx[0].call("status", spec.transfer_id) == "cancelled"
        # the driver replaces the rank and sends again under a new transfer id
        rx[1] = ReceiverProc(config.for_rank(1, 2))
        spec2 = make_spec("kill-rx-2", parts, mla, 2)
        (ok,) = _send_all([p.endpoint for p in rx], spec2, parts, mla, fast_sender, SenderFaults())
        assert isinstance(ok, SendResult) and ok.verified_ranks == {0, 1}
        want = reshard_kda(parts, 2)
        for rank, p in enumerate(rx):
            assert p.call("digest", spec2.transfer_id) == (crc32c(byte_view(want[rank])), crc32c(byte_view(mla)))
            assert p.call("occupancy") == (0, 0)
    finally:
        for p in rx:
            p.close()


def test_killed_sender_is_replaced_and_the_transfer_completes(receivers, fast_sender):
    parts, mla = random_state(2, seed=8)
    rxs = receivers(2)
    eps = tuple(r.endpoint for r in rxs)
    spec = make_spec("kill-tx", parts, mla, 2)
    procs = [SenderProc() for _ in range(2)]
    try:
        for r, p in enumerate(procs):
            p.call("load", "s", parts[r], mla)
        procs[0].post("send", SendJob(spec, 0, eps, fast_sender, "s"))
        procs[1].post("send", SendJob(spec, 1, eps, fast_sender, "s",
                                      faults=SenderFaults(stall_after_chunks=2, stall_s=30.0)))
        assert isinstance(procs[0].wait(), SendResult)
        deadline, rank0_chunks = time.monotonic() + 30, len(stream_plan(spec, 0, 0))
        while rxs[0].store.counters.chunks < rank0_chunks + 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        procs[1].kill()  # mid-stream: rank 1's part is incomplete everywhere
        assert all(rx.store.status(spec.transfer_id) == "receiving" for rx in rxs)
        # a replacement sender for prefill rank 1 re-sends its share under the same transfer id
        procs[1] = SenderProc()
        procs[1].call("load", "s", parts[1], mla)
        res = procs[1].call("send", SendJob(spec, 1, eps, fast_sender, "s"))
        assert isinstance(res, SendResult) and res.verified_ranks == {0, 1}
        want = reshard_kda(parts, 2)
        for rank, rx in enumerate(rxs):
            st = rx.store.take(spec.transfer_id)
            assert torch.equal(st.kda, want[rank]) and torch.equal(st.mla, mla)
        _assert_empty(rxs)
    finally:
        for p in procs:
            p.close()


def test_killed_sender_that_never_returns_is_cancelled_by_the_driver(receivers, fast_sender, auth):
    parts, mla = random_state(1, seed=9)
    rxs = receivers(2)
    eps = tuple(r.endpoint for r in rxs)
    spec = make_spec("kill-tx-cancel", parts, mla, 2)
    proc = SenderProc()
    try:
        proc.call("load", "s", parts[0], mla)
        proc.post("send", SendJob(spec, 0, eps, fast_sender, "s",
                                  faults=SenderFaults(stall_after_chunks=1, stall_s=30.0)))
        deadline = time.monotonic() + 30
        while sum(rx.store.occupancy()[0] for rx in rxs) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        proc.kill()
        with ReceiverClient(eps, auth) as client:
            assert client.cancel(spec.transfer_id) == [True, True]
            assert all(s.staged_transfers == 0 and s.state == "cancelled" for s in client.status(spec.transfer_id))
        _assert_empty(rxs)
    finally:
        proc.close()
