"""Shared fixtures: tiny checkpoints made once per session, thread caps for a 2-core machine; the test tiers
(tests/tiers.py: which tests are slow, and the guard that keeps processes out of the fast tier)."""

from __future__ import annotations

import os
import platform
import sys

# Triton runs on the CPU only through its interpreter; set before anything imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _exactness_excuse_share():
    """A test fails when more than 1 in 10 of its exactness comparisons needed a near-tie excuse."""
    exactness = sys.modules.get("tests.exactness")
    if exactness is not None:
        exactness.excuse_tally.reset()
    yield
    exactness = sys.modules.get("tests.exactness")
    if exactness is not None:
        exactness.excuse_tally.check_share()
        exactness.excuse_tally.reset()


MOONCAKE_PLATFORMS = {("Linux", "x86_64")}  # where the pinned Mooncake wheel exists (pyproject's mooncake extra)


@pytest.fixture(scope="session")
def mooncake_plane():
    """The Mooncake plane's tests: skipped where its wheel does not exist or with K3SERVE_MOONCAKE=0, an error
    where it should have installed and does not import (a failed install must not leave the run green)."""
    from k3serve.transfer.mooncake.plane import mooncake_available

    why = mooncake_available()
    if not why:
        return
    if (platform.system(), platform.machine()) not in MOONCAKE_PLATFORMS or os.environ.get("K3SERVE_MOONCAKE") == "0":
        pytest.skip(why)
    pytest.fail(f"the Mooncake plane is supported here ({platform.system()} {platform.machine()}) but {why}; "
                f"set K3SERVE_MOONCAKE=0 to skip its tests", pytrace=False)


@pytest.fixture
def one_thread():
    """One torch thread for the test: tiny shapes run as fast on one, and a loaded machine's oversubscription
    (two threads on a busy 2-core box ran training tests 20-50x slower) cannot touch them."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> str:
    from k3serve.model.checkpoint import make_checkpoint
    from k3serve.model.presets import preset

    return str(make_checkpoint(preset("tiny"), tmp_path_factory.mktemp("tiny"), seed=0))


@pytest.fixture(scope="session")
def tiny_trained_mxfp4_ckpt(tmp_path_factory) -> str:
    """The shipped tiny-trained model, PTQ'd to MXFP4 routed experts (OCP scale rule); non-expert tensors stay
    fp32, like every other exactness test's checkpoint (docs/mxfp4.md: bf16 TP exactness is not claimed)."""
    from k3serve.model.presets import write_preset_checkpoint
    from k3serve.model.quantize import quantize_checkpoint

    full = write_preset_checkpoint("tiny-trained", tmp_path_factory.mktemp("tt"))
    return str(quantize_checkpoint(full, tmp_path_factory.mktemp("tt_mxfp4"), "ocp"))


@pytest.fixture(scope="session")
def tiny_linear_ckpt(tmp_path_factory) -> str:
    from k3serve.model.checkpoint import make_checkpoint
    from k3serve.model.presets import preset

    return str(make_checkpoint(preset("tiny-linear"), tmp_path_factory.mktemp("tiny_linear"), seed=1))


@pytest.fixture(scope="session")
def tiny_model(tiny_ckpt):
    from k3serve.model.loader import load_model

    return load_model(tiny_ckpt)


@pytest.fixture(scope="session")
def tiny_linear_model(tiny_linear_ckpt):
    from k3serve.model.loader import load_model

    return load_model(tiny_linear_ckpt)


@pytest.fixture(scope="session")
def tiny_refs(tiny_model):
    """Reference traces of the tiny model (tests/exactness.py), shared by the whole session."""
    from tests.exactness import References

    return References(tiny_model)


# ---------------------------------------------------------------------------------------------------- tiers
from tests import tiers  # noqa: E402


def pytest_configure(config):
    tiers.install()


def pytest_collection_modifyitems(config, items):
    tiers.mark(items)
    _shared_deployment_modules_last(items)


def _shared_deployment_modules_last(items) -> None:
    """The modules of tests/cluster that use its shared deployment (tests/cluster/conftest.py) run after the others
    of that folder: the deployment starts with the first of them and stops with the folder, so its idle actors
    never compete with another module's own deployment. Modules that set SHARED_DEPLOYMENT_FAULTS (they kill parts
    of it) run after the other users (module order otherwise kept)."""

    def shared(item) -> bool:
        defs = getattr(item, "_fixtureinfo", None) and item._fixtureinfo.name2fixturedefs.get("deployment")
        return bool(defs) and defs[-1].baseid == "tests/cluster"

    here = [i for i, item in enumerate(items) if item.nodeid.startswith("tests/cluster/")]
    if not here:
        return
    assert here == list(range(here[0], here[-1] + 1)), "pytest collects a folder's tests together"
    block = [items[i] for i in here]
    users = {item.module.__name__ for item in block if shared(item)}
    block.sort(key=lambda item: (item.module.__name__ in users,  # stable: module order within a group kept
                                 getattr(item.module, "SHARED_DEPLOYMENT_FAULTS", False)))
    items[here[0]:here[-1] + 1] = block


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    tiers.guard_begin(item)
    try:
        yield
    finally:
        tiers.guard_end()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    found = tiers.take()
    if found and not report.failed:  # a swallowed ProcessInFastTier still fails the test
        report.outcome = "failed"
        report.longrepr = "\n".join(found)


# ---------------------------------------------------------------------------------------------------- exit
# Once in three full runs of the suite on a 2-core machine (2026-12-01) the pytest process died with SIGSEGV (rc
# 139) after the summary line "880 passed, 1 skipped": in the interpreter's own teardown, with no Python frame,
# where native objects (Mooncake engines, grpc servers and channels, torch and numba thread pools) are destroyed
# in an order none of them controls; the same tests in a smaller process never crashed (3 runs). So the suite
# ends the way every one of those libraries supports: pytest's summary printed, its plugins unconfigured, the
# atexit handlers run (ray.shutdown, multiprocessing's children, logging), faulthandler on for them, then the
# process exits with pytest's own status without the module teardown. A crash inside an atexit handler still
# fails the run, now with every thread's stack on stderr.
_EXIT_STATUS = pytest.StashKey[int]()


def pytest_sessionfinish(session, exitstatus):
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    status = config.stash.get(_EXIT_STATUS, None)
    if status is None or os.environ.get("K3SERVE_TEST_NORMAL_EXIT") == "1":  # escape hatch: the plain teardown
        return
    import atexit
    import faulthandler
    import sys

    faulthandler.enable(all_threads=True)
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
