"""What the served model writes: a few code prompts through a router, their streamed text, and whether the
tokens equal the single-process reference generator's (greedy)."""

from __future__ import annotations

import grpc

from k3serve.v1 import router_pb2, router_pb2_grpc

SAMPLE_PROMPTS = ("def parse_args(", "import os\nimport sys\n\n\ndef main():\n", "class Stack:\n    def __init__(self")


def sample_texts(router: str, checkpoint: str, prompts: tuple[str, ...] = SAMPLE_PROMPTS, max_tokens: int = 64,
                 timeout_s: float = 60.0) -> list[dict]:
    """Greedy generations through `router` ("host:port"): [{prompt, text, tokens, matches_reference}].

    ``text`` joins the streamed messages' ``text`` fields as a client sees them (incremental detokenization).
    """
    from k3serve.contracts.sampling import SamplingParams
    from k3serve.model.loader import load_model
    from k3serve.model.reference import reference_generate

    model = load_model(checkpoint)
    out = []
    with grpc.insecure_channel(router) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        for i, prompt in enumerate(prompts):
            ids = list(prompt.encode("utf-8"))
            req = router_pb2.GenerateRequest(request_id=f"sample-{i}", session_id=f"sample-{i}",
                                             prompt_token_ids=ids,
                                             sampling=router_pb2.SamplingParams(max_tokens=max_tokens,
                                                                                ignore_eos=True))
            tokens, text = [], []
            for resp in stub.Generate(req, timeout=timeout_s):
                tokens += resp.token_ids
                text.append(resp.text)
            ref = reference_generate(model, ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True)).token_ids
            out.append({"prompt": prompt, "text": "".join(text), "tokens": len(tokens),
                        "matches_reference": tokens == ref})
    return out
