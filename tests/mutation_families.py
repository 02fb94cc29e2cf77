"""The smallest case of each local exactness family, for the mutation check (tests/test_mutations.py).

``python -m tests.mutation_families OUT.json CKPTS.json FAMILY ...`` runs each family in this process (its
K3SERVE_TEST_MUTATION, if any, applies: k3serve/engine/mutation.py) and writes, per family, "exact" when every
comparison passed, else the first failure: ``exactness: ...`` (tests/exactness.py refused a stream) or
``error: ...`` (a request failed or an assertion of the family's own test).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

from k3serve.contracts.requests import PrefillRequest
from k3serve.contracts.sampling import SamplingParams
from k3serve.disagg.pipeline import LocalPipeline
from k3serve.engine.spec.config import SpecConfig
from k3serve.engine.spec.ngram import NgramConfig
from k3serve.model.loader import load_model
from tests.exactness import References, random_prompt

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_k=40, seed=5, max_tokens=6, ignore_eos=True)


def tap_logits(pipe: LocalPipeline) -> dict[str, list[torch.Tensor]]:
    """Collect, per request id, the served logits row `[vocab]` that chose each of its tokens."""
    rows: dict[str, list[torch.Tensor]] = defaultdict(list)
    pipe.prefill.logits_tap = pipe.decode.logits_tap = lambda rid, x: rows[rid].extend(x.float().cpu())
    return rows


def _serve(pipe: LocalPipeline, refs: References, cases: list[tuple[str, list[int], SamplingParams]],
           session: str = "") -> dict[str, list[int]]:
    logits = tap_logits(pipe)
    outs = pipe.generate([PrefillRequest(rid, tuple(p), sp, session_id=session) for rid, p, sp in cases])
    for rid, prompt, params in cases:
        assert outs[rid].error is None, f"{rid}: {outs[rid].error}"
        refs.check(prompt, params, outs[rid].token_ids, logits[rid], label=rid)
    assert pipe.decode.slots.num_used == 0 and pipe.decode.pages.num_used == 0
    return {rid: outs[rid].token_ids for rid, _, _ in cases}


def pipeline(ckpts: dict[str, str]) -> None:
    """Prefill -> in-process transfer -> decode, greedy and seeded (tests/engine/test_pipeline.py)."""
    refs = References(load_model(ckpts["tiny"]))
    with LocalPipeline(ckpts["tiny"]) as pipe:
        _serve(pipe, refs, [("pd-greedy", random_prompt(80, 1), GREEDY), ("pd-seeded", random_prompt(70, 2), SEEDED)])


def prefix(ckpts: dict[str, str]) -> None:
    """A second turn resumed from the first turn's 1024-token checkpoint (tests/engine/test_prefix_hits.py)."""
    refs = References(load_model(ckpts["tiny"]))
    with LocalPipeline(ckpts["tiny"]) as pipe:
        turn1 = random_prompt(1100, 11)
        out = _serve(pipe, refs, [("turn1", turn1, GREEDY)], session="m")["turn1"]
        turn2 = turn1 + out + random_prompt(30, 12)
        logits = tap_logits(pipe)
        got = pipe.generate([PrefillRequest("turn2", tuple(turn2), GREEDY, session_id="m")])["turn2"]
        assert got.error is None, got.error
        refs.check(turn2, GREEDY, got.token_ids, logits["turn2"], label="turn2")
        assert got.cached_tokens == 1024, got.cached_tokens


def speculative(ckpts: dict[str, str]) -> None:
    """N-gram drafts verified against the target (tests/spec/test_spec_pipeline.py)."""
    refs = References(load_model(ckpts["tiny"]))
    prompt = random_prompt(40, 301) * 3  # repeated: the n-gram drafter finds matches
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    spec = SpecConfig(num_draft_tokens=3, ngram=NgramConfig(min_n=1, max_n=3))  # single-token matches draft
    with LocalPipeline(ckpts["tiny"], speculative=spec) as pipe:
        _serve(pipe, refs, [("spec", prompt, params)])
        assert pipe.decode.spec_usage.verify_steps > 0, "no draft was verified"


def mxfp4(ckpts: dict[str, str]) -> None:
    """MXFP4 routed experts (tests/engine/test_mxfp4_serving.py)."""
    refs = References(load_model(ckpts["mxfp4"]))
    with LocalPipeline(ckpts["mxfp4"]) as pipe:
        _serve(pipe, refs, [("mx-greedy", list(b"def parse_args("), GREEDY),
                            ("mx-seeded", list(b"class Stack:\n"), SEEDED)])


FAMILIES = {"pipeline": pipeline, "prefix": prefix, "speculative": speculative, "mxfp4": mxfp4}


def run(families: list[str], ckpts: dict[str, str]) -> dict[str, str]:
    """ckpts: "tiny" (the random tiny preset) and "mxfp4" (the MXFP4 PTQ of tiny-trained), as tests/conftest.py
    writes them."""
    out = {}
    for name in families:
        try:
            FAMILIES[name](ckpts)
            out[name] = "exact"
        except AssertionError as e:
            kind = "exactness" if "no run with at most" in str(e) else "error"
            out[name] = f"{kind}: {str(e).splitlines()[0][:300]}"
        except Exception as e:  # a request or engine failure also fails the family's test
            out[name] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    return out


if __name__ == "__main__":
    dest, ckpts, names = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text()), sys.argv[3:]
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        raise SystemExit(f"unknown families {unknown}; known: {sorted(FAMILIES)}")
    dest.write_text(json.dumps(run(names, ckpts)))
