"""Rendezvous hashing: determinism, minimal movement and even spill on failure, bounded load, session keys."""

from __future__ import annotations

import collections
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import xxhash

from k3serve.router.hashing import rank_clusters, score, session_key

CLUSTERS = [f"c{i}" for i in range(8)]
REPO = Path(__file__).resolve().parents[2]


def test_golden_scores_and_rankings():
    # The formula is a contract between router replicas and versions: changing it remaps every session.
    assert score("s:abc", "c0") == xxhash.xxh64_intdigest(b"\x05\x00\x00\x00s:abcc0") == 5158235783648775259
    assert rank_clusters("s:abc", CLUSTERS) == ["c2", "c3", "c7", "c4", "c1", "c0", "c6", "c5"]
    assert rank_clusters("s:session-42", CLUSTERS) == ["c5", "c7", "c3", "c0", "c4", "c2", "c6", "c1"]
    assert rank_clusters("p:00ff", CLUSTERS) == ["c0", "c1", "c7", "c4", "c3", "c2", "c6", "c5"]


def test_rank_is_a_permutation_independent_of_input_order():
    rng = random.Random(0)
    for i in range(200):
        shuffled = CLUSTERS[:]
        rng.shuffle(shuffled)
        ranked = rank_clusters(f"s:{i}", shuffled)
        assert sorted(ranked) == sorted(CLUSTERS)
        assert ranked == rank_clusters(f"s:{i}", CLUSTERS)


def test_rank_is_deterministic_across_processes():
    keys = [f"s:{i}" for i in range(50)]
    code = (
        "import json; from k3serve.router.hashing import rank_clusters; "
        f"print(json.dumps([rank_clusters(k, {CLUSTERS!r}) for k in {keys!r}]))"
    )
    outs = set()
    for seed in ("1", "2"):  # different str-hash seeds must not matter
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=str(REPO))
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                check=True, cwd=REPO).stdout)  # fmt: skip
    assert len(outs) == 1
    assert outs.pop().strip() == str([rank_clusters(k, CLUSTERS) for k in keys]).replace("'", '"')


def test_rank_rejects_duplicates_and_orders_every_cluster():
    with pytest.raises(ValueError):
        rank_clusters("k", ["c0", "c0"])
    assert rank_clusters("k", []) == [] and rank_clusters("k", ["only"]) == ["only"]
    assert rank_clusters("s:abc", CLUSTERS)[:2] == ["c2", "c3"]


def test_no_concatenation_aliasing():
    assert score("ab", "c") != score("a", "bc")


def test_first_choice_is_balanced():
    counts = collections.Counter(rank_clusters(f"s:{i}", CLUSTERS)[0] for i in range(10_000))
    assert set(counts) == set(CLUSTERS)
    assert max(counts.values()) < 1.15 * 10_000 / 8
    assert min(counts.values()) > 0.85 * 10_000 / 8


@pytest.mark.parametrize("removed", ["c0", "c3", "c7"])
def test_removing_a_cluster_moves_only_its_sessions_and_spreads_them(removed):
    sessions = [f"s:{i}" for i in range(10_000)]
    before = {s: rank_clusters(s, CLUSTERS)[:2] for s in sessions}
    survivors = [c for c in CLUSTERS if c != removed]
    after = {s: rank_clusters(s, survivors)[0] for s in sessions}

    moved = [s for s in sessions if after[s] != before[s][0]]
    assert set(moved) == {s for s in sessions if before[s][0] == removed}  # only its own sessions move
    # ... each to its old secondary (so a pin's stored secondary agrees with fresh hashing)
    assert all(after[s] == before[s][1] for s in moved)
    spill = collections.Counter(after[s] for s in moved)
    fair = len(moved) / len(survivors)
    assert set(spill) == set(survivors)  # every survivor takes some
    assert max(spill.values()) <= 1.5 * fair, (spill, fair)


def test_session_key():
    prompt = list(range(1000))
    assert session_key("abc", prompt) == "s:abc"
    k = session_key("", prompt)
    assert k.startswith("p:")
    # Only the first block counts: same first 512 tokens, different tails, same cluster.
    assert session_key("", prompt[:512] + [7] * 100) == k
    assert session_key("", [1] + prompt[1:]) != k
    assert session_key("", prompt, block_size=256) != k
    short = session_key("", [1, 2, 3])
    assert short.startswith("p:") and short == session_key("", [1, 2, 3])
    with pytest.raises(ValueError):
        session_key("", [])
    with pytest.raises(ValueError):
        session_key("", [-1])
    with pytest.raises(ValueError):
        session_key("", [1], block_size=0)
