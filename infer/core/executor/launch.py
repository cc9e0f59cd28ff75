"""Starting a job from its first process (the engine): each executor's way of starting
the other ranks, handed to `distributed.start`, which then joins them all."""

from __future__ import annotations

import dataclasses

from .. import distributed
from ..distributed import DistributedState, ParallelConfig


def start(config: ParallelConfig, dist_backend: str, engine_args: dict) -> DistributedState:
    """mp: this node's other ranks as worker processes (`python -m infer.core.worker`);
    ray: every other rank as a Ray actor, with this node's address as the meeting point;
    external_launcher: torchrun started every rank, so nothing to start."""
    if config.executor == "ray":
        from .. import ray_executor

        # Ray places every rank: one "node" from here, met at this address.
        config = dataclasses.replace(config, master_addr=ray_executor.node_ip(), nnodes=1, node_rank=0)
        use_gpus = dist_backend != "gloo"
        return distributed.start(config, dist_backend,
                                 spawn=lambda cfg, ranks: ray_executor.spawn(cfg, ranks, engine_args, use_gpus))
    if config.executor == "mp":
        return distributed.start(config, dist_backend, spawn=lambda cfg, ranks: _processes(cfg, ranks, engine_args))
    return distributed.start(config, dist_backend)


def _processes(config: ParallelConfig, ranks: list[int], engine_args: dict) -> list:
    first = config.node_rank * config.ranks_per_node
    return [distributed._spawn_worker(config, r, r - first, engine_args) for r in ranks]
