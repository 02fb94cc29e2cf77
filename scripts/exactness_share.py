"""Per exactness test, the share of compared steps at which a wrong token would fail: the former rule and
tests/exactness.py's.

    PYTHONPATH=$PWD .venv/bin/python scripts/exactness_share.py tests/engine/test_prefix_hits.py [pytest args]

Runs pytest with a plugin that wraps ``tests.exactness.compare``: for every comparison it also feeds, at each
step d of the reference's run, the reference's stream with token d replaced by the likeliest other token there,
and records whether each rule refuses it. The former rule excused any divergence once a reference router margin
at a position up to the step was below 1e-4, or when moving the two tokens' logits by 1e-4 each flipped the
draw. Prints a markdown table (one row per test function) when the run ends.
"""

from __future__ import annotations

import sys
from collections import defaultdict

import pytest

FORMER_EPS_ROUTER = 1e-4
FORMER_EPS_LOGIT = 2e-4


def former_excuses(ref, d: int, wrong: int) -> bool:
    """Whether the former rule accepted the reference's stream with `wrong` at step d."""
    from k3serve.model.sampling import sample_token

    n = len(ref.prompt)
    if len(ref.router_margin) and float(ref.router_margin[: n + d].min()) < FORMER_EPS_ROUTER:
        return True
    nudged = ref.logits[d].clone()
    nudged[wrong] += FORMER_EPS_LOGIT / 2
    nudged[ref.token_ids[d]] -= FORMER_EPS_LOGIT / 2
    return sample_token(nudged, ref.params, n + d) == wrong


class SharePlugin:
    def __init__(self) -> None:
        self.rows: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])  # cases, steps, former, now

    def pytest_configure(self, config) -> None:
        from tests import exactness

        real = exactness.compare

        def compare(ref, got_tokens, got_logits=None, label="", prefix=False):
            verdict = real(ref, got_tokens, got_logits, label, prefix)
            self.record(exactness, real, ref, len(got_tokens) if prefix else len(ref.token_ids))
            return verdict

        exactness.compare = compare

    def record(self, exactness, real, ref, steps: int) -> None:
        import os

        test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0].split("[")[0]
        tally = (exactness.excuse_tally.checked, exactness.excuse_tally.excused, list(exactness.excuse_tally.notes))
        row = self.rows[test]
        row[0] += 1
        want = list(ref.token_ids)
        for d in range(min(steps, len(want))):
            wrong = next(t for t in ref.logits[d].argsort(descending=True).tolist() if t != want[d])
            stream = want[:d] + [wrong] + want[d + 1:]
            try:
                real(ref, stream)
                now = False
            except AssertionError:
                now = True
            row[1] += 1
            row[2] += not former_excuses(ref, d, wrong)
            row[3] += now
        exactness.excuse_tally.checked, exactness.excuse_tally.excused, exactness.excuse_tally.notes = tally

    def pytest_sessionfinish(self) -> None:
        print("\n| test | comparisons | steps | can fail before | can fail now |\n| --- | --- | --- | --- | --- |")
        for test, (cases, steps, former, now) in sorted(self.rows.items()):
            print(f"| {test} | {cases} | {steps} | {former}/{steps} ({former / steps:.0%}) | "
                  f"{now}/{steps} ({now / steps:.0%}) |")


if __name__ == "__main__":
    sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[1:]], plugins=[SharePlugin()]))
