"""``k3serve bench cuda``: the CUDA path on this machine's GPU (docs/cuda.md); the kernel tests on the GPU are
``scripts/cuda_check.sh``, which runs this too."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer()


@app.command("cuda")
def cuda(out: Path = typer.Option(Path("cuda-check-out"), "--out", help="Folder for cuda_check.json."),
         parts: str = typer.Option("roofline,kernels,model,decode,sweep", "--parts",
                                   help="A subset of roofline,kernels,model,decode,sweep."),
         presets: str = typer.Option("tiny-trained,tiny-linear,bench", "--presets",
                                     help="Presets the model part checks.")) -> None:
    """Rooflines, Triton kernel speed, the model in fp32/bf16 against the CPU reference, the decode step, launch
    sweeps: JSON in --out/cuda_check.json; exits 1 if a part failed, 2 without a CUDA device."""
    from benchmarks.cuda_check import main

    raise typer.Exit(main(["--out", str(out), "--parts", parts, "--presets", presets]))
