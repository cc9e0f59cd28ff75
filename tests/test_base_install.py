"""The base install (`pip install -e .`, no extras) runs every `infer` command but `serve`,
and `infer serve` there says which extra to install. Each test runs a fresh interpreter in
which the optional dependencies cannot be imported (a `sys.meta_path` finder refuses them),
so a module that imports one at import time fails here even though the test venv has it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import require_smollm2

# Everything pyproject.toml lists only under extras (serve, ray, ascend, dev), and what those bring.
OPTIONAL = ("fastapi", "starlette", "uvicorn", "prometheus_client", "ray", "peft", "kubernetes_validate", "openai",
            "jsonschema", "schemathesis", "matplotlib", "pytest", "hypothesis", "torch_npu")

PRELUDE = r"""
import contextlib, importlib, importlib.abc, io, json, pkgutil, sys
BLOCKED = set(sys.argv[1].split(","))

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
        return None

sys.meta_path.insert(0, Block())

def cli(*argv):
    from infer.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exc:
            code = exc.code
    return {"argv": list(argv), "code": code, "out": out.getvalue(), "err": err.getvalue()}
"""


def _run(body: str, timeout: float = 300) -> list:
    env = {**os.environ, "COLUMNS": "400"}  # rich's tables unwrapped
    res = subprocess.run([sys.executable, "-c", PRELUDE + body, ",".join(OPTIONAL)], capture_output=True, text=True,
                         timeout=timeout, env=env)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_the_blocker_blocks():
    # The finder must refuse what it names, or every test below passes vacuously.
    [msg] = _run("""
try:
    import fastapi
    print(json.dumps(["imported"]))
except ModuleNotFoundError as exc:
    print(json.dumps([str(exc)]))
""")
    assert "blocked by the test" in msg


def test_every_module_outside_the_server_imports_without_extras():
    failed = _run("""
import infer
failed = []
for m in pkgutil.walk_packages(infer.__path__, "infer."):
    if m.name.startswith("infer.server.") and m.name != "infer.server.cli" or m.name.endswith("__main__"):
        continue
    try:
        importlib.import_module(m.name)
    except Exception as exc:
        failed.append(f"{m.name}: {type(exc).__name__}: {exc}")
print(json.dumps(failed))
""")
    assert failed == []


def test_every_command_but_serve_runs_without_extras():
    results = _run("""
runs = [cli("--help"), cli("backends"), cli("conformance", "--backend", "torch", "--list")]
runs += [cli(cmd, "--help") for cmd in ("run", "serve", "graph", "bench", "conformance", "plan")]
runs.append(cli("serve", "--port", "0"))
print(json.dumps(runs))
""")
    by_argv = {" ".join(r["argv"]): r for r in results}
    for argv, r in by_argv.items():
        if argv != "serve --port 0":
            assert r["code"] == 0, (argv, r["err"][-2000:])
    assert "torch" in by_argv["backends"]["out"] and "cpu_ref" in by_argv["backends"]["out"]
    assert "--max-connections" in by_argv["serve --help"]["out"]
    served = by_argv["serve --port 0"]
    assert served["code"] == 2
    assert served["out"] == "" and served["err"].count("\n") == 1, served["err"]  # one line, no traceback
    assert "pip install 'infer[serve]'" in served["err"]


@pytest.mark.slow
def test_infer_run_generates_without_extras():
    require_smollm2()
    [r] = _run("""
print(json.dumps([cli("run", "What is the capital of France?", "--max-tokens", "8", "--temperature", "0")]))
""")
    assert r["code"] == 0, r["err"][-3000:]
    assert r["out"].strip(), r
    assert "tok/s" in r["out"] + r["err"]
