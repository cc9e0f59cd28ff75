"""`infer serve`: load the models, then run the OpenAI-compatible server under uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import threading
import time
import sys
from pathlib import Path

from ..cli_model import add_engine_args, engine_args

# Server-only dependencies (fastapi, uvicorn, prometheus_client) are imported by cmd_serve, never
# here: `infer run`, `infer backends` and the rest work on the base install (no `serve` extra).
# The connection guard's defaults (guard.py):
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_IDLE_TIMEOUT_S = 60.0
DEFAULT_MAX_CONNECTIONS = 4096


def add_serve(sub) -> None:
    # "resolve": --model is redefined below to take several models.
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (vLLM's routes, flags and metrics)",
                       conflict_handler="resolve")
    add_engine_args(p)
    p.add_argument("--model", action="append", default=None, metavar="MODEL",
                   help="HF directory, .gguf file or alias; repeat to serve several (default: smollm2)")
    p.add_argument("--served-model-name", action="append", default=None, metavar="NAME",
                   help="the name clients use, one per --model (default: the --model value)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed on start)")
    p.add_argument("--api-key", action="append", default=None,
                   help="require 'Authorization: Bearer KEY' on the API routes (repeatable; env INFER_API_KEY)")
    p.add_argument("--max-request-body-bytes", type=int, default=16 << 20)
    p.add_argument("--max-prompts-per-request", type=int, default=256,
                   help="prompts one completions request may carry (400 beyond)")
    p.add_argument("--max-sequences-per-request", type=int, default=1024,
                   help="prompts x n one request may ask for: each is a sequence in the batch (400 beyond)")
    c = p.add_argument_group("connections: slow or idle clients")
    c.add_argument("--timeout-keep-alive", type=float, default=5.0,
                   help="seconds an idle kept-alive connection stays open between requests (uvicorn's)")
    c.add_argument("--timeout-header", type=float, default=DEFAULT_HEADER_TIMEOUT_S,
                   help="seconds a client has to send a request's headers before the connection is closed")
    c.add_argument("--timeout-idle", type=float, default=DEFAULT_IDLE_TIMEOUT_S,
                   help="seconds a request body may stall before the connection is closed")
    c.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                   help="open connections at most; a new one beyond closes the oldest that sent no request "
                        "(lowered to fit the open-file limit)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let in-flight requests finish before aborting them")
    p.add_argument("--headless", action="store_true",
                   help="a worker node of a multi-node job (--nnodes, --node-rank >= 1): run its ranks, serve no API")
    t = p.add_argument_group("chat: templates, tools, reasoning")
    t.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template file that replaces the model's own")
    t.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="let the model decide when to call tools (tool_choice 'auto'); needs --tool-call-parser")
    t.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help="how tool calls are read from the model's text: hermes, llama3_json, or a plugin's")
    p.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="enable POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind --api-key); "
                        "env VLLM_ALLOW_RUNTIME_LORA_UPDATING=true does the same")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    p.set_defaults(func=cmd_serve)


def _names(args: argparse.Namespace) -> list[tuple[str, str]]:
    models = args.model or ["smollm2"]
    names = args.served_model_name or []
    if names and len(names) != len(models):
        raise ValueError(f"got {len(names)} --served-model-name for {len(models)} --model; give one per model")
    return list(zip(models, names or models))


def build(args: argparse.Namespace):
    """The app and its engine threads, from parsed flags."""
    from ..core.async_engine import AsyncLLM
    from ..core.data_parallel import DataParallelLLM
    from ..core.engine import LLMEngine
    from ..core.pooling import PoolingEngine, is_pooling
    from .app import create_app
    from .metrics import Metrics
    from .models import ModelRegistry, ServedModel
    from .protocol import RequestLimits

    from ..registry import get_reasoning_parser, get_tool_parser

    for flag in ("max_prompts_per_request", "max_sequences_per_request", "max_connections"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    for flag in ("timeout_keep_alive", "timeout_header", "timeout_idle"):
        if not getattr(args, flag) > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    limits = RequestLimits(args.max_prompts_per_request, args.max_sequences_per_request)
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json, ...)")
    tool_parser = get_tool_parser(args.tool_call_parser)() if args.tool_call_parser else None
    reasoning = get_reasoning_parser(args.reasoning_parser)() if args.reasoning_parser else None
    template = None
    if args.chat_template:
        try:
            template = Path(args.chat_template).read_text()
        except OSError as exc:
            raise ValueError(f"--chat-template: cannot read {args.chat_template}: {exc.strerror}") from None
    dp = args.data_parallel_size
    if dp > 1 and args.nnodes > 1:
        raise ValueError("--data-parallel-size with --nnodes > 1 is not supported yet: run the replicas on one node")
    metrics = Metrics(engine_label=dp > 1)
    served, replicas = [], []
    try:
        for model, name in _names(args):
            for i in range(dp):  # each replica its own engine (and its own ranks, on its own devices)
                a = engine_args(args, model=model, show_progress=False, data_parallel_rank=i)
                engine = PoolingEngine(a) if is_pooling(a) else LLMEngine(a)
                if template is not None:
                    engine.chat_template = template
                replicas.append(AsyncLLM(engine, [metrics.logger(name, engine.expert_load, engine=i)]))
            llm = replicas[-1] if dp == 1 else DataParallelLLM(replicas[-dp:])
            served.append(ServedModel(name, llm, tool_parser=tool_parser, auto_tool_choice=args.enable_auto_tool_choice,
                                      reasoning=reasoning))
        registry = ModelRegistry(served)
    except BaseException:
        for r in replicas:
            r.shutdown()
        raise
    keys = args.api_key or ([os.environ["INFER_API_KEY"]] if os.environ.get("INFER_API_KEY") else None)
    updates = args.allow_runtime_lora_updating or os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in (
        "1", "true")
    if updates and not args.enable_lora:
        raise ValueError("--allow-runtime-lora-updating needs --enable-lora")
    return create_app(registry, metrics, keys, args.max_request_body_bytes, limits, allow_lora_updates=updates)


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        import fastapi  # noqa: F401
        import prometheus_client
        import uvicorn
    except ImportError as exc:
        print(f"infer serve: {exc}; install the server's dependencies with pip install 'infer[serve]'", file=sys.stderr)
        return 2
    if args.headless:
        from ..core.worker import run_headless

        try:
            return run_headless(engine_args(args, model=(args.model or ["smollm2"])[0], show_progress=False))
        except ValueError as exc:
            print(f"infer serve: {exc}", file=sys.stderr)
            return 2
    # Like vLLM: no *_created series beside every counter and histogram.
    prometheus_client.disable_created_metrics()
    _log_to_stderr()
    try:
        app = build(args)
    except (ValueError, RuntimeError, FileNotFoundError) as exc:
        print(f"infer serve: {exc}", file=sys.stderr)
        return 2
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
        sock.listen(2048)  # connections made before uvicorn's loop runs wait in the backlog
    except OSError as exc:
        print(f"infer serve: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    host, port = sock.getsockname()[:2]
    models = ", ".join(m.name for m in app.state.models)
    # Listening before printing, so whoever reads this line can connect at once.
    print(f"infer serve: {models} on http://{host}:{port}", flush=True)
    from .guard import connection_cap, guarded_protocol

    protocol = guarded_protocol(args.timeout_header, args.timeout_idle, connection_cap(args.max_connections))
    config = uvicorn.Config(app, log_level=args.uvicorn_log_level, timeout_graceful_shutdown=args.shutdown_timeout,
                            lifespan="on", http=protocol, timeout_keep_alive=args.timeout_keep_alive,
                            backlog=2048)
    server = _graceful_server(config)
    failed: list[str] = []
    threading.Thread(target=_watch_engines, args=(server, app.state.models, failed), daemon=True,
                     name="infer-engine-watchdog").start()
    server.run(sockets=[sock])
    if failed:
        print(f"infer serve: exiting: {failed[0]}", file=sys.stderr, flush=True)
        return 1
    return 0


def _log_to_stderr() -> None:
    """The engine's INFO lines (KV capacity, captured graphs) on stderr, as vLLM's server shows them."""
    log = logging.getLogger("infer")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


# How often the server checks that its engines (and their worker ranks) are alive,
# and how long /health answers 503 before the process exits.
WATCH_INTERVAL_S = 0.5
DEAD_GRACE_S = 2.0


def _watch_engines(server, models, failed: list[str]) -> None:
    """Stop the server when an engine dies (a backend error, a worker rank that exited):
    /health answers 503 meanwhile, then the process exits non-zero naming the cause."""
    while not server.should_exit:
        for m in models:
            reason = m.llm.failure
            if reason:
                failed.append(f"model {m.name!r}: {reason}")
                time.sleep(DEAD_GRACE_S)
                server.should_exit = True
                return
        time.sleep(WATCH_INTERVAL_S)


# Before --shutdown-timeout runs out, the time left to end the requests still running.
CUT_MARGIN_S = 1.0


def _graceful_server(config):
    """A uvicorn.Server that exits 0 after a SIGTERM it handled gracefully.

    uvicorn re-raises the signal once it has shut down, so the process would
    die 'killed by SIGTERM'; for an orchestrator a clean drain is a clean exit.
    """
    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            # Just before uvicorn would cancel what is still running (mid-chunk, with a
            # traceback each), end those requests: streams get an error event and
            # [DONE], the others a 503.
            timeout = self.config.timeout_graceful_shutdown
            cut = None
            if timeout is not None:
                models = self.config.app.state.models
                cut = asyncio.get_running_loop().call_later(
                    max(0.0, timeout - min(CUT_MARGIN_S, timeout / 2)), lambda: [m.end_requests() for m in models])
            try:
                await super().shutdown(sockets)
            finally:
                if cut is not None:
                    cut.cancel()

        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                yield
                captured = getattr(self, "_captured_signals", [])
                captured[:] = [s for s in captured if s != signal.SIGTERM]

    return Server(config)
