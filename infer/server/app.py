"""The FastAPI application: OpenAI routes, vLLM's utility routes, health and metrics."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from .. import __version__
from .chat import create_chat_completion
from .completions import create_completion
from .errors import APIError, install_error_handlers
from .guard import install_accept_error_limiter
from .lora import install_lora_routes
from .metrics import Metrics
from .models import ModelRegistry
from .pooling import install_pooling_routes
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, RequestLimits, TokenizeRequest
from .security import APIKeyMiddleware, BodyLimitMiddleware

DEFAULT_MAX_BODY_BYTES = 16 << 20


def create_app(models: ModelRegistry, metrics: Metrics, api_keys: list[str] | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, limits: RequestLimits | None = None,
               allow_lora_updates: bool = False) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        install_accept_error_limiter(asyncio.get_running_loop())
        yield
        # uvicorn has stopped accepting and drained (or cancelled) the open
        # requests by now; stop the engine threads, aborting what is left.
        await asyncio.gather(*(asyncio.to_thread(m.llm.shutdown) for m in models))

    app = FastAPI(title="infer", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible LLM server (vLLM's routes and extras)")
    install_error_handlers(app)
    app.state.models, app.state.metrics = models, metrics
    app.state.limits = limits or RequestLimits()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await create_completion(body, models.generating(body.model, "/v1/completions"), raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await create_chat_completion(body, models.generating(body.model, "/v1/chat/completions"), raw)

    install_pooling_routes(app, models)

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [m.describe() for m in models] + [a.describe() for a in models.adapters.values()]}

    if allow_lora_updates:
        install_lora_routes(app, models)

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str) -> dict:
        return models.get(name).describe()

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        model = models.get(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt")
        if body.messages is not None:
            messages = [m.for_template() for m in body.messages]
            ids = (await model.off_loop(model.chat_prompt, messages, body.add_generation_prompt))["prompt_token_ids"]
        else:
            ids = await model.off_loop(model.encode, body.prompt, add_special_tokens=body.add_special_tokens)
        return {"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        model = models.get(body.model)
        vocab = model.engine.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", "tokens")
        tok = model.tokenizer("detokenize")
        return {"prompt": await model.off_loop(tok.decode, body.tokens)}

    @app.get("/health")
    async def health() -> Response:
        failures = {m.name: m.llm.failure for m in models if m.llm.failure}
        if failures:
            return JSONResponse({"status": "error", "dead": list(failures), "reasons": failures}, status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    # The last added runs first: the key is checked before any body is read.
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    if api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=api_keys)
    return app
