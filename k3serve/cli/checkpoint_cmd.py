"""``k3serve checkpoint``: make random checkpoints from presets, inspect checkpoints and configs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NoReturn

import typer

from k3serve.model.checkpoint import inspect_checkpoint, make_checkpoint
from k3serve.model.presets import PRESETS, TRAINED, preset, write_preset_checkpoint
from k3serve.model.quant_config import MXFP4_FORMAT

app = typer.Typer(help="Make and inspect checkpoints.", no_args_is_help=True, pretty_exceptions_enable=False)


def fail(msg: str) -> NoReturn:
    """One line on stderr, exit code 2."""
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(2)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def human_count(n: float) -> str:
    for unit in ("", "K", "M", "B"):
        if abs(n) < 1000:
            return f"{n:.0f}{unit}" if unit == "" else f"{n:.2f}{unit}"
        n /= 1000
    return f"{n:.2f}T"


@app.command()
def make(
    preset_name: str = typer.Option(..., "--preset", help=f"One of: {', '.join(PRESETS)}."),
    out: Path = typer.Option(..., "--out", help="Output directory (created; old weight files replaced)."),
    seed: int = typer.Option(0, "--seed", help="Values depend only on (seed, tensor name)."),
    shards: int = typer.Option(1, "--shards", help="Number of safetensors files."),
    dtype: str = typer.Option(None, "--dtype", help="Override the preset's torch_dtype (float32, bfloat16)."),
    quant: str = typer.Option("", "--quant", help="'mxfp4': routed experts as MXFP4 (OCP scale rule)."),
) -> None:
    """Write a checkpoint of a preset: config.json + safetensors (random values; shipped ones for tiny-trained)."""
    try:
        if quant not in ("", "mxfp4"):
            raise ValueError(f"--quant must be 'mxfp4', got {quant!r}")
        cfg = preset(preset_name)
        if preset_name in TRAINED:
            if dtype:
                raise ValueError(f"--dtype does not apply to the trained preset {preset_name!r}")
            if quant:
                raise ValueError(f"--quant does not apply to the trained preset {preset_name!r}: use "
                                 "`checkpoint quantize` on it")
            path = write_preset_checkpoint(preset_name, out, seed=seed, shards=shards)
        else:
            if dtype:
                cfg = cfg.replace(torch_dtype=dtype)
            if quant:
                cfg = cfg.replace(quantization=MXFP4_FORMAT, quant_scale_rule="ocp")
            path = make_checkpoint(cfg, out, seed=seed, shards=shards)
        info = inspect_checkpoint(path)
    except (ValueError, OSError) as e:  # ConfigError and CheckpointError are ValueErrors
        fail(str(e))
    typer.echo(str(path))
    typer.echo(
        f"{preset_name} ({info['model_type']}, {cfg.torch_dtype}{', MXFP4 experts' if quant else ''}): "
        f"{info['num_layers']} layers "
        f"({info['num_kda_layers']} KDA + {info['num_mla_layers']} MLA), {info['num_tensors']} tensors, "
        f"{human_count(info['num_params'])} params, {human_bytes(info['weights_bytes'])} in {info['num_files']} "
        f"file(s), seed {seed}"
    )


def _table(info: dict[str, Any]) -> str:
    rows: list[tuple[str, str]] = [
        ("path", info["path"]),
        ("model_type", info["model_type"]),
        ("layers", f"{info['num_layers']} ({info['num_kda_layers']} KDA + {info['num_mla_layers']} MLA)"),
        ("mla_layers (0-idx)", ", ".join(map(str, info["mla_layers"]))),
        ("hidden_size", str(info["hidden_size"])),
        ("vocab_size", str(info["vocab_size"])),
        ("num_experts", str(info["num_experts"])),
        ("torch_dtype", info["torch_dtype"]),
        ("quantization", info.get("quantization") or "none"),
        ("tensors", f"{info['num_tensors']:,}"),
        ("params", f"{info['num_params']:,} ({human_count(info['num_params'])})"),
        ("KDA state / request", f"{info['kda_state_bytes_per_request']:,} B "
                                f"({human_bytes(info['kda_state_bytes_per_request'])}, fp32)"),
        ("MLA cache / token", f"{info['mla_bytes_per_token']:,} B (bf16)"),
        ("weights", "present" if info["weights_present"] else "none"),
        ("expected size", f"{info['expected_weights_bytes']:,} B ({human_bytes(info['expected_weights_bytes'])}; "
                          f"{human_bytes(info['bf16_weights_bytes'])} in bf16)"),
    ]
    if info.get("quantization"):
        rows += [
            ("MXFP4 weights", f"{info['mxfp4_weights']:,} routed expert weights, {human_count(info['mxfp4_params'])} "
                              f"params, {human_bytes(info['mxfp4_bytes'])} (packed + scales; "
                              f"{human_bytes(info['routed_expert_bf16_bytes'])} in bf16)"),
            ("scale rule", info.get("quant_scale_rule") or "not recorded"),
            ("ignore list", f"targets {info['ignore_list_targets']:,} Linear weights; "
                            f"{info['ignore_list_targets_kept_full_precision']:,} of them stay full precision "
                            f"({', '.join(info['ignore_list_kept_sample'])})"),
        ]
        if info["weights_present"]:
            rows.append(("MXFP4 tensors present", f"{info['mxfp4_tensors_present']:,} "
                                                  f"({human_bytes(info['mxfp4_bytes_present'])})"))
    if info["weights_present"]:
        rows += [
            ("files", f"{info['num_files']} ({human_bytes(info['weights_bytes'])})"),
            ("missing tensors", str(info["missing_tensors"])
             + (f" (e.g. {', '.join(info['missing_sample'])})" if info["missing_tensors"] else "")),
            ("unexpected tensors", str(info["unexpected_tensors"])),
            ("shape mismatches", str(info["shape_mismatches"])),
        ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


@app.command()
def inspect(
    path: Path = typer.Argument(..., help="Checkpoint directory or a bare config.json."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """Summarise a checkpoint or config: layer pattern, sizes, and (if weights exist) what is missing."""
    try:
        info = inspect_checkpoint(path)
    except (ValueError, OSError) as e:
        fail(str(e))
    typer.echo(json.dumps(info, indent=2) if as_json else _table(info))


@app.command()
def quantize(
    src: Path = typer.Option(..., "--in", help="Full-precision checkpoint directory."),
    out: Path = typer.Option(..., "--out", help="Output directory for the MXFP4 checkpoint."),
    fmt: str = typer.Option("mxfp4", "--format", help="Only 'mxfp4' (compressed-tensors mxfp4-pack-quantized)."),
    rule: str = typer.Option("ocp", "--scale-rule", help="'ocp': 2^(floor(log2 amax) - 2); 'round-up': never clips."),
    dtype: str = typer.Option(None, "--dtype", help="Cast the non-expert tensors (default: keep the source's)."),
) -> None:
    """PTQ: routed expert weights to MXFP4 (the scale rule is recorded in the config); the rest copied."""
    from k3serve.model.quantize import quantize_checkpoint

    try:
        if fmt != "mxfp4":
            raise ValueError(f"--format must be 'mxfp4', got {fmt!r}")
        path = quantize_checkpoint(src, out, rule, dtype)
        info = inspect_checkpoint(path)
    except (ValueError, OSError) as e:
        fail(str(e))
    typer.echo(str(path))
    typer.echo(f"{info['mxfp4_weights']} routed expert weights in MXFP4 (scale rule {rule}): "
               f"{human_bytes(info['weights_bytes'])} on disk")


@app.command()
def dequantize(
    src: Path = typer.Option(..., "--in", help="MXFP4 checkpoint directory."),
    out: Path = typer.Option(..., "--out", help="Output directory for the full-precision checkpoint."),
    dtype: str = typer.Option(None, "--dtype", help="Output torch_dtype (default: the source's)."),
) -> None:
    """Back to full-precision routed experts (the exact dequantised values), for interchange and inspection."""
    from k3serve.model.quantize import dequantize_checkpoint

    try:
        path = dequantize_checkpoint(src, out, dtype)
        info = inspect_checkpoint(path)
    except (ValueError, OSError) as e:
        fail(str(e))
    typer.echo(str(path))
    typer.echo(f"full precision ({info['torch_dtype']}): {human_bytes(info['weights_bytes'])} on disk")
