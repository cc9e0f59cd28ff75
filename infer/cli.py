"""The `infer` command line.

Each subcommand is an ``add_<name>(subparsers)`` function that registers its
parser and sets ``func``; `COMMANDS` lists them, so adding `run`, `serve` or
`bench` is one function and one entry.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter, defaultdict
from typing import Callable

from rich.markup import escape
from rich.table import Table

from . import __version__
from .console import console as _console
from .primitives.backend import Backend
from .primitives.spec import PRIMITIVES
from .primitives.types import FLOAT_DTYPES
from .testing.cases import CHECKED

DTYPE_ALIASES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", **{d: d for d in FLOAT_DTYPES}}


# -- infer backends -----------------------------------------------------------
def declared_coverage(cls: type[Backend]) -> dict[str, str]:
    """primitive -> provider, from the class alone (no instance, no hardware).

    A primitive the class (or a base that is not another named backend)
    defines is native; one it lacks, or inherits from another backend's class,
    is served by that backend or by the declared fallback.
    """
    out = {}
    for prim in PRIMITIVES:
        owner = next((k for k in cls.__mro__ if callable(vars(k).get(prim))), None)
        if owner is None:
            out[prim] = cls.fallback or "missing"
        elif owner is not cls and issubclass(owner, Backend) and owner.name and owner.name != cls.name:
            out[prim] = owner.name
        else:
            out[prim] = cls.name
    return out


def _coverage(info) -> tuple[dict[str, str], str]:
    """(primitive -> provider, note) as Ops resolves it, or as declared when unavailable;
    the note names the declared fast paths (e.g. the torch backend's native kernels)."""
    if not info.available:
        return declared_coverage(info.cls), "declared"
    from .dispatch import Ops

    try:
        ops = Ops(info.cls())
        fast = ops.fast_paths()
        labels = sorted({label.split(":", 1)[1] for label in fast.values()})
        note = "; ".join(f"fast path {lb}: " + ", ".join(p for p, f in fast.items() if f.endswith(":" + lb))
                         for lb in labels)
        return ops.coverage(), note
    except Exception as exc:  # e.g. its fallback is unavailable here
        return declared_coverage(info.cls), f"declared; {type(exc).__name__}: {exc}"


def _coverage_summary(name: str, cov: dict[str, str]) -> str:
    providers = Counter("missing" if p.startswith("missing") else p for p in cov.values())
    parts = [f"{providers.pop(name, 0)} native"]
    parts += [f"{n} via {p}" for p, n in providers.items() if p != "missing"]
    if providers.get("missing"):
        missing = [k for k, p in cov.items() if p.startswith("missing")]
        parts.append(f"[red]missing: {', '.join(missing)}[/]")
    return ", ".join(parts)


def _default_device(cls: type[Backend]) -> str:
    try:  # default_device reads no hardware; skip __init__ so nothing is touched
        return cls.default_device(object.__new__(cls))
    except Exception:
        return "?"


def cmd_backends(args: argparse.Namespace) -> int:
    from .registry import registry

    reg = registry()
    console = _console()
    table = Table(title="infer backends", title_justify="left")
    for col in ("backend", "available", "plugin", "device", "block", "KV layout", "dtypes", "dist", "primitives"):
        table.add_column(col, overflow="fold")
    matrix: dict[str, dict[str, str]] = {}
    for name, info in sorted(reg.backends.items()):
        cls = info.cls
        cov, note = _coverage(info)
        matrix[name] = cov
        avail = f"[red]no[/]: {escape(info.available.reason)}" if not info.available else "[green]yes[/]" + (
            f" [yellow]({escape(info.available.reason)})[/]" if info.available.reason else "")  # a note, e.g. interpreter mode
        summary = _coverage_summary(name, cov) + (f" [dim]({escape(note)})[/]" if note else "")
        table.add_row(name, avail, info.plugin, _default_device(cls), str(cls.preferred_block_size),
                      cls.kv_cache_layout, ", ".join(cls.dtypes), cls.dist_backend, summary)
    console.print(table)
    if "torch" in reg.backends:
        from .backends.torch_native import native, quant_linear

        console.print("torch CPU kernels (rms_norm, rotary, silu_and_mul, kv_write, attention, int4 and Q8_0 linear, "
                      f"fused decode attention block and MLP; fp8 KV): {escape(native.status())}")
        console.print("torch kept-quantized weights: batched steps past the quantized kernels' rows use dequantized "
                      f"copies of up to {quant_linear.DENSE_COPY_BYTES / 2**20:.0f} MiB in all (INFER_DEQUANT_CACHE_MB; "
                      "past it, tiles dequantized at each call)")
    if args.coverage and matrix:
        cov_table = Table(title="primitive coverage (provider of each primitive)", title_justify="left")
        cov_table.add_column("primitive")
        for name in matrix:
            cov_table.add_column(name)
        for prim in PRIMITIVES:
            cells = [_provider_cell(name, matrix[name][prim]) for name in matrix]
            cov_table.add_row(prim, *cells)
        console.print(cov_table)
    if args.model:
        console.print(_kv_capacity_table(args, reg))
    if reg.models:
        console.print("model architectures: " + ", ".join(sorted(reg.models)))
    if reg.broken:
        broken = Table(title="plugins that failed to load", title_justify="left")
        broken.add_column("plugin")
        broken.add_column("reason", overflow="fold")
        for plugin, reason in sorted(reg.broken.items()):
            broken.add_row(plugin, escape(reason))
        console.print(broken)
    return 0


def _kv_capacity_table(args: argparse.Namespace, reg) -> Table:
    """KV capacity in tokens per tier of `args.model` on each available backend: the
    engine's own sizing (what `infer serve` with these flags would allocate)."""
    import logging

    from .core.engine import EngineArgs, LLMEngine, kv_concurrency

    table = Table(title=f"KV capacity for {args.model}", title_justify="left")
    for col in ("backend", "block", "device pool", "host tier", "max context", "max-context requests"):
        table.add_column(col, overflow="fold")
    quiet = logging.getLogger("infer")
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        for name, info in sorted(reg.backends.items()):
            if not info.available:
                continue
            try:
                engine = LLMEngine(EngineArgs(
                    model=args.model, backend=name, dtype=args.dtype, max_model_len=args.max_model_len,
                    block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
                    gpu_memory_utilization=args.gpu_memory_utilization, kv_offload_bytes=args.kv_offload_bytes,
                    kv_cache_dtype=args.kv_cache_dtype, enforce_eager=True, show_progress=False,
                    disable_hybrid_kv_cache_manager=args.disable_hybrid_kv_cache_manager,
                    skip_tokenizer_init=True))
            except Exception as exc:
                table.add_row(name, "", f"[red]{escape(type(exc).__name__)}[/]: {escape(str(exc))}", "", "", "")
                continue
            cache = engine.cache_config
            per_block = engine.worker.runner.kv_cache_bytes_per_block(cache.block_size)
            sizes = "/".join(str(k * cache.block_size) for k in cache.block_multiples)
            host = (f"{cache.num_tier_blocks * cache.block_size:,} tokens "
                    f"({cache.num_tier_blocks * per_block / 2**20:,.0f} MiB)" if cache.num_tier_blocks else "none")
            groups = engine.worker.runner.kv_groups
            pool = (f"{cache.num_blocks * cache.block_size:,} tokens "
                    f"({cache.num_blocks * per_block / 2**20:,.0f} MiB)")
            if groups.is_hybrid:  # a block is a page of one group's layers
                pool += f"; hybrid: {groups.describe()}"
            table.add_row(name, sizes, pool, host, f"{engine.max_model_len:,}",
                          f"{kv_concurrency(cache, engine.scheduler, engine.max_model_len):.2f}")
            engine.shutdown()
    finally:
        quiet.setLevel(level)
    return table


def _provider_cell(name: str, provider: str) -> str:
    if provider.startswith("missing"):
        return "[red]missing[/]"
    return "[green]native[/]" if provider == name else f"[yellow]{provider}[/]"


def add_backends(sub) -> None:
    from .cli_model import block_size_arg

    p = sub.add_parser("backends", help="list every backend found, available or not, and why")
    p.add_argument("--coverage", action="store_true", help="also print which backend provides each primitive")
    kv = p.add_argument_group("KV capacity per tier (with --model: builds the engine on each available backend)")
    kv.add_argument("--model", default=None, help="HF directory, .gguf file or alias to size the KV cache for")
    kv.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    kv.add_argument("--max-model-len", type=int, default=None)
    kv.add_argument("--block-size", type=block_size_arg, default=None, metavar="{N,auto}")
    kv.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache size in bytes (all layers)")
    kv.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    kv.add_argument("--kv-offload-bytes", type=int, default=0, metavar="BYTES", help="the host tier's size")
    kv.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    kv.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                    help="size the cache with every layer keeping every block")
    p.set_defaults(func=cmd_backends)


# -- infer conformance --------------------------------------------------------
_STATUS = {"pass": "[green]✓[/]", "fail": "[red]✗ fail[/]", "error": "[red]✗ error[/]", "skip": "[yellow]skip[/]"}


def _cell(result) -> str:
    cell = _STATUS[result.status]
    if result.status == "pass" and result.tol_used > 0.005:
        cell += f" [dim]{result.tol_used:.0%}[/]"
    return cell


def cmd_conformance(args: argparse.Namespace) -> int:
    from .registry import BackendUnavailableError
    from .testing import cases_for, run_conformance, select

    console, err = _console(), _console(stderr=True)
    dtypes = [DTYPE_ALIASES[d] for d in args.dtype] if args.dtype else None
    if args.list:
        for case in select(cases_for(args.backend), args.primitive, dtypes, args.match):
            console.print(case.id)
        return 0
    try:
        with console.status(f"running conformance of '{args.backend}' ..."):
            report = run_conformance(args.backend, args.primitive, dtypes, args.match, device=args.device)
    except BackendUnavailableError as exc:
        err.print(f"[red]error:[/] {escape(str(exc))}")
        return 2
    if not report.results:
        err.print("[red]error:[/] no case matches the filters")
        return 2
    rows: dict[tuple[str, str], dict[str, object]] = defaultdict(dict)
    for r in report.results:
        rows[(r.case.primitive, r.case.name)][r.case.dtype] = r
    used_dtypes = [d for d in FLOAT_DTYPES if any(d in row for row in rows.values())]
    table = Table(title=f"conformance: {report.backend} vs cpu_ref  ([dim]%: share of the dtype's tolerance used[/])",
                  title_justify="left")
    table.add_column("primitive")
    table.add_column("case")
    for d in used_dtypes:
        table.add_column(d)
    table.add_column("implemented by")
    for (prim, name), row in rows.items():
        providers = sorted({r.provider for r in row.values() if r.provider})
        table.add_row(prim, name, *[_cell(row[d]) if d in row else "" for d in used_dtypes], ", ".join(providers))
    console.print(table)
    bad = [r for r in report.results if r.status in ("fail", "error")]
    for r in bad:
        console.print(f"[red]{r.status.upper()}[/] {r.case.id}: {escape(r.detail)}")
    skips = Counter(r.detail for r in report.results if r.status == "skip")
    for reason, n in skips.items():
        console.print(f"[yellow]SKIP[/] {n} case(s): {escape(reason)}")
    style = "green" if report.ok else "red"
    console.print(f"[bold {style}]{escape(report.summary())}[/]")
    return 0 if report.ok else 1


def add_conformance(sub) -> None:
    p = sub.add_parser("conformance", help="check a backend's primitives against the cpu_ref oracle")
    p.add_argument("--backend", required=True, help="backend name (see `infer backends`)")
    p.add_argument("--device", default=None, help="device for the backend (default: its own)")
    p.add_argument("--dtype", action="append", choices=sorted(DTYPE_ALIASES), help="only these dtypes (repeatable)")
    p.add_argument("--primitive", action="append", choices=CHECKED, help="only these primitives (repeatable)")
    p.add_argument("-k", "--match", default=None, help="only cases whose id contains this text")
    p.add_argument("--list", action="store_true", help="list the selected case ids and exit")
    p.set_defaults(func=cmd_conformance)


from .bench import add_bench_parser  # noqa: E402
from .cli_model import add_graph, add_run  # noqa: E402  (model commands import the engine lazily)
from .cli_plan import add_plan  # noqa: E402
from .server.cli import add_serve  # noqa: E402  (imports fastapi and uvicorn only when run)

COMMANDS: list[Callable] = [add_run, add_serve, add_graph, add_bench_parser, add_backends, add_conformance, add_plan]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="infer", description="LLM inference runtime over pluggable backends")
    parser.add_argument("--version", action="version", version=f"infer {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
