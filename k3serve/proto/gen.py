"""Regenerate the Python gRPC code for every .proto under k3serve/proto.

Sources live at ``k3serve/proto/<package path>/<name>.proto``; the generated modules land at
``<repo root>/<package path>/`` so that proto package ``k3serve.v1`` imports as ``k3serve.v1`` (a sub-package of
k3serve; no top-level ``proto`` module that would collide with proto-plus). Run:
``python -m k3serve.proto.gen`` (``--check`` compares instead of writing; a test runs the check).
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
REPO_ROOT = PROTO_ROOT.parent.parent


def proto_files() -> list[Path]:
    return sorted(p.relative_to(PROTO_ROOT) for p in PROTO_ROOT.rglob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc

    files = [str(p) for p in proto_files()]
    args = ["protoc", f"-I{PROTO_ROOT}", f"--python_out={out_dir}", f"--grpc_python_out={out_dir}",
            f"--pyi_out={out_dir}", *files]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    outs = sorted(p.relative_to(out_dir) for p in out_dir.rglob("*") if p.suffix in (".py", ".pyi"))
    return outs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true", help="exit 1 if the committed code is stale")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        outs = generate(Path(tmp))
        stale = [str(o) for o in outs
                 if not (REPO_ROOT / o).exists() or not filecmp.cmp(Path(tmp) / o, REPO_ROOT / o, shallow=False)]
        if args.check:
            if stale:
                print("stale generated files (run python -m k3serve.proto.gen):", *stale, sep="\n  ")
                return 1
            return 0
        for o in outs:
            dst = REPO_ROOT / o
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes((Path(tmp) / o).read_bytes())
        for d in {(REPO_ROOT / o).parent for o in outs}:
            while d != REPO_ROOT and d != REPO_ROOT / "k3serve":
                (d / "__init__.py").touch()
                d = d.parent
    print(f"generated {len(outs)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
