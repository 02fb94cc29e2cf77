"""pytest plugin: the kernel tests' Triton calls run on a real GPU, without the interpreter.

The kernel tests build their inputs and oracles on the CPU and ask for ``backend="triton"``; under the
suite's ``TRITON_INTERPRET=1`` the Triton kernels then run in the interpreter on those CPU tensors. On a
CUDA machine this plugin makes the same tests run the compiled kernels on the device instead:

    TRITON_INTERPRET=0 python -m pytest -p tests.triton_on_cuda -k triton tests/kernels

Each Triton entry point (the ``*_triton`` functions the dispatchers in ``k3serve.kernels`` call) is
wrapped: its tensor arguments are copied to the GPU, the kernel runs there, every argument the kernel
wrote (in-place commits, pools a kernel must leave untouched) is copied back into the caller's CPU tensor,
and the results come back to the CPU. The tests' assertions, tolerances and oracles are unchanged, so a
kernel that is exact in the interpreter but wrong on the device (masking, shared memory, accumulation) fails
the same assertion it passes on the CPU. ``scripts/cuda_check.sh`` runs it.

Not loaded by the suite: it is only named with ``-p`` on a machine with a GPU.
"""

from __future__ import annotations

import functools
import importlib
import os

import pytest
import torch

# module -> entry points the dispatchers call (kda.py, gate.py, short_conv.py, mla_decode.py, kda_spec.py,
# mxfp4.py import them lazily at call time, so patching the module attribute reaches every call)
ENTRY_POINTS = {
    "k3serve.kernels.kda_triton": ("chunk_kda_triton", "recurrent_kda_triton"),
    "k3serve.kernels.gate_triton": ("kda_gate_triton",),
    "k3serve.kernels.short_conv_triton": ("short_conv_triton",),
    "k3serve.kernels.mla_decode_triton": ("mla_decode_triton",),
    "k3serve.kernels.kda_spec_triton": ("kda_verify_triton", "kda_commit_triton"),
    "k3serve.kernels.mxfp4_triton": ("mxfp4_linear_triton",),
}

# tests whose subject is the CPU without a GPU, which this plugin removes by construction
CPU_ONLY = ("test_unknown_backend_and_triton_without_interpreter",)


def _to_device(x, device):
    return x.to(device) if isinstance(x, torch.Tensor) and x.device.type == "cpu" else x


def _to_host(x):
    if isinstance(x, torch.Tensor):
        return x.cpu()
    if isinstance(x, tuple):
        return tuple(_to_host(v) for v in x)
    if isinstance(x, list):
        return [_to_host(v) for v in x]
    return x


def _write_back(host: torch.Tensor, dev: torch.Tensor) -> None:
    """Copy the device tensor into the caller's CPU tensor where the kernel changed it (NaN-aware)."""
    back = dev.cpu()
    if not torch.equal(back.isnan(), host.isnan()) or not torch.equal(back.nan_to_num(), host.nan_to_num()):
        host.copy_(back)


def on_cuda(fn, device: torch.device, calls: list[int]):
    """``fn`` with its CPU tensor arguments on ``device``, writes mirrored back, results on the CPU; each call
    counted in ``calls[0]``."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        calls[0] += 1
        d_args = [_to_device(a, device) for a in args]
        d_kwargs = {k: _to_device(v, device) for k, v in kwargs.items()}
        out = fn(*d_args, **d_kwargs)
        torch.cuda.synchronize(device)
        with torch.no_grad():
            for host, dev in [*zip(args, d_args), *((kwargs[k], d_kwargs[k]) for k in kwargs)]:
                if isinstance(host, torch.Tensor) and dev is not host:
                    _write_back(host, dev)
        return _to_host(out)

    return run


def pytest_configure(config):
    if os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on"):
        raise pytest.UsageError("tests.triton_on_cuda runs the compiled kernels: set TRITON_INTERPRET=0")
    if not torch.cuda.is_available():
        raise pytest.UsageError("tests.triton_on_cuda needs a CUDA device (torch.cuda.is_available() is False)")
    from k3serve.kernels import _dispatch

    device = torch.device("cuda", torch.cuda.current_device())
    config._triton_calls = [0]      # Triton calls made in this process so far
    config.pluginmanager.register(TritonTests(), "triton_on_cuda_tests")
    for name, fns in ENTRY_POINTS.items():
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # the tests that reach this module then fail on the same import: reported there
            print(f"triton_on_cuda: {name} does not import here ({type(exc).__name__}: {exc})")
            continue
        for fn in fns:
            setattr(module, fn, on_cuda(getattr(module, fn), device, config._triton_calls))
    # the dispatchers refuse CPU tensors for backend="triton" without the interpreter; here they are moved
    _dispatch._interpret_enabled = lambda: True


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="checks the CPU-without-interpreter refusal, which this plugin bypasses")
    for item in items:
        if getattr(item, "originalname", item.name) in CPU_ONLY:
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """The call phase's report carries how many Triton calls the test made (a user property: it reaches the
    xdist controller and the junit XML)."""
    outcome = yield
    if not hasattr(item.config, "_triton_calls"):
        return
    if call.when == "setup":
        item._triton_calls_at_setup = item.config._triton_calls[0]
    elif call.when == "call":
        made = item.config._triton_calls[0] - getattr(item, "_triton_calls_at_setup", 0)
        outcome.get_result().user_properties.append(("triton_calls", made))


class TritonTests:
    """Which tests made Triton calls, and their outcomes (from the reports: in the xdist controller too)."""

    def __init__(self) -> None:
        self.outcomes: dict[str, str] = {}

    def pytest_runtest_logreport(self, report):
        if report.when == "call" and dict(report.user_properties).get("triton_calls", 0):
            self.outcomes[report.nodeid] = report.outcome

    def pytest_terminal_summary(self, terminalreporter):
        passed = sum(o == "passed" for o in self.outcomes.values())
        terminalreporter.write_line(f"triton_on_cuda: {len(self.outcomes)} tests ran Triton kernels on the GPU, "
                                    f"{passed} passed")
        for nodeid, o in sorted(self.outcomes.items()):
            if o != "passed":
                terminalreporter.write_line(f"triton_on_cuda:   {o}: {nodeid}")


def pytest_report_header(config):
    return f"triton_on_cuda: Triton entry points run on {torch.cuda.get_device_name()}"
