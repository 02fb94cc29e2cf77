"""The router's admission gate: uncached-token estimate per session, class choice, reservations."""

import threading
import time

import pytest

from k3serve.router.admission import AdmissionRejected, ClassSpec
from k3serve.router.gate import AdmissionGate

CLASSES = [ClassSpec("short", 4096, inflight_token_budget=10_000, max_concurrent=8, queue_limit=4, max_wait_s=0.3),
           ClassSpec("long", None, inflight_token_budget=8192, max_concurrent=1, queue_limit=0, max_wait_s=0.0)]


@pytest.fixture
def gate(rclient, ns):
    g = AdmissionGate(rclient, ns, CLASSES, lease_ttl_s=5.0)
    yield g
    g.close()


def test_warm_session_counts_only_its_uncached_tokens(gate):
    turn1 = list(range(200)) * 30  # 6000 tokens: a long request when cold
    assert gate.uncached_tokens("s:a", turn1) == 6000
    assert gate.request_class(6000).name == "long"
    gate.record_prompt("s:a", turn1)
    turn2 = turn1 + [7] * 300
    # the cluster holds the session's KDA checkpoint at the last 512-token block end of turn 1 (5632)
    assert gate.uncached_tokens("s:a", turn2) == 6300 - 5632
    assert gate.request_class(gate.uncached_tokens("s:a", turn2)).name == "short"
    # a prompt that does not extend the recorded one gets no credit
    assert gate.uncached_tokens("s:a", [1] + turn2[1:]) == 6300


def test_long_budget_rejects_with_retry_hint_and_release_frees(gate):
    first = gate.admit("c0", "r1", 6000)
    assert first is not None
    with pytest.raises(AdmissionRejected) as err:
        gate.admit("c0", "r2", 6000)
    assert err.value.retry_after_s >= 0
    assert gate.class_stats(["c0"])["long"]["rejected"] == 1
    gate.release(first)
    # the refused request held nothing: whoever comes next gets the room
    assert gate.admit("c0", "r3", 6000) is not None
    assert gate.class_stats(["c0"])["long"]["inflight_requests"] == 1


def test_disabled_gate_admits_everything(rclient, ns):
    g = AdmissionGate(rclient, ns, CLASSES, enabled=False)
    try:
        assert g.admit("c0", "x", 10**6) is None and g.admit("c0", "y", 10**6) is None
    finally:
        g.close()


# ---- issue 19 #3: the estimate uses the serving cluster and the engine's own policy --------------------------
def test_an_exact_repeat_is_estimated_as_the_engine_computes_it(gate):
    prompt = list(range(1024))
    gate.record_prompt("s:r", prompt, "c0")
    # the only checkpoint is at 1024 and a hit must stop strictly before the prompt's end: all 1024 recomputed
    assert gate.uncached_tokens("s:r", prompt, "c0") == 1024
    assert gate.uncached_tokens("s:r", prompt + [5], "c0") == 1  # one more token: the 1024 checkpoint serves


def test_the_estimate_is_for_the_cluster_that_will_serve(gate):
    turn1 = [3] * 10_000
    gate.record_prompt("s:m", turn1, "c0")
    turn2 = turn1 + [4] * 200
    assert gate.uncached_tokens("s:m", turn2, "c0") == 10_200 - 9728  # warm where it ran
    assert gate.uncached_tokens("s:m", turn2, "c1") == 10_200  # the pin moved: cold there
    assert gate.request_class(gate.uncached_tokens("s:m", turn2, "c1")).name == "long"


def test_the_estimate_follows_the_engine_policy_not_a_constant(rclient, ns):
    from k3serve.cluster.deploy import ClusterSpec

    policy = ClusterSpec(prefix_scheme="naive").prefix_policy()  # the object the engine is built with
    g = AdmissionGate(rclient, ns, CLASSES, policy=policy)
    try:
        assert g.policy is policy and policy.block_size == 4096
        turn1 = [1] * 6000
        g.record_prompt("s:n", turn1, "c0")
        assert g.uncached_tokens("s:n", turn1 + [2] * 100, "c0") == 6100 - 4096  # naive: checkpoints every 4096
    finally:
        g.close()


def test_close_waits_for_the_renewer_so_the_client_may_be_closed_after(rclient, ns):
    """A gate's close() returns once its renewer thread has stopped: a beat in progress while the owner closed
    the Redis client had raised in the thread (seen in a full run: ValueError from redis-py's reader)."""
    before = {t for t in threading.enumerate() if t.name == "lease-renewer"}
    g = AdmissionGate(rclient, ns, CLASSES, lease_ttl_s=1.0, renew_interval_s=0.05)
    res = g.admit("c0", "held", 100, remaining_s=lambda: 1.0)  # the renewer has a lease to renew each beat
    time.sleep(0.2)
    g.close()
    mine = {t for t in threading.enumerate() if t.name == "lease-renewer"} - before
    assert not [t for t in mine if t.is_alive()]
    g.release(res)
