"""Plain-data operations the engine driver sends to every TP rank's worker.

The driver (scheduler, allocators, prefix cache) decides *which* slot and pages a request uses; workers hold
the tensors and execute these ops identically on every rank, each on its own heads. Every op is a frozen
dataclass of Python ints/tuples, cheap to pickle to a worker process or a Ray actor.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolConfig:
    """Capacity of one worker's pools (the same on every rank of a group)."""

    kda_slots: int
    mla_pages: int
    page_size: int = 64
    # speculative decoding's record buffers (docs/speculative.md): spec_slots requests verified at once, each
    # with up to spec_tokens (= k + 1) records per KDA layer and head; 0 = no speculative decoding
    spec_slots: int = 0
    spec_tokens: int = 0

    def __post_init__(self) -> None:
        if self.kda_slots <= 0 or self.mla_pages <= 0 or self.page_size <= 0:
            raise ValueError(f"pool sizes must be positive: {self}")
        if self.spec_slots < 0 or self.spec_tokens < 0 or (self.spec_slots > 0) != (self.spec_tokens > 0):
            raise ValueError(f"spec_slots and spec_tokens must both be positive or both 0: {self}")

    @staticmethod
    def record_slot_bytes(num_kda_layers: int, heads_local: int, head_dim: int, spec_tokens: int) -> int:
        """Bytes of one request's record buffer on one rank (fp32 records, kernels/kda_spec.py)."""
        from k3serve.kernels.kda_records import record_floats

        return num_kda_layers * heads_local * spec_tokens * record_floats(head_dim) * 4

    @staticmethod
    def kda_slot_bytes(num_kda_layers: int, heads_local: int, block_floats: int) -> int:
        return num_kda_layers * heads_local * block_floats * 4

    @staticmethod
    def page_bytes(num_mla_layers: int, page_size: int, latent_dim: int, elem_bytes: int) -> int:
        return num_mla_layers * page_size * latent_dim * elem_bytes

    @classmethod
    def from_bytes(cls, cfg, tp: int, kda_bytes: int, mla_bytes: int, page_size: int = 64) -> "PoolConfig":
        """Pools that fit a byte budget per rank: KDA slots of this rank's heads, MLA pages (replicated).

        cfg: a ModelConfig. Raises ValueError when a budget cannot hold even one slot or one page.
        """
        elem = 2 if cfg.torch_dtype in ("bfloat16", "float16") else 4
        slot = cls.kda_slot_bytes(cfg.num_kda_layers, cfg.kda_num_heads // tp, cfg.kda_head_block_floats)
        page = cls.page_bytes(cfg.num_mla_layers, page_size, cfg.mla_latent_dim, elem)
        if kda_bytes < slot or mla_bytes < page:
            raise ValueError(f"pool budget too small: one KDA slot needs {slot} B (got {kda_bytes}), "
                             f"one MLA page needs {page} B (got {mla_bytes})")
        return cls(kda_bytes // slot, mla_bytes // page, page_size)


@dataclass(frozen=True)
class ResetSlots:
    """Zero the KDA state (recurrent + conv windows) of these slots: a fresh request."""

    slots: tuple[int, ...]


@dataclass(frozen=True)
class CopySlot:
    """dst <- src for every KDA layer and head (checkpoint save, or restore into a private slot)."""

    src: int
    dst: int


@dataclass(frozen=True)
class PrefillChunk:
    """Run `token_ids` of one request at positions start .. start+len-1 from the state in `slot`.

    block_table: the request's pages (page i holds positions i*page_size ..); must cover start+len tokens.
    Returns the last token's logits `[vocab]` when want_logits, every token's `[len, vocab]` when all_logits
    (per-token log-probabilities, e.g. bits per byte through the serving path), else None.
    capture_layers: with capture_rows > 0, the result is ``(logits, {layer: [r, d] fp32})``: those layers'
    hidden states (ForwardBatch.capture_layers keys) for the chunk's last r = min(capture_rows, len) tokens
    (the drafter's start state, contracts/handoff.py DraftFeatures).
    """

    slot: int
    token_ids: tuple[int, ...]
    start: int
    block_table: tuple[int, ...]
    want_logits: bool
    all_logits: bool = False
    capture_layers: tuple[int, ...] = ()
    capture_rows: int = 0


@dataclass(frozen=True)
class DecodeBatch:
    """One decode step for B requests: token b at position starts[b] with state slots[b]. Returns `[B, vocab]`."""

    slots: tuple[int, ...]
    token_ids: tuple[int, ...]
    starts: tuple[int, ...]
    block_tables: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class VerifyBatch:
    """Speculative verify for B requests: request b runs token_ids[b] (x_0 = its last token, then its drafts; all
    rows the same length T) at positions starts[b] .. starts[b]+T-1 from the committed state in slots[b], which
    is read and NOT written; the per-token KDA records go to record buffer record_slots[b]; MLA rows are written
    (rows of rejected tokens are rolled back by length: nothing reads past a request's committed length).

    capture_layers: layers whose hidden states come back (the drafter feature hook, engine/spec/drafter.py).
    Returns (logits `[B, T, vocab]` fp32, {layer: `[B, T, d]` fp32}).
    """

    slots: tuple[int, ...]
    record_slots: tuple[int, ...]
    token_ids: tuple[tuple[int, ...], ...]
    starts: tuple[int, ...]
    block_tables: tuple[tuple[int, ...], ...]
    capture_layers: tuple[int, ...] = ()


@dataclass(frozen=True)
class CommitBatch:
    """After a VerifyBatch: replay the first accepted[b] records of record_slots[b] into the state of slots[b]
    (the recurrent state and the conv windows, written once). 0 <= accepted[b] <= T of that verify."""

    slots: tuple[int, ...]
    record_slots: tuple[int, ...]
    accepted: tuple[int, ...]
    num_tokens: int  # T of the verify these records came from


@dataclass(frozen=True)
class ExportState:
    """Read a request's state for a handoff: KDA `[L_kda, H_local, block]` and MLA rows `[L_mla, n, D]`."""

    slot: int
    block_table: tuple[int, ...]
    num_tokens: int
    include_mla: bool = True


@dataclass(frozen=True)
class InstallState:
    """Write a handoff's state: KDA blocks into `slot`, MLA rows into the pages of `block_table`.

    kda `[L_kda, H_local, block]` fp32 and mla `[L_mla, num_tokens, D]` are tensors (the only non-plain op).
    """

    slot: int
    block_table: tuple[int, ...]
    kda: object
    mla: object


@dataclass(frozen=True)
class InstallStaged:
    """Install a verified transfer from this rank's transfer staging (k3serve.transfer): its KDA blocks into
    `slot`, its MLA rows into the pages of `block_table`, then drop the staging. Fails, installing nothing, if
    the transfer is not verified on this rank."""

    slot: int
    block_table: tuple[int, ...]
    transfer_id: str


@dataclass(frozen=True)
class SendState:
    """Stream this rank's share of a request's state to the decode group over k3serve.transfer.

    job: a k3serve.transfer.handoff_send.StateSendJob (the same on every rank). Returns a SendOutcome.
    """

    slot: int
    block_table: tuple[int, ...]
    num_tokens: int
    job: object


@dataclass(frozen=True)
class PrefillStreamed:
    """A prefill's last chunk with layer-wise export: run `chunk` and stream this rank's share of the request's
    state (`num_tokens` tokens) while it runs, each layer as soon as the chunk's forward has computed it.

    job: a k3serve.transfer.handoff_send.StateSendJob (the same on every rank). Returns ``(chunk result, outcome)``:
    what PrefillChunk returns, and the SendOutcome SendState would have returned for the same state.
    """

    chunk: PrefillChunk
    num_tokens: int
    job: object
