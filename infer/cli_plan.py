"""`infer plan`: print a step's XY-Serve tables (Token-Table, Task-Table, SmoothGEMM tiles)."""

from __future__ import annotations

import argparse

import numpy as np

from .core import xy_plan


def parse_requests(text: str) -> list[tuple[int, int]]:
    """'Q:CTX,Q:CTX,...' -> [(q_len, cached_len), ...]; a bare 'Q' has no cached context."""
    reqs = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        q, _, ctx = item.partition(":")
        reqs.append((int(q), int(ctx or 0)))
    if not reqs or any(q < 0 or c < 0 for q, c in reqs):
        raise argparse.ArgumentTypeError(f"--reqs wants Q:CTX pairs of non-negative ints, got {text!r}")
    return reqs


def random_requests(seed: int, budget: int = 2048) -> list[tuple[int, int]]:
    """A mixed step as continuous batching fills it: decodes, then prefill chunks up to `budget` tokens."""
    rng = np.random.default_rng(seed)
    reqs = [(1, int(c)) for c in rng.integers(16, 4000, int(rng.integers(16, 64)))]
    left = budget - len(reqs)
    while left > 0:
        n = int(min(left, rng.integers(32, 1024)))
        reqs.append((n, int(rng.integers(0, 4000))))
        left -= n
    return [reqs[i] for i in rng.permutation(len(reqs))]


def _print_tables(console, reqs, args) -> None:
    from rich.table import Table

    q = np.array([r[0] for r in reqs], np.int64)
    qsl = np.concatenate([[0], np.cumsum(q)])
    seq = q + np.array([r[1] for r in reqs], np.int64)
    table = xy_plan.attention_table(qsl, seq, tuple(args.q_tiles))
    tasks = xy_plan.assign(table, args.cores, args.heads)
    snake = xy_plan.assign(table, args.cores, args.heads, refine=False)
    naive = xy_plan.contiguous_split(table, args.cores, args.heads)

    tt = Table(title=f"Token-Table: attention ({len(reqs)} requests, {int(qsl[-1])} tokens, {len(table)} tiles)",
               title_justify="left")
    for col in ("tile", "request", "start", "token_num", "kv_len", "tile_size", "cost"):
        tt.add_column(col, justify="right")
    for i in range(len(table)):
        tt.add_row(str(i), str(table.request[i]), str(table.start[i]), str(table.token_num[i]), str(table.kv_len[i]),
                   str(table.tile_size[i]), str(table.cost[i]))
    console.print(tt)

    task = Table(title=f"Task-Table: {args.cores} cores, {args.heads} head group(s) per tile "
                       "(unit = tile.head, run order)", title_justify="left")
    task.add_column("core", justify="right")
    task.add_column("load", justify="right")
    task.add_column("units", overflow="fold")
    for c, units in enumerate(tasks.tiles):
        names = " ".join(f"{u // args.heads}.{u % args.heads}" if args.heads > 1 else str(u) for u in units)
        task.add_row(str(c), f"{tasks.load[c]:.0f}", names)
    console.print(task)
    console.print(f"load balance (max/mean): xy-serve {tasks.imbalance:.3f}, mirrored round-robin alone "
                  f"{snake.imbalance:.3f}, contiguous split {naive.imbalance:.3f}")

    for spec in args.linear:
        name, _, n = spec.partition(":")
        lin = xy_plan.linear_table(name, int(qsl[-1]), int(n), args.m_tile, args.n_tile)
        lt = Table(title=f"Token-Table: {name} (SmoothGEMM, M={int(qsl[-1])} padded to "
                         f"{-(-int(qsl[-1]) // args.m_tile) * args.m_tile}, N={n})", title_justify="left")
        for col in ("tile", "start", "token_num", "tile_size", "n_start", "n_size"):
            lt.add_column(col, justify="right")
        for i in range(len(lin)):
            lt.add_row(str(i), str(lin.start[i]), str(lin.token_num[i]), str(lin.tile_size[i]), str(lin.n_start[i]),
                       str(lin.n_size[i]))
        console.print(lt)


def cmd_plan(args: argparse.Namespace) -> int:
    from .console import console as _console

    reqs = args.reqs if args.reqs is not None else random_requests(args.seed, args.budget)
    _print_tables(_console(), reqs, args)
    return 0


def add_plan(sub) -> None:
    p = sub.add_parser("plan", help="print a step's XY-Serve decomposition (Token-Table, Task-Table, SmoothGEMM tiles)")
    p.add_argument("--reqs", type=parse_requests, default=None,
                   help="the step's requests as Q:CTX pairs (query tokens this step : tokens already cached), "
                        "e.g. 300:0,1:700,64:1200; default: a random mixed step")
    p.add_argument("--seed", type=int, default=0, help="seed of the random step")
    p.add_argument("--budget", type=int, default=2048, help="tokens of the random step")
    p.add_argument("--cores", type=int, default=xy_plan.DEFAULT_CORES, help="cores the tiles are dealt to")
    p.add_argument("--heads", type=int, default=1, help="KV head groups per tile (each a separate unit of work)")
    p.add_argument("--q-tiles", type=int, nargs="+", default=list(xy_plan.DEFAULT_Q_TILES),
                   help="query-tile shapes (rows)")
    p.add_argument("--linear", action="append", default=[], metavar="NAME:N",
                   help="also print a linear op's SmoothGEMM tiles, N output features (repeatable)")
    p.add_argument("--m-tile", type=int, default=xy_plan.DEFAULT_M_TILE)
    p.add_argument("--n-tile", type=int, default=xy_plan.DEFAULT_N_TILE)
    p.set_defaults(func=cmd_plan)
