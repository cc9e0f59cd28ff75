"""Multi-process execution on torch.distributed: tensor parallelism first.

Ranks and groups (vLLM's layout): ``rank = pp_rank * tp + tp_rank``; each
pipeline stage has a tensor-parallel group, the ``tp`` group the program's
collectives run on (`core/parallel.py`, `core/lowering.py`).

Executors (``distributed_executor_backend``):

- ``mp``: the engine is rank 0; it starts the other ranks of this host as
  worker processes (``python -m infer.core.worker``) that build their shard of
  the model and then follow rank 0: rank 0 broadcasts each call of its executor
  (``(method, args)``, pickled by ``broadcast_object_list``; a step's is its host
  inputs, a `StepInput`), and every rank runs the same method. With ``nnodes > 1`` each node starts
  its own ranks (``--node-rank``; a ``--headless`` node serves no API).
- ``external_launcher``: every rank was started by ``torchrun`` (env://
  rendezvous) and runs a whole engine; the schedulers see the same requests
  and make the same decisions, so no step is broadcast (vLLM does the same).

Collectives have a timeout (``INFER_DIST_TIMEOUT_S``, default 120 s), so a rank
that hangs or dies makes the others fail instead of waiting forever.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

import numpy as np

from ..primitives.types import AttentionMetadata

EXECUTORS = ("mp", "external_launcher", "ray")
# Point-to-point tags between pipeline stages: messages, activations, logits.
TAG_MESSAGE, TAG_CARRY, TAG_LOGITS = 1, 2, 3
DEFAULT_TIMEOUT_S = 120.0
log = logging.getLogger("infer")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # None: mp when world_size > 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port (single node only)

    def __post_init__(self):
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "nnodes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer; got {v!r}")
        if self.distributed_executor_backend not in (None, *EXECUTORS):
            raise ValueError(f"distributed_executor_backend must be one of {', '.join(EXECUTORS)}; "
                             f"got {self.distributed_executor_backend!r}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank={self.node_rank} is outside 0..{self.nnodes - 1} (nnodes={self.nnodes})")
        if self.world_size % self.nnodes:
            raise ValueError(f"tensor_parallel_size x pipeline_parallel_size = {self.world_size} ranks cannot be "
                             f"split evenly over nnodes={self.nnodes}")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("with nnodes > 1 every node must be given the same --master-addr and --master-port")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def executor(self) -> str | None:
        if self.world_size == 1 and self.distributed_executor_backend != "external_launcher":
            return None
        return self.distributed_executor_backend or "mp"

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes


class CollectiveError(RuntimeError):
    """A collective or point-to-point transfer with the other ranks failed (a peer died
    or timed out): the job cannot go on (`DistributedState.lost`)."""


@dataclass(frozen=True)
class StepInput:
    """What every rank needs to run one step: host arrays only."""

    input_ids: np.ndarray
    positions: np.ndarray
    sample_rows: np.ndarray
    meta: AttentionMetadata
    block_copies: tuple[tuple[int, int], ...] = ()
    tier_ops: tuple = ()  # kv_tier.TierOp copies to and from the host tier, before the block copies
    lora_indices: np.ndarray | None = None  # [T] each token's LoRA slot (0: none), with LoRA enabled
    images: tuple = ()  # multimodal.ImageSlice: the image rows of the step's tokens (a VLM)


@dataclass
class DistributedState:
    """This process's place in the job, and the groups it joined."""

    config: ParallelConfig
    rank: int
    local_rank: int
    tp_group: Any = None
    control_group: Any = None  # gloo, every rank: the start-up agreement check
    stage_control: Any = None  # gloo, this pipeline stage's ranks: where the stage's first rank hands out messages
    workers: list[subprocess.Popen] = field(default_factory=list)  # mp, rank 0 of a node: the ranks it started
    failed: str | None = None  # set by the monitor when a worker dies
    aborted: str | None = None  # why the group was left after a failed collective (`lost`)
    _closed: bool = False
    _sends: list = field(default_factory=list)  # (work, buffers) of point-to-point sends not yet known complete

    @property
    def world_size(self) -> int:
        return self.config.world_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.config.tensor_parallel_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.config.tensor_parallel_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.config.pipeline_parallel_size - 1

    def stage_layers(self, num_layers: int) -> tuple[int, int]:
        """This rank's pipeline stage: layers [first, end), split as evenly as they go."""
        return stage_layers(num_layers, self.pp_rank, self.config.pipeline_parallel_size)

    # -- pipeline stages: activations forward, logits back to the sampler ------------
    def send_carry(self, carry: dict[str, Any]) -> None:
        """This stage's residual stream to the same tensor-parallel rank of the next stage."""
        import torch.distributed as dist

        dst = self.rank + self.config.tensor_parallel_size
        for name in sorted(carry):
            self._isend(_as_torch(carry[name]).contiguous(), dst, TAG_CARRY)

    def recv_carry(self, backend, names: tuple[str, ...], shape: tuple[int, ...], dtype: str) -> dict[str, Any]:
        import torch.distributed as dist

        src, out = self.rank - self.config.tensor_parallel_size, {}
        for name in sorted(names):
            buf = backend.asarray(np.zeros(shape, np.float32), dtype)
            dist.recv(_as_torch(buf), src, tag=TAG_CARRY)
            out[name] = buf
        return out

    def share_logits(self, backend, logits, shape: tuple[int, ...]):
        """The last stage's logits on the rank(s) that sample: every rank under
        torchrun (each samples); under mp the last stage's first rank sends them
        to rank 0 without waiting, and rank 0 takes them with `recv_logits`."""
        import torch.distributed as dist

        last = self.last_stage_rank
        if self.config.executor == "external_launcher":
            if self.rank == last:
                dist.broadcast(_as_torch(logits).contiguous(), last)
                return logits
            buf = backend.asarray(np.zeros(shape, np.float32))
            dist.broadcast(_as_torch(buf), last)
            return buf
        if self.rank == last:
            self._isend(_as_torch(logits).contiguous(), 0, TAG_LOGITS)
            return logits
        return None

    @property
    def last_stage_rank(self) -> int:
        return (self.config.pipeline_parallel_size - 1) * self.config.tensor_parallel_size

    def recv_logits(self, backend, shape: tuple[int, ...]):
        """Rank 0 (mp): the logits of its oldest step in flight, from the last stage."""
        import torch.distributed as dist

        buf = backend.asarray(np.zeros(shape, np.float32))
        dist.recv(_as_torch(buf), self.last_stage_rank, tag=TAG_LOGITS)
        return buf

    @property
    def is_driver(self) -> bool:
        """Rank 0 of an mp or Ray job: it schedules, and hands each step to the others."""
        return self.rank == 0 and self.config.executor in ("mp", "ray")

    # -- rank 0 -> workers -------------------------------------------------------
    def broadcast(self, message: Any) -> Any:
        """Rank 0's `message` on every rank (mp executor); a worker passes None and gets it.

        It reaches the first pipeline stage's ranks by a broadcast among them; each
        of those hands it on to the same tensor-parallel rank of the next stage, and
        so on, so a stage gets a step's message when it has finished the step before
        (a point-to-point send that rank 0 does not wait for: the stages overlap)."""
        import torch.distributed as dist

        first = self.pp_rank * self.config.tensor_parallel_size
        if self.is_first_stage:
            box = [message]
            dist.broadcast_object_list(box, src=first, group=self.stage_control)
            message = box[0]
        else:
            message = self._recv_object(self.rank - self.config.tensor_parallel_size, TAG_MESSAGE)
        if not self.is_last_stage:
            self._isend_object(message, self.rank + self.config.tensor_parallel_size, TAG_MESSAGE)
        return message

    def _isend(self, tensor, dst: int, tag: int) -> None:
        import torch.distributed as dist

        self._sends = [(w, b) for w, b in self._sends if not w.is_completed()]
        self._sends.append((dist.isend(tensor, dst, tag=tag), tensor))

    def _isend_object(self, obj: Any, dst: int, tag: int) -> None:
        import pickle

        import torch

        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        self._isend(torch.tensor([data.numel()], dtype=torch.int64), dst, tag)
        self._isend(data, dst, tag)

    def _recv_object(self, src: int, tag: int) -> Any:
        import pickle

        import torch
        import torch.distributed as dist

        size = torch.zeros(1, dtype=torch.int64)
        dist.recv(size, src, tag=tag)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(data, src, tag=tag)
        return pickle.loads(data.numpy().tobytes())

    def wait_sends(self) -> None:
        for work, _ in self._sends:
            work.wait()
        self._sends = []

    def lost(self, exc: BaseException, wait_s: float = 5.0) -> RuntimeError:
        """The error to raise when a collective failed: it names the worker that
        died (waiting briefly for its exit), else says which peer error it was."""
        deadline = time.monotonic() + wait_s
        while self.failed is None and self.workers and time.monotonic() < deadline:
            for i, p in enumerate(self.workers):
                if p.poll() is not None:
                    self.failed = f"rank {self.rank + 1 + i} (pid {p.pid}) exited with code {p.returncode}"
                    break
            else:
                time.sleep(0.05)
        if self.failed:
            self.aborted = f"distributed worker {self.failed}; the engine cannot continue"
        else:
            self.aborted = f"rank {self.rank}: a collective with the other ranks failed ({exc})"
        self.abort()
        return RuntimeError(self.aborted)

    def abort(self) -> None:
        """After a failed collective the group is unusable: stop this node's worker ranks and
        leave the process group now, on this thread. Left to `__del__`, that teardown (a stop
        message to a dead group, then the group's destruction) ran during interpreter exit, in
        collection order, where one full-suite run died of SIGABRT in torch's tensor clean-up
        instead of exiting with its own code (and see the pause at the end)."""
        if self._closed:
            return
        self._closed = True
        import torch.distributed as dist

        for p in self.workers:
            with contextlib.suppress(Exception):
                p.kill()
                if isinstance(p, subprocess.Popen):
                    p.wait(30)
        self._sends = []
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        # The failed collective's work is destroyed on a gloo thread, which must take the GIL to
        # release its Python-owned tensors; if that happens during interpreter finalization the
        # thread is unwound through a noexcept frame and the process dies of SIGABRT ('terminate
        # called without an active exception', 1 run in 6 when a script exits right after the
        # error). Releasing the GIL for a moment here lets that thread finish now.
        time.sleep(0.2)

    def check_agreement(self, fingerprint: dict) -> None:
        """Every rank must run the same model with the same flags: fail naming the ranks that differ."""
        import torch.distributed as dist

        mine = _digest(fingerprint)
        every: list[Any] = [None] * self.world_size
        dist.all_gather_object(every, (mine, fingerprint), group=self.control_group)
        differ = [r for r, (d, _) in enumerate(every) if d != every[0][0]]
        if differ:
            first = differ[0]
            keys = sorted(k for k in every[0][1] if every[0][1].get(k) != every[first][1].get(k))
            raise RuntimeError(f"ranks disagree: rank {first} runs {({k: every[first][1].get(k) for k in keys})}, "
                               f"rank 0 runs {({k: every[0][1].get(k) for k in keys})}; start every rank with the "
                               "same model and flags")

    def meet(self) -> None:
        """Every rank of an mp or Ray job, once the stop message has reached it: wait for the
        others before leaving the process group. Without it the driver tore down its side while
        a worker on another node still had the stop message (or a forwarded copy of it) on the
        wire, and that worker died of SIGABRT at exit ('terminate called without an active
        exception', 1 CI run of a TP=3 job over three loopback nodes)."""
        import torch.distributed as dist

        try:
            dist.barrier(group=self.control_group)
        except Exception as exc:  # noqa: BLE001 (a dead peer: leave anyway)
            log.warning("ranks did not meet before leaving the process group: %s", exc)

    def close(self, timeout: float = 30.0) -> None:
        """Tell the workers to stop (driver), wait for them, leave the process group."""
        if self._closed:
            return
        self._closed = True
        import torch.distributed as dist

        if self.is_driver and self.failed is None:
            try:
                self.broadcast(("stop", ()))
            except Exception as exc:  # noqa: BLE001 (a dead worker: nothing to tell)
                log.warning("could not tell the workers to stop: %s", exc)
            else:
                self.meet()
        deadline = time.monotonic() + timeout
        for p in self.workers:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                if isinstance(p, subprocess.Popen):
                    p.wait()
        if dist.is_initialized():
            if self.config.executor == "external_launcher" and self.failed is None:
                # Every rank runs its own engine: wait until all are done with their last
                # collective, so none tears down the group under a peer's pending send
                # (gloo then aborted rank 0 at exit, 'terminate called without an active
                # exception', in about 1 of 8 torchrun runs).
                try:
                    dist.barrier()
                except Exception as exc:  # noqa: BLE001 (a dead peer: leave anyway)
                    log.warning("ranks did not meet before leaving the process group: %s", exc)
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def stage_layers(num_layers: int, stage: int, stages: int) -> tuple[int, int]:
    """Layers [first, end) of pipeline stage `stage`; the first stages take one more when uneven."""
    if stages > num_layers:
        raise ValueError(f"pipeline_parallel_size={stages} is larger than the model's {num_layers} layers")
    per, extra = divmod(num_layers, stages)
    first = stage * per + min(stage, extra)
    return first, first + per + (stage < extra)


def _as_torch(x):
    """A torch view of a backend tensor (a NumPy array shares its memory) for torch.distributed."""
    import torch

    return x if isinstance(x, torch.Tensor) else torch.from_numpy(x)


def _digest(obj: dict) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timeout_s() -> float:
    return float(os.environ.get("INFER_DIST_TIMEOUT_S", DEFAULT_TIMEOUT_S))


def start(config: ParallelConfig, dist_backend: str, *, rank: int | None = None,
          spawn: Callable[[ParallelConfig, list[int]], list] | None = None) -> DistributedState:
    """Join (and for a node's first process, first start) the job; returns this process's state.

    mp and ray: called with ``rank=None`` on a node's first process, which is
    global rank ``node_rank * ranks_per_node``; ``spawn(config, ranks)`` starts
    the node's other ranks (`executor.launch` hands in the executor's way) and
    returns handles with poll/wait/kill. A worker calls it with its rank.
    external_launcher: the rank comes from torchrun's environment (RANK,
    WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT).
    """
    import torch.distributed as dist

    executor = config.executor
    timeout = timedelta(seconds=timeout_s())
    if executor == "external_launcher":
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise RuntimeError(f"distributed_executor_backend='external_launcher' expects to be started by torchrun "
                               f"(missing {', '.join(missing)} in the environment)")
        world = int(os.environ["WORLD_SIZE"])
        if world != config.world_size:
            raise ValueError(f"torchrun started {world} ranks but tensor_parallel_size x pipeline_parallel_size = "
                             f"{config.world_size}; make --nproc-per-node x --nnodes match")
        rank = int(os.environ["RANK"])
        state = DistributedState(config, rank, int(os.environ.get("LOCAL_RANK", rank)))
        dist.init_process_group(dist_backend, init_method="env://", rank=rank, world_size=world, timeout=timeout)
    elif executor in ("mp", "ray"):
        port = config.master_port or free_port()
        config = dataclasses.replace(config, master_port=port)
        first = config.node_rank * config.ranks_per_node
        if rank is None:  # a node's first process: start the node's other ranks
            rank = first
            state = DistributedState(config, rank, 0)
            if dist_backend == "gloo" and "OMP_NUM_THREADS" not in os.environ:
                # CPU ranks share the node's cores, as the workers are told to: no oversubscription
                import torch

                torch.set_num_threads(_threads_per_rank(config))
            others = list(range(first + 1, first + config.ranks_per_node))
            if others and spawn is None:
                raise ValueError(f"the first process of a {executor} job starts the other ranks: give spawn")
            state.workers = spawn(config, others) if others else []
        else:
            state = DistributedState(config, rank, 0 if executor == "ray" else rank - first)
        try:
            dist.init_process_group(dist_backend, init_method=f"tcp://{config.master_addr}:{port}", rank=rank,
                                    world_size=config.world_size, timeout=timeout)
        except Exception:
            for p in state.workers:
                p.kill()
            raise
        if state.workers:
            _monitor(state)
    else:
        raise ValueError(f"unknown distributed_executor_backend {executor!r}")
    # Every rank creates every group, in the same order (torch.distributed's rule).
    tp, staged = config.tensor_parallel_size, config.pipeline_parallel_size > 1
    state.control_group = dist.group.WORLD if dist_backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    for stage in range(config.pipeline_parallel_size):
        ranks = list(range(stage * tp, (stage + 1) * tp))
        group = dist.new_group(ranks, timeout=timeout) if staged else dist.group.WORLD
        control = dist.new_group(ranks, timeout=timeout, backend="gloo") if staged else state.control_group
        if rank in ranks:
            state.tp_group, state.stage_control = group, control
    _close_at_exit(state)
    return state


def _close_at_exit(state: DistributedState) -> None:
    """Leave the job (stop the workers, destroy the process group) when the interpreter exits,
    if nothing closed it before: left to the engine's collection during finalization, that
    teardown aborted the process ('terminate called without an active exception', SIGABRT
    instead of the script's exit code) in about 1 of 5 runs of a plain tensor-parallel script."""
    import atexit
    import weakref

    ref = weakref.ref(state)

    def close() -> None:
        s = ref()
        if s is not None:
            s.close()

    atexit.register(close)


def _spawn_worker(config: ParallelConfig, rank: int, local_rank: int, engine_args: dict) -> subprocess.Popen:
    spec = {"parallel": dataclasses.asdict(config), "rank": rank, "local_rank": local_rank, "engine_args": engine_args}
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(_threads_per_rank(config)))
    return subprocess.Popen([sys.executable, "-m", "infer.core.worker", json.dumps(spec)], env=env)


def _threads_per_rank(config: ParallelConfig) -> int:
    return max(1, (os.cpu_count() or 1) // config.ranks_per_node)


def _monitor(state: DistributedState) -> None:
    """Watch the workers this process started: one that exits while the job runs is named in
    `state.failed` and logged (its peers' collectives then fail, or time out)."""

    def watch():
        while not state._closed:
            for i, p in enumerate(state.workers):
                code = p.poll()
                if code is not None and not state._closed:
                    rank = state.rank + 1 + i
                    state.failed = f"rank {rank} (pid {p.pid}) exited with code {code}"
                    log.error("distributed worker %s", state.failed)
                    return
            time.sleep(0.2)

    threading.Thread(target=watch, name="infer-worker-monitor", daemon=True).start()
