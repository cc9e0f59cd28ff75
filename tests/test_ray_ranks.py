"""The Ray executor's rank handles on an in-process Ray instance: a rank actor is
watched like a process (poll, wait, kill, exit codes). The whole executor runs in
tests/test_distributed.py::test_ray_executor_on_a_local_cluster."""

from __future__ import annotations

import subprocess

import pytest

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


def test_a_rank_actor_reports_like_a_process(local_ray):
    import os

    from infer.core.ray_executor import RayRank

    @ray.remote
    class Rank:
        def pid(self):
            return os.getpid()

        def run(self, code, wait_s=0.0):
            import time

            time.sleep(wait_s)
            if code == "crash":
                raise RuntimeError("rank failed")
            return code

    def start(code, wait_s=0.0):
        actor = Rank.remote()
        pid = ray.get(actor.pid.remote())
        return RayRank(actor, actor.run.remote(code, wait_s), pid)

    done = start(3)
    assert done.wait(60) == 3 and done.poll() == 3 and done.returncode == 3
    crashed = start("crash")
    assert crashed.wait(60) == 1  # an exception in the rank is a failure exit
    busy = start(0, wait_s=60)
    assert busy.poll() is None and busy.pid > 0
    with pytest.raises(subprocess.TimeoutExpired):
        busy.wait(0.2)
    busy.kill()
    assert busy.poll() == -9
