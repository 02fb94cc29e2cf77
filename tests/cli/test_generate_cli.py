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


def test_generate_bad_input_exits_2(tiny_ckpt):
    out = _run("generate", "--checkpoint", tiny_ckpt, "--prompt-ids", "1,2,99999", "--json")
    assert out.returncode == 2 and "99999" in out.stderr
    out = _run("generate", "--checkpoint", tiny_ckpt, "--json")
    assert out.returncode == 2 and "exactly one" in out.stderr
