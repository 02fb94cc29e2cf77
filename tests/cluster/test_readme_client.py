"""The README's gRPC client snippet, copied out of README.md and run against the shared live deployment; and the
main job's samples (greedy and sampled) against the reference generator."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

from k3serve.cluster.samples import SAMPLE_PROMPTS, sample_texts
from k3serve.contracts.sampling import SamplingParams
from k3serve.tokenizer import ByteTokenizer
from k3serve.v1 import router_pb2

README = Path(__file__).resolve().parents[2] / "README.md"


def _snippet() -> str:
    text = README.read_text()
    section = text.split("## Sending a request (gRPC)", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1, "README's 'Sending a request (gRPC)' must hold exactly one python block"
    return blocks[0]


def test_the_readme_client_snippet_streams_the_reference_tokens(deployment, reference_refs, tmp_path, monkeypatch):
    endpoints = tmp_path / "k3serve.json"  # what `k3serve serve --endpoints-file` writes
    endpoints.write_text(json.dumps({"routers": deployment.router_addresses}))
    monkeypatch.setenv("K3SERVE_ENDPOINTS", str(endpoints))
    scope: dict = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(_snippet(), str(README), "exec"), scope)
    request = scope["request"]
    prompt = ByteTokenizer().encode(request.prompt_text, add_bos=True)  # what the router does with prompt_text
    reference_refs.check(prompt, SamplingParams.from_proto(request.sampling), scope["tokens"], label="readme")
    last = scope["reply"]
    assert isinstance(last, router_pb2.GenerateResponse) and scope["tokens"] and scope["text"]
    assert last.finish_reason in ("length", "stop") and last.usage.completion_tokens == len(scope["tokens"])
    assert last.usage.prompt_tokens == len(prompt)
    assert printed.getvalue().startswith("def parse_args(" + scope["text"])


def test_the_main_jobs_samples_are_greedy_and_sampled_and_equal_the_reference(deployment):
    got = sample_texts(deployment.router_addresses[0], deployment.checkpoint, max_tokens=24)
    assert [(s["prompt"], s["mode"].split()[0]) for s in got] == [(p, m) for p in SAMPLE_PROMPTS
                                                                   for m in ("greedy", "sampled")]
    assert all(s["matches_reference"] and s["tokens"] == 24 and s["text"] for s in got), got
    greedy, sampled = got[0::2], got[1::2]
    assert [g["text"] for g in greedy] != [s["text"] for s in sampled]  # sampling is not the greedy run again
