"""The in-process state channel: the state travels as tensors inside the ticket.

Used by the local pipeline (`k3serve generate`) and by clusters with `clusters.transfer: object_store` (the
tensors come back from the prefill rank actors and go to the decode rank actors through Ray's object store).

```
 export:  ExportState on every prefill rank ─▶ InlineState(kda: one [L_kda, H/P, block] per rank, mla)
 install: reshard_kda(P -> D) ─▶ InstallState(slot, pages, kda_r, mla) on decode rank r
```
"""

from __future__ import annotations

from k3serve.contracts.channel import StateInstallError
from k3serve.contracts.handoff import InlineState, StateRef
from k3serve.engine.ops import ExportState, InstallState
from k3serve.transfer.plan import PlanError, reshard_kda


class InProcessChannel:
    name = "inprocess"

    def export(self, executor, request_id: str, slot: int, block_table: tuple[int, ...],
               num_tokens: int) -> InlineState:
        results = executor.run(ExportState(slot, block_table, num_tokens))
        return InlineState(tuple(r[0] for r in results), results[0][1])

    def install(self, executor, state: StateRef, slot: int, block_table: tuple[int, ...]) -> None:
        if not isinstance(state, InlineState):
            raise StateInstallError(f"the in-process channel installs inline state, got {type(state).__name__}")
        try:
            parts = reshard_kda(list(state.kda), executor.tp)
        except PlanError as e:
            raise StateInstallError(str(e)) from e
        executor.run_each([InstallState(slot, block_table, part, state.mla) for part in parts])

    def discard(self, state: StateRef) -> None:
        pass  # the tensors go with the ticket
