"""The Mooncake plane across processes: prefill -> decode through the engines' real path (SendState on the
prefill ranks' hooks, the engine writing into the decode ranks' registered staging, InstallStaged), and killed
receivers / senders. Greedy decode after the transfer equals the single-process reference."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from transfer_helpers import make_spec, random_state
from k3serve.bench.transfer_faults import SenderFaults
from k3serve.bench.transfer_procs import ReceiverProc, SenderProc, SendJob
from k3serve.contracts.handoff import StagedState
from k3serve.contracts.requests import PrefillRequest
from k3serve.contracts.sampling import SamplingParams
from k3serve.decode.engine import DecodeConfig, DecodeEngine
from k3serve.engine.block_hash import model_fingerprint
from k3serve.engine.executor import WorkerSpec, make_executor
from k3serve.engine.ops import ExportState, PoolConfig
from k3serve.model.checkpoint import load_config
from k3serve.model.reference import reference_generate
from k3serve.prefill.engine import PrefillConfig, PrefillEngine
from k3serve.transfer.chunks import stream_plan
from k3serve.transfer.client import ReceiverClient
from k3serve.transfer.mooncake.plane import MooncakeConfig, mooncake_available
from k3serve.transfer.plan import reshard_kda
from k3serve.transfer.receiver import ReceiverConfig
from k3serve.transfer.sender import SendResult, TransferFailed
from k3serve.transfer.wire import byte_view, crc32c

pytestmark = pytest.mark.skipif(bool(mooncake_available()), reason=mooncake_available() or "available")

MC = MooncakeConfig(staging_bytes=8 << 20, send_bytes=8 << 20, quarantine_s=0.5, batch_bytes=64 << 10)
POOLS = PoolConfig(kda_slots=4, mla_pages=32)
PARAMS = SamplingParams(max_tokens=5, ignore_eos=True)
PROMPT = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(11)).tolist()


def _capturing_channel():
    """MooncakeChannel that also reads the prefill ranks' state (ExportState, in process) right before it is sent:
    what the decode pools must hold after install, resharded."""
    from k3serve.transfer.mooncake.hooks import MooncakeChannel

    class Capturing(MooncakeChannel):
        exported: list = []

        def export(self, executor, request_id, slot, block_table, num_tokens):
            self.exported.append(executor.run(ExportState(slot, block_table, num_tokens)))
            return super().export(executor, request_id, slot, block_table, num_tokens)

    return Capturing


@pytest.mark.parametrize("p,d", [(2, 1), (1, 2)])
def test_engines_over_mooncake_install_the_reshard_and_decode_like_the_reference(p, d, tiny_ckpt, tiny_model, auth):
    from k3serve.transfer.mooncake.hooks import MooncakeReceiverHooks, MooncakeSendHooks

    cfg = load_config(tiny_ckpt)
    reference = reference_generate(tiny_model, PROMPT, PARAMS).token_ids
    prefill_ex = make_executor(WorkerSpec(tiny_ckpt, p, POOLS, hooks=MooncakeSendHooks(MC)))
    decode_ex = make_executor(WorkerSpec(tiny_ckpt, d, POOLS, hooks=MooncakeReceiverHooks(ReceiverConfig(auth), MC)))
    try:
        endpoints = tuple(decode_ex.ready)
        channel = _capturing_channel()("mc", cfg, endpoints, auth.secret, p, d, POOLS.page_size, chunk_bytes=8192)
        prefill = PrefillEngine(cfg, prefill_ex, PrefillConfig(POOLS), model_fingerprint(cfg.to_hf_dict()), channel)
        decode = DecodeEngine(cfg, decode_ex, DecodeConfig(POOLS), channel)
        prefill.add_request(PrefillRequest("r-mc", tuple(PROMPT), PARAMS))
        (h,) = prefill.run_to_completion()
        assert isinstance(h.state, StagedState) and h.state.nbytes > 0
        with ReceiverClient(endpoints, auth) as client:
            assert [s.state for s in client.status(h.transfer_id)] == ["verified"] * d
        decode.submit(h)
        run = decode.running[h.request_id]
        got = decode_ex.run(ExportState(run.slot, tuple(run.pages[:-(-h.num_tokens // POOLS.page_size)]),
                                        h.num_tokens))
        tokens = [h.first_token]
        while decode.has_work:
            for ev in decode.step():
                tokens += ev.token_ids
        assert tokens == reference
        assert decode.slots.num_used == 0 and decode.pages.num_used == 0
        with ReceiverClient(endpoints, auth) as client:
            assert all(s.staged_transfers == 0 and s.state == "installed" for s in client.status(h.transfer_id))
        (sent,) = channel.exported
        want = reshard_kda([k for k, _ in sent], d)
        for r, (kda, mla) in enumerate(got):
            assert torch.equal(kda, want[r]) and torch.equal(mla, sent[0][1])
    finally:
        decode_ex.close()
        prefill_ex.close()


def _send_procs(procs, jobs):
    for proc, job in zip(procs, jobs):
        proc.post("send", job)
    return [proc.wait(60) for proc in procs]


def _wait(pred, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def test_killed_receiver_fails_cleanly_then_a_new_transfer_succeeds(auth, fast_sender):
    parts, mla = random_state(1, seed=7)
    config = ReceiverConfig(auth)
    rx = [ReceiverProc(config.for_rank(r, 2), MC) for r in range(2)]
    tx = SenderProc()
    try:
        tx.call("load", "s", parts[0], mla)
        spec = make_spec("mc-kill-rx-1", parts, mla, 2)
        stall = SenderFaults(stall_after_chunks=2, stall_s=3.0, dst_ranks=frozenset({1}))
        tx.post("send", SendJob(spec, 0, tuple(p.endpoint for p in rx), fast_sender, "s", stall, mooncake=MC))
        _wait(lambda: rx[1].call("counters").chunks >= 2, "rank 1 to receive two chunks")
        rx[1].kill()  # mid-stream
        failed = tx.wait(60)
        assert failed.code in ("UNAVAILABLE", "CANCELLED"), failed
        assert rx[0].call("occupancy") == (0, 0) and rx[0].call("status", spec.transfer_id) == "cancelled"
        assert rx[0].call("region_used") == 0
        rx[1] = ReceiverProc(config.for_rank(1, 2), MC)  # the driver replaces the rank, sends under a new id
        spec2 = make_spec("mc-kill-rx-2", parts, mla, 2)
        (ok,) = _send_procs([tx], [SendJob(spec2, 0, tuple(p.endpoint for p in rx), fast_sender, "s", mooncake=MC)])
        assert isinstance(ok, SendResult) and ok.verified_ranks == {0, 1}
        want = reshard_kda(parts, 2)
        for rank, p in enumerate(rx):
            assert p.call("digest", spec2.transfer_id) == (crc32c(byte_view(want[rank])), crc32c(byte_view(mla)))
            assert p.call("occupancy") == (0, 0) and p.call("region_used") == 0 and p.call("registrations") == 1
    finally:
        tx.close()
        for p in rx:
            p.close()


def test_killed_sender_is_replaced_and_the_transfer_completes(auth, fast_sender):
    from k3serve.transfer.buffers import RegionBuffers
    from k3serve.transfer.mooncake.plane import DataPlane
    from k3serve.transfer.receiver import TransferReceiver

    parts, mla = random_state(2, seed=8)
    planes = [DataPlane(MC) for _ in range(2)]
    regions = [RegionBuffers(MC.staging_bytes, quarantine_s=MC.quarantine_s) for _ in range(2)]
    for plane, region in zip(planes, regions):
        plane.register(region)
    rx = [TransferReceiver(ReceiverConfig(auth).for_rank(r, 2), region=regions[r], segment=planes[r].segment)
          for r in range(2)]
    eps = tuple(x.endpoint for x in rx)
    spec = make_spec("mc-kill-tx", parts, mla, 2)
    procs = [SenderProc() for _ in range(2)]
    try:
        for r, p in enumerate(procs):
            p.call("load", "s", parts[r], mla)
        procs[0].post("send", SendJob(spec, 0, eps, fast_sender, "s", mooncake=MC))
        procs[1].post("send", SendJob(spec, 1, eps, fast_sender, "s",
                                      faults=SenderFaults(stall_after_chunks=2, stall_s=30.0), mooncake=MC))
        assert isinstance(procs[0].wait(), SendResult)
        rank0_chunks = len(stream_plan(spec, 0, 0))  # then rank 1's first two (it stalls after them)
        _wait(lambda: rx[0].store.counters.chunks >= rank0_chunks + 2, "rank 1's stream to start")
        procs[1].kill()  # mid-stream: prefill rank 1's share is incomplete everywhere
        assert [x.store.status(spec.transfer_id) for x in rx] == ["receiving"] * 2
        procs[1] = SenderProc()  # a replacement re-sends its share under the same transfer id
        procs[1].call("load", "s", parts[1], mla)
        res = procs[1].call("send", SendJob(spec, 1, eps, fast_sender, "s", mooncake=MC), timeout=60)
        assert isinstance(res, SendResult) and res.verified_ranks == {0, 1}
        want = reshard_kda(parts, 2)
        for rank, x in enumerate(rx):
            st = x.store.take(spec.transfer_id)
            assert torch.equal(st.kda, want[rank]) and torch.equal(st.mla, mla)
            x.store.recycle(st)
            assert x.store.occupancy() == (0, 0) and regions[rank].used_bytes == 0
    finally:
        for p in procs:
            p.close()
        for x, plane in zip(rx, planes):
            x.stop(0)
            plane.close()
