"""State channels between a prefill group and a decode group (contracts/channel.py), and the gRPC and Mooncake
transfer planes, resharded on the path (docs/architecture.md §4, §14).

```
 plan.py / chunks.py   pure plan: head spans P -> D, round-robin MLA page ranges, chunk byte offsets
 spec.py               TransferSpec / StateGeometry (validated at configuration time)
 wire.py               PushMessage framing (zero-copy payload), CRC32C, spec <-> proto
 sender.py             TransferSender: one prefill rank's parallel, layer-wise, retried streams
 receiver.py           TransferReceiver: a decode rank's gRPC service over staging.py (verify, then install)
 client.py             Status / Cancel on a decode group's receivers
 decode_host.py        decode TP group whose rank processes host the receivers (InstallStaged)
 inprocess.py          InProcessChannel: the state as tensors in the ticket (local pipeline, Ray object store)
 handoff_send.py       GrpcChannel: SendState (or, layer-wise, PrefillStreamed) on every prefill rank, InstallStaged
                       on every decode rank
 memory.py             allocator tuning so ~MiB message buffers reuse warm pages
 buffers.py            staging buffers: the heap (pooled) or one registered region (data planes)
 mooncake/             the Mooncake data plane: gRPC control, payload by the Transfer Engine (docs/transfer.md)
```
Harnesses live outside: sender/receiver helper processes, baselines and fault taps in benchmarks/transfer_*.py.
Generated protobuf code: k3serve.transfer.v1 (source k3serve/proto/k3serve/transfer/v1/transfer.proto).
"""
