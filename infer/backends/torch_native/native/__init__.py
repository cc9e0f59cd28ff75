"""Native CPU kernels of the torch backend: `kernels.c`, compiled on first use.

At decode sizes a torch op costs microseconds of dispatch whatever its work,
and a primitive such as rms_norm-after-residual is five to ten of them; the
kernels do each in one call. They are built with the system C compiler (``cc``,
or ``$CC``) into ``$INFER_CACHE_DIR/native`` (default ``~/.cache/infer``),
keyed by a hash of the source, the flags and the compiler, under a file lock
so parallel test workers build once, and loaded with ctypes (which releases the
GIL during each call).

``INFER_NATIVE=0`` turns them off; so does a missing or failing compiler, in
which case `status()` says why and the torch ops run instead.
``INFER_NATIVE_MARCH`` picks the target instruction set (default: the host's).

The kernels split work over the OpenMP runtime torch loaded (the library links
that very file), so they run on torch's own threads: their speed then does not
depend on whether torch or infer was imported first or on the user's OpenMP
settings. Where no such runtime is found (or ``INFER_NATIVE_OPENMP=0``) they
use a thread pool of their own.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import os
import platform
import shlex
import subprocess
import tempfile
from pathlib import Path

from ....openmp import runtime_path

SOURCE = Path(__file__).with_name("kernels.c")
# -ffp-contract=off: products are rounded before they are summed, as in torch's unfused ops.
BASE_FLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared", "-std=c11", "-pthread")


def flags() -> tuple[str, ...]:
    """Compiler flags: the host's instruction set unless ``$INFER_NATIVE_MARCH`` names another
    (``x86-64`` builds the portable loops instead of the AVX-512 ones)."""
    return (*BASE_FLAGS, f"-march={os.environ.get('INFER_NATIVE_MARCH', 'native')}")

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "infer_rms_norm": (_P, _I, _P, _I, _P, _P, _I, _P, _I, _I, _I, _F),
    "infer_rotary": (_P, _I, _I, _I, _P, _I, _I, _I, _P, _P, _I, _I, ctypes.c_int, _P, _I, _I),
    "infer_silu_and_mul": (_P, _I, _P, _I, _I),
    "infer_gelu_tanh_and_mul": (_P, _I, _P, _I, _I),
    "infer_attention": (_P, _I, _I, _I, _I, _P, _I, _I, _I, _I, _P, _I, _I, _P, _P, _I, _F, _I, _P, _F, _F, _F, _P,
                        _I),
    "infer_attention_fp8": (_P, _I, _I, _I, _I, _P, _I, _I, _I, _I, _P, _I, _I, _P, _P, _I, _F, _I, _P, _F, _F, _F,
                            _P, _I),
    "infer_kv_write_fp8": (_P, _I, _P, _I, _P, _I, _P, _I, _I, _F, _F),
    "infer_int8_gemv": (_P, _P, _P, _I, _I, _I, _I, _P, _I, _I),
    "infer_int4_gemm": (_P, _P, _P, _I, _I, _P, _I, _I, _I, _P, _I, _I),
    "infer_int8_gemm": (_P, _P, _P, _I, _I, _P, _I, _I, _I, _P, _I, _I),
    "infer_attention_block_packed": (_P, _I, _P, _P, _P, _F, _P, _I),
    "infer_mlp_packed": (_P, _I, _P, _P, _I),
}
_TYPED = ("f32", "bf16")


def cache_dir() -> Path:
    root = os.environ.get("INFER_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "infer")
    return Path(root) / "native"


def openmp_runtime() -> str | None:
    """The OpenMP runtime library torch loaded into this process (libgomp, libomp or
    libiomp); None if there is none or ``INFER_NATIVE_OPENMP=0``."""
    if os.environ.get("INFER_NATIVE_OPENMP", "1") == "0":
        return None
    return runtime_path()


def _compiler() -> list[str]:
    return shlex.split(os.environ.get("CC", "cc"))


def _library_path() -> Path:
    cc = _compiler()
    version = subprocess.run([*cc, "--version"], capture_output=True, text=True, check=True).stdout.splitlines()[0]
    parts = (SOURCE.read_text(), " ".join(flags()), version, platform.machine(), openmp_runtime() or "")
    key = hashlib.sha256("\0".join(parts).encode())
    return cache_dir() / f"kernels-{key.hexdigest()[:16]}.so"


def _build(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():  # another process built it while this one waited
            return
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
        os.close(fd)
        try:
            runtime = openmp_runtime()
            if runtime is None or not _build_openmp(tmp, runtime):
                _run([*_compiler(), *flags(), "-o", tmp, str(SOURCE), "-lm"])  # the kernels' own thread pool
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


def _build_openmp(out: str, runtime: str) -> bool:
    """Compile with -fopenmp but link against torch's runtime file only (a link step with
    -fopenmp would add the system's libgomp, maybe a second runtime); False when the
    compiler cannot."""
    obj = out + ".o"
    try:
        _run([*_compiler(), *flags(), "-fopenmp", "-DINFER_OPENMP", "-c", "-o", obj, str(SOURCE)])
        _run([*_compiler(), *flags(), "-o", out, obj, runtime, "-lm"])
        return True
    except RuntimeError:
        return False
    finally:
        if os.path.exists(obj):
            os.unlink(obj)


def _run(cmd: list[str]) -> None:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"compiling {SOURCE.name} failed:\n{res.stderr.strip()}")


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str]:
    if os.environ.get("INFER_NATIVE", "1") == "0":
        return None, "off (INFER_NATIVE=0)"
    try:
        path = _library_path()
        if not path.exists():
            _build(path)
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError, IndexError) as e:
        return None, f"unavailable: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    for name, args in _SIGNATURES.items():
        for fn in (getattr(lib, f"{name}_{t}") for t in _TYPED):
            fn.argtypes, fn.restype = args, ctypes.c_int
    lib.infer_kv_write.argtypes = (_P, _I, _P, _I, _P, _I, _P, _I, _I, _I)
    lib.infer_kv_write.restype = ctypes.c_int
    lib.infer_token_bitmask.argtypes, lib.infer_token_bitmask.restype = (_P, _I, _P, _I, _P, _I, _I), ctypes.c_int
    lib.infer_int4_half_scales.argtypes, lib.infer_int4_half_scales.restype = (), ctypes.c_int
    lib.infer_bf16_dot.argtypes, lib.infer_bf16_dot.restype = (), ctypes.c_int
    lib.infer_bf16_gemv.argtypes, lib.infer_bf16_gemv.restype = (_P, _I, _I, _I, _P, _P, _I, _I), ctypes.c_int
    lib.infer_moe_bf16.argtypes = (_P, _I, _I, _I, _I, _I, _P, _I, _I, _F, _I, _P, _I, _I, _I, _P, _P, _P, _P, _P, _P,
                                   _I, _F, _F, _P, _P, _P, _P, _I)
    lib.infer_moe_bf16.restype = ctypes.c_int
    lib.infer_mla_block_bf16.argtypes, lib.infer_mla_block_bf16.restype = (_P, _I, _P, _P, _P, _P, _I), ctypes.c_int
    lib.infer_attention_bf16_fast.argtypes, lib.infer_attention_bf16_fast.restype = (ctypes.c_int,), ctypes.c_int
    lib.infer_openmp.argtypes, lib.infer_openmp.restype = (), ctypes.c_int
    threads = "torch's OpenMP threads" if lib.infer_openmp() else "own thread pool"
    return lib, f"built ({path}; {threads})"


@functools.cache
def openmp() -> bool:
    """Whether the kernels split their work over torch's own OpenMP threads."""
    lib = library()
    return lib is not None and bool(lib.infer_openmp())


@functools.cache
def bf16_dot() -> bool:
    """Whether the kernels were built with AVX512-BF16 (the host has it): the bf16 GEMV runs."""
    lib = library()
    return lib is not None and bool(lib.infer_bf16_dot())


def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None when they are off or could not be built."""
    return _load()[0]


def status() -> str:
    """One line for `infer backends`: whether the kernels run, and why not."""
    return _load()[1]
