"""One attempt of a request on one cluster: stream its tokens to the client and classify how the call ended.

```
 ClusterGenerateRequest(prompt + tokens already streamed, max_tokens - streamed, same seed, cache identity, salt)
   ──▶ cluster front ──stream──▶ client           (watched: liveness.Watchdog)
 ends: FINISHED | CLIENT_GONE | FAULT (transport or cluster: fail over) | raises grpc abort (client's error)
```
What is *not* a cluster fault: the client's own error (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ALREADY_EXISTS for
a duplicate in-flight request id: passed through with the cluster's message), the client's deadline
(DEADLINE_EXCEEDED: the router forwards the client's remaining time and sets no timer of its own), and the
client leaving. Only those never mark a cluster suspect; everything else (UNAVAILABLE, INTERNAL, a stall, a
cluster whose heartbeat expired, a stream that ended without finishing) fails over.
"""

from __future__ import annotations

import enum
import logging
import uuid
from dataclasses import dataclass, field

import grpc

from k3serve.auth import AuthConfig, sign
from k3serve.internal.v1 import cluster_pb2, cluster_pb2_grpc
from k3serve.router.liveness import Watchdog
from k3serve.router.progress import StreamProgress
from k3serve.router.validate import ValidRequest
from k3serve.tokenizer import ByteTokenizer, StreamDecoder
from k3serve.v1 import router_pb2

log = logging.getLogger(__name__)

# the client's errors: the cluster's answer goes to the client as it is, and no cluster is blamed. INTERNAL is
# an op that raised for this request (engine.executor.OpFailed): resubmitting it would take one cluster after
# another out of rotation
PASS_THROUGH = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                          grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.DEADLINE_EXCEEDED,
                          grpc.StatusCode.INTERNAL})
CLUSTER_GENERATE = f"/{cluster_pb2.DESCRIPTOR.services_by_name['Cluster'].full_name}/Generate"
_NO_DEADLINE_S = 1e7  # grpc reports "no deadline" as a huge remaining time


class Ending(enum.Enum):
    FINISHED = "finished"  # the last message (finish_reason) reached the client
    CLIENT_GONE = "client_gone"  # the client cancelled or its deadline passed; its cancel reached the cluster
    FAULT = "fault"  # transport or cluster failure: mark the cluster suspect, fail over


@dataclass
class Attempts:
    """What one client request has received so far, across failovers."""

    streamed: list[int] = field(default_factory=list)
    failovers: int = 0
    cached: int = 0
    drafted: int = 0  # speculative decoding, summed over the attempts that finished a stream part
    accepted: int = 0
    verify_steps: int = 0
    # one incremental decoder per client request, surviving failovers: text pieces follow the token stream
    text: StreamDecoder = field(default_factory=StreamDecoder)


@dataclass(frozen=True)
class Target:
    """Where and as whom an attempt runs: the cluster, the cache identity (session) and the tenant salt."""

    cluster: str
    stub: cluster_pb2_grpc.ClusterStub | None
    cache_identity: str
    salt: str


def stream_attempt(target: Target, req: ValidRequest, st: Attempts, progress: StreamProgress, auth: AuthConfig,
                   watchdog: Watchdog, tok: ByteTokenizer | None, context):
    """Generator: yields the client's messages; returns an ``Ending``. Aborts the client's call (raises) for the
    client's own errors."""
    cluster = target.cluster
    sampling = req.sampling.with_max_tokens(req.sampling.max_tokens - len(st.streamed)).to_proto()
    inner = router_pb2.GenerateRequest(request_id=req.request_id, session_id=target.cache_identity,
                                       prompt_token_ids=list(req.prompt_ids) + st.streamed, sampling=sampling)
    watch = None
    try:
        if target.stub is None:
            raise ConnectionError(f"cluster {cluster} has no endpoint")
        remaining = context.time_remaining()
        creq = cluster_pb2.ClusterGenerateRequest(request=inner, absolute_offset=len(st.streamed),
                                                  cache_salt=target.salt)
        call = target.stub.Generate(
            creq, metadata=sign(auth, CLUSTER_GENERATE, req.request_id, creq),
            timeout=remaining if remaining is not None and remaining < _NO_DEADLINE_S else None)
        context.add_callback(call.cancel)
        watch = watchdog.watch(cluster, call, progress)
        for resp in call:
            if not st.streamed and not st.failovers:
                st.cached = resp.cached_tokens
            st.streamed += resp.token_ids
            st.drafted += resp.drafted_tokens
            st.accepted += resp.accepted_tokens
            st.verify_steps += resp.verify_steps
            progress.advance(len(resp.token_ids))
            msg = router_pb2.GenerateResponse(token_ids=resp.token_ids, finish_reason=resp.finish_reason,
                                              logprobs=resp.logprobs)
            if tok is not None:
                msg.text = st.text.decode(resp.token_ids, final=bool(resp.finish_reason))
            if resp.finish_reason:
                msg.usage.CopyFrom(router_pb2.Usage(
                    prompt_tokens=len(req.prompt_ids), cached_tokens=st.cached, completion_tokens=len(st.streamed),
                    cluster_id=cluster, failovers=st.failovers, drafted_tokens=st.drafted,
                    accepted_tokens=st.accepted, verify_steps=st.verify_steps))
                yield msg
                return Ending.FINISHED
            yield msg
        raise ConnectionError(f"cluster {cluster} ended the stream of {req.request_id} without finishing")
    except grpc.RpcError as e:
        if not context.is_active():
            return Ending.CLIENT_GONE
        if watch is not None and watch.fault:
            log.warning("request %s on %s: %s", req.request_id, cluster, watch.fault)
            return Ending.FAULT
        if e.code() == grpc.StatusCode.INTERNAL:  # the engine's text stays in the log: the client gets an id
            incident = uuid.uuid4().hex[:12]
            log.warning("request %s failed on %s (incident %s): %s", req.request_id, cluster, incident, e.details())
            context.abort(e.code(), f"this request failed on cluster {cluster} (incident {incident}); the cluster "
                                    f"serves on, and the same request would likely fail again")
        if e.code() in PASS_THROUGH:
            context.abort(e.code(), e.details())
        log.warning("cluster %s failed request %s: %s %s", cluster, req.request_id, e.code(), e.details())
    except ConnectionError as e:
        log.warning("%s", e)
    finally:
        if watch is not None:
            watchdog.unwatch(watch)
    return Ending.FAULT
