"""What the engine-racing benchmarks share: each configuration in a fresh process of the
same script (``--child ...``, its result the last line it prints, as JSON), and the
JSON and PNG outputs."""

from __future__ import annotations

import json
import subprocess
import sys


def run_child(script: str, args: list[str], timeout: float = 3600) -> dict:
    """``python script --child *args`` in a new interpreter; its last stdout line, parsed."""
    res = subprocess.run([sys.executable, script, "--child", *args], capture_output=True, text=True, timeout=timeout)
    if res.returncode:
        raise RuntimeError(f"{' '.join(args)} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def save_json(path: str | None, **content) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(content, f, indent=1)


def pyplot():
    """matplotlib's pyplot without a display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
