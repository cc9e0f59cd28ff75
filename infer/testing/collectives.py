"""Conformance of `all_reduce` / `all_gather`: two real gloo processes.

Collectives cannot be checked in one process, so the runner starts two worker
processes (``python -m infer.testing.collectives JOBDIR RANK``) that join a
gloo group through a file rendezvous, run every collective case on the backend
under test and on `cpu_ref`, and leave their results in JOBDIR. All cases share
one pair of processes: starting Python and torch twice costs seconds, a case
milliseconds. Only backends whose device is the CPU are checked this way.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import numpy as np

from ..primitives.backend import Backend
from .cases import COLLECTIVES, Case, all_cases
from .results import ORACLE, CaseResult, compare

WORLD_SIZE = 2
TIMEOUT_S = 180


def run_collectives(backend: Backend, cases: list[Case]) -> list:
    """CaseResults of collective `cases` on `backend`, in order."""
    if not str(backend.device).startswith("cpu"):
        reason = f"collectives are checked with {WORLD_SIZE} gloo processes on the CPU; backend device is '{backend.device}'"
        return [CaseResult(c, backend.name, "skip", detail=reason) for c in cases]
    cls = type(backend)
    all_ids = tuple(c.id for c in all_cases() if c.primitive in COLLECTIVES)
    # Run every collective case once per backend class and device, so pytest's
    # one-case-at-a-time calls share a single pair of processes.
    outcome = _run_all(f"{cls.__module__}:{cls.__qualname__}", str(backend.device), all_ids)
    return [_result(backend, case, outcome) for case in cases]


@functools.lru_cache(maxsize=8)
def _run_all(backend_path: str, device: str, case_ids: tuple[str, ...]) -> dict:
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="infer-collectives-") as tmp:
        job = Path(tmp)
        (job / "job.json").write_text(json.dumps({"backend": backend_path, "device": device, "cases": list(case_ids)}))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_import_root(backend_path), os.environ.get("PYTHONPATH")]))}
        procs = [
            subprocess.Popen([sys.executable, "-m", "infer.testing.collectives", tmp, str(rank)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
            for rank in range(WORLD_SIZE)
        ]
        failure = None
        for rank, proc in enumerate(procs):
            try:
                out, _ = proc.communicate(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                for p in procs:
                    p.kill()
                out, _ = proc.communicate()
                failure = f"rank {rank} timed out after {TIMEOUT_S}s"
            if proc.returncode and failure is None:
                failure = f"rank {rank} exited {proc.returncode}: {out.strip()[-800:]}"
        if failure:
            return {"failure": failure}
        ranks = []
        for rank in range(WORLD_SIZE):
            status = json.loads((job / f"rank{rank}.json").read_text())
            with np.load(job / f"rank{rank}.npz") as arrays:
                status["arrays"] = {k: arrays[k] for k in arrays.files}
            ranks.append(status)
    return {"ranks": ranks, "seconds": time.perf_counter() - start}


def _import_root(backend_path: str) -> str | None:
    """The sys.path entry the backend's module was imported from, for the workers.

    A class defined in a test file (tests/ is on pytest's path, not on the
    workers') stays importable that way.
    """
    top = sys.modules.get(backend_path.split(":")[0].split(".")[0])
    file = getattr(top, "__file__", None)
    if not file:
        return None
    path = Path(file).resolve().parent
    return str(path.parent if Path(file).name == "__init__.py" else path)


def _result(backend: Backend, case: Case, outcome: dict):
    res = CaseResult(case, backend.name, "pass")
    if "failure" in outcome:
        res.status, res.detail = "error", f"collective workers failed: {outcome['failure']}"
        return res
    res.seconds = outcome["seconds"] / max(1, len(outcome["ranks"][0]["cases"]))
    problems = []
    for rank, data in enumerate(outcome["ranks"]):
        info = data["cases"][case.id]
        if info["status"] != "ok":
            res.status, res.detail = info["status"], f"rank {rank}: {info['detail']}"
            return res
        res.provider = info["provider"]

        def outputs(side: str) -> dict[str, np.ndarray]:
            prefix = f"{case.id}|{side}|"
            return {k.removeprefix(prefix): v for k, v in data["arrays"].items() if k.startswith(prefix)}

        found, err, used = compare(outputs("tested"), outputs("oracle"), case.dtype)
        problems += [f"rank {rank}: {p}" for p in info["problems"] + found]
        res.max_abs_err, res.tol_used = max(res.max_abs_err, err), max(res.tol_used, used)
    if problems:
        res.status, res.detail = "fail", "; ".join(problems)
    return res


def _worker(job: Path, rank: int) -> None:
    import torch.distributed as dist

    from ..dispatch import Ops
    from ..registry import BackendUnavailableError, get_backend
    from .calls import invoke

    spec = json.loads((job / "job.json").read_text())
    module, _, qualname = spec["backend"].partition(":")
    cls = functools.reduce(getattr, qualname.split("."), importlib.import_module(module))
    backend = cls(device=spec["device"])
    ref = get_backend(ORACLE)
    sides = (("tested", backend, Ops(backend)), ("oracle", ref, Ops(ref)))
    dist.init_process_group("gloo", init_method=f"file://{job / 'rendezvous'}", rank=rank,
                            world_size=WORLD_SIZE, timeout=timedelta(seconds=60))
    wanted = set(spec["cases"])
    statuses, arrays = {}, {}
    for case in (c for c in all_cases() if c.id in wanted):
        inputs = case.inputs()
        inputs["x"] = inputs["xs"][rank]
        info = {"status": "ok", "detail": "", "provider": None, "problems": []}
        for side, b, ops in sides:
            try:
                h = invoke(b, ops, case.primitive, inputs, case.dtype if side == "tested" else "float32")
            except BackendUnavailableError as exc:
                info.update(status="skip", detail=str(exc))
                break
            except Exception as exc:
                info.update(status="error", detail=f"{side}: {type(exc).__name__}: {exc}")
                break
            arrays.update({f"{case.id}|{side}|{k}": v for k, v in h.outputs.items()})
            if side == "tested":
                info.update(provider=h.provider, problems=h.problems)
        statuses[case.id] = info
    dist.destroy_process_group()
    np.savez(job / f"rank{rank}.npz", **arrays)
    (job / f"rank{rank}.json").write_text(json.dumps({"cases": statuses}))


if __name__ == "__main__":
    _worker(Path(sys.argv[1]), int(sys.argv[2]))
