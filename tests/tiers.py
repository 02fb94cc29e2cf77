"""Test tiers: which tests are `slow` (Ray, worker processes, long runs), and a guard that fails any other test
that starts a process, so nothing multi-process can sit unnoticed in the fast tier (`scripts/test.sh --fast`,
i.e. `-m "not slow"`).

A test is slow when its path is listed below (a directory, a module or one test), a parameter of it names a slow
backend (SLOW_PARAMS), or it carries `@pytest.mark.slow`. Everything else runs in both tiers and must stay in this
process.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
import threading
from contextlib import contextmanager

import pytest

# path prefix (relative to the repository root) -> why it is not in the fast tier
SLOW: dict[str, str] = {
    "tests/cluster/test_deterministic_drill.py": "live deployment (Ray)",
    "tests/cluster/test_drain_live.py": "live deployment (Ray)",
    "tests/cluster/test_eagle3_service.py": "live deployment (Ray)",
    "tests/cluster/test_failover_drills.py": "live deployment (Ray)",
    "tests/cluster/test_front_cancel.py": "live deployment (Ray)",
    "tests/cluster/test_lifecycle_live.py": "live deployment (Ray)",
    "tests/cluster/test_mooncake_service.py": "live deployment (Ray, Mooncake)",
    "tests/cluster/test_mxfp4_service.py": "live deployment (Ray)",
    "tests/cluster/test_ray_start.py": "starts Ray",
    "tests/cluster/test_redis_server.py": "starts redis-server processes",
    "tests/cluster/test_readme_client.py": "live deployment (Ray)",
    "tests/cluster/test_router_live.py": "live deployment (Ray)",
    "tests/cluster/test_service_e2e.py": "live deployment (Ray)",
    "tests/cluster/test_mutations_live.py": "live deployment (Ray)",
    "tests/cluster/test_spec_service.py": "live deployment (Ray)",
    "tests/cluster/test_two_nodes.py": "two Ray nodes",
    "tests/cluster/test_http_live.py": "live deployment (Ray)",
    "tests/cluster/test_hostile_live.py": "live deployment (Ray)",
    "tests/test_mutations.py": "a process per mutation",
    "tests/cli/": "runs the CLI in a subprocess",
    "tests/kernels/test_kda_cpu.py::test_without_numba_the_torch_path_runs": "a fresh interpreter",
    "tests/kernels/test_kda_cpu.py::test_the_callers_torch_thread_count_survives_the_kernel": "a fresh interpreter",
    "tests/router/test_hashing.py::test_rank_is_deterministic_across_processes": "fresh interpreters",
    "tests/transfer/test_mooncake_procs.py": "Mooncake engines in worker processes",
    "tests/bench/test_bench_smoke.py": "runs whole benches",
    "tests/bench/test_cuda_check_cpu.py::test_model_part_on_the_cpu_compares_equal_paths_as_equal":
        "the CUDA check's model part (generations)",
    "tests/bench/test_bench_spec.py": "runs a whole bench",
    "tests/bench/test_numerics_cpu.py": "runs a whole bench",
    "tests/kernels/test_bench_kernels.py": "runs a whole bench",
    "tests/train/test_train_smoke.py": "a training run",
    "tests/train/test_qat.py": "a training run",
    "tests/eagle3/test_drafter_train.py": "a training run",
    "tests/engine/test_pipeline.py": "pipelines of real requests",
    "tests/engine/test_prefill_interleave.py": "long prompts through the prefill engine",
    "tests/kernels/test_kda_triton.py": "Triton kernels under the interpreter",
    "tests/model/test_cpu_gemm.py::test_a_model_on_either_library_serves_the_same_greedy_tokens": "generations",
    "tests/model/test_model_paths.py::test_prefill_then_decode_equals_reference": "18 generations vs the reference",
    "tests/engine/test_deterministic_paths.py": "deterministic pipelines on every path",
    "tests/engine/test_deterministic_packed.py": "deterministic pipelines on every path",
    "tests/engine/test_prefix_hits.py": "multi-turn pipelines",
    "tests/spec/test_deterministic_spec.py": "deterministic speculative pipelines",
    "tests/eagle3/test_eagle3_serving.py": "speculative pipelines",
    "tests/train/test_model_grad.py": "whole-model finite differences",
    "tests/router/test_budget_invariant.py": "restarts redis-server",
    "tests/router/test_membership.py::test_view_keeps_last_membership_when_redis_is_down": "stops redis-server",
    "tests/router/test_membership.py::test_redis_restart_agents_reregister_and_view_recovers": "restarts redis-server",
    "tests/router/test_membership.py::test_the_private_redis_needs_its_generated_password_and_never_shows_it":
        "its own redis-server",
    "tests/router/test_router_service.py::test_redis_errors_of_any_kind_degrade_like_an_outage": "own redis-server",
    "tests/engine/test_mxfp4_serving.py": "TP worker processes",
    "tests/engine/test_op_errors.py::test_multiproc_op_failed_vs_worker_died": "TP worker processes",
    "tests/spec/test_spec_pipeline.py::test_scripted_drafts_equal_reference": "TP worker processes",
    "tests/spec/test_spec_pipeline.py::test_ngram_equals_reference": "TP worker processes",
    "tests/train/test_trained_serving.py::test_cluster_path_equals_reference": "TP worker processes",
    "tests/train/test_trained_serving.py::test_serving_logprobs_give_eval_bits_per_byte": "TP worker processes",
    "tests/transfer/test_loopback_acceptance.py": "sender and receiver processes",
    "tests/transfer/test_layerwise_prefill.py": "TP worker processes",
    "tests/transfer/test_mooncake_layerwise.py": "TP worker processes",
    "tests/transfer/test_bench_transfer.py": "sender and receiver processes",
    "tests/transfer/test_faults.py::test_retried_transfer_installs_and_decodes_like_the_reference": "processes",
    "tests/transfer/test_faults.py::test_killed_receiver_fails_cleanly_then_a_new_transfer_succeeds": "processes",
    "tests/transfer/test_faults.py::test_killed_sender_is_replaced_and_the_transfer_completes": "processes",
    "tests/transfer/test_faults.py::test_killed_sender_that_never_returns_is_cancelled_by_the_driver": "processes",
    "tests/test_layering.py::test_a_router_process_imports_no_torch": "imports in a fresh interpreter",
}

# Short probes library code runs and waits for (ctypes.util.find_library asks ldconfig, or gcc / ld / objdump;
# platform asks uname): not a second process doing the test's work, so the guard lets them through.
PROBES = frozenset({"ldconfig", "gcc", "cc", "ld", "objdump", "uname"})

# a word in a test's parameter id -> why such cases are not in the fast tier
SLOW_PARAMS: dict[str, str] = {"triton": "Triton kernels under the interpreter"}

_state = threading.local()
_lock = threading.Lock()
_active: dict[str, object] = {"item": None, "allowed": 0, "violations": []}


class ProcessInFastTier(RuntimeError):
    """A test outside the slow tier started a process."""


@contextmanager
def processes_allowed():
    """Let a shared fixture start its helper process (e.g. the router tests' one redis-server per session)."""
    with _lock:
        _active["allowed"] += 1
    try:
        yield
    finally:
        with _lock:
            _active["allowed"] -= 1


def _check(what: str, argv0: str = "") -> None:
    if os.path.basename(argv0) in PROBES:
        return
    item = _active["item"]
    if item is None or _active["allowed"] or getattr(_state, "inside", False):
        return
    msg = (f"{item} started {what}, but it is in the fast tier: list it in tests/tiers.py SLOW (or mark it "
           f"slow), or start the process from a shared fixture under tiers.processes_allowed()")
    _active["violations"].append(msg)
    raise ProcessInFastTier(msg)


def _argv0(name: str, args: tuple) -> str:
    """The program a ``Popen._execute_child(self, args, executable, ...)`` call runs ("" for other calls)."""
    if name != "_execute_child" or len(args) < 2:
        return ""
    argv = args[1]
    if isinstance(argv, (str, bytes, os.PathLike)):
        argv = str(argv).split()
    return os.fsdecode(argv[0]) if argv else ""


def _wrap(owner, name: str, what: str) -> None:
    real = getattr(owner, name, None)
    if real is None:
        return

    def guarded(*args, **kwargs):
        _check(what, _argv0(name, args))
        _state.inside = True  # Popen -> fork_exec and Process.start -> Popen must not report twice
        try:
            return real(*args, **kwargs)
        finally:
            _state.inside = False

    setattr(owner, name, guarded)


def install() -> None:
    """Patch every way this interpreter starts a process (Ray, redis-server and worker pools all go through
    these)."""
    _wrap(subprocess.Popen, "_execute_child", "a subprocess")
    _wrap(multiprocessing.process.BaseProcess, "start", "a multiprocessing process")
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp"):
        _wrap(os, name, f"os.{name}")


def slow_reason(nodeid: str) -> str | None:
    params = nodeid.partition("[")[2].rstrip("]").split("-")
    for word, why in SLOW_PARAMS.items():
        if word in params:
            return why
    for prefix, why in SLOW.items():
        if prefix.endswith("/"):
            if nodeid.startswith(prefix):
                return why
        elif nodeid == prefix or nodeid.startswith((prefix + "::", prefix + "[")):
            return why
    return None


def mark(items: list[pytest.Item]) -> None:
    for item in items:
        why = slow_reason(item.nodeid)
        if why is not None:
            item.add_marker(pytest.mark.slow(reason=why))


def guard_begin(item: pytest.Item) -> None:
    with _lock:
        _active["item"] = None if item.get_closest_marker("slow") else item.nodeid
        _active["violations"] = []


def take() -> list[str]:
    """The violations of the current phase (setup, call or teardown), cleared."""
    with _lock:
        found, _active["violations"] = list(_active["violations"]), []
    return found


def guard_end() -> None:
    with _lock:
        _active["item"], _active["violations"] = None, []
