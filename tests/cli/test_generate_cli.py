import json
import subprocess
import sys

import pytest

from k3serve.contracts.sampling import SamplingParams


def _run(*args):
    return subprocess.run([sys.executable, "-m", "k3serve.cli.main", *args], capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("extra", [[], ["--prefill-tp", "2", "--decode-tp", "1"]])
def test_generate_matches_reference(tiny_ckpt, tiny_refs, extra):
    ref = _run("generate", "--checkpoint", tiny_ckpt, "--prompt-ids", "1,2,3", "--max-tokens", "6", "--reference",
               "--json")
    assert ref.returncode == 0, ref.stderr
    want = json.loads(ref.stdout)
    assert len(want["token_ids"]) == 6 or want["finish_reason"] == "stop"
    got = _run("generate", "--checkpoint", tiny_ckpt, "--prompt-ids", "1,2,3", "--max-tokens", "6", "--json", *extra)
    assert got.returncode == 0, got.stderr
    params = SamplingParams(max_tokens=6)  # what generate sends for these flags
    tiny_refs.check([1, 2, 3], params, want["token_ids"], label="generate --reference")  # another process
    tiny_refs.check([1, 2, 3], params, json.loads(got.stdout)["token_ids"], label=f"generate {extra}")


def test_generate_speculative_matches_reference_and_reports_drafts(tiny_ckpt):
    ids = ",".join(["7", "8", "9"] * 6)  # a repeated prompt: the n-gram drafter has matches
    ref = _run("generate", "--checkpoint", tiny_ckpt, "--prompt-ids", ids, "--max-tokens", "10", "--reference",
               "--json")
    got = _run("generate", "--checkpoint", tiny_ckpt, "--prompt-ids", ids, "--max-tokens", "10", "--json",
               "--speculative", "ngram", "--num-draft-tokens", "3")
    assert got.returncode == 0, got.stderr
    out = json.loads(got.stdout)
    assert out["token_ids"] == json.loads(ref.stdout)["token_ids"]
    assert out["verify_steps"] >= 0 and out["drafted_tokens"] >= out["accepted_tokens"] >= 0
    assert out["speculative"] == "ngram" and out["num_draft_tokens"] == 3


def test_generate_deterministic_speculative_equals_its_reference_exactly(tiny_ckpt):
    """--deterministic --speculative: drafts verified with the deterministic operators; the deterministic
    reference's tokens with no tolerance (tests/spec/test_deterministic_spec.py checks the bits)."""
    args = ("generate", "--checkpoint", tiny_ckpt, "--prompt-ids", "5,6,7,5,6,7,5,6", "--max-tokens", "6",
            "--ignore-eos", "--deterministic", "--json")
    ref = _run(*args, "--reference")
    got = _run(*args, "--speculative", "ngram", "--num-draft-tokens", "3")
    assert ref.returncode == 0 and got.returncode == 0, ref.stderr + got.stderr
    want, out = json.loads(ref.stdout), json.loads(got.stdout)
    assert out["numerics"] == "deterministic" and out["speculative"] == "ngram"
    assert out["token_ids"] == want["token_ids"] and len(want["token_ids"]) == 6


def test_generate_deterministic_equals_its_reference_exactly(tiny_ckpt):
    """--deterministic: the TP 2 -> 1 path gives the deterministic reference's tokens with no tolerance."""
    args = ("generate", "--checkpoint", tiny_ckpt, "--prompt-ids", "5,6,7,8,9", "--max-tokens", "6",
            "--temperature", "0.9", "--seed", "3", "--ignore-eos", "--deterministic", "--json")
    ref = _run(*args, "--reference")
    got = _run(*args, "--prefill-tp", "2", "--decode-tp", "1")
    assert ref.returncode == 0 and got.returncode == 0, ref.stderr + got.stderr
    want, out = json.loads(ref.stdout), json.loads(got.stdout)
    assert out["numerics"] == want["numerics"] == "deterministic"
    assert out["token_ids"] == want["token_ids"] and len(want["token_ids"]) == 6
