"""A real out-of-tree plugin: pip-install examples/infer-example-backend, then
find it through the `infer` entry-point group in a fresh process.

The package goes into a temporary ``--target`` directory put on PYTHONPATH of
the subprocesses only, so the shared venv (and tests running beside this one)
never see it, and nothing needs uninstalling afterwards.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "infer-example-backend"


def _infer_command() -> list[str]:
    script = Path(sys.executable).with_name("infer")  # the console script of this venv
    return [str(script)] if script.exists() else [sys.executable, "-m", "infer.cli"]


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("example-plugin")
    # Build from a copy: setuptools writes build/ and *.egg-info next to the sources.
    src = shutil.copytree(EXAMPLE, tmp / "src", ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    site = tmp / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--target", str(site), str(src)],
        check=True, capture_output=True, text=True, timeout=300,
    )
    assert (site / "infer_example_backend").is_dir()
    pythonpath = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": pythonpath, "COLUMNS": "400"}


def _infer(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*_infer_command(), *args], env=env, capture_output=True, text=True, timeout=300)


def test_installed_plugin_is_listed_by_infer_backends(plugin_env):
    res = _infer(plugin_env, "backends")
    assert res.returncode == 0, res.stderr
    row = next(line for line in res.stdout.splitlines() if line.startswith("│ example "))
    assert "yes" in row
    assert "3 native, 15 via torch" in row  # its own three primitives, torch for the rest
    assert "ExampleLlamaForCausalLM" in res.stdout  # the model hook works too
    assert "failed to load" not in res.stdout


def test_installed_plugin_passes_conformance(plugin_env):
    res = _infer(plugin_env, "conformance", "--backend", "example")
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr
    assert "0 failed, 0 errors, 0 skipped" in res.stdout
    rows = res.stdout.splitlines()
    # Its own implementations and the torch fallback were both exercised.
    assert any(line.startswith("│ rms_norm") and "│ example" in line for line in rows)
    assert any(line.startswith("│ attention") and "│ torch" in line for line in rows)


def test_plugin_is_invisible_without_the_install():
    """The entry point, nothing else, is what made `example` appear above."""
    if importlib.util.find_spec("infer_example_backend") is not None:
        pytest.skip("infer-example-backend is installed in this environment itself")
    res = _infer({**os.environ, "COLUMNS": "400"}, "conformance", "--backend", "example")
    assert res.returncode == 2
    assert "unknown backend 'example'" in res.stderr
