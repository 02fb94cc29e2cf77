"""The main job on embedded defaults (``bash scripts/main.sh``).

Makes a tiny random K3-style checkpoint, sends a few prompts through the local disaggregated path (prefill
TP=2 -> in-process handoff with P->D reshard -> decode TP=1), compares every output with the single-process
reference generator, and prints the generated text. Exits 1 on any token mismatch.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3serve.demo")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--prefill-tp", type=int, default=2)
    ap.add_argument("--decode-tp", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args(argv)
    torch.set_num_threads(2)

    from k3serve.engine.pipeline import LocalPipeline
    from k3serve.engine.requests import PrefillRequest
    from k3serve.engine.sampling import SamplingParams
    from k3serve.model.checkpoint import make_checkpoint
    from k3serve.model.loader import load_model
    from k3serve.model.presets import preset
    from k3serve.model.reference import reference_generate
    from k3serve.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    prompts = ["The Kimi Delta Attention state is", "Disaggregated prefill and decode",
               "A prefix cache hit at 512 tokens"]
    params = [SamplingParams(max_tokens=args.max_tokens, ignore_eos=True),
              SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=args.max_tokens, ignore_eos=True),
              SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)]
    with tempfile.TemporaryDirectory(prefix="k3serve-demo-") as d:
        t0 = time.monotonic()
        ckpt = str(make_checkpoint(preset(args.preset), d, seed=0))
        print(f"checkpoint: preset={args.preset} at {ckpt} ({time.monotonic() - t0:.1f}s)")
        reference = load_model(ckpt)
        reqs = [PrefillRequest(f"req-{i}", tuple(tok.encode(p, add_bos=True)), sp, session_id=f"s{i}")
                for i, (p, sp) in enumerate(zip(prompts, params))]
        t0 = time.monotonic()
        with LocalPipeline(ckpt, args.prefill_tp, args.decode_tp) as pipe:
            outs = pipe.generate(reqs)
        elapsed = time.monotonic() - t0
        mismatches = 0
        for r in reqs:
            out = outs[r.request_id]
            ref = reference_generate(reference, list(r.prompt_ids), r.params)
            same = out.error is None and out.token_ids == ref.token_ids
            mismatches += not same
            print(json.dumps({"request_id": r.request_id, "prompt": tok.decode(r.prompt_ids),
                              "text": tok.decode(out.token_ids), "token_ids": out.token_ids,
                              "equals_reference": same}))
        print(f"prefill TP={args.prefill_tp} -> decode TP={args.decode_tp}: {len(reqs)} requests in {elapsed:.1f}s, "
              f"{mismatches} mismatches against the reference")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
