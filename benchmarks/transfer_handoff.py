"""Handoff bench: the time from a prompt's last prefill chunk to its first decode token, with layer-wise export
off and on, through a real prefill group and a real decode group over our gRPC plane.

```
 prefill TP P (rank processes, GrpcSendHooks) ──gRPC──▶ decode TP D (rank processes + receivers)
   step k-1 (chunk k-1) ...
   t0 ─ last step: chunk k ──────────────────────────────┐  off: forward, then SendState (every layer's bytes)
                          on: PrefillStreamed: a layer's  │  on:  each layer's bytes leave as soon as the
                              bytes leave while later     │       chunk computed it, overlapping the forward
                              layers compute              │
   t_handoff ─ the handoff (first token sampled, state verified on every decode rank)
   decode.submit: InstallStaged ; decode.step() ─ t1: the first decode token
```
`last_chunk_to_first_decode_s` = t1 - t0, split into `last_step_s` (t_handoff - t0: the last chunk's forward
and whatever of the transfer does not overlap it) and `install_and_step_s` (t_handoff -> t1). Modes alternate
within each repetition (background load hits both alike); medians reported, and the median of the
per-repetition difference (`saved_s_median`, off - on). A long prompt with a short last chunk is where
the overlap matters: the state moved is the whole prompt's, the forward it can hide behind is the last chunk's.
Every repetition's first decode token must be the same in both modes (the streamed state is the exported one).
"""

from __future__ import annotations

import secrets
import statistics
import tempfile
import time
from dataclasses import dataclass

import torch

from k3serve.auth import AuthConfig
from k3serve.contracts.requests import PrefillRequest
from k3serve.contracts.sampling import SamplingParams
from k3serve.decode.engine import DecodeConfig, DecodeEngine
from k3serve.engine.block_hash import model_fingerprint, prefix_key
from k3serve.engine.executor import WorkerSpec, make_executor
from k3serve.engine.ops import PoolConfig
from k3serve.model.checkpoint import load_config
from k3serve.model.presets import write_preset_checkpoint
from k3serve.prefill.engine import PrefillConfig, PrefillEngine
from k3serve.transfer.decode_host import ReceivingExecutor
from k3serve.transfer.handoff_send import GrpcChannel, GrpcSendHooks
from k3serve.transfer.receiver import ReceiverConfig
from k3serve.transfer.spec import DEFAULT_CHUNK_BYTES, StateGeometry


@dataclass(frozen=True)
class HandoffBenchConfig:
    preset: str = "tiny"
    tokens: int = 8192  # prompt length (the state moved is the whole prompt's)
    last_chunk_tokens: int = 256  # the prompt runs as one chunk of tokens - last_chunk_tokens, then this one
    prefill_tp: int = 2
    decode_tp: int = 1
    reps: int = 3
    chunk_bytes: int = DEFAULT_CHUNK_BYTES

    def __post_init__(self) -> None:
        if not 0 < self.last_chunk_tokens <= self.tokens // 2:
            raise ValueError(f"handoff bench: last_chunk_tokens must be in [1, tokens / 2], got "
                             f"{self.last_chunk_tokens} of {self.tokens}")
        if self.reps < 1 or self.prefill_tp < 1 or self.decode_tp < 1:
            raise ValueError(f"handoff bench needs reps >= 1 and positive TP degrees: {self}")


def _one(cfg, pre, channel, decode: DecodeEngine, pools: PoolConfig, prompt: tuple[int, ...], layerwise: bool,
         rid: str, budget: int) -> tuple[dict, int]:
    """One request through prefill (two chunks) and its first decode step: (times, the first decode token)."""
    engine = PrefillEngine(cfg, pre, PrefillConfig(pools, step_token_budget=budget, enable_prefix_cache=False,
                                                   layerwise_export=layerwise),
                           prefix_key(model_fingerprint(cfg.to_hf_dict()), ""), channel)
    engine.add_request(PrefillRequest(rid, prompt, SamplingParams(max_tokens=2, ignore_eos=True)))
    handoff = None
    while handoff is None:
        if not engine.has_work:
            raise RuntimeError(f"prefill of {rid} failed: {engine.take_failures()}")
        t0 = time.perf_counter()
        out = list(engine.step())
        handoff = out[0] if out else None
    t_handoff = time.perf_counter()
    decode.submit(handoff)
    token = None
    while token is None:
        for ev in decode.step():
            if ev.request_id == rid and ev.token_ids:
                token = ev.token_ids[0]
    t1 = time.perf_counter()
    while decode.has_work:  # max_tokens=2: the request ends here; drain it so the pools are empty again
        list(decode.step())
    return {"last_chunk_to_first_decode_s": t1 - t0, "last_step_s": t_handoff - t0,
            "install_and_step_s": t1 - t_handoff}, token


def run_handoff_bench(cfg: HandoffBenchConfig = HandoffBenchConfig()) -> dict:
    budget = cfg.tokens - cfg.last_chunk_tokens  # step 1: that many tokens; step 2: the last chunk
    with tempfile.TemporaryDirectory(prefix="k3serve-handoff-") as d:
        ckpt = str(write_preset_checkpoint(cfg.preset, d))
        mcfg = load_config(ckpt)
        pools = PoolConfig(kda_slots=4, mla_pages=-(-(cfg.tokens + 8) // 64) + 4)
        auth = AuthConfig(secrets.token_hex(16), peer="bench")
        dec = ReceivingExecutor(WorkerSpec(ckpt, cfg.decode_tp, pools), ReceiverConfig(auth))
        try:
            pre = make_executor(WorkerSpec(ckpt, cfg.prefill_tp, pools, hooks=GrpcSendHooks()))
            try:
                channel = GrpcChannel("bench", mcfg, dec.endpoints, auth.secret, cfg.prefill_tp, cfg.decode_tp,
                                      pools.page_size, cfg.chunk_bytes)
                decode = DecodeEngine(mcfg, dec, DecodeConfig(pools), channel)
                prompt = tuple(torch.randint(0, mcfg.vocab_size, (cfg.tokens,),
                                             generator=torch.Generator().manual_seed(5)).tolist())
                _one(mcfg, pre, channel, decode, pools, prompt, True, "warm-up", budget)  # connections, pages
                times: dict[bool, list[dict]] = {False: [], True: []}
                for rep in range(cfg.reps):
                    tokens = {}
                    for mode in ((False, True) if rep % 2 == 0 else (True, False)):
                        t, tokens[mode] = _one(mcfg, pre, channel, decode, pools, prompt, mode,
                                               f"r{rep}-{'on' if mode else 'off'}", budget)
                        times[mode].append(t)
                    if tokens[False] != tokens[True]:
                        raise RuntimeError(f"first decode token differs with layer-wise export on ({tokens[True]}) "
                                           f"and off ({tokens[False]})")
            finally:
                pre.close()
        finally:
            dec.close()
    med = {mode: {k: round(statistics.median(t[k] for t in ts), 4) for k in ts[0]} for mode, ts in times.items()}
    off, on = med[False]["last_chunk_to_first_decode_s"], med[True]["last_chunk_to_first_decode_s"]
    saved = [a["last_chunk_to_first_decode_s"] - b["last_chunk_to_first_decode_s"]
             for a, b in zip(times[False], times[True])]
    return {"preset": cfg.preset, "tokens": cfg.tokens, "last_chunk_tokens": cfg.last_chunk_tokens,
            "prefill_tp": cfg.prefill_tp, "decode_tp": cfg.decode_tp, "reps": cfg.reps,
            "state_bytes_per_decode_rank": StateGeometry.of_config(mcfg, cfg.tokens).rank_bytes(cfg.decode_tp),
            "off": med[False], "on": med[True], "on_over_off": round(on / off, 3),
            # paired by repetition (the two modes ran back to back): the steadier figure on a loaded machine
            "saved_s_median": round(statistics.median(saved), 4),
            "last_chunk_to_first_decode_s_per_rep": {"off": [round(t["last_chunk_to_first_decode_s"], 4)
                                                             for t in times[False]],
                                                     "on": [round(t["last_chunk_to_first_decode_s"], 4)
                                                            for t in times[True]]},
            "first_decode_token_equal": True}
