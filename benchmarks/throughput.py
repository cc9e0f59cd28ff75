"""Offline throughput of infer against transformers; the same as `infer bench throughput`.

    python benchmarks/throughput.py --json out.json --png out.png
    python benchmarks/throughput.py --quick --skip-transformers

The workload, the measurements and the report live in `infer.bench`, so the
installed package has them too.
"""

from __future__ import annotations

import argparse
import sys

from infer.bench import add_throughput_args, cmd_bench

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_throughput_args(parser)
    sys.exit(cmd_bench(parser.parse_args()))
