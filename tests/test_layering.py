"""The package layering (docs/architecture.md): the core never imports a role, and folders form no cycle.

```
 cli ─▶ cluster ─▶ router, disagg ─▶ prefill, decode ─▶ transfer ─▶ engine ─▶ model ─▶ kernels
                                                                  └──────────┴─▶ contracts (the floor)
```
Imports are read from the source (every `import` / `from ... import`, also inside functions), so a lazy import
cannot hide an edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

import k3serve

ROOT = Path(k3serve.__file__).parent
ROLES = {"prefill", "decode", "transfer", "router", "cluster"}
CORE = {"model", "engine", "contracts", "kernels"}
GENERATED = {"v1", "internal", "proto"}  # generated protobuf packages: leaves


def _folder(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "k3serve" or len(parts) < 2:
        return None
    return parts[1] if (ROOT / parts[1]).is_dir() else "<top>"


def _edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        src = rel.parts[0] if len(rel.parts) > 1 else "<top>"
        if src in GENERATED:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                dst = _folder(name)
                if dst is not None and dst != src and dst not in GENERATED:
                    edges.setdefault(src, set()).add(dst)
    return edges


def test_core_imports_no_role():
    edges = _edges()
    bad = {src: sorted(edges.get(src, set()) & ROLES) for src in CORE}
    assert not any(bad.values()), f"core packages import roles: {bad}"


def test_no_import_cycle_between_folders():
    edges = _edges()
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for start in sorted(edges):
        if start not in state and (cycle := visit(start)):
            raise AssertionError(f"import cycle between folders: {' -> '.join(cycle)}")


def test_a_router_process_imports_no_torch():
    """A deployment starts two routers; they validate requests against the model's config only, so their
    module (what Ray imports in the router's process) must not pull in torch (~3 s of CPU per process)."""
    import subprocess
    import sys

    code = ("import sys, k3serve.cluster.router_actor, k3serve.router.server, k3serve.router.gate, "
            "k3serve.router.metrics, k3serve.model.config_file, k3serve.cluster.redis_server; "
            "print(sorted(m for m in ('torch', 'numba', 'safetensors') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", f"the router's modules import {out.stdout.strip()}"
