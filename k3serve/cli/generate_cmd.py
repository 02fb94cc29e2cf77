"""``k3serve generate``: one prompt through the local disaggregated path (or the reference generator)."""

from __future__ import annotations

import json
import sys

import typer

app = typer.Typer(help="Generate tokens from a checkpoint (local prefill -> decode, or the reference).",
                  invoke_without_command=True, no_args_is_help=False)


def _fail(msg: str) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(2)


@app.callback()
def generate(
    checkpoint: str = typer.Option(..., "--checkpoint", help="checkpoint directory"),
    prompt_ids: str = typer.Option("", "--prompt-ids", help="comma-separated token ids"),
    prompt: str = typer.Option("", "--prompt", help="prompt text (byte tokenizer presets)"),
    max_tokens: int = typer.Option(16, "--max-tokens"),
    temperature: float = typer.Option(0.0, "--temperature"),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k"),
    seed: int = typer.Option(0, "--seed"),
    ignore_eos: bool = typer.Option(False, "--ignore-eos"),
    prefill_tp: int = typer.Option(1, "--prefill-tp"),
    decode_tp: int = typer.Option(1, "--decode-tp"),
    reference: bool = typer.Option(False, "--reference", help="run the single-process reference generator"),
    speculative: str = typer.Option("", "--speculative", help="draft with ngram | eagle3 (speculative decoding)"),
    num_draft_tokens: int = typer.Option(3, "--num-draft-tokens", help="drafts per verify step (k)"),
    drafter: str = typer.Option("", "--drafter", help="drafter checkpoint directory (eagle3)"),
    deterministic: bool = typer.Option(False, "--deterministic",
                                       help="numerics: deterministic (bit-identical on every path; docs/numerics.md)"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    import torch

    from k3serve.contracts.numerics import DEFAULT_NUMERICS, DETERMINISTIC
    from k3serve.contracts.requests import PrefillRequest
    from k3serve.contracts.sampling import SamplingError, SamplingParams
    from k3serve.model.checkpoint import CheckpointError, load_config
    from k3serve.model.config import ConfigError
    from k3serve.model.reference import PromptError
    from k3serve.tokenizer import ByteTokenizer

    torch.set_num_threads(max(1, torch.get_num_threads()))
    tok = ByteTokenizer()
    if bool(prompt_ids) == bool(prompt):
        _fail("give exactly one of --prompt-ids and --prompt")
    try:
        ids = [int(x) for x in prompt_ids.split(",") if x.strip()] if prompt_ids else tok.encode(prompt)
    except ValueError:
        _fail("--prompt-ids must be comma-separated integers")
    numerics = DETERMINISTIC if deterministic else DEFAULT_NUMERICS
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, max_tokens=max_tokens,
                            ignore_eos=ignore_eos)
    spec_cfg = None
    if speculative:
        if reference:
            _fail("--speculative runs the serving path; it cannot be combined with --reference")
        from k3serve.engine.spec.config import SpecConfig, make_drafter

        try:
            spec_cfg = SpecConfig(method=speculative, num_draft_tokens=num_draft_tokens, drafter_dir=drafter)
            make_drafter(spec_cfg)  # a drafter that cannot be built is a usage error, reported before any work
        except ValueError as e:
            _fail(str(e).replace("speculative.method", "--speculative").replace("speculative.num_draft_tokens",
                                                                                   "--num-draft-tokens"))
    try:
        cfg = load_config(checkpoint)
        if reference:
            from k3serve.model.loader import load_model
            from k3serve.model.reference import reference_generate

            res = reference_generate(load_model(checkpoint, numerics=numerics), ids, params)
            out_ids, reason, cached = res.token_ids, res.finish_reason, 0
        else:
            from k3serve.disagg.pipeline import LocalPipeline

            with LocalPipeline(checkpoint, prefill_tp, decode_tp, speculative=spec_cfg, numerics=numerics) as pipe:
                res = pipe.generate([PrefillRequest("cli-0", tuple(ids), params)])["cli-0"]
            if res.error:
                _fail(f"{res.error.code}: {res.error.message}")
            out_ids, reason, cached = res.token_ids, res.finish_reason, res.cached_tokens
    except (CheckpointError, ConfigError, PromptError, SamplingError) as e:
        _fail(str(e))
    result = {"token_ids": out_ids, "finish_reason": reason, "prompt_tokens": len(ids), "cached_tokens": cached,
              "path": "reference" if reference else f"prefill_tp={prefill_tp},decode_tp={decode_tp}",
              "numerics": numerics.mode.value}
    if spec_cfg is not None:
        result.update(speculative=spec_cfg.method, num_draft_tokens=spec_cfg.num_draft_tokens,
                      drafted_tokens=res.drafted_tokens, accepted_tokens=res.accepted_tokens,
                      verify_steps=res.verify_steps)
    if cfg.vocab_size == tok.vocab_size:
        result["text"] = tok.decode(out_ids)
    if as_json:
        json.dump(result, sys.stdout)
        sys.stdout.write("\n")
    else:
        typer.echo(result.get("text", " ".join(map(str, out_ids))))
