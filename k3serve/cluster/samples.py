"""What the served model writes: a few code prompts through a router, greedy and sampled (seeded), their streamed
text, and whether the tokens equal the single-process reference generator's."""

from __future__ import annotations

import grpc

from k3serve.v1 import router_pb2, router_pb2_grpc

SAMPLE_PROMPTS = ("def parse_args(", "import os\nimport sys\n\n\ndef main():\n", "class Stack:\n    def __init__(self")
SAMPLED_TEMPERATURE = 0.8
SAMPLED_SEED = 7


def sample_texts(router: str, checkpoint: str, prompts: tuple[str, ...] = SAMPLE_PROMPTS, max_tokens: int = 64,
                 timeout_s: float = 60.0) -> list[dict]:
    """Each prompt greedy, then sampled at SAMPLED_TEMPERATURE with a fixed seed, through `router` ("host:port"):
    [{prompt, mode, text, tokens, matches_reference}].

    ``text`` joins the streamed messages' ``text`` fields as a client sees them (incremental detokenization);
    sampled runs are compared to the reference too, since randomness is keyed by (seed, position).
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
            for mode, temperature in (("greedy", 0.0), ("sampled", SAMPLED_TEMPERATURE)):
                wire = router_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=temperature,
                                                 seed=SAMPLED_SEED)
                req = router_pb2.GenerateRequest(request_id=f"sample-{i}-{mode}", session_id=f"sample-{i}-{mode}",
                                                 prompt_token_ids=ids, sampling=wire)
                tokens, text = [], []
                for resp in stub.Generate(req, timeout=timeout_s):
                    tokens += resp.token_ids
                    text.append(resp.text)
                # from the wire, as the router reads it: the temperature is a float32 there
                ref = reference_generate(model, ids, SamplingParams.from_proto(wire)).token_ids
                out.append({"prompt": prompt, "mode": mode if mode == "greedy" else
                            f"sampled (temperature {SAMPLED_TEMPERATURE}, seed {SAMPLED_SEED})",
                            "text": "".join(text), "tokens": len(tokens), "matches_reference": tokens == ref})
    return out
