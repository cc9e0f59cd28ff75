"""Executors: how the engine's calls reach every rank of its job.

- `Executor` (uniproc): the engine's process is the whole job, or one of torchrun's
  ranks, each of which runs a whole engine that makes the same calls
  (``external_launcher``): the call runs on this process's worker.
- `DriverExecutor` (mp and Ray, on rank 0): each call is handed to the other ranks
  first (``(method, args)`` broadcast, `DistributedState.broadcast`), whose loop runs
  ``getattr(worker, method)(*args)`` (`core/worker.py`), then runs on rank 0's worker.
  Only rank 0 samples.

Interface: `execute_model(step, sampling)`, `collective_rpc(method, *args)`,
`failure`, `shutdown()`; pipelines add `execute_model(..., non_block=True)` and `finish`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from ..args import PER_RANK_ARGS, EngineArgs
from ..distributed import CollectiveError, DistributedState, StepInput
from . import launch
from .rank import rank_backend
from .sampler import ModelRunnerOutput, SamplingInput
from .worker import Pending, Worker


class Executor:
    def __init__(self, worker: Worker, dist: DistributedState | None = None):
        self.worker, self.dist = worker, dist
        self._pending: list[Pending] = []  # pipeline steps started and not finished

    @property
    def pipelined(self) -> bool:
        """Steps may be started before the last ones finished (rank 0 of an mp or Ray pipeline)."""
        return False

    @property
    def failure(self) -> str | None:
        """Why the job cannot go on (a rank died, a collective failed), or None."""
        d = self.dist
        return None if d is None else d.aborted or (f"distributed worker {d.failed}; the engine cannot continue"
                                                     if d.failed else None)

    def collective_rpc(self, method: str, *args: Any) -> Any:
        """``worker.<method>(*args)`` on every rank of the job; this process's rank's result."""
        self._check()
        return self._local(getattr(self.worker, method), *args)

    def execute_model(self, step: StepInput, sampling: SamplingInput, non_block: bool = False):
        """One step on every rank, sampled where the logits end up: its `ModelRunnerOutput`
        (a `Pending` for `finish` with `non_block` on rank 0 of a pipeline)."""
        if self.dist is None:
            return self.worker.execute_model(step, sampling)
        self._check()
        return self._local(self.worker.execute_model, step, sampling)

    def finish(self, pending: Pending) -> ModelRunnerOutput:
        self._pending.remove(pending)
        self._check()
        return self._local(self.worker.finish, pending)

    def _check(self) -> None:
        """Refuse to go on in a failed job; the first to notice a dead rank tears the group down."""
        d = self.dist
        if d is not None and self.failure:
            raise d.lost(RuntimeError(self.failure)) if d.aborted is None else RuntimeError(d.aborted)

    def _local(self, fn, *args):
        """fn on this rank; a failed collective inside it ends the job (other errors are the caller's)."""
        if self.dist is None:
            return fn(*args)
        try:
            return fn(*args)
        except CollectiveError as exc:
            raise self.dist.lost(exc) from exc

    def shutdown(self) -> None:
        """Stop the other ranks and leave the process group (nothing to do in one process)."""
        d, self.dist = self.dist, None
        if d is None:
            return
        for p in self._pending:  # take what the last stage still sends
            if d.failed is not None or d.aborted is not None:
                break
            try:
                d.recv_logits(self.worker.backend, p.shape)
            except Exception:  # noqa: BLE001 (a dead stage: nothing will come)
                break
        self._pending = []
        d.close()


class DriverExecutor(Executor):
    """Rank 0 of an mp or Ray job: every call goes to the worker ranks, then runs here."""

    @property
    def pipelined(self) -> bool:
        return self.dist is not None and self.dist.config.pipeline_parallel_size > 1

    def collective_rpc(self, method: str, *args: Any) -> Any:
        self._send(method, args)
        return self._local(getattr(self.worker, method), *args)  # the workers run it: no check in between

    def execute_model(self, step: StepInput, sampling: SamplingInput, non_block: bool = False):
        self._send("execute_model", (step, None))  # the other ranks do not sample
        try:
            out = self.worker.execute_model(step, sampling)
        except CollectiveError as exc:
            raise self.dist.lost(exc) from exc
        if isinstance(out, Pending):
            self._pending.append(out)
            return out if non_block else self.finish(out)
        return out

    def _send(self, method: str, args: tuple) -> None:
        self._check()
        try:
            self.dist.broadcast((method, args))
        except Exception as exc:
            raise self.dist.lost(exc) from exc


def create(a: EngineArgs, load_tokenizer: bool) -> Executor:
    """Start the job `a` describes (the other ranks, when this is the first process of
    an mp or Ray job) and build this process's worker."""
    parallel = a.parallel_config()
    local_rank = int(os.environ.get("LOCAL_RANK", 0)) if parallel.executor == "external_launcher" else 0
    backend = rank_backend(a, local_rank)
    if parallel.executor is None:
        return Executor(Worker(a, backend, None, load_tokenizer))
    fields = dataclasses.asdict(a)
    dist = launch.start(parallel, backend.dist_backend, fields)
    try:
        dist.check_agreement({k: v for k, v in fields.items() if k not in PER_RANK_ARGS})
        worker = Worker(a, backend, dist, load_tokenizer)
    except BaseException:
        dist.close()
        raise
    return DriverExecutor(worker, dist) if dist.is_driver else Executor(worker, dist)
