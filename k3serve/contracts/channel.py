"""The state channel: one typed interface for moving a request's state from prefill pools to decode pools.

```
 PrefillEngine._finish ──export(executor, request_id, slot, pages, n)──▶ StateRef   (prefill ranks read pools)
 DecodeEngine._admit   ──install(executor, state, slot, pages)────────▶ decode ranks write pools
 DecodeEngine.cancel   ──discard(state)───────────────────────────────▶ staging freed (request left early)
```
Implementations (`k3serve/transfer/`): `InProcessChannel` (tensors in the ticket: local pipeline, Ray object
store), `GrpcChannel` (each prefill rank streams its share over gRPC to the decode ranks' receivers,
resharded on the path, verified before install) and `MooncakeChannel` (the same control over gRPC, the payload
written by the Mooncake Transfer Engine into the receivers' registered staging). A channel never installs half a state: `install` either
writes the whole verified state or raises `StateInstallError` having written nothing the request keeps.
"""

from __future__ import annotations

from typing import Protocol

from k3serve.contracts.handoff import StateRef


class StateTransferError(RuntimeError):
    """export failed (a transfer that did not verify on every decode rank): fails this request only."""


class StateInstallError(RuntimeError):
    """install found the state missing or unverified on some rank: fails this request only."""


class StateChannel(Protocol):
    """Moves state between the pools of two TP groups. `executor` is an `engine.executor.Executor`."""

    name: str

    def export(self, executor, request_id: str, slot: int, block_table: tuple[int, ...],
               num_tokens: int) -> StateRef:
        """Read the state of `slot` + the MLA rows of `num_tokens` tokens in `block_table` on every prefill rank
        and make it available to the decode group. Raises StateTransferError."""

    def install(self, executor, state: StateRef, slot: int, block_table: tuple[int, ...]) -> None:
        """Write `state` into `slot` and the pages of `block_table` on every decode rank. Raises
        StateInstallError (nothing installed) or the executor's WorkerDied."""

    def discard(self, state: StateRef) -> None:
        """The request left before install: free whatever holds its state (staging). Never raises."""


class LayerwiseChannel(StateChannel, Protocol):
    """A channel that can also stream a prefill's state layer by layer while its last chunk runs
    (`layerwise = True`; PrefillConfig.layerwise_export): the engine runs that chunk as an
    `engine.ops.PrefillStreamed` op carrying `stream_job(...)` and hands every rank's outcome to `streamed`."""

    layerwise: bool

    def stream_job(self, request_id: str, num_tokens: int) -> object:
        """The job every prefill rank streams `num_tokens` tokens of state with (one transfer id)."""

    def streamed(self, job: object, outcomes: list) -> StateRef:
        """The state the ranks streamed, as `export` returns it. Raises StateTransferError (cancelled)."""

    def abandon(self, job: object) -> None:
        """Drop a streamed state nobody will install. Never raises."""
