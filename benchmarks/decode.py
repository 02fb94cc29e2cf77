"""``k3serve bench decode``: continuous-batching decode throughput and achieved memory bandwidth.

For each batch size the decode engine runs steps over B requests with a fixed context; tokens/s is B * steps /
time. Decode is memory-bound, so the honest ceiling is the machine's copy bandwidth, measured in the same run
(a large ``Tensor.copy_``, counting bytes read + written). Bytes one step must move are estimated from the
model geometry:

* every non-routed weight once (attention, norms, dense/shared MLPs, router, lm_head; one embedding row per
  request);
* routed experts: the expected number of distinct experts a batch of B tokens selects per MoE layer,
  ``E * (1 - (1 - k/E)^B)``, each expert read once;
* KDA state read and written once per request (``2 * slot bytes``), MLA latent rows read once per request.

Per-step breakdown: a few more steps run under ``torch.profiler``; the model's and the engine's
``record_function`` labels (KDA / MLA attention, MoE / dense FFN, sampling) are summed per step and the rest of
the step is ``overhead`` (embedding, final norm + lm_head, gathers and scatters of the KDA slots, block tables,
op dispatch). The fractions come from the profiled steps (the profiler inflates small ops a little); the
seconds are those fractions of the unprofiled step time.

``gemv_floor`` (batch 1 measured): the step's matrix products alone, each weight read cold by the library GEMV,
and the fraction of the copy bandwidth such a step would reach (decode_floor.py): the ceiling of
``achieved_fraction["1"]`` on this machine's BLAS.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.decode_floor import gemv_floor
from benchmarks.numerics_compare import add_default_at_bench_threads, mode_threads, numerics_side_by_side
from k3serve.contracts.numerics import DEFAULT_NUMERICS, DETERMINISTIC, Numerics
from k3serve.decode.engine import DecodeConfig, DecodeEngine
from k3serve.engine.block_hash import model_fingerprint, prefix_key
from k3serve.engine.executor import LocalExecutor, WorkerSpec
from k3serve.engine.ops import PoolConfig
from k3serve.contracts.requests import PrefillRequest
from k3serve.contracts.sampling import SamplingParams
from k3serve.model.checkpoint import load_config
from k3serve.model.config import ModelConfig
from k3serve.model.loader import load_weights
from k3serve.model.model import PROFILE_LABELS
from k3serve.decode.engine import SAMPLING_LABEL
from k3serve.model.names import SplitKind, checkpoint_specs
from k3serve.model.presets import write_preset_checkpoint
from k3serve.prefill.engine import PrefillConfig, PrefillEngine


def copy_gbps(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best / 1e9


def step_bytes(cfg: ModelConfig, batch: int, context: int, elem: int = 4) -> int:
    """Estimated bytes one decode step moves for `batch` requests at `context` tokens (see module doc)."""
    dense = expert = 0
    for s in checkpoint_specs(cfg):
        if s.split.kind is SplitKind.EXPERT:
            expert = s.numel * elem * 3  # w1, w2, w3 of one expert (all experts are the same size)
        elif not s.name.endswith("embed_tokens.weight"):
            dense += s.numel * elem
    e, k = cfg.num_experts, cfg.num_experts_per_token
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    distinct = e * (1 - (1 - k / e) ** batch)
    slot = cfg.num_kda_layers * cfg.kda_num_heads * cfg.kda_head_block_floats * 4
    mla = cfg.num_mla_layers * context * cfg.mla_latent_dim * elem
    return int(dense + batch * cfg.hidden_size * elem + moe_layers * distinct * expert + batch * (2 * slot + mla))


def _step_breakdown(decode: DecodeEngine, steps: int, step_s: float) -> dict:
    """Profile `steps` decode steps; seconds per step by part, scaled to the unprofiled `step_s`."""
    labels = {**{f"attention_{k}": v for k, v in PROFILE_LABELS.items() if k in ("kda", "mla")},
              "moe": PROFILE_LABELS["moe"], "dense_ffn": PROFILE_LABELS["dense"], "sampling": SAMPLING_LABEL}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            decode.step()
        total = time.perf_counter() - t
    by_name = {v: 0.0 for v in labels.values()}
    for ev in prof.events():
        if ev.name in by_name:
            by_name[ev.name] += ev.cpu_time_total / 1e6
    frac = {k: by_name[v] / total for k, v in labels.items()}
    frac["attention"] = frac["attention_kda"] + frac["attention_mla"]
    frac["overhead"] = max(0.0, 1.0 - frac["attention"] - frac["moe"] - frac["dense_ffn"] - frac["sampling"])
    return {"step_s": step_s, "seconds": {k: f * step_s for k, f in frac.items()}, "fraction": frac}


def decoding_engine(ckpt: str, cfg: ModelConfig, batch: int, context: int, max_tokens: int,
                    numerics: Numerics = DEFAULT_NUMERICS, device: str = "cpu") -> DecodeEngine:
    """A local decode engine holding `batch` requests of `context` random prompt tokens, prefilled and handed
    over, each allowed `max_tokens` more (ignore_eos): what the decode benches time steps of (on `device`)."""
    pools = PoolConfig(kda_slots=batch + 2, mla_pages=batch * (-(-(context + max_tokens + 4) // 64)) + 8)
    prefill = PrefillEngine(cfg, LocalExecutor(WorkerSpec(ckpt, 1, pools, device=device, numerics=numerics)),
                            PrefillConfig(pools, enable_prefix_cache=False, numerics=numerics),
                            prefix_key(model_fingerprint(cfg.to_hf_dict()), ""))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        prefill.add_request(PrefillRequest(f"b{i}", tuple(torch.randint(0, 256, (context,), generator=g).tolist()),
                                           params))
    handoffs = prefill.run_to_completion()
    prefill.executor.close()
    decode = DecodeEngine(cfg, LocalExecutor(WorkerSpec(ckpt, 1, pools, device=device, numerics=numerics)),
                          DecodeConfig(pools, max_batch=batch))
    for h in handoffs:
        decode.submit(h)
    return decode


def _decode_rate(ckpt: str, cfg: ModelConfig, batch: int, context: int, steps: int,
                 numerics: Numerics = DEFAULT_NUMERICS, clock: Callable[[], float] = time.perf_counter
                 ) -> tuple[float, dict]:
    """(tokens/s over `steps` timed steps, the per-step breakdown). clock: wall time by default;
    ``time.thread_time`` gives tokens per CPU-second of this thread (the local executor runs the model here)."""
    profiled = 3
    decode = decoding_engine(ckpt, cfg, batch, context, steps + profiled + 4, numerics)
    decode.step()  # warm-up
    t = clock()
    for _ in range(steps):
        decode.step()
    elapsed = clock() - t
    return batch * steps / elapsed, _step_breakdown(decode, profiled, elapsed / steps)


# Rounds of the default/deterministic side by side: the two modes' engines alternate round by round and each
# mode keeps its best round (load only adds time), so a burst of load on the shared cores moves both modes or
# neither (one sequential run per mode moved the batch-1 ratio 1.48x -> 1.94x between two runs of one tree).
SIDE_BY_SIDE_ROUNDS = 3


def paired_rates(ckpt: str, cfg: ModelConfig, batch: int, context: int, steps: int,
                 rounds: int = SIDE_BY_SIDE_ROUNDS) -> tuple[float, float, list[tuple[float, float]]]:
    """(default tokens/s, deterministic tokens/s, every round's (default, deterministic)) at this thread count:
    one engine per mode, warmed up, then ``rounds`` alternating rounds of ``steps`` timed steps each; each mode's
    rate is its best round's."""
    engines = [decoding_engine(ckpt, cfg, batch, context, rounds * steps + 4, n)
               for n in (DEFAULT_NUMERICS, DETERMINISTIC)]
    for e in engines:
        e.step()  # warm-up
    samples = []
    for _ in range(rounds):
        pair = []
        for e in engines:
            t = time.perf_counter()
            for _ in range(steps):
                e.step()
            pair.append(batch * steps / (time.perf_counter() - t))
        samples.append((pair[0], pair[1]))
    for e in engines:
        e.executor.close()
    return max(a for a, _ in samples), max(b for _, b in samples), samples


def run_decode_bench(preset_name: str = "bench", batches: tuple[int, ...] = (1, 8, 32), context: int = 256,
                     steps: int = 8, deterministic: bool = False) -> dict:
    """deterministic: also measure numerics mode deterministic in the same run (``numerics``: tokens/s of
    both modes by batch size and the slowdown, from :func:`paired_rates`; ``rounds``: every round's pair)."""
    with tempfile.TemporaryDirectory(prefix="k3serve-bench-") as d:
        ckpt = str(write_preset_checkpoint(preset_name, d))
        cfg = load_config(ckpt)
        ceiling = copy_gbps()
        tokens_per_s, achieved, breakdown = {}, {}, {}
        for b in batches:
            rate, breakdown[str(b)] = _decode_rate(ckpt, cfg, b, context, steps)
            tokens_per_s[str(b)] = rate
            achieved[str(b)] = step_bytes(cfg, b, context) * rate / b / 1e9
        numerics = None
        if deterministic:  # both modes at the mode's thread count, batch by batch (bench/numerics_compare.py)
            with mode_threads() as bench_threads:
                same, det, rounds = {}, {}, {}
                for b in batches:
                    same[str(b)], det[str(b)], rounds[str(b)] = paired_rates(ckpt, cfg, b, context, steps)
            numerics = add_default_at_bench_threads(numerics_side_by_side(same, det, lower_is_better=False),
                                                    tokens_per_s, bench_threads, lower_is_better=False)
            numerics["rounds"] = {b: [[round(x, 2) for x in pair] for pair in r] for b, r in rounds.items()}
        floor = None
        if "1" in tokens_per_s:  # the step's GEMVs alone: what batch 1 can reach on this BLAS (decode_floor.py)
            floor = gemv_floor(cfg, load_weights(ckpt), step_bytes(cfg, 1, context), ceiling,
                               1.0 / tokens_per_s["1"])
    return {"preset": preset_name, "numerics": numerics, "context_tokens": context, "steps": steps, "threads": torch.get_num_threads(),
            "tokens_per_s": tokens_per_s, "copy_gbps": ceiling, "achieved_gbps": achieved,
            "achieved_fraction": {b: g / ceiling for b, g in achieved.items()},
            "batch_scaling": {b: r / tokens_per_s[str(batches[0])] for b, r in tokens_per_s.items()},
            "step_breakdown": breakdown, "gemv_floor": floor}
