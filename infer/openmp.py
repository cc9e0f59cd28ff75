"""One OpenMP worker pool in the process: model work runs at full speed on any thread.

torch's CPU ops (and the torch backend's native kernels, which share torch's
OpenMP runtime) split their work over an OpenMP team. libgomp keeps one pool of
worker threads *per thread that starts parallel regions*: the model loaded on
the main thread leaves a pool there, and an engine stepped by another thread
(the server's engine thread, a user's worker thread) starts a second one. With
both pools docked the process holds more OpenMP threads than CPUs, and libgomp
then cuts an idle worker's spin-wait from ~300,000 iterations to 100 (its
"throttled" spin count, whatever GOMP_SPINCOUNT says): every op after the first
wakes its workers through a futex, and SmolLM2's decode ran at 46-49 tok/s on a
second thread against 107-111 on the main one (2 cores).

`release_pool()` frees the calling thread's pool (OpenMP 5's
`omp_pause_resource_all`; libgomp joins that thread's workers, so they no longer
count). The engine calls it where a thread stops running model work: after the
load, at the end of `LLM.generate`, and when the async engine thread goes idle.
The next parallel region on whichever thread steps the engine next starts a
fresh pool of its own (~100 us), and it is then the only one.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: omp_pause_soft = 1, omp_pause_hard = 2
_forked = False


def _after_fork_in_child() -> None:
    # A forked child inherits the parent's pool without its threads: pausing it would wait forever.
    global _forked
    _forked = True


os.register_at_fork(after_in_child=_after_fork_in_child)


def runtime_path() -> str | None:
    """The OpenMP runtime library torch loaded into this process (libgomp, libomp or libiomp),
    found in the process's memory map; None if there is none."""
    import torch  # noqa: F401  (loads the runtime)

    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        path = fields[5] if len(fields) == 6 else ""
        if os.path.basename(path).startswith(("libgomp", "libiomp", "libomp")) and ".so" in path:
            return path
    return None


@functools.cache
def _pause_all():
    path = runtime_path()
    if path is None:
        return None
    try:
        fn = ctypes.CDLL(path).omp_pause_resource_all  # the loaded library: dlopen returns its handle
    except (OSError, AttributeError):  # a runtime older than OpenMP 5
        return None
    fn.argtypes, fn.restype = (ctypes.c_int,), ctypes.c_int
    return fn


def release_pool() -> bool:
    """Free the calling thread's OpenMP worker pool; True if the runtime did (or had none to free).
    A no-op (False) inside a parallel region, in a forked child, or without an OpenMP 5 runtime."""
    if _forked:
        return False
    fn = _pause_all()
    return fn is not None and fn(OMP_PAUSE_SOFT) == 0
