"""Layer-wise export in the prefill forward: a prompt's last chunk streams each layer's state to the decode group
as soon as that layer is computed (PrefillConfig.layerwise_export, engine/ops.py PrefillStreamed).

Prefill TP 2 (two rank processes with GrpcSendHooks) -> decode TP 1 (a rank process with its receiver): the
state installed from the streamed transfer is byte-identical to the one exported after the forward, and greedy
decode from it equals the single-process reference.
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
from k3serve.transfer.decode_host import ReceivingExecutor
from k3serve.transfer.handoff_send import GrpcChannel, GrpcSendHooks
from k3serve.transfer.receiver import ReceiverConfig
from tests.exactness import compare

PARAMS = SamplingParams(max_tokens=5, ignore_eos=True)
PROMPT = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(21)).tolist()
POOLS = PoolConfig(kda_slots=4, mla_pages=32)


@pytest.fixture(scope="module")
def groups(tiny_ckpt, auth):
    """(cfg, prefill executor TP 2 with gRPC senders, decode executor TP 1 with its receiver, the channel)."""
    cfg = load_config(tiny_ckpt)
    dec = ReceivingExecutor(WorkerSpec(tiny_ckpt, 1, POOLS), ReceiverConfig(auth))
    pre = make_executor(WorkerSpec(tiny_ckpt, 2, POOLS, hooks=GrpcSendHooks()))
    channel = GrpcChannel("lw", cfg, dec.endpoints, auth.secret, 2, 1, POOLS.page_size, chunk_bytes=8192)
    yield cfg, pre, dec, channel
    pre.close()
    dec.close()


def _prefill(groups, request_id: str, layerwise: bool, params: SamplingParams = PARAMS):
    cfg, pre, _, channel = groups
    # 128-token chunks: the last chunk (tokens 256..299) is the one that streams
    engine = PrefillEngine(cfg, pre, PrefillConfig(POOLS, step_token_budget=128, enable_prefix_cache=False,
                                                   layerwise_export=layerwise),
                           prefix_key(model_fingerprint(cfg.to_hf_dict()), ""), channel)
    engine.add_request(PrefillRequest(request_id, tuple(PROMPT), params))
    out = engine.run_to_completion()
    assert not engine.take_failures() and engine.slots.num_used == 0 and engine.pages.num_used == 0
    return out


def _installed(decode: DecodeEngine, dec, h) -> tuple[torch.Tensor, torch.Tensor]:
    decode.submit(h)
    run = decode.running[h.request_id]
    n_pages = -(-h.num_tokens // POOLS.page_size)
    (state,) = dec.run(ExportState(run.slot, tuple(run.pages[:n_pages]), h.num_tokens))
    return state


def test_streamed_state_is_the_exported_state_and_decodes_like_the_reference(groups, tiny_refs):
    cfg, _, dec, channel = groups
    (on,) = _prefill(groups, "lw-on", layerwise=True)
    (off,) = _prefill(groups, "lw-off", layerwise=False)
    assert isinstance(on.state, StagedState) and on.state.nbytes == off.state.nbytes > 0
    assert on.first_token == off.first_token
    decode = DecodeEngine(cfg, dec, DecodeConfig(POOLS), channel)
    kda_on, mla_on = _installed(decode, dec, on)
    kda_off, mla_off = _installed(decode, dec, off)
    assert torch.equal(kda_on, kda_off) and torch.equal(mla_on, mla_off)
    tokens = {on.request_id: [on.first_token], off.request_id: [off.first_token]}
    while decode.has_work:
        for ev in decode.step():
            tokens[ev.request_id] += ev.token_ids
    reference = tiny_refs.trace(PROMPT, PARAMS)
    compare(reference, tokens["lw-on"], label="layer-wise export")
    compare(reference, tokens["lw-off"], label="export after the forward")
    assert decode.slots.num_used == 0 and decode.pages.num_used == 0
    assert all(s.staged_transfers == 0 and s.staged_bytes == 0 for s in channel.client.status())


def test_a_request_done_at_its_first_token_leaves_no_streamed_staging(groups):
    _, _, _, channel = groups
    (h,) = _prefill(groups, "lw-one", layerwise=True, params=SamplingParams(max_tokens=1, ignore_eos=True))
    assert h.finished and h.state is None
    assert all(s.staged_transfers == 0 and s.staged_bytes == 0 for s in channel.client.status())
