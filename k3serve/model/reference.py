"""The single-process reference generator: the oracle every serving path is tested against.

No prefix cache, no pages, no TP, no transfer: the whole prompt is prefilled at once from a zero state into a
dense latent cache, then one token at a time is decoded with MLA attention in the decompressed form (numerics
mode deterministic: the absorbed form over fixed key blocks, layers/mla_blocked.py, as every other path).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from k3serve.contracts.sampling import SamplingParams
from k3serve.model.sampling import is_stop, sample_token
from k3serve.model.model import HybridModel
from k3serve.model.state import DenseLatentCache, ForwardBatch


class PromptError(ValueError):
    """An unusable prompt; the message names the problem."""


def validate_prompt(prompt_ids: list[int], vocab_size: int, max_len: int) -> None:
    if not prompt_ids:
        raise PromptError("prompt is empty")
    # min / max run in C (a long prompt's per-token Python check was ~0.45 ms per 8K tokens on every request)
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size:
        bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
        raise PromptError(f"prompt token ids must be in [0, {vocab_size}); got {bad[:5]}")
    if len(prompt_ids) >= max_len:
        raise PromptError(f"prompt has {len(prompt_ids)} tokens; the model's context is {max_len}")


@dataclass
class GenerationResult:
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"
    logits: list[torch.Tensor] = field(default_factory=list)  # per generated token: `[vocab]` fp32 that chose it


def reference_generate(model: HybridModel, prompt_ids: list[int], params: SamplingParams,
                       keep_logits: bool = False) -> GenerationResult:
    cfg = model.cfg
    validate_prompt(prompt_ids, cfg.vocab_size, cfg.max_position_embeddings)
    params.validate(cfg.vocab_size)
    kda = model.new_kda_state(1)
    latent = DenseLatentCache(cfg.num_mla_layers, 1)
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=model.device)
    logits = model.forward(ids, ForwardBatch(kda, latent, [0], decode=False))[0]
    pos = len(prompt_ids)
    out: list[int] = []
    kept: list[torch.Tensor] = []
    while True:
        tok = sample_token(logits, params, pos)
        out.append(tok)
        if keep_logits:
            kept.append(logits.cpu())
        if is_stop(tok, params, cfg.eos_token_id):
            return GenerationResult(out, "stop", kept)
        if len(out) >= params.max_tokens or pos + 1 >= cfg.max_position_embeddings:
            return GenerationResult(out, "length", kept)
        step = torch.tensor([[tok]], dtype=torch.long, device=model.device)
        logits = model.forward(step, ForwardBatch(kda, latent, [pos], decode=True))[0]
        pos += 1
