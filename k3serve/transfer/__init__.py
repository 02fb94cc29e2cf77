"""Prefill -> decode state transfer over gRPC, resharded on the path (DESIGN.md §6).

```
 plan.py / chunks.py   pure plan: head spans P -> D, round-robin MLA page ranges, chunk byte offsets
 spec.py               TransferSpec / StateGeometry (validated at configuration time)
 wire.py               PushMessage framing (zero-copy payload), CRC32C, spec <-> proto
 sender.py             TransferSender: one prefill rank's parallel, layer-wise, retried streams
 receiver.py           TransferReceiver: a decode rank's gRPC service over staging.py (verify, then install)
 client.py             Status / Cancel on a decode group's receivers
 faults.py             fault-injection switches (peer authentication: k3serve/auth.py)
 decode_host.py        decode TP group whose rank processes host the receivers (InstallStaged)
 handoff_send.py       the SendState op's side: a prefill rank's send job, its cached senders
 memory.py             allocator tuning so ~MiB message buffers reuse warm pages
 procs.py              sender / receiver helper processes (loopback tests, bench)
```
Generated protobuf code: k3serve.transfer.v1 (source k3serve/proto/k3serve/transfer/v1/transfer.proto).
"""
