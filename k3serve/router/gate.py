"""The router's admission gate: request class by uncached prompt tokens, budget reservations in Redis.

```
 uncached = prompt - what the serving cluster is expected to restore from its prefix cache for this session:
            the deepest KDA checkpoint the engine saved for the session's last prompt *on that cluster*
            (PrefixCachePolicy.checkpoint_boundaries: the same policy object the engine runs) that this prompt
            extends and that stops strictly before its end (the engine needs the last token's logits)
 class    = classify(uncached)               e.g. short <= 4096 < long
 reserve  = (cluster, class) budget in Redis: wait in the class queue up to max_wait_s, else
            RESOURCE_EXHAUSTED with a retry-after hint (the expected drain time); leases renewed (and re-asserted
            if Redis lost them) while the request streams
```
A warm 1M-token session with a 2K-token turn is therefore a short request. Eviction on the cluster is not
visible here: an evicted checkpoint makes the estimate low by what was evicted (the engine chunks long prefills
by its own long_threshold, which bounds the harm). When Redis fails (unreachable, OOM, READONLY, ...) the gate
lets requests through (counted as ``bypassed``) and keeps them as held reservations: the renewer puts them
into Redis once it answers again, so they count against the budget from then on.
"""

from __future__ import annotations

import logging
import struct
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import redis
import xxhash

from k3serve.contracts.prefix_policy import PrefixCachePolicy
from k3serve.router.admission import Admission, AdmissionRejected, ClassSpec, RecoveryGuard, Reservation, classify
from k3serve.router.membership import key_prefix
from k3serve.router.metrics import Counters

log = logging.getLogger(__name__)


def prefix_digest(tokens: Sequence[int]) -> str:
    return xxhash.xxh64(struct.pack(f"<{len(tokens)}I", *tokens)).hexdigest()


@dataclass
class _Held:
    res: Reservation
    remaining_s: Callable[[], float]  # the holder's expected remaining time (published for retry hints)


class AdmissionGate:
    """Admission for one router process. ``renew_interval_s`` (default min(lease/3, 0.5 s)) is the renewer's beat;
    the state-loss guard holds new admissions for three beats after Redis lost its state."""

    def __init__(self, client: redis.Redis, namespace: str, classes: Sequence[ClassSpec], *, enabled: bool = True,
                 lease_ttl_s: float = 10.0, policy: PrefixCachePolicy | None = None, context_ttl_s: float = 3600.0,
                 renew_interval_s: float | None = None) -> None:
        self.client, self.classes, self.enabled = client, list(classes), enabled
        self.policy = policy or PrefixCachePolicy()
        self.lease_ttl_s, self.context_ttl_s = lease_ttl_s, context_ttl_s
        self.renew_interval_s = renew_interval_s or min(lease_ttl_s / 3, 0.5)
        guard = RecoveryGuard(alive_ttl_s=6 * self.renew_interval_s, grace_s=3 * self.renew_interval_s)
        self.admission = Admission(client, namespace, guard=guard)
        self._prefix = key_prefix(namespace)
        self._held: dict[str, _Held] = {}
        self._lock = threading.Lock()
        self.counters = Counters("bypassed", "reasserted")
        try:  # a fresh router on a fresh Redis: nothing to recover, so no grace to wait out
            client.set(f"{self._prefix}adm:alive", "1", px=int(guard.alive_ttl_s * 1000), nx=True)
        except (redis.RedisError, OSError) as e:
            log.warning("admission guard not armed at start (Redis: %s: %s)", type(e).__name__, e)
        self._closed = threading.Event()
        self._renewer = threading.Thread(target=self._renew_loop, name="lease-renewer", daemon=True)
        self._renewer.start()

    # --------------------------------------------------------------------------------------- classification
    def uncached_tokens(self, session: str, prompt: Sequence[int], cluster: str | None = None) -> int:
        """Prompt tokens ``cluster`` is not expected to restore from its prefix cache for this session
        (``cluster`` None: wherever the session last ran)."""
        try:
            rec = self.client.get(f"{self._prefix}ctx:{session}")
        except (redis.RedisError, OSError):
            return len(prompt)
        if not rec:
            return len(prompt)
        length_s, digest, where = (str(rec).split(":") + [""])[:3]
        length = int(length_s)
        if cluster is not None and where != cluster:
            return len(prompt)  # the cache is where the session last ran, not here
        if length > len(prompt) or prefix_digest(prompt[:length]) != digest:
            return len(prompt)
        # the checkpoints the engine saved for that prompt; a hit stops strictly before this prompt's end
        saved = self.policy.checkpoint_boundaries(length, 0)
        cached = max((b for b in saved if b <= len(prompt) - 1), default=0)
        return len(prompt) - cached

    def record_prompt(self, session: str, prompt: Sequence[int], cluster: str = "") -> None:
        """Remember the prompt ``cluster`` just prefilled for the session (the next turn's cache estimate)."""
        try:
            self.client.set(f"{self._prefix}ctx:{session}", f"{len(prompt)}:{prefix_digest(prompt)}:{cluster}",
                            px=int(self.context_ttl_s * 1000))
        except (redis.RedisError, OSError) as e:
            log.info("session %s: prompt not recorded (Redis: %s)", session, type(e).__name__)

    def request_class(self, uncached: int) -> ClassSpec:
        return classify(uncached, self.classes)

    # ------------------------------------------------------------------------------------------ reservations
    def _refused(self, e: AdmissionRejected) -> AdmissionRejected:
        self.counters.inc(f"rejected:{e.cls}")
        return e

    def admit(self, cluster: str, request_id: str, uncached: int, cancel: threading.Event | None = None,
              remaining_s: Callable[[], float] | None = None, cls: ClassSpec | None = None) -> Reservation | None:
        """Reserve ``uncached`` tokens of the request's class (or ``cls``) on ``cluster``; None when budgets are
        off. ``remaining_s`` is the request's expected remaining time (its published expected end).

        Each call reserves under its own id (``request_id`` + a random suffix), so two requests that share a
        client-chosen id never share one reservation. Raises AdmissionRejected (queue full, or waited max_wait_s).
        """
        if not self.enabled:
            return None
        cls = cls or self.request_class(uncached)
        rid = f"{request_id}#{uuid.uuid4().hex[:12]}"
        tokens = max(uncached, 1)
        remaining = remaining_s or (lambda: 0.0)
        try:
            res = self.admission.reserve_or_wait(cluster, cls, rid, tokens, self.lease_ttl_s, cancel=cancel,
                                                 expected_s=remaining())
        except AdmissionRejected as e:
            raise self._refused(e) from None
        except (redis.RedisError, OSError) as e:
            # Redis unusable (down, OOM, READONLY, ...): serve, and account the request once Redis is back
            log.warning("admission bypassed for %s on %s (Redis: %s: %s)", request_id, cluster, type(e).__name__, e)
            self.counters.inc("bypassed")
            res = Reservation(cluster, cls.name, rid, tokens, 0.0, self.lease_ttl_s)
        self.counters.inc(f"admitted:{cls.name}")
        with self._lock:
            self._held[rid] = _Held(res, remaining)
        return res

    def refuse(self, cluster: str, cls: ClassSpec, uncached: int, message: str, *, expected_s: float = 0.0,
               at_least_s: float = 0.0, unseen: tuple[int, int] = (0, 0)) -> AdmissionRejected:
        """The refusal of a request turned away before admission (a router at its stream limit), hinted when
        (cluster, cls) is expected to have room for it, not before ``at_least_s`` (Admission.rejected)."""
        return self._refused(self.admission.rejected(cluster, cls, max(uncached, 1), "refused", message,
                                                     expected_s=expected_s, unseen=unseen, at_least_s=at_least_s))

    def move(self, res: Reservation | None, cluster: str) -> Reservation | None:
        """A failover: the request keeps the class and tokens it was admitted with, now held on ``cluster``.

        It already streamed to its client, so it is not refused now (it may hold the new cluster's class over
        budget until it ends; the next admissions there wait for it)."""
        if res is None:
            return None
        new = Reservation(cluster, res.cls, res.request_id, res.tokens, 0.0, res.lease_ttl_s)
        with self._lock:
            held = self._held.get(res.request_id)
            remaining = held.remaining_s if held else (lambda: 0.0)
            self._held[res.request_id] = _Held(new, remaining)
        self._release_in_redis(res)
        try:
            [(new, _)] = self.admission.reassert_many([(new, remaining())])
        except (redis.RedisError, OSError) as e:
            log.warning("reservation of %s not moved to %s yet (Redis: %s)", res.request_id, cluster, e)
        return new

    def release(self, res: Reservation | None) -> None:
        if res is None:
            return
        with self._lock:
            self._held.pop(res.request_id, None)
        self._release_in_redis(res)

    def _release_in_redis(self, res: Reservation) -> None:
        try:
            self.admission.release(res)
        except (redis.RedisError, OSError) as e:
            log.info("release of %s deferred to its lease (Redis: %s)", res.request_id, type(e).__name__)

    def _renew_loop(self) -> None:
        while not self._closed.wait(self.renew_interval_s):
            self.renew_once()

    def renew_once(self) -> None:
        """One beat: the guard's alive key, then every held lease renewed, or put back if Redis lost it."""
        with self._lock:
            held = [(h.res, h.remaining_s) for h in self._held.values()]
        try:
            self.admission.touch()
            if not held:
                return
            renewed = self.admission.reassert_many([(r, remaining()) for r, remaining in held])
        except (redis.RedisError, OSError, ValueError) as e:
            # ValueError: redis-py's reader when the connection is closed under it by another thread (a client
            # closed, a failed call on another thread resetting the pool); the next beat reconnects
            log.info("lease renewal skipped (Redis: %s: %s); retrying next beat", type(e).__name__, e)
            return
        gone = []
        with self._lock:
            for (old, _), (new, lost) in zip(held, renewed):
                h = self._held.get(old.request_id)
                if h is None or h.res is not old:
                    gone.append(new)  # released or moved while we renewed: the renewal must not resurrect it
                    continue
                h.res = new
                if lost:
                    self.counters.inc("reasserted")
                    log.warning("lease of %s on %s/%s was lost (Redis flushed, restarted or paused?); re-asserted",
                                old.request_id, old.cluster, old.cls)
        for res in gone:
            self._release_in_redis(res)

    def class_stats(self, clusters: Sequence[str]) -> dict[str, dict[str, int]]:
        """Per class: in-flight tokens, requests and queued waiters summed over `clusters` (one round trip)."""
        pairs = [(c, cls.name) for cls in self.classes for c in clusters]
        try:
            loads = self.admission.stats(pairs)
        except (redis.RedisError, OSError) as e:
            log.info("class stats unavailable (Redis: %s)", type(e).__name__)
            loads = []
        out = {cls.name: {"inflight_tokens": 0, "inflight_requests": 0, "queued": 0,
                          "rejected": self.counters[f"rejected:{cls.name}"]} for cls in self.classes}
        for (_, name), load in zip(pairs, loads):
            st = out[name]
            st["inflight_tokens"] += load.tokens
            st["inflight_requests"] += load.count
            st["queued"] += load.queued
        return out

    def close(self) -> None:
        """Stop the renewer and wait for its beat in progress (bounded by the client's socket timeout), so that
        the owner may close the Redis client or server after this returns."""
        self._closed.set()
        if self._renewer is not threading.current_thread():
            self._renewer.join(timeout=self.renew_interval_s + 10.0)
