"""The Mooncake data plane (docs/architecture.md §4, docs/transfer.md): gRPC keeps control, Mooncake Transfer Engine writes the payload.

```
 plane.py     MooncakeConfig, DataPlane (one TransferEngine per process; regions registered once)
 sender.py    MooncakeSender / LandingSession: Open, engine writes at the resharded offsets, headers, manifest
 hooks.py     worker hooks and the StateChannel for `clusters.transfer: mooncake`
```
Everything else is the gRPC plane's: plan and chunk offsets (chunks.py), CRC32C and manifest (wire.py),
verify-before-install staging (staging.py, over a registered region from buffers.py), HMAC (auth.py).
The engine is an optional dependency: `pip install 'k3serve[mooncake]'`.
"""
