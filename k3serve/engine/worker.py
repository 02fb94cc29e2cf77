"""One TP rank's worker: the model shard plus the two state stores it owns.

```
 kda_store  [kda_slots, L_kda, H_local, block_floats] fp32   one slot per running request or checkpoint
 page_store [mla_pages, L_mla, page_size, D]          dtype  MLA latent rows, identical on every rank
 record_store [spec_slots, L_kda, H_local, spec_tokens, R] fp32  speculative verify records (R = 6K)
```
A slot's blocks for one layer, ``kda_store[slot, layer]``, are the head-contiguous transfer units.

A worker is joined to a state-transfer plane by the `WorkerHooks` it is built with (made by the plane, e.g.
`transfer.handoff_send.GrpcSendHooks` on prefill ranks, `transfer.decode_host.ReceiverHooks` on decode ranks),
and executes ops through one explicit table (`ModelWorker.HANDLERS`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from k3serve.engine.ops import (CommitBatch, CopySlot, DecodeBatch, ExportState, InstallStaged, InstallState,
                                PoolConfig, PrefillChunk, PrefillStreamed, ResetSlots, SendState, VerifyBatch)
from k3serve.kernels.kda_records import record_floats
from k3serve.kernels.kda_spec import kda_commit
from k3serve.model.model import HybridModel
from k3serve.model.state import ForwardBatch, PagedLatentCache

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Staging(Protocol):
    """A decode rank's verified transfers (transfer/staging.py StagingStore)."""

    def take(self, transfer_id: str) -> object:
        """The verified state (`.kda [L_kda, H_local, block]`, `.mla [L_mla, n, D]`); raises if not verified."""

    def recycle(self, state: object) -> None: ...


class LayerSend(Protocol):
    """One rank's layer-wise send of a request's state (made by WorkerHooks.begin_send over two buffers the
    worker fills layer by layer; e.g. transfer/handoff_send.py StreamedSend)."""

    def layer_ready(self, kind: str, layer: int) -> None:
        """Layer `layer` of `kind` ("kda" | "mla") is final in the buffers: its bytes may leave now."""

    def finish(self) -> object:
        """Wait for the receivers' acks: the outcome SendState would have returned (never raises for a failed
        transfer: the outcome says so)."""

    def abort(self, reason: str) -> None:
        """Stop sending and cancel the transfer on the receivers."""


def _no_cleanup() -> None:
    pass


@dataclass(frozen=True)
class WorkerHooks:
    """What joins a worker to a transfer plane, fixed at construction.

    send_state(job, rank, kda `[L_kda, H_local, block]`, mla `[L_mla, n, D]`) -> outcome: SendState's work.
    begin_send(job, rank, kda, mla) -> LayerSend: PrefillStreamed's (the same buffers, filled layer by layer while
        the last chunk runs; None: this plane has no layer-wise export).
    staging: where InstallStaged takes verified transfers from.
    report: a value the rank reports to its driver once built (a receiver's endpoint).
    close: stops what the hooks started (a receiver, cached senders).
    """

    send_state: Callable[[object, int, torch.Tensor, torch.Tensor], object] | None = None
    begin_send: Callable[[object, int, torch.Tensor, torch.Tensor], LayerSend] | None = None
    staging: Staging | None = None
    report: object = None
    close: Callable[[], None] = _no_cleanup


class HooksFactory(Protocol):
    """Builds a rank's hooks in the rank's own process (so it must pickle): cfg is the model's ModelConfig."""

    def __call__(self, cfg: object, rank: int, tp: int) -> WorkerHooks: ...


class ModelWorker:
    def __init__(self, model: HybridModel, pools: PoolConfig, hooks: WorkerHooks | None = None) -> None:
        cfg = model.cfg
        self.model, self.pools = model, pools
        dev = model.device
        self.kda_store = torch.zeros(pools.kda_slots, cfg.num_kda_layers, model.kda_heads_local,
                                     cfg.kda_head_block_floats, dtype=torch.float32, device=dev)
        self.page_store = torch.zeros(pools.mla_pages, cfg.num_mla_layers, pools.page_size, cfg.mla_latent_dim,
                                      dtype=_DTYPES.get(cfg.torch_dtype, torch.float32), device=dev)
        self.record_store = torch.zeros(pools.spec_slots, cfg.num_kda_layers, model.kda_heads_local,
                                        pools.spec_tokens, record_floats(cfg.kda_head_dim), dtype=torch.float32,
                                        device=dev)
        self.hooks = hooks or WorkerHooks()

    def execute(self, op: object) -> object:
        handler = self.HANDLERS.get(type(op))
        if handler is None:
            raise TypeError(f"worker cannot execute {type(op).__name__}")
        return handler(self, op)

    # ------------------------------------------------------------------------------------------------ ops
    def _ResetSlots(self, op: ResetSlots) -> None:
        self.kda_store[list(op.slots)] = 0.0

    def _CopySlot(self, op: CopySlot) -> None:
        self.kda_store[op.dst].copy_(self.kda_store[op.src])

    def _block_table(self, tables: tuple[tuple[int, ...], ...]) -> torch.Tensor:
        width = max(1, max(len(t) for t in tables))
        bt = torch.zeros(len(tables), width, dtype=torch.long)
        for i, t in enumerate(tables):
            bt[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        return bt.to(self.page_store.device)

    def _PrefillChunk(self, op: PrefillChunk, on_layer: Callable[[int], None] | None = None
                      ) -> torch.Tensor | None | tuple:
        # a view of the slot: the forward updates the pool in place
        blocks = [self.kda_store[op.slot: op.slot + 1, layer] for layer in range(self.model.cfg.num_kda_layers)]
        latent = PagedLatentCache(self.page_store, self._block_table((op.block_table,)))
        ids = torch.tensor([op.token_ids], dtype=torch.long, device=self.model.device)
        capture = op.capture_layers if op.capture_rows > 0 else ()
        batch = ForwardBatch(blocks, latent, [op.start], decode=False, capture_layers=tuple(capture),
                             on_layer=on_layer)
        logits = self.model.forward(ids, batch, op.all_logits)
        out = logits[0].cpu() if op.want_logits or op.all_logits else None
        if not capture:
            return out
        return out, {layer: h[0, -op.capture_rows:].cpu() for layer, h in batch.captured.items()}

    def _DecodeBatch(self, op: DecodeBatch) -> torch.Tensor:
        layers = range(self.model.cfg.num_kda_layers)
        first, n = op.slots[0], len(op.slots)
        # Slots come lowest-free-first, so a batch is often one ascending run: then the blocks are views and
        # the forward updates the pool in place. Otherwise gather (copy), run, scatter back. At batch 32 on the
        # bench preset the copies would move as many bytes per step as the weights.
        adjacent = tuple(op.slots) == tuple(range(first, first + n))
        if adjacent:
            blocks = [self.kda_store[first: first + n, layer] for layer in layers]
        else:
            slots = torch.tensor(op.slots, dtype=torch.long, device=self.kda_store.device)
            blocks = [self.kda_store[slots, layer] for layer in layers]
        latent = PagedLatentCache(self.page_store, self._block_table(op.block_tables))
        ids = torch.tensor(op.token_ids, dtype=torch.long, device=self.model.device).unsqueeze(1)
        logits = self.model.forward(ids, ForwardBatch(blocks, latent, list(op.starts), decode=True))
        if not adjacent:
            for layer, b in zip(layers, blocks):
                self.kda_store[slots, layer] = b
        return logits.cpu()

    def _gather_blocks(self, slots: tuple[int, ...]) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Per KDA layer `[B, H_local, block]`: views of the pool when the slots are one ascending run, else
        copies (then the index to scatter them back with)."""
        layers = range(self.model.cfg.num_kda_layers)
        first, n = slots[0], len(slots)
        if tuple(slots) == tuple(range(first, first + n)):
            return [self.kda_store[first: first + n, layer] for layer in layers], None
        idx = torch.tensor(slots, dtype=torch.long, device=self.kda_store.device)
        return [self.kda_store[idx, layer] for layer in layers], idx

    def _VerifyBatch(self, op: VerifyBatch) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        cfg = self.model.cfg
        t = len(op.token_ids[0])
        if any(len(row) != t for row in op.token_ids) or t > self.pools.spec_tokens:
            raise ValueError(f"VerifyBatch rows must share one length <= spec_tokens={self.pools.spec_tokens}")
        blocks, _ = self._gather_blocks(op.slots)  # read only: the verify never writes the state
        records = [torch.empty(len(op.slots), self.model.kda_heads_local, t, record_floats(cfg.kda_head_dim),
                               device=self.kda_store.device) for _ in range(cfg.num_kda_layers)]
        latent = PagedLatentCache(self.page_store, self._block_table(op.block_tables))
        ids = torch.tensor(op.token_ids, dtype=torch.long, device=self.model.device)
        batch = ForwardBatch(blocks, latent, list(op.starts), decode=False, kda_records=records,
                             capture_layers=tuple(op.capture_layers))
        logits = self.model.forward(ids, batch, all_logits=True)
        rslots = torch.tensor(op.record_slots, dtype=torch.long, device=self.kda_store.device)
        for layer, rec in enumerate(records):
            self.record_store[rslots, layer, :, :t] = rec
        return logits.cpu(), {layer: h.cpu() for layer, h in batch.captured.items()}

    def _CommitBatch(self, op: CommitBatch) -> None:
        cfg = self.model.cfg
        blocks, idx = self._gather_blocks(op.slots)
        rslots = torch.tensor(op.record_slots, dtype=torch.long, device=self.kda_store.device)
        accepted = torch.tensor(op.accepted, dtype=torch.long)
        for layer, b in enumerate(blocks):
            records = self.record_store[rslots, layer, :, : op.num_tokens]
            kda_commit(b, records, accepted, cfg.kda_head_dim, cfg.short_conv_kernel_size)
            if idx is not None:
                self.kda_store[idx, layer] = b

    def _ExportState(self, op: ExportState) -> tuple[torch.Tensor, torch.Tensor | None]:
        kda = self.kda_store[op.slot].cpu().clone()
        if not op.include_mla:
            return kda, None
        latent = PagedLatentCache(self.page_store, self._block_table((op.block_table,)))
        rows = torch.stack([latent.read(i, 0, op.num_tokens) for i in range(self.model.cfg.num_mla_layers)])
        return kda, rows.cpu().clone()

    def _InstallState(self, op: InstallState) -> None:
        kda, mla = op.kda, op.mla
        if tuple(kda.shape) != tuple(self.kda_store.shape[1:]):
            raise ValueError(f"KDA state shape {tuple(kda.shape)} != slot shape {tuple(self.kda_store.shape[1:])}")
        self.kda_store[op.slot].copy_(kda)
        latent = PagedLatentCache(self.page_store, self._block_table((op.block_table,)))
        for i in range(mla.shape[0]):
            latent.write(i, mla[i].unsqueeze(0).to(self.page_store.device), [0])

    def _SendState(self, op: SendState) -> object:
        if self.hooks.send_state is None:
            raise RuntimeError("SendState: this worker was built without a transfer sender (WorkerHooks.send_state)")
        kda, mla = self._ExportState(ExportState(op.slot, op.block_table, op.num_tokens))
        return self.hooks.send_state(op.job, self.model.tp.rank, kda, mla)

    def _PrefillStreamed(self, op: PrefillStreamed) -> tuple[object, object]:
        """The last chunk, each layer's state handed to the sender as soon as this chunk's forward computed it
        (nothing later in the forward touches a layer's state once its attention ran), so the transfer of the
        first layers overlaps the compute of the last ones. The buffers hold what ExportState would return."""
        if self.hooks.begin_send is None:
            raise RuntimeError("PrefillStreamed: this worker's transfer plane has no layer-wise export "
                               "(WorkerHooks.begin_send)")
        c, cfg, n = op.chunk, self.model.cfg, op.num_tokens
        if n != c.start + len(c.token_ids):
            raise ValueError(f"PrefillStreamed.num_tokens {n} is not where its chunk ends "
                             f"({c.start} + {len(c.token_ids)}): only a prompt's last chunk streams its state")
        kda = torch.empty(tuple(self.kda_store.shape[1:]), dtype=torch.float32)
        mla = torch.empty(cfg.num_mla_layers, n, cfg.mla_latent_dim, dtype=self.page_store.dtype)
        latent = PagedLatentCache(self.page_store, self._block_table((c.block_table,)))
        send = self.hooks.begin_send(op.job, self.model.tp.rank, kda, mla)

        def export_layer(layer: int) -> None:
            if cfg.is_kda_layer(layer):
                i = cfg.kda_index(layer)
                kda[i].copy_(self.kda_store[c.slot, i])
                send.layer_ready("kda", i)
            else:
                i = cfg.mla_index(layer)
                mla[i].copy_(latent.read(i, 0, n))
                send.layer_ready("mla", i)

        try:
            result = self._PrefillChunk(c, export_layer)
        except BaseException:
            send.abort("the prefill chunk failed")
            raise
        return result, send.finish()

    def _InstallStaged(self, op: InstallStaged) -> None:
        staging = self.hooks.staging
        if staging is None:
            raise RuntimeError("InstallStaged: this worker was built without a transfer receiver (WorkerHooks.staging)")
        state = staging.take(op.transfer_id)  # verified only; raises (installing nothing) otherwise
        try:
            self._InstallState(InstallState(op.slot, op.block_table, state.kda.to(self.kda_store.device),
                                            state.mla.to(self.page_store.device)))
        finally:  # the buffers go back to the receiver (its pool, or its registered region) either way
            staging.recycle(state)

    HANDLERS: dict[type, Callable[["ModelWorker", object], object]] = {
        ResetSlots: _ResetSlots, CopySlot: _CopySlot, PrefillChunk: _PrefillChunk, DecodeBatch: _DecodeBatch,
        ExportState: _ExportState, InstallState: _InstallState, SendState: _SendState,
        InstallStaged: _InstallStaged, VerifyBatch: _VerifyBatch, CommitBatch: _CommitBatch,
        PrefillStreamed: _PrefillStreamed,
    }
