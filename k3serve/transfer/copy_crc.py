"""Copy a payload into staging and CRC32C the bytes that landed, in one pass over main memory.

A receiver must both place a chunk (copy it to its resharded offset) and check its CRC32C. Done as two calls
over a 4 MiB chunk, each streams the whole chunk through the caches: CRC32C reads it from memory, then the copy
reads it again (it no longer fits in L2) and writes the destination. Cut into L2-sized blocks::

    src  [ b0 | b1 | b2 | ... ]        for each block k:  dst[k] <- src[k]        (src read from memory once)
           │    │                                         crc = extend(crc, dst[k])  (dst[k] still in L2)
    dst  [ b0 | b1 | b2 | ... ]

the CRC reads what the copy just wrote, from L2: one pass over memory, and the CRC is over the exact bytes that
are placed (a copy that went wrong fails the check like a bad wire). Both calls release the GIL (numpy's copy
and google_crc32c's C loop), so a receiver's handler thread can read the next message meanwhile.
"""

from __future__ import annotations

import google_crc32c
import numpy as np

# 512 KiB: half a typical 1 MiB L2, so one block of source and destination stay there
PLACE_BLOCK_BYTES = 512 << 10


def copy_crc32c(dst: np.ndarray, src, block: int = PLACE_BLOCK_BYTES) -> int:
    """Copy `src` into `dst` and return the CRC32C of `dst` after the copy.

    dst: uint8 numpy array [n] (a writable view of staging); src: any bytes-like object of n bytes (a
    memoryview of the received message, no copy). Raises ValueError on a size mismatch.
    """
    s = np.frombuffer(src, dtype=np.uint8)
    if dst.dtype != np.uint8 or dst.ndim != 1 or s.nbytes != dst.nbytes:
        raise ValueError(f"copy_crc32c: {s.nbytes} source bytes into a {dst.dtype} destination of {dst.nbytes}")
    if block <= 0:
        raise ValueError(f"copy_crc32c: block must be positive, got {block}")
    crc = 0
    for o in range(0, s.nbytes, block):
        d = dst[o: o + block]
        d[...] = s[o: o + block]
        crc = google_crc32c.extend(crc, d)
    return crc
