"""Bench records and the figures page: each `k3serve bench record` run saves one JSON record (the command, the
host, the bench's own JSON); `k3serve bench report` renders every record into docs/results.md, one table per
bench, one row per record, so no figure in the docs is typed by hand."""

from __future__ import annotations

import json
import os
import platform
import re
import time
from dataclasses import dataclass
from pathlib import Path

RECORD_VERSION = 1

# The held-out acceptance section of `bench eagle3` and `bench spec` (benchmarks/heldout_accept.py), one column
# per method and figure.
HELDOUT_COLUMNS: tuple[tuple[str, str], ...] = (
    ("held-out kept", "heldout.kept"), ("scanned", "heldout.scanned"),
    ("* greedy tok/verify k=3", "heldout.rows.*.greedy_tokens_per_verify.3"),
    ("* T=1 alpha", "heldout.rows.*.t1_alpha_mean"), ("* T=1 tok/verify", "heldout.rows.*.t1_tokens_per_verify_mean"))

# bench -> (column header, dotted path into the bench's JSON); a "*" segment makes one column per key found there.
# Benches not listed show their top-level numbers.
COLUMNS: dict[str, tuple[tuple[str, str], ...]] = {
    "eagle3": (("k online", "k_online"), ("held-out k T=1", "heldout.k_t1")) + HELDOUT_COLUMNS,
    "spec": (("preset", "preset"), ("held-out k T=1", "heldout.k_t1")) + HELDOUT_COLUMNS,
    "kernels": (("backend", "chunk_backend"), ("chunk tok/s", "chunk_tokens_per_s"),
                ("chunk GFLOP/s", "chunk_gflops"), ("of matmul", "chunk_achieved_fraction"),
                ("vs recurrent", "speedup"), ("vs torch path", "chunk_speedup_over_torch"),
                ("matmul GFLOP/s", "matmul_gflops")),
    "decode": (("preset", "preset"), ("context", "context_tokens"), ("tok/s b=*", "tokens_per_s.*"),
               ("GB/s b=*", "achieved_gbps.*"), ("copy GB/s", "copy_gbps"),
               ("step / GEMV floor", "gemv_floor.step_over_floor")),
    "trace": (("policy", "policy"), ("requests", "requests"), ("completed", "completed"), ("reuse", "reuse"),
              ("ideal", "ideal_reuse"), ("of ideal", "reuse_of_ideal"), ("load max/mean", "load_max_over_mean"),
              ("TTFT p50 s", "ttft_p50_s"), ("TTFT p99 s", "ttft_p99_s"), ("prefill tok/s", "prefill_tps")),
    "prefix": (("reuse k3", "k3.reuse_ratio"), ("reuse naive", "naive.reuse_ratio"),
               ("cold TTFT s", "ttft.cold_ttft_s"), ("hit TTFT s", "ttft.hit_ttft_s"),
               ("cold short s", "ttft.cold_short_ttft_s"), ("hit speedup", "hit_speedup"),
               ("hit/short floor", "ttft.hit_over_cold_short_floor")),
}


class ReportError(ValueError):
    """A record that cannot be read or rendered; the message names the file and the field."""


@dataclass(frozen=True)
class Record:
    bench: str
    command: str
    recorded: str  # UTC, ISO 8601
    host: dict
    result: dict
    path: str = ""


def host_facts() -> dict:
    """What a reader needs to weigh a figure: the CPU, its core count, and the load while it ran."""
    cpu = platform.machine()  # not platform.processor(): it runs `uname -p` in a subprocess
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count() or 0, "load_avg_1m": round(os.getloadavg()[0], 2)}


def save_record(out_dir: str | Path, bench: str, argv: list[str], result: dict, host: dict) -> Path:
    """Write one record as `<out_dir>/<bench>-<args slug>.json` (the same command overwrites its own record)."""
    if not isinstance(result, dict):
        raise ReportError(f"bench {bench}: result must be a JSON object, got {type(result).__name__}")
    command = " ".join(["k3serve", "bench", bench, *argv, "--json"])
    slug = re.sub(r"[^A-Za-z0-9]+", "-", " ".join(argv)).strip("-")[:80] or "default"
    path = Path(out_dir) / f"{bench}-{slug}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"version": RECORD_VERSION, "bench": bench, "command": command,
              "recorded": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()), "host": host, "result": result}
    path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return path


def load_records(json_dir: str | Path) -> list[Record]:
    root = Path(json_dir)
    if not root.is_dir():
        raise ReportError(f"--json-dir {json_dir}: not a directory")
    out = []
    for path in sorted(root.glob("*.json")):
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ReportError(f"{path}: not JSON ({e})") from e
        for key in ("bench", "command", "recorded", "host", "result"):
            if key not in raw:
                raise ReportError(f"{path}: missing field {key!r}")
        if raw.get("version") != RECORD_VERSION:
            raise ReportError(f"{path}: field 'version' is {raw.get('version')!r}, expected {RECORD_VERSION}")
        out.append(Record(raw["bench"], raw["command"], raw["recorded"], raw["host"], raw["result"], str(path)))
    return out


def _lookup(result: dict, path: str) -> list[tuple[str, object]]:
    """(key that filled a "*", value) pairs at a dotted path; missing paths give nothing."""
    found: list[tuple[str, object]] = [("", result)]
    for seg in path.split("."):
        nxt = []
        for star, node in found:
            if not isinstance(node, dict):
                continue
            if seg == "*":
                nxt += [(str(k), v) for k, v in node.items()]
            elif seg in node:
                nxt.append((star, node[seg]))
        found = nxt
    return found


def _columns(bench: str, records: list[Record]) -> list[tuple[str, str, str]]:
    """(header, path, star key) for every column any record of the bench fills, in COLUMNS order."""
    spec = COLUMNS.get(bench) or tuple(
        (k, k) for k in dict.fromkeys(k for r in records for k, v in r.result.items()
                                      if isinstance(v, (int, float, str)) and not isinstance(v, bool)))
    cols: list[tuple[str, str, str]] = []
    for header, path in spec:
        stars = dict.fromkeys(star for r in records for star, _ in _lookup(r.result, path))
        cols += [(header.replace("*", star), path, star) for star in stars]
    return cols


def _cell(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value).replace("|", "\\|")


def render(records: list[Record], json_dir: str) -> str:
    """The figures page: one table per bench; each row is one record, its command first."""
    lines = ["# Results", "",
             f"Generated by `k3serve bench report --json-dir {json_dir} > docs/results.md` from the records in",
             f"`{json_dir}/` (each written by `k3serve bench record --out {json_dir} BENCH ARGS...`); do not edit",
             "by hand. Each row's command reproduces it; `host` gives the CPU, its cores and the 1-minute load",
             "average before and after the run (a loaded host gives slower figures than the machine can).", ""]
    if not records:
        return "\n".join(lines + ["No records yet.", ""])
    for bench in sorted({r.bench for r in records}):
        rows = sorted((r for r in records if r.bench == bench), key=lambda r: r.command)
        cols = _columns(bench, rows)
        lines += [f"## {bench}", "", "| command | " + " | ".join(c[0] for c in cols) + " | host | recorded |",
                  "| --- " * (len(cols) + 3) + "|"]
        for r in rows:
            cells = []
            for _, path, star in cols:
                vals = [v for s, v in _lookup(r.result, path) if s == star]
                cells.append(_cell(vals[0]) if vals else "")
            load = f"{r.host.get('load_avg_1m', '?')}-{r.host['load_avg_1m_after']}" if "load_avg_1m_after" in r.host \
                else f"{r.host.get('load_avg_1m', '?')}"
            host = f"{r.host.get('cpu', '?')}, {r.host.get('cores', '?')} cores, load {load}"
            lines.append(f"| `{r.command}` | " + " | ".join(cells) + f" | {_cell(host)} | {r.recorded} |")
        lines.append("")
    return "\n".join(lines)
