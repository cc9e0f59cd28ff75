"""The rich console every command prints through."""

from __future__ import annotations

import os
import sys

from rich.console import Console


def console(stderr: bool = False) -> Console:
    """stdout's (or stderr's) console; piped output (CI logs, tests) gets $COLUMNS or a
    wide 200 columns instead of wrapping at 80."""
    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() else int(os.environ.get("COLUMNS") or 200)
    return Console(file=stream, width=width, highlight=False)
