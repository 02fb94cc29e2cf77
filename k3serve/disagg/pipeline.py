"""The local disaggregated path: a prefill group and a decode group in one driver, the state in process.

Used by ``k3serve generate`` and by tests that drive prefill -> handoff -> decode directly; the cluster service
runs the same loop (`disagg/loop.py`) in its front, with the groups in Ray actors and a transfer plane between
them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from k3serve.contracts.numerics import DEFAULT_NUMERICS, Numerics
from k3serve.contracts.requests import PrefillRequest, RequestFailure, StreamEvent
from k3serve.decode.engine import DecodeConfig, DecodeEngine
from k3serve.disagg.loop import DisaggLoop
from k3serve.engine.block_hash import model_fingerprint, prefix_key
from k3serve.engine.executor import WorkerSpec, make_executor
from k3serve.engine.ops import PoolConfig
from k3serve.engine.spec.config import SpecConfig
from k3serve.engine.spec.drafter import Drafter
from k3serve.model.checkpoint import load_config
from k3serve.prefill.engine import PrefillConfig, PrefillEngine
from k3serve.transfer.inprocess import InProcessChannel


@dataclass
class RequestOutput:
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    cached_tokens: int = 0
    error: RequestFailure | None = None
    drafted_tokens: int = 0  # speculative decoding (0 when off)
    accepted_tokens: int = 0
    verify_steps: int = 0
    logprobs: list[float] = field(default_factory=list)  # with params.logprobs: one per token


class LocalPipeline:
    def __init__(self, checkpoint: str, prefill_tp: int = 1, decode_tp: int = 1,
                 prefill: PrefillConfig | None = None, decode: DecodeConfig | None = None,
                 speculative: SpecConfig | None = None, drafter: Drafter | None = None,
                 numerics: Numerics = DEFAULT_NUMERICS, device: str = "cpu") -> None:
        """speculative: decode with drafts (ignored when `decode` is given: that config says it);
        drafter: the drafting method (default: the one the config names);
        numerics: the mode of both groups (contracts/numerics.py); it replaces `prefill.numerics`;
        device: where both groups' ranks hold the model and pools ("cpu", "cuda", "cuda:1"; CUDA runs the
        Triton kernels)."""
        self.cfg = load_config(checkpoint)
        prefill = replace(prefill or PrefillConfig(PoolConfig(kda_slots=64, mla_pages=1024)), numerics=numerics)
        if decode is None:
            k1 = speculative.num_draft_tokens + 1 if speculative is not None else 0
            decode = DecodeConfig(PoolConfig(kda_slots=64, mla_pages=1024, page_size=prefill.pools.page_size,
                                             spec_slots=64 if k1 else 0, spec_tokens=k1), speculative=speculative)
        self._prefill_exec = make_executor(WorkerSpec(checkpoint, prefill_tp, prefill.pools, device=device,
                                                       numerics=numerics))
        try:
            self._decode_exec = make_executor(WorkerSpec(checkpoint, decode_tp, decode.pools, device=device,
                                                          numerics=numerics))
        except BaseException:
            self._prefill_exec.close()
            raise
        channel = InProcessChannel()
        self.decode = DecodeEngine(self.cfg, self._decode_exec, decode, channel, drafter)
        if prefill.draft_capture is None and self.decode.draft_capture is not None:
            prefill = replace(prefill, draft_capture=self.decode.draft_capture)  # the drafter's warm start
        # one process, one tenant: an unkeyed block-hash key (a deployment keys it with its secret)
        key = prefix_key(model_fingerprint(self.cfg.to_hf_dict()), "")
        self.prefill = PrefillEngine(self.cfg, self._prefill_exec, prefill, key, channel)
        self.loop = DisaggLoop(self.prefill, self.decode)

    def generate(self, requests: list[PrefillRequest]) -> dict[str, RequestOutput]:
        """Run requests to completion; outputs by request id (failures carry `error`)."""
        outs = {r.request_id: RequestOutput(r.request_id) for r in requests}
        for r in requests:
            self.loop.add(r)
        while self.loop.has_work:
            for ev in self.loop.step():
                self._apply(outs[ev.request_id], ev)
        for rid, out in outs.items():
            t = self.decode.timings.get(rid)
            if t is not None:
                out.drafted_tokens, out.accepted_tokens, out.verify_steps = (t.drafted_tokens, t.accepted_tokens,
                                                                             t.verify_steps)
        return outs

    @staticmethod
    def _apply(out: RequestOutput, ev: StreamEvent) -> None:
        out.token_ids.extend(ev.token_ids)
        out.logprobs.extend(ev.logprobs)
        if ev.cached_tokens >= 0:
            out.cached_tokens = ev.cached_tokens
        if ev.error is not None:
            out.error = ev.error
        elif ev.finish_reason:
            out.finish_reason = ev.finish_reason

    def close(self) -> None:
        self._prefill_exec.close()
        self._decode_exec.close()

    def __enter__(self) -> "LocalPipeline":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
