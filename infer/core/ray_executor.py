"""The ``ray`` executor: worker ranks as Ray actors on a running Ray cluster.

The engine (rank 0) connects to the cluster (``RAY_ADDRESS``, default
``auto``: the cluster this host belongs to), reserves one bundle per worker
rank in a placement group (one CPU each, or one GPU each for a CUDA backend),
and starts an actor in each that runs `infer.core.worker` for its rank; the
ranks then meet over torch.distributed at rank 0's node address, as with the
mp executor. Ray places the actors, so the job may span the cluster's nodes
without ``--nnodes``. Install with ``pip install 'infer[ray]'``.
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

PLACEMENT_TIMEOUT_S = 120.0


def _ray():
    try:
        import ray
    except ImportError as exc:
        raise RuntimeError("distributed_executor_backend='ray' needs Ray: pip install 'infer[ray]'") from exc
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), log_to_driver=True,
                 runtime_env={"env_vars": {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}})
    return ray


def node_ip() -> str:
    """This node's address on the Ray cluster (where the worker ranks find rank 0)."""
    return _ray().util.get_node_ip_address()


class RayRank:
    """One worker rank's actor, with the part of `subprocess.Popen`'s interface the
    driver uses (poll, wait, kill, pid, returncode) so it is watched like a process."""

    def __init__(self, actor, ref, pid: int):
        self.actor, self.ref, self.pid, self.returncode = actor, ref, pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            ray = _ray()
            done, _ = ray.wait([self.ref], timeout=0)
            if done:
                try:
                    self.returncode = int(ray.get(done[0]))
                except Exception:  # noqa: BLE001 (the actor died: Ray raises its error here)
                    self.returncode = 1
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        ray = _ray()
        done, _ = ray.wait([self.ref], timeout=timeout)
        if not done:
            raise subprocess.TimeoutExpired("ray actor", timeout)
        return self.poll()

    def kill(self) -> None:
        _ray().kill(self.actor, no_restart=True)
        if self.returncode is None:
            self.returncode = -9


def spawn(config, ranks: list[int], engine_args: dict, use_gpus: bool) -> list[RayRank]:
    """Start `ranks` as actors in one placement group; each runs the worker loop until stopped."""
    import dataclasses

    ray = _ray()
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = {"GPU": 1} if use_gpus else {"CPU": 1}
    group = placement_group([dict(bundle) for _ in ranks], strategy="PACK")
    try:
        ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except Exception as exc:
        raise RuntimeError(f"the Ray cluster cannot place {len(ranks)} worker ranks of {bundle} each within "
                           f"{PLACEMENT_TIMEOUT_S:.0f} s ({ray.available_resources()} available)") from exc

    @ray.remote
    class RankActor:
        def pid(self) -> int:
            return os.getpid()

        def run(self, spec: dict) -> int:
            from infer.core import worker

            return worker.main([json.dumps(spec)])

    out = []
    for i, rank in enumerate(ranks):
        actor = RankActor.options(num_cpus=0 if use_gpus else 1, num_gpus=1 if use_gpus else 0,
                                  scheduling_strategy=PlacementGroupSchedulingStrategy(group, i)).remote()
        spec = {"parallel": dataclasses.asdict(config), "rank": rank, "local_rank": 0, "engine_args": engine_args}
        pid = ray.get(actor.pid.remote())  # before `run`, which holds the actor until the job stops
        out.append(RayRank(actor, actor.run.remote(spec), pid))
    return out


def release(ranks: list[Any]) -> None:
    """Kill what is left of the actors (after they were told to stop)."""
    for r in ranks:
        if isinstance(r, RayRank) and r.poll() is None:
            r.kill()
