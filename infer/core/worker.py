"""A worker rank of the ``mp`` executor: ``python -m infer.core.worker SPEC``.

Started by the driver (`core/distributed.py`) with a JSON spec: the engine
arguments, its rank and local rank. It joins the process group, builds its
shard of the model (`executor.worker.Worker`), then runs the driver's calls,
``(method, args)``, as ``getattr(worker, method)(*args)`` until ``("stop", ())``.
A failure is printed with the rank and ends the process with code 1, which the
driver's monitor reports.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import traceback


def run(spec: dict) -> None:
    from . import distributed
    from .args import PER_RANK_ARGS, EngineArgs
    from .distributed import ParallelConfig
    from .executor.rank import rank_backend
    from .executor.worker import Worker

    args = EngineArgs(**spec["engine_args"])
    args = dataclasses.replace(args, show_progress=False)
    config = ParallelConfig(**spec["parallel"])
    backend = rank_backend(args, spec["local_rank"])
    dist = distributed.start(config, backend.dist_backend, rank=spec["rank"])
    try:
        fields = dataclasses.asdict(args)
        dist.check_agreement({k: v for k, v in fields.items() if k not in PER_RANK_ARGS})
        worker = Worker(args, backend, dist)
        while True:
            method, call_args = dist.broadcast(None)
            if method == "stop":
                dist.meet()
                return
            getattr(worker, method)(*call_args)
    finally:
        dist.close()


def run_headless(args) -> int:
    """A node that serves no API (``infer serve --headless --node-rank N``): its first
    rank runs here, the node's other ranks as worker processes; returns when the
    driver on node 0 stops the job (0) or a rank fails (1)."""
    from . import distributed

    config = args.parallel_config()
    if config.executor != "mp" or config.node_rank == 0:
        raise ValueError("--headless is for the other nodes of a multi-node mp job: give --nnodes > 1 and "
                         "--node-rank >= 1 (node 0 runs the API server)")
    fields = dataclasses.asdict(args)
    first = config.node_rank * config.ranks_per_node
    others = [distributed._spawn_worker(config, r, r - first, fields) for r in range(first + 1, first + config.ranks_per_node)]
    spec = {"parallel": dataclasses.asdict(config), "rank": first, "local_rank": 0, "engine_args": fields}
    code = main([json.dumps(spec)])
    for p in others:
        code = max(code, p.wait())
    return code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(argv[0])
    logging.basicConfig(level=logging.WARNING, format=f"[rank {spec['rank']}] %(levelname)s %(message)s")
    try:
        run(spec)
    except Exception:  # noqa: BLE001 (reported, then a non-zero exit the driver sees)
        print(f"infer worker rank {spec['rank']} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
