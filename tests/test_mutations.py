"""The exactness tests can fail: each local exactness family (tests/mutation_families.py) runs in its own process
under each mutation of the served path (k3serve/engine/mutation.py), and tests/exactness.py must refuse every
applicable one; the same families without a mutation pass (in this process, where the hook is inert)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from k3serve.engine import mutation
from tests.mutation_families import FAMILIES, run

ALL = tuple(FAMILIES)
APPLICABLE = {  # prefix_early needs a prefix hit; every family installs a transferred state and decodes
    "wrong_token": ALL, "kda_scale": ALL, "drop_mla_page": ALL, "prefix_early": ("prefix",),
}
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ckpts(tiny_ckpt, tiny_trained_mxfp4_ckpt, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("mutations") / "ckpts.json"
    path.write_text(json.dumps({"tiny": tiny_ckpt, "mxfp4": tiny_trained_mxfp4_ckpt}))
    return path


@pytest.fixture(scope="module")
def mutated(ckpts) -> dict[str, dict[str, str]]:
    """Every mutation's families, one process each, run side by side."""
    procs = {}
    for kind in mutation.KINDS:
        out = ckpts.parent / f"{kind}.json"
        env = dict(os.environ, K3SERVE_TEST_MUTATION=kind, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        procs[kind] = (out, subprocess.Popen([sys.executable, "-m", "tests.mutation_families", str(out), str(ckpts),
                                              *APPLICABLE[kind]], cwd=ROOT, env=env, stderr=subprocess.PIPE,
                                             text=True))
    results = {}
    for kind, (out, proc) in procs.items():
        _, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"{kind}: the family runner failed:\n{err[-3000:]}"
        results[kind] = json.loads(out.read_text())
    return results


def test_the_families_pass_without_a_mutation(ckpts):
    assert mutation.ACTIVE == "", "run the suite without K3SERVE_TEST_MUTATION"
    assert run(list(ALL), json.loads(ckpts.read_text())) == {f: "exact" for f in ALL}


@pytest.mark.parametrize("kind", mutation.KINDS)
def test_every_mutation_fails_the_exactness_check_of_every_family(mutated, kind):
    got = mutated[kind]
    assert set(got) == set(APPLICABLE[kind])
    missed = {family: r for family, r in got.items() if not r.startswith("exactness:")}
    assert not missed, f"{kind}: not refused by tests/exactness.py: {missed}"


def test_an_unknown_mutation_is_refused_at_import():
    env = dict(os.environ, K3SERVE_TEST_MUTATION="wrong_tokens", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", "import k3serve.engine.mutation"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "K3SERVE_TEST_MUTATION='wrong_tokens' is not one of" in r.stderr


def test_per_request_mode_mutates_only_the_requests_that_name_a_mutation(monkeypatch):
    monkeypatch.setattr(mutation, "ACTIVE", mutation.PER_REQUEST)
    marked = f"tenant~s1-{mutation.marker('wrong_token')}-t0-a0"
    assert (mutation.kind_for(marked), mutation.kind_for("tenant~s1-t0-a0")) == ("wrong_token", "")
    assert mutation.resume_point(1024, 512, marked) == 1024  # another kind's call site leaves it alone
    plain = [mutation.token(7, "tenant~s1-t0-a0", step, 8, 259) for step in range(8)]
    mutated = [mutation.token(7, marked, step, 8, 259) for step in range(8)]
    assert plain == [7] * 8 and sorted(mutated) == [7] * 7 + [8]
    assert mutation.resume_point(1024, 512, f"x-{mutation.marker('prefix_early')}") == 512
