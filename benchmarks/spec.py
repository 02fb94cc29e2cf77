"""``k3serve bench spec``: speculative decoding against plain decoding, side by side in one run.

Trace (agentic, repeated context): each session is a shell-like transcript over one Python stdlib file: turn 1
shows the tool output (`$ cat FILE` + a chunk of the file) and starts quoting it back (`$ sed -n ...` + the
chunk's first lines); turn 2 appends turn 1's answer and quotes the same output again from another line. What a
model writes there repeats its context, which is what the n-gram drafter feeds on. The turn-2 prompts are
built from the plain run's turn-1 outputs, and every configuration decodes the same prompts.

For each batch size (sessions decoded together) the prompts are prefilled once (not timed) and the handoffs
are decoded by a fresh decode engine per configuration: plain, then k = 1..K with the drafter, then plain again
(the two plain runs bracket load drift; their mean is the baseline). Reported per (k, batch):
``tokens_per_verify`` (tokens emitted per verify step: accepted drafts + 1), ``acceptance_rate``,
``tokens_per_s`` (decode tokens / decode wall time), ``plain_tokens_per_s``, ``speedup`` and ``mismatches``
(requests whose tokens differ from the plain run's; greedy, so 0 unless a near-tie flips).

Held-out acceptance (``heldout``, benchmarks/heldout_accept.py): n-gram and the run's EAGLE-3 methods on
filtered held-out prompts, greedy and at temperature 1 (alpha, tokens per verify under rejection sampling).

Memory: per request and rank, the records this scheme keeps for a verify window of k+1 tokens against k+1
state snapshots (snapshot per draft), at the served model's geometry and at K3's (``K3_GEOMETRY``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.heldout_accept import ContinuationFilter, heldout_section
from k3serve.contracts.requests import PrefillRequest
from k3serve.contracts.sampling import SamplingParams
from k3serve.decode.engine import DecodeConfig, DecodeEngine
from k3serve.engine.block_hash import model_fingerprint, prefix_key
from k3serve.engine.executor import LocalExecutor, WorkerSpec
from k3serve.engine.ops import PoolConfig
from k3serve.engine.spec.config import SpecConfig, make_drafter
from k3serve.model.checkpoint import load_config
from k3serve.model.loader import load_model
from k3serve.model.presets import write_preset_checkpoint
from k3serve.prefill.engine import PrefillConfig, PrefillEngine
from k3serve.tokenizer import ByteTokenizer

TRACE_FILES = ("textwrap.py", "shlex.py", "fnmatch.py", "bisect.py", "glob.py", "heapq.py", "csv.py",
               "colorsys.py")
# K3 (MODEL.md §8): 69 KDA layers, 96 KDA heads of K = 128, short conv kernel 4; TP 8 per decode rank
K3_GEOMETRY = {"kda_layers": 69, "kda_heads": 96, "head_dim": 128, "conv_kernel": 4, "tp": 8}


def _chunk(name: str, size: int) -> str:
    text = (Path(os.__file__).parent / name).read_text()
    start = text.find("\ndef ")
    return text[max(0, start + 1): max(0, start + 1) + size]


def turn_one(name: str, size: int) -> str:
    chunk = _chunk(name, size)
    head = "\n".join(chunk.splitlines()[:3])
    return f"$ cat {name}\n{chunk}\n$ sed -n 1,20p {name}\n{head}\n"


def turn_two(first_prompt: str, first_answer: str, name: str, size: int) -> str:
    lines = _chunk(name, size).splitlines()
    again = "\n".join(lines[3:5])
    return f"{first_prompt}{first_answer}\n$ sed -n 4,20p {name}\n{again}\n"


def memory_report(kda_layers: int, kda_heads: int, head_dim: int, conv_kernel: int, tp: int, k: int) -> dict:
    """Bytes per request per rank for a verify window of k+1 tokens: records vs k+1 state snapshots."""
    heads = kda_heads // tp
    block = head_dim * head_dim + 3 * (conv_kernel - 1) * head_dim
    state = kda_layers * heads * block * 4
    records = PoolConfig.record_slot_bytes(kda_layers, heads, head_dim, k + 1)  # what the record pool holds
    records_bf16 = kda_layers * heads * (k + 1) * (5 * head_dim * 2 + head_dim * 4)
    snapshots = (k + 1) * state
    return {"k": k, "state_bytes": state, "snapshot_per_draft_bytes": snapshots, "records_bytes": records,
            "records_over_snapshot": records / snapshots, "records_bf16_bytes": records_bf16,
            "records_bf16_over_snapshot": records_bf16 / snapshots}


def _decode(cfg, ckpt, pools, handoffs, spec: SpecConfig | None, batch: int) -> tuple[dict[str, list[int]], float, dict]:
    engine = DecodeEngine(cfg, LocalExecutor(WorkerSpec(ckpt, 1, pools)),
                          DecodeConfig(pools, max_batch=batch, speculative=spec))
    try:
        out = {h.request_id: [h.first_token] for h in handoffs}
        t = time.perf_counter()
        for h in handoffs:
            engine.submit(h)
        while engine.has_work:
            for ev in engine.step():
                out[ev.request_id] += list(ev.token_ids)
        elapsed = time.perf_counter() - t
        u = engine.spec_usage
        return out, elapsed, {"drafted": u.drafted_tokens, "accepted": u.accepted_tokens, "steps": u.verify_steps}
    finally:
        engine.executor.close()


def _prefill(cfg, ckpt, pools, prompts: dict[str, str], params: SamplingParams, capture=None) -> list:
    """Handoffs for `prompts`; `capture`: the EAGLE-3 drafters' warm-start rows (ignored by the others)."""
    tok = ByteTokenizer()
    prefill = PrefillEngine(cfg, LocalExecutor(WorkerSpec(ckpt, 1, pools)),
                            PrefillConfig(pools, enable_prefix_cache=False, draft_capture=capture),
                            prefix_key(model_fingerprint(cfg.to_hf_dict()), ""))
    try:
        for rid, text in prompts.items():
            prefill.add_request(PrefillRequest(rid, tuple(tok.encode(text)), params))
        return prefill.run_to_completion()
    finally:
        prefill.executor.close()


def method_specs(preset: str, methods: tuple[str, ...]) -> dict[str, Callable[[int], SpecConfig]]:
    """Row name -> SpecConfig for k. Names: ``ngram``; ``eagle3-lk`` / ``eagle3-kl`` (the drafters shipped for
    `preset`, k3serve/model/eagle3/assets.py); ``eagle3`` = ``eagle3-lk``; ``eagle3=DIR`` (a drafter checkpoint)."""
    out: dict[str, Callable[[int], SpecConfig]] = {}
    for name in methods:
        if name == "ngram":
            out[name] = lambda k: SpecConfig(method="ngram", num_draft_tokens=k)
            continue
        if name.startswith("eagle3="):
            path = name.split("=", 1)[1]
        elif name in ("eagle3", "eagle3-lk", "eagle3-kl"):
            from k3serve.model.eagle3.assets import shipped_drafters

            path = shipped_drafters(preset)["eagle3-kl" if name == "eagle3-kl" else "eagle3-lk"]
            name = "eagle3-lk" if name == "eagle3" else name
        else:
            raise ValueError(f"method must be ngram, eagle3, eagle3-lk, eagle3-kl or eagle3=DIR, got {name!r}")
        out[name] = lambda k, path=path: SpecConfig(method="eagle3", num_draft_tokens=k, drafter_dir=path)
    return out


def run_spec_bench(preset: str = "tiny-trained", max_k: int = 7, batches: tuple[int, ...] = (1, 8),
                   sessions: int = 8, max_tokens: int = 48, chunk_bytes: int = 400,
                   methods: tuple[str, ...] = ("ngram",), heldout: torch.Tensor | None = None,
                   heldout_prompts: int = 8, heldout_seeds: tuple[int, ...] = (0, 1),
                   heldout_filter: ContinuationFilter = ContinuationFilter()) -> dict:
    """Each method against plain decode on the agentic trace: k = 1..max_k at each batch size, plain decode
    measured before and after the speculative runs of each batch (side by side, one run). With `heldout` (the
    held-out token stream, loaded by the command) and heldout_prompts > 0, also the ``heldout`` section
    (benchmarks/heldout_accept.py) for n-gram and every EAGLE-3 method of the run."""
    tok = ByteTokenizer()
    specs = method_specs(preset, methods)
    section = None
    with _checkpoint(preset) as ckpt:
        if heldout is not None and heldout_prompts > 0:
            drafters = {name: make(1).drafter_dir for name, make in specs.items() if make(1).method == "eagle3"}
            section = heldout_section(load_model(ckpt), drafters, heldout, heldout_prompts, seeds=heldout_seeds,
                                      flt=heldout_filter)
        cfg = load_config(ckpt)
        eagle = [f for f in specs.values() if f(1).method == "eagle3"]
        capture = make_drafter(eagle[0](1), cfg).capture if eagle else None
        pools = PoolConfig(kda_slots=sessions * 2 + 2, mla_pages=sessions * 2 * 24 + 8, page_size=64,
                           spec_slots=max(batches), spec_tokens=max_k + 1)
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        names = [TRACE_FILES[i % len(TRACE_FILES)] for i in range(sessions)]
        first = {f"s{i}t1": turn_one(n, chunk_bytes) for i, n in enumerate(names)}
        # turn 1 answers from a plain decode at batch 1 (the trace is the same for every configuration)
        h1 = _prefill(cfg, ckpt, pools, first, params)
        ans, _, _ = _decode(cfg, ckpt, pools, h1, None, 1)
        second = {f"s{i}t2": turn_two(first[f"s{i}t1"], tok.decode(ans[f"s{i}t1"]), n, chunk_bytes)
                  for i, n in enumerate(names)}
        prompts = {**first, **second}
        handoffs = {h.request_id: h for h in _prefill(cfg, ckpt, pools, prompts, params, capture)}
        runs = []
        for batch in batches:
            groups = [list(prompts)[i: i + batch] for i in range(0, len(prompts), batch)]

            def measure(spec):
                outs, secs, usage = {}, 0.0, {"drafted": 0, "accepted": 0, "steps": 0}
                for g in groups:
                    o, s, u = _decode(cfg, ckpt, pools, [handoffs[r] for r in g], spec, batch)
                    outs.update(o)
                    secs += s
                    usage = {key: usage[key] + u[key] for key in usage}
                return outs, secs, usage

            plain_out, plain_a, _ = measure(None)
            spec_runs = [(name, k, *measure(make(k))) for name, make in specs.items() for k in range(1, max_k + 1)]
            _, plain_b, _ = measure(None)
            decoded = sum(len(v) - 1 for v in plain_out.values())  # the first token comes from prefill
            plain_tps = decoded / ((plain_a + plain_b) / 2)
            for name, k, outs, secs, u in spec_runs:
                tps = sum(len(v) - 1 for v in outs.values()) / secs
                runs.append({"method": name, "k": k, "batch": batch,
                             "tokens_per_verify": (u["accepted"] + u["steps"]) / u["steps"] if u["steps"] else 0.0,
                             "acceptance_rate": u["accepted"] / u["drafted"] if u["drafted"] else 0.0,
                             "verify_steps": u["steps"], "drafted_tokens": u["drafted"],
                             "accepted_tokens": u["accepted"], "tokens_per_s": tps,
                             "plain_tokens_per_s": plain_tps, "plain_runs_s": [plain_a, plain_b],
                             "speedup": tps / plain_tps,
                             "mismatches": sum(outs[r] != plain_out[r] for r in outs)})
        ngram = {(r["batch"], r["k"]): r["tokens_per_s"] for r in runs if r["method"] == "ngram"}
        for r in runs:  # the drafters side by side: each row against n-gram at the same batch and k
            if (r["batch"], r["k"]) in ngram:
                r["speedup_vs_ngram"] = r["tokens_per_s"] / ngram[(r["batch"], r["k"])]
        geometry = {"kda_layers": cfg.num_kda_layers, "kda_heads": cfg.kda_num_heads,
                    "head_dim": cfg.kda_head_dim, "conv_kernel": cfg.short_conv_kernel_size, "tp": 1}
        sample = tok.decode(plain_out[f"s0t2"][:max_tokens])
    out = {"preset": preset, "trace": {"sessions": sessions, "turns": 2, "max_tokens": max_tokens,
                                       "files": names, "sample_turn2_answer": sample},
           "torch_threads": torch.get_num_threads(), "load_avg_1m": os.getloadavg()[0], "runs": runs,
           "memory": {"served": {**geometry, **memory_report(**geometry, k=max_k)},
                      "k3": {**K3_GEOMETRY, **memory_report(**K3_GEOMETRY, k=max_k)}}}
    if section is not None:
        out["heldout"] = section
    return out


class _checkpoint:
    """A preset's checkpoint in a temporary directory (the shipped weights for tiny-trained)."""

    def __init__(self, preset: str) -> None:
        import tempfile

        self._tmp = tempfile.TemporaryDirectory(prefix="k3serve-bench-spec-")
        self.path = str(write_preset_checkpoint(preset, Path(self._tmp.name)))

    def __enter__(self) -> str:
        return self.path

    def __exit__(self, *exc: object) -> None:
        self._tmp.cleanup()
