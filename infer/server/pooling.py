"""Pooling routes: POST /v1/embeddings (OpenAI), /v1/rerank, /rerank and /v2/rerank
(Jina / Cohere), /v1/score and /score (vLLM's text_1 / text_2), /classify, /pooling.

Each input is one engine request (`AsyncLLM.encode`) tokenized here, on the model's
tokenizer thread; a refused input fails the whole API request with a 400 naming
the field and the others are aborted. A cross-encoder scores (query, document)
pairs together; an embedding model scores them by the cosine of their embeddings.
"""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Any, Literal

import numpy as np
from fastapi import FastAPI, Request
from pydantic import Field

from ..core.async_engine import EngineDeadError
from ..core.pooling import PoolingEngine, PoolingParams, PoolingRequestOutput
from .errors import APIError
from .models import ModelRegistry, ServedModel
from .protocol import _ValidText

Input = str | list[str] | list[int] | list[list[int]]


class _Pooling(_ValidText):
    model: str | None = None
    truncate_prompt_tokens: int | None = None
    priority: int = 0


class EmbeddingRequest(_Pooling):
    input: Input
    encoding_format: str = "float"
    dimensions: int | None = None
    normalize: bool | None = None
    user: str | None = None


class PoolingRequest(_Pooling):
    input: Input
    encoding_format: str = "float"


class ClassificationRequest(_Pooling):
    input: str | list[str] | list[int] | list[list[int]]


class ScoreRequest(_Pooling):
    text_1: str | list[str]
    text_2: str | list[str]


class _Document(_ValidText):
    text: str


class RerankRequest(_Pooling):
    query: str
    documents: list[str | _Document]
    top_n: int | None = Field(default=None)
    return_documents: bool = True


def install_pooling_routes(app: FastAPI, models: ModelRegistry) -> None:
    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, raw: Request) -> dict:
        model = _pooling_model(models, body.model, "embed", "/v1/embeddings")
        fmt = _format(body.encoding_format)
        if body.dimensions is not None and body.dimensions < 1:
            raise APIError(400, f"dimensions must be >= 1, got {body.dimensions}", "dimensions")
        params = PoolingParams("embed", body.dimensions, body.normalize, True, body.truncate_prompt_tokens)
        outs = await _run(model, raw, _inputs(body.input), params, body.priority)
        data = [{"object": "embedding", "index": i, "embedding": _encode(o.outputs.data, fmt)} for i, o in enumerate(outs)]
        return _listing("embd", model, data, outs)

    @app.post("/pooling")
    async def pooling(body: PoolingRequest, raw: Request) -> dict:
        model = _pooling_model(models, body.model, None, "/pooling")
        fmt = _format(body.encoding_format)
        params = PoolingParams(model.engine.task, truncate_prompt_tokens=body.truncate_prompt_tokens)
        outs = await _run(model, raw, _inputs(body.input), params, body.priority)
        data = [{"object": "pooling", "index": i, "data": _encode(o.outputs.data, fmt)} for i, o in enumerate(outs)]
        return _listing("pool", model, data, outs)

    @app.post("/classify")
    async def classify(body: ClassificationRequest, raw: Request) -> dict:
        model = _pooling_model(models, body.model, "classify", "/classify")
        params = PoolingParams("classify", truncate_prompt_tokens=body.truncate_prompt_tokens)
        outs = await _run(model, raw, _inputs(body.input), params, body.priority)
        labels = model.engine.worker.model.config.get("id2label") or {}
        data = []
        for i, o in enumerate(outs):
            probs = o.outputs.data
            best = int(np.argmax(probs))
            data.append({"index": i, "label": labels.get(str(best), labels.get(best, str(best))),
                         "probs": probs.tolist(), "num_classes": len(probs)})
        return _listing("classify", model, data, outs)

    async def score(body: ScoreRequest, raw: Request) -> dict:
        model = _pooling_model(models, body.model, None, "/v1/score")
        first = [body.text_1] if isinstance(body.text_1, str) else list(body.text_1)
        second = [body.text_2] if isinstance(body.text_2, str) else list(body.text_2)
        if not second:
            raise APIError(400, "text_2 is empty: give at least one text to score", "text_2")
        if len(first) == 1:
            first = first * len(second)
        if len(first) != len(second):
            raise APIError(400, f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1 or as "
                                "many as text_2", "text_1")
        scores, outs = await _scores(model, raw, first, second, body.truncate_prompt_tokens, body.priority)
        data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
        return _listing("score", model, data, outs)

    app.post("/v1/score")(score)
    app.post("/score")(score)

    async def rerank(body: RerankRequest, raw: Request) -> dict:
        model = _pooling_model(models, body.model, None, "/v1/rerank")
        docs = [d if isinstance(d, str) else d.text for d in body.documents]
        if not docs:
            raise APIError(400, "documents is empty: give at least one document to rank", "documents")
        if body.top_n is not None and body.top_n < 0:
            raise APIError(400, f"top_n must be >= 0, got {body.top_n}", "top_n")
        scores, outs = await _scores(model, raw, [body.query] * len(docs), docs, body.truncate_prompt_tokens,
                                     body.priority)
        order = sorted(range(len(docs)), key=lambda i: -scores[i])[: body.top_n or None]
        results = [{"index": i, "relevance_score": scores[i], **({"document": {"text": docs[i]}}
                                                                  if body.return_documents else {})} for i in order]
        tokens = sum(len(o.prompt_token_ids) for o in outs)
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": model.name, "usage": {"total_tokens": tokens},
                "results": results}

    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        app.post(path)(rerank)


def _pooling_model(models: ModelRegistry, name: str | None, task: str | None, route: str) -> ServedModel:
    model = models.get(name)
    engine = model.engine
    if not isinstance(engine, PoolingEngine):
        raise APIError(400, f"the model '{model.name}' generates text; {route} needs a pooling model (an embedding "
                            "model or a cross-encoder, served with --runner pooling or auto)", "model")
    if task is not None and engine.task != task:
        kind = "a classifier (cross-encoder)" if engine.classifier else "an embedding model"
        raise APIError(400, f"the model '{model.name}' is {kind}: {route} needs "
                            f"{'an embedding model' if task == 'embed' else 'a classifier'}", "model")
    return model


def _format(fmt: str) -> Literal["float", "base64"]:
    if fmt not in ("float", "base64"):
        raise APIError(400, f"encoding_format must be 'float' or 'base64', got {fmt!r}", "encoding_format")
    return fmt  # type: ignore[return-value]


def _encode(row: np.ndarray, fmt: str) -> list[float] | str:
    if fmt == "base64":  # OpenAI's: the little-endian float32 bytes
        return base64.b64encode(np.asarray(row, "<f4").tobytes()).decode("ascii")
    return row.tolist()


def _inputs(value: Input) -> list[str | dict]:
    """The inputs of a request: one string, strings, one token-id list or token-id lists."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise APIError(400, "input is empty: give a string, a list of strings or token ids", "input")
    if all(isinstance(x, int) for x in value):
        return [{"prompt_token_ids": list(value)}]
    if all(isinstance(x, list) for x in value):
        return [{"prompt_token_ids": list(x)} for x in value]
    if all(isinstance(x, str) for x in value):
        return list(value)
    raise APIError(400, "input must be a string, a list of strings, a list of token ids or a list of such lists",
                   "input")


def _listing(prefix: str, model: ServedModel, data: list[dict], outs: list[PoolingRequestOutput]) -> dict[str, Any]:
    tokens = sum(len(o.prompt_token_ids) for o in outs)
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model.name,
            "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}}


async def _scores(model: ServedModel, raw: Request, first: list[str], second: list[str], truncate: int | None,
                  priority: int) -> tuple[list[float], list[PoolingRequestOutput]]:
    engine = model.engine
    if engine.classifier:  # a cross-encoder reads each pair at once
        if len(engine.worker.model.config.get("id2label") or {"0": 0}) != 1:
            raise APIError(400, f"the model '{model.name}' classifies into several labels; scores need a "
                                "cross-encoder with one output", "model")
        pairs = [{"text": a, "text_pair": b} for a, b in zip(first, second)]
        outs = await _run(model, raw, pairs, PoolingParams("classify", truncate_prompt_tokens=truncate), priority)
        return [o.outputs.score for o in outs], outs
    texts = list(dict.fromkeys(first + second))  # each distinct text embedded once
    outs = await _run(model, raw, texts, PoolingParams("embed", truncate_prompt_tokens=truncate), priority)
    vec = {t: np.asarray(o.outputs.data, np.float64) for t, o in zip(texts, outs)}
    scores = [float(vec[a] @ vec[b] / max(np.linalg.norm(vec[a]) * np.linalg.norm(vec[b]), 1e-12))
              for a, b in zip(first, second)]
    return scores, outs


async def _run(model: ServedModel, raw: Request, inputs: list[str | dict], params: PoolingParams,
               priority: int) -> list[PoolingRequestOutput]:
    """Every input through the engine at once (it batches them); all their results, in order."""
    raw.app.state.limits.check_pooling(len(inputs))
    if model.cut_short:
        raise APIError(503, "the server is shutting down")
    rid = f"pool-{uuid.uuid4().hex}"
    prompts = await model.off_loop(lambda: [_tokenized(model, x) for x in inputs])  # one hop for all
    tasks = [asyncio.create_task(model.llm.encode(f"{rid}-{i}", p, params)) for i, p in enumerate(prompts)]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in tasks:
            if t.done() and t.exception() is not None:
                raise t.exception()
        return [t.result() for t in tasks]
    except (ValueError, TypeError) as exc:
        message = str(exc)
        param = next((f for f in ("dimensions", "truncate_prompt_tokens") if message.startswith(f)), "input")
        raise APIError(400, message, param) from None
    except EngineDeadError as exc:
        raise APIError(503, str(exc)) from None
    finally:
        for t in tasks:
            t.cancel()  # a request that failed or went away: the others are aborted (AsyncLLM)


def _tokenized(model: ServedModel, x: str | dict) -> dict:
    """An input as token ids (and BERT's token types), tokenized on the model's own tokenizer copy."""
    if isinstance(x, dict) and "prompt_token_ids" in x:
        return x
    text, pair = (x, None) if isinstance(x, str) else (x["text"], x.get("text_pair"))
    model.check_text_length(len(text) + len(pair or ""), "input")
    enc = model.tokenizer("tokenize the input")(text, pair, add_special_tokens=True)
    out = {"prompt": text, "prompt_token_ids": list(enc["input_ids"])}
    if enc.get("token_type_ids") is not None:
        out["token_type_ids"] = list(enc["token_type_ids"])
    return out
