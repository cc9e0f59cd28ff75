"""Host-memory housekeeping."""

from __future__ import annotations

import ctypes
import gc


def trim_heap(collect: bool = True) -> None:
    """Return freed heap pages to the OS where the C library allows it (glibc's `malloc_trim`).

    Loading a checkpoint frees hundreds of MB of temporaries in pieces that
    glibc keeps mapped for reuse; the process would carry them, as RSS, for
    its whole life. Elsewhere (musl, macOS) this does nothing. `collect`: run the cycle
    collector first (skip it where this runs once a weight).
    """
    if collect:
        gc.collect()  # objects in reference cycles (a GGUF reader's) hold their memory until collected
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
