"""Speculative decoding: drafter interface, drafters, the lossless acceptance rule (docs/speculative.md)."""
