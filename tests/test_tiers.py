"""The tier guard: a fast-tier test that starts a process fails, naming the test; the slow list does not rot."""

from __future__ import annotations

import multiprocessing
import re
import subprocess
from pathlib import Path

import pytest

from tests import tiers

ROOT = Path(__file__).resolve().parents[1]


def test_a_subprocess_in_the_fast_tier_is_refused_naming_the_test():
    with pytest.raises(tiers.ProcessInFastTier, match=r"test_tiers\.py::test_a_subprocess.*tests/tiers\.py SLOW"):
        subprocess.run(["true"], check=True)
    assert len(tiers.take()) == 1  # consumed here: the hook would otherwise fail this test even if swallowed


def test_a_worker_process_in_the_fast_tier_is_refused():
    with pytest.raises(tiers.ProcessInFastTier, match="a multiprocessing process"):
        multiprocessing.get_context("spawn").Process(target=print).start()
    assert tiers.take()


def test_a_library_probe_is_not_a_process_of_the_test():
    import ctypes.util

    assert ctypes.util.find_library("c")  # runs ldconfig -p
    assert tiers.take() == []


def test_a_shared_fixture_may_start_its_helper_under_the_allowance():
    with tiers.processes_allowed():
        assert subprocess.run(["true"]).returncode == 0
    assert tiers.take() == []


@pytest.mark.slow
def test_a_slow_test_may_start_processes():
    assert subprocess.run(["true"]).returncode == 0


def test_every_slow_entry_names_a_real_test():
    for entry in tiers.SLOW:
        path, _, name = entry.partition("::")
        target = ROOT / path
        assert target.exists(), entry
        if name:
            assert re.search(rf"^def {re.escape(name)}\(", target.read_text(), re.M), entry


def test_slow_reason_matches_directories_modules_and_single_tests():
    assert tiers.slow_reason("tests/cli/test_output.py::test_x") == "runs the CLI in a subprocess"
    assert tiers.slow_reason("tests/cluster/test_service_e2e.py::test_y[a-b]") is not None
    assert tiers.slow_reason("tests/cluster/test_deploy_config.py::test_z") is None
    assert tiers.slow_reason("tests/kernels/test_x.py::test_y[7-k3-triton]") == "Triton kernels under the interpreter"
    assert tiers.slow_reason("tests/kernels/test_x.py::test_y[7-k3-torch]") is None
    name = "tests/router/test_hashing.py::test_rank_is_deterministic_across_processes"
    assert tiers.slow_reason(name) is not None and tiers.slow_reason(name + "_too") is None
