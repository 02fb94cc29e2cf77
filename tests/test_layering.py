"""The package layering (docs/architecture.md): the core never imports a role, neither files nor folders form an
import cycle, nothing served imports the bench harnesses, and no module outgrows one concept (~600 lines).

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
CHECKOUT = ROOT.parent
MAX_LINES = 600
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


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph (its nodes, the first repeated at the end), or None."""
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
            return cycle
    return None


def _modules() -> dict[str, Path]:
    """Every module of k3serve and of the checkout's benchmarks/, by dotted name (a package by its __init__)."""
    out = {}
    for top in (ROOT, CHECKOUT / "benchmarks"):
        for path in top.rglob("*.py"):
            parts = list(path.relative_to(CHECKOUT).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _file_edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules it imports, read from the source: every import, also inside functions and under
    TYPE_CHECKING. ``from pkg import name`` is an edge to ``pkg.name`` where that is a module, else to ``pkg``; the
    parent packages Python imports on the way are not edges (a package's __init__ is a file like any other)."""

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {}
    for mod, path in modules.items():
        package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str | None] = []
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
                targets = [known(f"{base}.{a.name}") if f"{base}.{a.name}" in modules else known(base)
                           for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [known(a.name) for a in node.names]
            edges.setdefault(mod, set()).update(t for t in targets if t and t != mod)
    return edges


def test_no_import_cycle_between_files():
    cycle = _cycle(_file_edges(_modules()))
    assert cycle is None, f"import cycle between files: {' -> '.join(cycle)}"


def test_no_import_cycle_between_folders():
    """Within every folder, its subfolders (each with everything below it) form no cycle: an import between two
    folders counts as one between the children of their closest common folder that hold them. benchmarks/ is
    layered as a folder of k3serve's (under cli, which runs it, over the roles and the core it measures)."""
    modules = _modules()
    folder = {m: p.parent.relative_to(ROOT if p.is_relative_to(ROOT) else CHECKOUT).parts for m, p in modules.items()}
    edges: dict[str, set[str]] = {}
    for src, dsts in _file_edges(modules).items():
        for dst in dsts:
            a, b = folder[src], folder[dst]
            common = 0
            while common < min(len(a), len(b)) and a[common] == b[common]:
                common += 1
            if common < len(a) and common < len(b):  # neither folder holds the other
                edges.setdefault("/".join(a[:common + 1]), set()).add("/".join(b[:common + 1]))
    cycle = _cycle(edges)
    assert cycle is None, f"import cycle between folders: {' -> '.join(cycle)}"


def test_nothing_served_imports_the_benchmarks():
    """benchmarks/ is outside the wheel: only the bench command group (and the modules it registers) reaches it."""
    bench_cli = {f"k3serve.cli.{p.stem}" for p in (ROOT / "cli").glob("bench*_cmd.py")}
    edges = _file_edges(_modules())
    bad = sorted(f"{src} -> {dst}" for src, dsts in edges.items() if src.startswith("k3serve") and src not in bench_cli
                 for dst in dsts if dst.split(".")[0] == "benchmarks")
    assert not bad, f"served code imports the bench harnesses: {bad}"


def test_no_module_over_600_lines():
    """A module holds one concept; past ~600 lines it holds several (split by concept, not by count)."""
    tests = Path(__file__).parent
    big = {str(p.relative_to(CHECKOUT)): n for top in (ROOT, CHECKOUT / "benchmarks", tests) for p in top.rglob("*.py")
           if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines: {big}"


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
