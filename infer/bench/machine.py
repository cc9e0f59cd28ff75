"""What this machine allows: memory bandwidth, fp32 matmul peak, BLAS set-up,
and how busy other processes keep the CPUs. Shared by `infer bench` and
`benchmarks/primitives.py`."""

from __future__ import annotations

import ctypes
import os
import time

import numpy as np

GB = 1e9
MIB = 1 << 20

def _best(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def measure_bandwidth(mib: int, repeats: int = 5, allocations: int = 2) -> dict[str, float]:
    """GB/s of large-array kernels over arrays far bigger than any cache, best over
    fresh allocations (in a VM, where an array's pages land changes its speed)."""
    import torch

    best: dict[str, float] = {}
    n = mib * MIB // 4
    for _ in range(allocations):
        a, b = torch.ones(n), torch.empty(n)
        an, bn = a.numpy(), b.numpy()
        kernels = {"torch sum (read)": (lambda: a.sum(), 4 * n), "torch copy (read+write)": (lambda: b.copy_(a), 8 * n),
                   "numpy dot (read)": (lambda: np.dot(an, an), 4 * n), "numpy copyto (read+write)": (lambda: np.copyto(bn, an), 8 * n)}
        for name, (fn, nbytes) in kernels.items():
            best[name] = max(best.get(name, 0.0), nbytes / _best(fn, repeats) / GB)
        del a, b, an, bn
    return best


def measure_peak(n: int, repeats: int = 3, dtype: str = "float32") -> dict[str, float]:
    """GFLOP/s of an n^3 matmul: torch's, and NumPy's in float32."""
    import torch

    a, b = torch.randn(n, n).to(getattr(torch, dtype)), torch.randn(n, n).to(getattr(torch, dtype))
    peak = {f"torch {n}^3": 2 * n**3 / _best(lambda: a @ b, repeats) / GB}
    if dtype == "float32":
        an, bn = a.numpy(), b.numpy()
        peak[f"numpy {n}^3"] = 2 * n**3 / _best(lambda: an @ bn, repeats) / GB
    return peak


def measure_linear(shapes: list[tuple[int, int]], rows: int, dtype: str, repeats: int = 3) -> float:
    """GFLOP/s of torch's ``F.linear`` over a model's weight shapes [(out, in)] at `rows` rows:
    the FLOPs of all of them over the sum of each one's best time."""
    import torch
    import torch.nn.functional as F

    dt, flops, seconds = getattr(torch, dtype), 0.0, 0.0
    for out_f, in_f in shapes:
        w, x = torch.randn(out_f, in_f).to(dt), torch.randn(rows, in_f).to(dt)
        seconds += _best(lambda: F.linear(x, w), repeats)
        flops += 2 * rows * out_f * in_f
    return flops / seconds / GB


def blas_info() -> dict:
    """Which BLAS each library uses, and the settings that change it."""
    import torch

    info = {k: v for k, v in os.environ.items() if k.startswith(("OPENBLAS_", "OMP_", "MKL_", "GOMP_"))}
    info["torch_threads"], info["cpu_count"] = torch.get_num_threads(), os.cpu_count()
    info["torch_blas"] = "mkl" if torch.backends.mkl.is_available() else "other"
    try:
        from threadpoolctl import threadpool_info

        info["threadpools"] = [{k: p.get(k) for k in ("internal_api", "architecture", "num_threads", "version")} for p in threadpool_info()]
    except ImportError:  # ask numpy's OpenBLAS directly
        try:
            path = next(ln.split()[-1] for ln in open("/proc/self/maps") if "openblas" in ln)
            lib = ctypes.CDLL(path)
            for sym in ("scipy_openblas_get_corename64_", "scipy_openblas_get_corename", "openblas_get_corename"):
                if fn := getattr(lib, sym, None):
                    fn.restype = ctypes.c_char_p
                    info["numpy_openblas_kernel"] = fn().decode()
                    break
        except (OSError, StopIteration):
            pass
    return info


class CpuLoad:
    """Share of the machine's CPU time that other processes used (Linux; None elsewhere)."""

    def __init__(self):
        self.start = self._read()

    @staticmethod
    def _read():
        try:
            v = [int(x) for x in open("/proc/stat").readline().split()[1:]]
            own = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
            return time.monotonic(), v[0] + v[1] + v[2] + v[5] + v[6], int(own[11]) + int(own[12])
        except OSError:
            return None

    def wait_quiet(self, max_wait: float, threshold: float = 0.1) -> None:
        """Sleep in short windows until other processes leave the CPUs (or max_wait passes)."""
        deadline = time.monotonic() + max_wait
        while time.monotonic() < deadline:
            probe = CpuLoad()
            time.sleep(0.25)
            if (probe.other() or 0.0) < threshold:
                break

    def other(self, min_window: float = 0.0) -> float | None:
        """Over at least `min_window` seconds (sleeping out the rest): /proc/stat counts in 10 ms ticks."""
        if self.start and (rest := self.start[0] + min_window - time.monotonic()) > 0:
            time.sleep(rest)
        end = self._read()
        if not (self.start and end) or end[0] - self.start[0] < 0.05:  # too short to say
            return None
        ticks = os.sysconf("SC_CLK_TCK") * (end[0] - self.start[0]) * (os.cpu_count() or 1)
        return min(1.0, max(0.0, ((end[1] - self.start[1]) - (end[2] - self.start[2])) / ticks))


def l3_bytes() -> int:
    try:
        return int(open("/sys/devices/system/cpu/cpu0/cache/index3/size").read().strip().rstrip("K")) * 1024
    except (OSError, ValueError):
        return 32 * MIB
