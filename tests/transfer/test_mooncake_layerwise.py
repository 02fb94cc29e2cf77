"""Layer-wise export on the Mooncake plane (transfer/mooncake/layerwise.py): a prompt's last chunk copies each
final layer into the prefill rank's registered send region and the engine writes it while later layers compute.

Prefill TP 2 (MooncakeSendHooks) -> decode TP 1 (MooncakeReceiverHooks): the installed state equals the one
exported after the forward, byte for byte; greedy decode from it equals the single-process reference; nothing
stays staged or held in the send region's ranges.
"""

from __future__ import annotations

import pytest
import torch

from k3serve.contracts.handoff import StagedState
from k3serve.contracts.requests import PrefillRequest
from k3serve.contracts.sampling import SamplingParams
from k3serve.decode.engine import DecodeConfig, DecodeEngine
from k3serve.engine.block_hash import model_fingerprint, prefix_key
from k3serve.engine.executor import WorkerSpec, make_executor
from k3serve.engine.ops import ExportState, PoolConfig
from k3serve.model.checkpoint import load_config
from k3serve.prefill.engine import PrefillConfig, PrefillEngine
from k3serve.transfer.mooncake.plane import MooncakeConfig
from k3serve.transfer.receiver import ReceiverConfig
from tests.exactness import compare

pytestmark = pytest.mark.usefixtures("mooncake_plane")  # tests/conftest.py: skip, or an error

MC = MooncakeConfig(staging_bytes=8 << 20, send_bytes=8 << 20, quarantine_s=0.5, batch_bytes=64 << 10,
                     listen_any=True)
PARAMS = SamplingParams(max_tokens=5, ignore_eos=True)
PROMPT = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(23)).tolist()
POOLS = PoolConfig(kda_slots=4, mla_pages=32)


def test_mooncake_layerwise_state_is_the_exported_state_and_decodes_like_the_reference(tiny_ckpt, tiny_refs, auth):
    from k3serve.transfer.mooncake.hooks import MooncakeChannel, MooncakeReceiverHooks, MooncakeSendHooks

    cfg = load_config(tiny_ckpt)
    pre = make_executor(WorkerSpec(tiny_ckpt, 2, POOLS, hooks=MooncakeSendHooks(MC)))
    dec = make_executor(WorkerSpec(tiny_ckpt, 1, POOLS, hooks=MooncakeReceiverHooks(ReceiverConfig(auth), MC)))
    try:
        channel = MooncakeChannel("mclw", cfg, tuple(dec.ready), auth.secret, 2, 1, POOLS.page_size,
                                  chunk_bytes=8192)
        assert channel.layerwise
        handoffs = {}
        for name, layerwise in (("on", True), ("off", False)):
            # 128-token chunks: the last chunk (tokens 256..299) is the one that streams
            engine = PrefillEngine(cfg, pre, PrefillConfig(POOLS, step_token_budget=128, enable_prefix_cache=False,
                                                           layerwise_export=layerwise),
                                   prefix_key(model_fingerprint(cfg.to_hf_dict()), ""), channel)
            engine.add_request(PrefillRequest(f"mclw-{name}", tuple(PROMPT), PARAMS))
            (handoffs[name],) = engine.run_to_completion()
            assert not engine.take_failures() and engine.slots.num_used == 0
        on, off = handoffs["on"], handoffs["off"]
        assert isinstance(on.state, StagedState) and on.state.nbytes == off.state.nbytes > 0
        assert on.first_token == off.first_token
        decode = DecodeEngine(cfg, dec, DecodeConfig(POOLS), channel)
        states = []
        for h in (on, off):
            decode.submit(h)
            run = decode.running[h.request_id]
            (state,) = dec.run(ExportState(run.slot, tuple(run.pages[:-(-h.num_tokens // POOLS.page_size)]),
                                           h.num_tokens))
            states.append(state)
        assert torch.equal(states[0][0], states[1][0]) and torch.equal(states[0][1], states[1][1])
        tokens = {on.request_id: [on.first_token], off.request_id: [off.first_token]}
        while decode.has_work:
            for ev in decode.step():
                tokens[ev.request_id] += ev.token_ids
        reference = tiny_refs.trace(PROMPT, PARAMS)
        compare(reference, tokens["mclw-on"], label="layer-wise export over Mooncake")
        compare(reference, tokens["mclw-off"], label="export after the forward over Mooncake")
        assert decode.slots.num_used == 0 and decode.pages.num_used == 0
        assert all(s.staged_transfers == 0 and s.staged_bytes == 0 for s in channel.client.status())
    finally:
        dec.close()
        pre.close()
