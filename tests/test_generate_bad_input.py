"""`k3serve generate` refuses bad input with exit code 2 and names what is wrong, in this process (the fast tier):
the same command object the console script runs (tests/cli/ runs it in a subprocess for whole generations)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from k3serve.cli.main import app

runner = CliRunner()


def _generate(*args: str):
    return runner.invoke(app, ["generate", *args], prog_name="k3serve")


def test_generate_bad_input_exits_2(tiny_ckpt):
    out = _generate("--checkpoint", tiny_ckpt, "--prompt-ids", "1,2,99999", "--json")
    assert out.exit_code == 2 and "99999" in out.stderr, out.stderr
    out = _generate("--checkpoint", tiny_ckpt, "--json")
    assert out.exit_code == 2 and "exactly one" in out.stderr, out.stderr


@pytest.mark.parametrize("args,needle", [
    (["--speculative", "ngram", "--num-draft-tokens", "0"], "--num-draft-tokens"),
    (["--speculative", "medusa"], "--speculative"),
    (["--speculative", "eagle3"], "eagle3"),
    (["--speculative", "ngram", "--reference"], "--reference"),
])
def test_generate_bad_speculative_flags_exit_2(tiny_ckpt, args, needle):
    out = _generate("--checkpoint", tiny_ckpt, "--prompt-ids", "1,2", "--json", *args)
    assert out.exit_code == 2 and needle in out.stderr, out.stderr
