"""Test-only faults in the served path, proving that the exactness tests can fail (tests/test_mutations.py).

Inert unless ``K3SERVE_TEST_MUTATION`` names one of ``KINDS`` when the process starts (Ray workers and rank
processes inherit the environment); each call site is one line and returns its input unchanged otherwise.
``per-request`` applies to each request the kind its request id names as ``mutate-<kind>`` (and none to the
others), so one live deployment carries every mutation beside normal traffic (tests/cluster/test_mutations_live.py):

  wrong_token    one decode step of each request emits the next token id instead (the step from the request id)
  kda_scale      the KDA state a decode group installs after a transfer is scaled by 1 + 1e-3
  prefix_early   a prefix hit resumes one block before its checkpoint (that block's tokens run twice)
  drop_mla_page  the first MLA page a decode group installs after a transfer is zeroed
"""

from __future__ import annotations

import os
import zlib

from k3serve.engine.ops import ExportState, InstallState

KINDS = ("wrong_token", "kda_scale", "prefix_early", "drop_mla_page")
PER_REQUEST = "per-request"
ACTIVE = os.environ.get("K3SERVE_TEST_MUTATION", "")
if ACTIVE and ACTIVE not in KINDS + (PER_REQUEST,):
    raise ValueError(f"K3SERVE_TEST_MUTATION={ACTIVE!r} is not one of {KINDS + (PER_REQUEST,)}")
KDA_SCALE = 1 + 1e-3


def marker(kind: str) -> str:
    """What a request id holds to get `kind` under ``per-request``."""
    return f"mutate-{kind}"


def kind_for(request_id: str) -> str:
    """The mutation applied to `request_id` ("" for none)."""
    if ACTIVE != PER_REQUEST:
        return ACTIVE
    return next((k for k in KINDS if marker(k) in request_id), "")


def token(tok: int, request_id: str, step: int, max_tokens: int, vocab_size: int) -> int:
    """wrong_token: the token a request emits as its `step`-th (0 = the prefill's), shifted at one decode step."""
    if kind_for(request_id) != "wrong_token" or max_tokens < 2:
        return tok
    target = 1 + zlib.crc32(request_id.encode()) % (max_tokens - 1)
    return (tok + 1) % vocab_size if step == target else tok


def resume_point(cached_tokens: int, block_size: int, request_id: str) -> int:
    """prefix_early: where a prefix hit of `cached_tokens` resumes the prompt's prefill."""
    if kind_for(request_id) != "prefix_early" or cached_tokens < block_size:
        return cached_tokens
    return cached_tokens - block_size


def installed(executor, slot: int, block_table: tuple[int, ...], num_tokens: int, page_size: int,
              request_id: str) -> None:
    """kda_scale / drop_mla_page: corrupt the state just installed in `slot` and the pages of `block_table`."""
    kind = kind_for(request_id)
    if kind not in ("kda_scale", "drop_mla_page"):
        return
    parts = executor.run(ExportState(slot, block_table, num_tokens))  # per rank: (kda, mla)
    mla = parts[0][1].clone()
    if kind == "drop_mla_page":
        mla[:, :page_size] = 0
    scale = KDA_SCALE if kind == "kda_scale" else 1.0
    executor.run_each([InstallState(slot, block_table, kda * scale, mla) for kda, _ in parts])
