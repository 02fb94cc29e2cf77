"""Shutdown drains: SIGTERM of `k3serve serve`, and `ray job stop` of a submitted serve job.

Both run a real deployment in another process (its own Ray), start 8 streaming requests, signal once every
stream has its first token, and require: health NOT_SERVING and new requests UNAVAILABLE while draining, all 8
streams complete with the reference tokens, the drain message printed, a clean exit. The `ray job stop` test
makes one stream long (LONG_TOKENS): the stop takes seconds to reach the job, and the drain must find it running.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cluster.live_clients import (check_refused_while_draining, prompt, start_streams, wait_for_file,
                                        write_deploy)
from tests.cluster.ray_nodes import free_ports, kill_ray_session
from k3serve.contracts.sampling import SamplingParams
from tests.exactness import References

MAX_TOKENS = 48
# `ray job stop` reaches the job through the CLI, the dashboard and the job supervisor: 1.4 s on a quiet 2-core
# host, more when loaded, where 48-token streams had all finished before the drain began (nothing left in flight to
# check). One stream of this length holds the drain open ~10x longer; the other 7 keep MAX_TOKENS (references shared)
LONG_TOKENS = 400
BIN = Path(sys.executable).parent


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def _lengths(long: bool) -> list[int]:
    return [LONG_TOKENS if long and i == 0 else MAX_TOKENS for i in range(8)]


def _streams(address: str, tag: str, long: bool = False):
    prompts = [prompt(30 + 7 * i, 500 + i) for i in range(8)]
    streams = start_streams(address, prompts, _lengths(long), tag)
    for s in streams:
        assert s.first.wait(120), "a stream got no first token"
    return prompts, streams


@pytest.fixture(scope="module")
def refs(tiny_model):
    """Both tests send the same prompts: reference traces computed once (tests/exactness.py)."""
    return References(tiny_model)


def _check_complete(streams, prompts, refs, long: bool = False) -> None:
    for s in streams:
        assert s.done.wait(120)
    for s, p, n in zip(streams, prompts, _lengths(long)):
        assert s.error is None, (s.error, s.details)
        assert s.finish_reason == "length"
        refs.check(p, SamplingParams(max_tokens=n, ignore_eos=True), s.tokens, label=f"stream of {len(p)} tokens")


def test_sigterm_drains_in_flight_streams_and_exits_0(tmp_path, tiny_ckpt, refs):
    deploy = write_deploy(tmp_path / "deploy.yaml", tiny_ckpt)
    ep = tmp_path / "endpoints.json"
    out = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([str(BIN / "k3serve"), "serve", "--config", str(deploy), "--endpoints-file", str(ep)],
                            stdout=out, stderr=subprocess.STDOUT, env=_env(), start_new_session=True)
    try:
        info = wait_for_file(ep, 240, alive=lambda: proc.poll() is None)
        prompts, streams = _streams(info["routers"][0], "sigterm")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert check_refused_while_draining(info["routers"][0], streams)
        _check_complete(streams, prompts, refs)
        rc = proc.wait(timeout=120)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out.seek(0)
    log = out.read()
    assert rc == 0, log[-3000:]
    assert "SIGTERM: draining" in log and "8 stream(s) were in flight, 0 cut" in log, log[-3000:]
    print(f"SIGTERM -> exit 0 in {took:.1f} s; {log.strip().splitlines()[-1]}")


@pytest.mark.skipif(shutil.which("ray", path=str(BIN)) is None, reason="no ray CLI in this environment")
def test_ray_job_stop_drains_the_submitted_serve_job(tmp_path, tiny_ckpt, refs):
    # short temp dir: Ray's socket paths must fit in 107 bytes
    temp_dir = Path(f"/tmp/k3t-{os.getpid()}-{time.monotonic_ns() % 10**6}")
    port, agent, agent_grpc, env_agent, metrics = free_ports(5)
    dash = f"http://127.0.0.1:{port}"
    # the job supervisor SIGKILLs a stopped job after RAY_JOB_STOP_WAIT_TIME_S (3 s by default): it must
    # exceed the deployment's drain_timeout_s, or in-flight streams are cut
    head_env = _env(RAY_AUTH_MODE="token", RAY_JOB_STOP_WAIT_TIME_S="150")
    ray = str(BIN / "ray")
    # its own session (process group), which Ray's daemons keep: the cleanup kills that group (ray_nodes.py)
    head = subprocess.Popen([ray, "start", "--head", "--port=0", "--node-ip-address=127.0.0.1", "--num-cpus=4",
                             "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={port}",
                             # the agent's own ports too: by default 52365 and friends, which another Ray of this
                             # process (the package's shared deployment) may hold, leaving this head without a job
                             # agent ("No available agent to submit job")
                             f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}",
                             f"--runtime-env-agent-port={env_agent}", f"--metrics-export-port={metrics}",
                             f"--temp-dir={temp_dir}", "--disable-usage-stats"],
                            env=head_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    cli_env = _env(RAY_AUTH_MODE="token", RAY_API_SERVER_ADDRESS=dash)
    job = f"k3serve-drain-{os.getpid()}"
    try:  # the finally below cleans up a start that timed out or failed too
        started, _ = head.communicate(timeout=180)
        assert head.returncode == 0, f"ray start failed ({head.returncode}): {started[-3000:]}"
        deploy = write_deploy(tmp_path / "deploy.yaml", tiny_ckpt)
        ep = tmp_path / "endpoints.json"
        submit = [ray, "job", "submit", "--no-wait", "--submission-id", job, "--", "env", "OMP_NUM_THREADS=1",
                  str(BIN / "k3serve"), "serve", "--config", str(deploy), "--endpoints-file", str(ep)]
        deadline = time.monotonic() + 60
        while True:
            sub = subprocess.run(submit, env=cli_env, capture_output=True, text=True, timeout=120)
            # right after `ray start --head` the dashboard may have no job agent yet (its HTTP 500 says "please
            # try again later"; seen when this test ran right after another Ray test): retry only that
            if (sub.returncode == 0 or "No available agent to submit job" not in sub.stdout + sub.stderr
                    or time.monotonic() > deadline):
                break
            time.sleep(2)
        assert sub.returncode == 0, sub.stdout[-2000:] + sub.stderr[-2000:]
        info = wait_for_file(ep, 240)
        prompts, streams = _streams(info["routers"][0], "rayjob", long=True)
        t0 = time.monotonic()
        stop = subprocess.Popen([ray, "job", "stop", job], env=cli_env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        assert check_refused_while_draining(info["routers"][0], streams)
        _check_complete(streams, prompts, refs, long=True)
        stop_out, _ = stop.communicate(timeout=180)
        took = time.monotonic() - t0
        assert stop.returncode == 0, stop_out
        logs = subprocess.run([ray, "job", "logs", job], env=cli_env, capture_output=True, text=True,
                              timeout=60).stdout
        status = subprocess.run([ray, "job", "status", job], env=cli_env, capture_output=True, text=True,
                                timeout=60)
        assert "was stopped" in (status.stdout + status.stderr).lower()
        # at least the long stream was in flight when the signal came (the short ones may have ended by then)
        drained = re.search(r"(\d+) stream\(s\) were in flight, 0 cut", logs)
        assert "SIGTERM: draining" in logs and drained and int(drained[1]) >= 1, logs[-3000:]
        # stopped by the drain, not force-killed at the supervisor's deadline
        sup_logs = "".join(p.read_text(errors="replace") for p in temp_dir.glob("session_*/logs/**/*job*")
                           if p.is_file())
        assert "force-killed" not in sup_logs
        print(f"ray job stop -> stopped in {took:.1f} s; drained: "
              f"{[ln for ln in logs.splitlines() if 'drained in' in ln]}")
    finally:
        left = kill_ray_session(str(temp_dir), [head.pid])
    assert not left, f"Ray processes of this test survived its cleanup: {left}"  # they would slow every later test
