"""Benchmark harnesses behind `k3serve bench ...` (JSON, measured side by side in one run), and the
process helpers, baselines and fault taps the transfer bench and tests share (transfer_procs.py,
transfer_baselines.py, transfer_faults.py). Nothing in the serving path imports this package."""
