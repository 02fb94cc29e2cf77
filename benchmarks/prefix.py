"""``k3serve bench prefix``: the K3 hybrid prefix cache against the naive scheme on a multi-turn agentic trace.

Both schemes run the same trace through the real prefill engine (tiny model by default): sessions share a
system prompt, then take many short turns, each turn's prompt being the previous prompt + the model's reply +
a small user increment. Reported per scheme:

* ``reuse_ratio``: tokens restored from the cache / tokens ideally reusable at token level (for each prompt the
  longest common prefix with any earlier prompt, capped at len - 1 since the last token must be computed);
* ``checkpoint_to_page_bytes``: bytes of KDA checkpoints held / bytes of MLA pages held at the end, at this
  model's geometry and at full K3 geometry (69 KDA layers x 96 heads, 24 MLA layers x 576 bf16);
* prefill tokens computed and wall time.

Then TTFT of a long prefix with a small increment (default 8192 + 128), cold vs hit, K3 scheme, and of a cold prompt
of the increment alone (the floor a hit can approach): medians of ``ttft_repeats`` rounds on a warm engine, with the
engine's first request reported apart (:func:`ttft_hit_vs_cold`). Beside them, the least the hit can cost over the
short prompt on this machine: its extra attention FLOPs at the machine's measured fp32 matmul peak
(``hit_over_cold_short_floor``, prefix_floor.py).
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time

from benchmarks.prefix_floor import hit_floor, peak_gflops
from benchmarks.numerics_compare import add_default_at_bench_threads, mode_threads, numerics_side_by_side
from k3serve.contracts.numerics import DEFAULT_NUMERICS, DETERMINISTIC, Numerics
from k3serve.engine.block_hash import model_fingerprint, prefix_key
from k3serve.engine.executor import LocalExecutor, WorkerSpec
from k3serve.engine.ops import PoolConfig
from k3serve.contracts.prefix_policy import PrefixCachePolicy
from k3serve.contracts.requests import PrefillRequest
from k3serve.contracts.sampling import SamplingParams
from k3serve.model.checkpoint import load_config
from k3serve.model.config import ModelConfig
from k3serve.model.presets import write_preset_checkpoint
from k3serve.prefill.engine import PrefillConfig, PrefillEngine

# Rounds of the TTFT trio (cold, hit, short) after the warm-up request; their medians are reported.
TTFT_REPEATS = 3

K3_FULL = dict(kda_layers=69, kda_heads=96, head_dim=128, conv=3, mla_layers=24, latent=576, elem=2)


def _lcp(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def agentic_trace(sessions: int, turns: int, system_len: int, increment: tuple[int, int], reply: int,
                  seed: int = 0) -> list[tuple[str, list[int]]]:
    """(session id, prompt) in arrival order: sessions interleave turn by turn, sharing one system prompt."""
    rng = random.Random(seed)
    system = [rng.randrange(256) for _ in range(system_len)]
    history = {f"s{i}": list(system) for i in range(sessions)}
    trace = []
    for _ in range(turns):
        for sid, hist in history.items():
            hist += [rng.randrange(256) for _ in range(rng.randint(*increment))]
            trace.append((sid, list(hist)))
            hist += [rng.randrange(256) for _ in range(reply)]  # the model's reply joins the next prompt
    return trace


def _engine(ckpt: str, cfg: ModelConfig, policy: PrefixCachePolicy, pages: int,
            numerics: Numerics = DEFAULT_NUMERICS) -> PrefillEngine:
    pools = PoolConfig(kda_slots=64, mla_pages=pages, page_size=policy.page_size)
    ex = LocalExecutor(WorkerSpec(ckpt, 1, pools, numerics=numerics))
    return PrefillEngine(cfg, ex, PrefillConfig(pools, policy, step_token_budget=4096, numerics=numerics),
                         prefix_key(model_fingerprint(cfg.to_hf_dict()), ""))


def _held_bytes(engine: PrefillEngine, cfg: ModelConfig) -> dict:
    st = engine.cache.stats()
    ckpt_b = st["checkpoints"] * cfg.num_kda_layers * cfg.kda_num_heads * cfg.kda_head_block_floats * 4
    page_b = st["pages_held"] * engine.config.pools.page_size * cfg.num_mla_layers * cfg.mla_latent_dim * 4
    f = K3_FULL
    full_ckpt = st["checkpoints"] * f["kda_layers"] * f["kda_heads"] * (f["head_dim"] ** 2 + 3 * f["conv"] * f["head_dim"]) * 4
    full_page = st["pages_held"] * engine.config.pools.page_size * f["mla_layers"] * f["latent"] * f["elem"]
    return {"checkpoints": st["checkpoints"], "pages_held": st["pages_held"],
            "checkpoint_bytes": ckpt_b, "page_bytes": page_b,
            "checkpoint_to_page_bytes": ckpt_b / page_b if page_b else None,
            "checkpoint_to_page_bytes_k3_full_geometry": full_ckpt / full_page if full_page else None}


class _TraceRun:
    """One engine taking the trace's requests one at a time (so two of them can alternate request by request),
    with the reuse counts and its own wall time."""

    def __init__(self, ckpt: str, cfg: ModelConfig, policy: PrefixCachePolicy, numerics: Numerics) -> None:
        self.cfg = cfg
        self.engine = _engine(ckpt, cfg, policy, pages=4096, numerics=numerics)
        self.reused = self.ideal = self.computed = 0
        self.wall_s = 0.0
        self.seen: list[list[int]] = []

    def step(self, rid: str, sid: str, prompt: list[int]) -> None:
        self.ideal += min(len(prompt) - 1, max((_lcp(prompt, p) for p in self.seen), default=0))
        self.seen.append(prompt)
        t0 = time.monotonic()
        self.engine.add_request(PrefillRequest(rid, tuple(prompt), SamplingParams(max_tokens=1), session_id=sid))
        (h,) = self.engine.run_to_completion()
        self.wall_s += time.monotonic() - t0
        self.reused += h.cached_tokens
        self.computed += len(prompt) - h.cached_tokens

    def close(self) -> dict:
        out = {"reused_tokens": self.reused, "ideal_reusable_tokens": self.ideal,
               "reuse_ratio": self.reused / self.ideal if self.ideal else 0.0,
               "prefill_tokens_computed": self.computed, "wall_s": self.wall_s,
               **_held_bytes(self.engine, self.cfg)}
        self.engine.executor.close()
        return out


def run_traces(ckpt: str, cfg: ModelConfig, policy: PrefixCachePolicy, trace: list[tuple[str, list[int]]],
               modes: tuple[Numerics, ...]) -> list[dict]:
    """The trace through one engine per numerics mode, the engines alternating request by request (a burst of
    load on the shared cores then lands on both); per mode the reuse counts and the wall time of its own
    requests."""
    runs = [_TraceRun(ckpt, cfg, policy, n) for n in modes]
    for i, (sid, prompt) in enumerate(trace):
        for r in runs:
            r.step(f"t{i}", sid, prompt)
    return [r.close() for r in runs]


def run_trace(ckpt: str, cfg: ModelConfig, policy: PrefixCachePolicy, trace: list[tuple[str, list[int]]],
              numerics: Numerics = DEFAULT_NUMERICS) -> dict:
    return run_traces(ckpt, cfg, policy, trace, (numerics,))[0]


def ttft_hit_vs_cold(ckpt: str, cfg: ModelConfig, prefix_len: int, increment: int,
                     numerics: Numerics = DEFAULT_NUMERICS, repeats: int = TTFT_REPEATS) -> dict:
    """TTFT of a cold ``prefix + increment`` prompt, of a hit on that prefix with a new increment, and of a cold
    prompt of the increment alone (the floor a hit can approach), on one warm engine.

    The engine's first request (a cold prompt of the same size) pays one-time costs a serving engine pays once
    (first touch of the pools, oneDNN primitives and numba dispatch for new shapes): it is reported alone as
    ``first_request_ttft_s`` and not counted. Then ``repeats`` rounds, each on a fresh random prefix (so each
    cold prompt misses): cold, hit, short. The ``*_ttft_s`` figures are the rounds' medians (one number on a
    machine whose runs swing by tens of percent), ``*_samples_s`` every round's figure."""
    return ttft_paired(ckpt, cfg, prefix_len, increment, (numerics,), repeats)[0]


def ttft_paired(ckpt: str, cfg: ModelConfig, prefix_len: int, increment: int, modes: tuple[Numerics, ...],
                repeats: int = TTFT_REPEATS) -> list[dict]:
    """:func:`ttft_hit_vs_cold` for one engine per numerics mode, the engines alternating round by round on the
    same prompts (a burst of load on the shared cores then lands on every mode's round, not on one mode's)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    rng = random.Random(1)
    params = SamplingParams(max_tokens=1)
    engines = [_engine(ckpt, cfg, PrefixCachePolicy(), pages=4096, numerics=n) for n in modes]
    tokens = lambda n: [rng.randrange(256) for _ in range(n)]  # noqa: E731

    def timed(engine: PrefillEngine, rid: str, prompt: list[int]) -> tuple[float, int]:
        t = time.monotonic()
        engine.add_request(PrefillRequest(rid, tuple(prompt), params, session_id="ttft"))
        (h,) = engine.run_to_completion()
        return time.monotonic() - t, h.cached_tokens

    first = tokens(prefix_len + increment)
    samples = [{"first": timed(e, "first", first)[0], "cold": [], "hit": [], "short": [], "cached": []}
               for e in engines]
    for r in range(repeats):
        prefix = tokens(prefix_len)
        # the first token 256 (outside the random 0..255) starts a fresh block chain: nothing of it is cached
        cold, hit, short = prefix + tokens(increment), prefix + tokens(increment), [256] + tokens(increment - 1)
        for e, got in zip(engines, samples):
            got["cold"].append(timed(e, f"cold{r}", cold)[0])
            hit_s, hit_cached = timed(e, f"hit{r}", hit)
            got["hit"].append(hit_s)
            got["cached"].append(hit_cached)
            got["short"].append(timed(e, f"short{r}", short)[0])
    for e in engines:
        e.executor.close()
    out = []
    for got in samples:
        cold_s, hit_s, short_s = (statistics.median(got[k]) for k in ("cold", "hit", "short"))
        out.append({"prefix_tokens": prefix_len, "increment_tokens": increment, "repeats": repeats,
                    "first_request_ttft_s": got["first"], "cold_ttft_s": cold_s, "hit_ttft_s": hit_s,
                    "hit_cached_tokens": min(got["cached"]), "hit_speedup": cold_s / hit_s,
                    "cold_short_ttft_s": short_s, "hit_over_cold_short": hit_s / short_s,
                    "cold_samples_s": got["cold"], "hit_samples_s": got["hit"], "cold_short_samples_s": got["short"]})
    return out


def run_prefix_bench(preset_name: str = "tiny", sessions: int = 3, turns: int = 10, system_len: int = 4096,
                     increment: tuple[int, int] = (32, 160), reply: int = 48, ttft_prefix: int = 8192,
                     ttft_increment: int = 128, deterministic: bool = False, ttft_repeats: int = TTFT_REPEATS) -> dict:
    """deterministic: also run the K3 trace and the TTFT pair in numerics mode deterministic, reported side by
    side with the default mode (``numerics``)."""
    if ttft_repeats < 1:  # before the trace runs, not minutes into it
        raise ValueError(f"ttft_repeats must be >= 1, got {ttft_repeats}")
    with tempfile.TemporaryDirectory(prefix="k3serve-bench-") as d:
        ckpt = str(write_preset_checkpoint(preset_name, d))
        cfg = load_config(ckpt)
        trace = agentic_trace(sessions, turns, system_len, increment, reply)
        k3 = run_trace(ckpt, cfg, PrefixCachePolicy(scheme="k3"), trace)
        naive = run_trace(ckpt, cfg, PrefixCachePolicy(scheme="naive", naive_chunk=4096), trace)
        ttft = ttft_hit_vs_cold(ckpt, cfg, ttft_prefix, ttft_increment, repeats=ttft_repeats)
        # the least a hit can cost over the short prompt at this machine's matmul peak (prefix_floor.py)
        ttft.update(hit_floor(cfg, ttft_prefix, ttft_increment, ttft["cold_short_ttft_s"], ttft["hit_ttft_s"],
                              peak_gflops()))
        numerics = None
        if deterministic:  # both modes at the mode's thread count, their engines alternating (run_traces,
            # ttft_paired; bench/numerics_compare.py)
            figures = lambda tr, tt: {"trace_wall_s": tr["wall_s"], "cold_ttft_s": tt["cold_ttft_s"],  # noqa: E731
                                      "hit_ttft_s": tt["hit_ttft_s"]}
            with mode_threads() as bench_threads:
                modes = (DEFAULT_NUMERICS, DETERMINISTIC)
                k3_same, k3_det = run_traces(ckpt, cfg, PrefixCachePolicy(scheme="k3"), trace, modes)
                ttft_same, ttft_det = ttft_paired(ckpt, cfg, ttft_prefix, ttft_increment, modes, ttft_repeats)
                same, det = figures(k3_same, ttft_same), figures(k3_det, ttft_det)
            numerics = add_default_at_bench_threads(numerics_side_by_side(same, det, lower_is_better=True),
                                                    figures(k3, ttft), bench_threads, lower_is_better=True)
            numerics["deterministic_reuse_ratio"] = k3_det["reuse_ratio"]
    return {"preset": preset_name, "numerics": numerics,
            "trace": {"sessions": sessions, "turns": turns, "system_prompt_tokens": system_len,
                      "increment_tokens": list(increment), "reply_tokens": reply, "requests": len(trace),
                      "prompt_tokens": sum(len(p) for _, p in trace)},
            "k3": k3, "naive": naive, "ttft": ttft, "hit_speedup": ttft["hit_speedup"]}
