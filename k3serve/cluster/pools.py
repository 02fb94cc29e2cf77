"""Pool occupancy of one cluster, as status reports it (``ClusterStatus.clusters[].pools``, Prometheus).

```
 prefill.kda_slots      slots held by requests being prefilled      (capacity: the prefill slot pool)
 prefill.checkpoints    KDA checkpoints kept by the prefix cache    (same slot pool)
 prefill.request_pages  MLA pages referenced by requests in prefill (capacity: the prefill page pool)
 prefill.cached_pages   MLA pages held by the prefix cache          (same page pool; may overlap the above)
 decode.kda_slots       slots of running decode requests            (capacity: the decode slot pool)
 decode.mla_pages       pages reserved by running decode requests   (capacity: the decode page pool)
 decode.waiting         handoffs waiting for a slot/pages           (no capacity)
 decode.staging_bytes   transfer staging held on the decode ranks   (gRPC channel only; no capacity)
 decode.spec_records    record buffers held by a verify in flight   (capacity: pools.spec_slots; 0 between steps)
 decode.spec_accepted   drafts accepted, of drafts verified          ("capacity" = drafted, both cumulative
                        (speculative decoding only)                   since start: used / capacity = acceptance)
```
An idle cluster reads 0 everywhere except what the prefix cache keeps (checkpoints, cached pages).
The engine-side numbers are taken by the engine thread (the only one that touches the engines): see
:func:`engine_pools`; staging is asked of the receivers from the agent thread.
"""

from __future__ import annotations

from k3serve.contracts.status import PoolUsage
from k3serve.decode.engine import DecodeEngine
from k3serve.prefill.engine import PrefillEngine


def engine_pools(prefill: PrefillEngine, decode: DecodeEngine) -> dict[str, PoolUsage]:
    """Occupancy of both engines' pools; call from the thread that runs the engines."""
    checkpoints = len(prefill.cache.checkpoints())
    request_pages = len({p for run in prefill.running for p in run.pages})
    return {
        "prefill.kda_slots": PoolUsage(prefill.slots.num_used - checkpoints, prefill.slots.capacity),
        "prefill.checkpoints": PoolUsage(checkpoints, prefill.slots.capacity),
        "prefill.request_pages": PoolUsage(request_pages, prefill.pages.capacity),
        "prefill.cached_pages": PoolUsage(len(prefill.cache.held_pages()), prefill.pages.capacity),
        "decode.kda_slots": PoolUsage(decode.slots.num_used, decode.slots.capacity),
        "decode.mla_pages": PoolUsage(decode.pages.num_used, decode.pages.capacity),
        "decode.waiting": PoolUsage(len(decode.waiting)),
        **({"decode.spec_records": PoolUsage(decode.records_in_use, decode.config.pools.spec_slots),
            "decode.spec_accepted": PoolUsage(decode.spec_usage.accepted_tokens, decode.spec_usage.drafted_tokens)}
           if decode.drafter is not None else {}),
    }
