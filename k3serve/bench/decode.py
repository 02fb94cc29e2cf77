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
"""

from __future__ import annotations

import tempfile
import time

import torch

from k3serve.decode.engine import DecodeConfig, DecodeEngine
from k3serve.engine.block_hash import model_fingerprint
from k3serve.engine.executor import LocalExecutor, WorkerSpec
from k3serve.engine.ops import PoolConfig
from k3serve.contracts.requests import PrefillRequest
from k3serve.contracts.sampling import SamplingParams
from k3serve.model.checkpoint import load_config
from k3serve.model.config import ModelConfig
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


def _decode_rate(ckpt: str, cfg: ModelConfig, batch: int, context: int, steps: int) -> float:
    pools = PoolConfig(kda_slots=batch + 2, mla_pages=batch * (-(-(context + steps + 8) // 64)) + 8)
    prefill = PrefillEngine(cfg, LocalExecutor(WorkerSpec(ckpt, 1, pools)), PrefillConfig(pools, enable_prefix_cache=False),
                            model_fingerprint(cfg.to_hf_dict()))
    params = SamplingParams(max_tokens=steps + 4, ignore_eos=True)
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        prefill.add_request(PrefillRequest(f"b{i}", tuple(torch.randint(0, 256, (context,), generator=g).tolist()),
                                           params))
    handoffs = prefill.run_to_completion()
    prefill.executor.close()
    decode = DecodeEngine(cfg, LocalExecutor(WorkerSpec(ckpt, 1, pools)), DecodeConfig(pools, max_batch=batch))
    for h in handoffs:
        decode.submit(h)
    decode.step()  # warm-up
    t = time.perf_counter()
    for _ in range(steps):
        decode.step()
    return batch * steps / (time.perf_counter() - t)


def run_decode_bench(preset_name: str = "bench", batches: tuple[int, ...] = (1, 8, 32), context: int = 256,
                     steps: int = 8) -> dict:
    with tempfile.TemporaryDirectory(prefix="k3serve-bench-") as d:
        ckpt = str(write_preset_checkpoint(preset_name, d))
        cfg = load_config(ckpt)
        ceiling = copy_gbps()
        tokens_per_s, achieved = {}, {}
        for b in batches:
            rate = _decode_rate(ckpt, cfg, b, context, steps)
            tokens_per_s[str(b)] = rate
            achieved[str(b)] = step_bytes(cfg, b, context) * rate / b / 1e9
    return {"preset": preset_name, "context_tokens": context, "steps": steps, "threads": torch.get_num_threads(),
            "tokens_per_s": tokens_per_s, "copy_gbps": ceiling, "achieved_gbps": achieved,
            "achieved_fraction": {b: g / ceiling for b, g in achieved.items()}}
