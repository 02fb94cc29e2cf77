"""The local disaggregated path: a prefill group and a decode group in one driver, handoffs in process.

Used by ``k3serve generate`` and by tests that drive prefill -> handoff -> decode directly; the cluster service
runs the same engines in Ray actors with the transfer layer between them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from k3serve.decode.engine import DecodeConfig, DecodeEngine
from k3serve.engine.block_hash import model_fingerprint
from k3serve.engine.executor import WorkerSpec, make_executor
from k3serve.engine.ops import PoolConfig
from k3serve.contracts.requests import PrefillRequest, RequestFailure
from k3serve.model.checkpoint import load_config
from k3serve.prefill.engine import PrefillConfig, PrefillEngine


@dataclass
class RequestOutput:
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    cached_tokens: int = 0
    error: RequestFailure | None = None


class LocalPipeline:
    def __init__(self, checkpoint: str, prefill_tp: int = 1, decode_tp: int = 1,
                 prefill: PrefillConfig | None = None, decode: DecodeConfig | None = None) -> None:
        self.cfg = load_config(checkpoint)
        prefill = prefill or PrefillConfig(PoolConfig(kda_slots=64, mla_pages=1024))
        decode = decode or DecodeConfig(PoolConfig(kda_slots=64, mla_pages=1024, page_size=prefill.pools.page_size))
        self._prefill_exec = make_executor(WorkerSpec(checkpoint, prefill_tp, prefill.pools))
        try:
            self._decode_exec = make_executor(WorkerSpec(checkpoint, decode_tp, decode.pools))
        except BaseException:
            self._prefill_exec.close()
            raise
        self.prefill = PrefillEngine(self.cfg, self._prefill_exec, prefill, model_fingerprint(self.cfg.to_hf_dict()))
        self.decode = DecodeEngine(self.cfg, self._decode_exec, decode)

    def generate(self, requests: list[PrefillRequest]) -> dict[str, RequestOutput]:
        """Run requests to completion; outputs by request id (failures carry `error`)."""
        outs = {r.request_id: RequestOutput(r.request_id) for r in requests}
        for r in requests:
            self.prefill.add_request(r)
        while self.prefill.has_work or self.decode.has_work or self.prefill.failures or self.decode.failures:
            for f in self.prefill.take_failures() + self.decode.take_failures():
                outs[f.request_id].error = f
            for h in self.prefill.step():
                outs[h.request_id].cached_tokens = h.cached_tokens
                for ev in self.decode.submit(h):
                    self._apply(outs[ev.request_id], ev)
            for ev in self.decode.step():
                self._apply(outs[ev.request_id], ev)
        return outs

    @staticmethod
    def _apply(out: RequestOutput, ev) -> None:
        out.token_ids.extend(ev.token_ids)
        if ev.finished:
            out.finish_reason = ev.finish_reason

    def close(self) -> None:
        self._prefill_exec.close()
        self._decode_exec.close()

    def __enter__(self) -> "LocalPipeline":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
