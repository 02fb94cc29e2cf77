"""The Mooncake plane across processes: prefill -> decode through the engines' real path (SendState on the
prefill ranks' hooks, the engine writing into the decode ranks' registered staging, InstallStaged), and killed
receivers / senders. Greedy decode after the transfer equals the single-process reference."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
import torch

from transfer_helpers import make_spec, random_state
from benchmarks.transfer_faults import SenderFaults
from benchmarks.transfer_procs import ReceiverProc, SenderProc, SendJob
from k3serve.contracts.handoff import StagedState
from k3serve.contracts.requests import PrefillRequest
from k3serve.contracts.sampling import SamplingParams
from k3serve.decode.engine import DecodeConfig, DecodeEngine
from k3serve.engine.block_hash import model_fingerprint, prefix_key
from k3serve.engine.executor import WorkerSpec, make_executor
from k3serve.engine.ops import ExportState, PoolConfig
from k3serve.model.checkpoint import load_config
from k3serve.model.reference import reference_generate
from k3serve.prefill.engine import PrefillConfig, PrefillEngine
from k3serve.transfer.chunks import stream_plan
from k3serve.transfer.client import ReceiverClient
from k3serve.transfer.mooncake.plane import MooncakeConfig
from k3serve.transfer.plan import reshard_kda
from k3serve.transfer.receiver import ReceiverConfig
from k3serve.transfer.sender import SendResult, TransferFailed
from k3serve.transfer.wire import byte_view, crc32c

pytestmark = pytest.mark.usefixtures("mooncake_plane")  # tests/conftest.py: skip, or an error

MC = MooncakeConfig(staging_bytes=8 << 20, send_bytes=8 << 20, quarantine_s=0.5, batch_bytes=64 << 10,
                     listen_any=True)
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
        key = prefix_key(model_fingerprint(cfg.to_hf_dict()), "")
        prefill = PrefillEngine(cfg, prefill_ex, PrefillConfig(POOLS), key, channel)
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


@pytest.fixture(scope="module")
def local():
    """In-process data planes: local.receiver(rank, d) and local.send(...) in a thread; closed after the module."""
    from k3serve.transfer.buffers import RegionBuffers
    from k3serve.transfer.mooncake.plane import DataPlane
    from k3serve.transfer.receiver import TransferReceiver

    class Local:
        def __init__(self) -> None:
            self.plane, self.region = DataPlane(MC), RegionBuffers(MC.send_bytes, quarantine_s=0.0)
            self.made: list[tuple] = []

        def receiver(self, auth, rank: int, d: int) -> TransferReceiver:
            plane, region = DataPlane(MC), RegionBuffers(MC.staging_bytes, quarantine_s=MC.quarantine_s)
            plane.register(region)
            rx = TransferReceiver(ReceiverConfig(auth).for_rank(rank, d), region=region, segment=plane.segment)
            self.made.append((rx, plane))
            return rx

        def send(self, rank, endpoints, spec, kda, mla, config, faults=None) -> list:
            """Starts sending in a thread; the returned list gets the SendResult or TransferFailed."""
            from k3serve.transfer.mooncake.sender import MooncakeSender

            out: list = []

            def run() -> None:
                with MooncakeSender(rank, endpoints, config, self.plane, self.region, faults, MC.batch_bytes) as s:
                    try:
                        out.append(s.send(spec, kda, mla))
                    except TransferFailed as e:
                        out.append(e)

            t = threading.Thread(target=run)
            t.start()
            out.append(t)
            return out

    made = Local()
    yield made
    for rx, plane in made.made:
        rx.stop(0)
        plane.close()
    made.plane.close()


def _result(pending: list, timeout: float = 60.0):
    pending[0].join(timeout)
    assert len(pending) == 2, "the sender did not finish"
    return pending[1]


def _wait(pred, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def test_killed_receiver_fails_cleanly_then_a_new_transfer_succeeds(auth, fast_sender, local):
    parts, mla = random_state(1, seed=7)
    config = ReceiverConfig(auth)
    rx0, rx1 = local.receiver(auth, 0, 2), ReceiverProc(config.for_rank(1, 2), MC)
    try:
        spec = make_spec("mc-kill-rx-1", parts, mla, 2)
        stall = SenderFaults(stall_after_chunks=2, stall_s=3.0, dst_ranks=frozenset({1}))
        pending = local.send(0, (rx0.endpoint, rx1.endpoint), spec, parts[0], mla, fast_sender, stall)
        _wait(lambda: rx1.call("counters").chunks >= 2, "rank 1 to receive two chunks")
        rx1.kill()  # mid-stream
        failed = _result(pending)
        assert isinstance(failed, TransferFailed) and failed.code in ("UNAVAILABLE", "CANCELLED"), failed
        assert rx0.store.occupancy() == (0, 0) and rx0.store.status(spec.transfer_id) == "cancelled"
        assert rx0.store.region.used_bytes == 0 and local.region.used_bytes == 0
        rx1 = ReceiverProc(config.for_rank(1, 2), MC)  # the driver replaces the rank, sends under a new id
        spec2 = make_spec("mc-kill-rx-2", parts, mla, 2)
        ok = _result(local.send(0, (rx0.endpoint, rx1.endpoint), spec2, parts[0], mla, fast_sender))
        assert isinstance(ok, SendResult) and ok.verified_ranks == {0, 1}
        want = reshard_kda(parts, 2)
        st = rx0.store.take(spec2.transfer_id)
        assert torch.equal(st.kda, want[0]) and torch.equal(st.mla, mla)
        rx0.store.recycle(st)
        assert rx1.call("digest", spec2.transfer_id) == (crc32c(byte_view(want[1])), crc32c(byte_view(mla)))
        assert rx1.call("occupancy") == (0, 0) and rx1.call("region_used") == 0 and rx1.call("registrations") == 1
        assert rx0.store.region.used_bytes == 0
    finally:
        rx1.close()


def test_killed_sender_is_replaced_and_the_transfer_completes(auth, fast_sender, local):
    parts, mla = random_state(2, seed=8)
    rx = [local.receiver(auth, r, 2) for r in range(2)]
    eps = tuple(x.endpoint for x in rx)
    spec = make_spec("mc-kill-tx", parts, mla, 2)
    proc = SenderProc()  # prefill rank 1, in its own process so that it can be killed
    try:
        proc.call("load", "s", parts[1], mla)
        proc.post("send", SendJob(spec, 1, eps, fast_sender, "s",
                                  faults=SenderFaults(stall_after_chunks=2, stall_s=30.0), mooncake=MC))
        assert isinstance(_result(local.send(0, eps, spec, parts[0], mla, fast_sender)), SendResult)
        rank0_chunks = len(stream_plan(spec, 0, 0))  # then rank 1's first two (it stalls after them)
        _wait(lambda: rx[0].store.counters.chunks >= rank0_chunks + 2, "rank 1's stream to start")
        proc.kill()  # mid-stream: prefill rank 1's share is incomplete everywhere
        assert [x.store.status(spec.transfer_id) for x in rx] == ["receiving"] * 2
        # a replacement for prefill rank 1 re-sends its share under the same transfer id
        res = _result(local.send(1, eps, spec, parts[1], mla, fast_sender))
        assert isinstance(res, SendResult) and res.verified_ranks == {0, 1}
        want = reshard_kda(parts, 2)
        for rank, x in enumerate(rx):
            st = x.store.take(spec.transfer_id)
            assert torch.equal(st.kda, want[rank]) and torch.equal(st.mla, mla)
            x.store.recycle(st)
            assert x.store.occupancy() == (0, 0) and x.store.region.used_bytes == 0
        assert local.region.used_bytes == 0
    finally:
        proc.close()
