"""deploy/: the Kubernetes manifests against the Kubernetes schemas (offline, with
kubernetes-validate), and the commands their containers run against infer's own parser."""

from __future__ import annotations

import json
import os
import re
import shlex
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

from infer.cli import build_parser

DEPLOY = Path(__file__).parent.parent / "deploy"
K8S_VERSION = "1.30"  # the pod-index label the multi-node manifest reads is on by default from 1.28
MANIFESTS = sorted((DEPLOY / "k8s").glob("*.yaml"))


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifests_match_the_kubernetes_schemas(path):
    kv = pytest.importorskip("kubernetes_validate")
    docs = documents(path)
    assert docs
    for doc in docs:
        kv.validate(doc, K8S_VERSION, strict=True)  # raises on any unknown or mistyped field


def test_the_schema_check_rejects_a_broken_manifest():
    kv = pytest.importorskip("kubernetes_validate")
    doc = documents(DEPLOY / "k8s" / "single-node.yaml")[0]
    doc["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {"path": "/health"}
    with pytest.raises(kv.ValidationError):
        kv.validate(doc, K8S_VERSION, strict=True)


def _dockerfile_entrypoint(image: str) -> list[str]:
    """The ENTRYPOINT of deploy/Dockerfile.<kind> for image infer:<kind>."""
    text = (DEPLOY / f"Dockerfile.{image.split(':')[1]}").read_text()
    return json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M).group(1))


def _containers():
    for path in MANIFESTS:
        for doc in documents(path):
            spec = doc.get("spec", {}).get("template", {}).get("spec")
            for c in (spec or {}).get("containers", []):
                yield f"{path.name}:{doc['metadata']['name']}", c


def _argv(container: dict, tmp_path: Path, pod_index: int) -> list[str]:
    """The argv `infer` receives when the container starts (its shell expanded for real)."""
    if "command" not in container:  # the image's entrypoint, then the manifest's args
        return _dockerfile_entrypoint(container["image"])[1:] + container.get("args", [])
    fake = tmp_path / "bin" / "infer"
    fake.parent.mkdir(exist_ok=True)
    out = tmp_path / "argv.json"
    fake.write_text(f"#!/usr/bin/env python3\nimport json, sys\njson.dump(sys.argv[1:], open({str(out)!r}, 'w'))\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    env = {"PATH": f"{fake.parent}{os.pathsep}{os.environ['PATH']}"}
    for e in container.get("env", []):
        env[e["name"]] = e["value"] if "value" in e else str(pod_index)  # valueFrom: the pod index label
    subprocess.run(container["command"] + container.get("args", []), env=env, check=True, timeout=30)
    return json.loads(out.read_text())


@pytest.mark.parametrize("name,container", list(_containers()), ids=lambda x: x if isinstance(x, str) else "")
def test_containers_run_real_infer_flags(name, container, tmp_path):
    argv = _argv(container, tmp_path, pod_index=0)
    args = build_parser().parse_args(argv)  # an unknown flag or a bad value exits here
    assert argv[0] == "serve"
    if "workers" in name:  # the second node: its ranks, no API
        assert args.headless and args.node_rank == 1 and args.nnodes == 2
    if "leader" in name:
        assert not args.headless and args.node_rank == 0
    if "multi-node" in name:
        world = args.tensor_parallel_size * args.pipeline_parallel_size
        gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
        assert world == gpus * args.nnodes  # one rank per GPU on every node
        assert args.master_addr == "infer-leader-0.infer-ranks" and args.master_port == 29500
