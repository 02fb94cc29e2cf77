"""The numba CPU kernels: the fused chunked-KDA forward (``kda_cpu``, its numba code ``kda_cpu_kernel`` in register
tiles over the 16-lane vectors of ``_simd``) and the MXFP4 routed experts of a MoE layer
(``mxfp4_moe_cpu``). Each is an implementation behind the dispatch of ``kernels/``; where numba cannot be imported
its ``NUMBA_ERROR`` says why and the caller keeps the torch path."""
