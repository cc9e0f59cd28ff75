"""The models one server process serves, each behind its own AsyncLLM, routed by name."""

from __future__ import annotations

import asyncio
import copy
import functools
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

from ..core.async_engine import AsyncLLM
from ..core.engine import LLMEngine
from ..core.multimodal import MediaConnector, MultiModalProcessor, chat_images
from .errors import APIError

T = TypeVar("T")
# A text longer than max_model_len x the longest token's characters x this cannot fit the
# context whatever its tokens; the slack covers normalizers that drop characters.
TEXT_BOUND_SLACK = 4

# generation_config keys that become the defaults of unset request fields.
_SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass
class ServedModel:
    name: str
    llm: AsyncLLM
    created: int = field(default_factory=lambda: int(time.time()))
    # --tool-call-parser (with --enable-auto-tool-choice: tool_choice 'auto' allowed) and --reasoning-parser
    tool_parser: Any = None
    auto_tool_choice: bool = False
    reasoning: Any = None
    # The API requests running (Generation objects), and whether a shutdown cut them short.
    live: set = field(default_factory=set, repr=False)
    cut_short: bool = False
    lora: Any = None  # the base model runs without an adapter (see `AdapterModel`)

    def __post_init__(self):
        # The engine thread detokenizes with its tokenizer while the event loop
        # applies chat templates and serves /tokenize; a fast tokenizer used
        # from two threads at once can fail ("Already borrowed"), so each side
        # has its own copy.
        tok = self.llm.engine.tokenizer
        self._tokenizer = copy.deepcopy(tok) if tok is not None else None
        # Tokenizing, templating and detokenizing for requests run here, one at a time (the
        # copy is not for concurrent use), off the event loop: a long prompt does not stall
        # every other request and /health.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"infer-tokenizer-{self.name}")
        # A VLM: image URLs loaded and preprocessed on that thread, by a processor of its own.
        mm, a = getattr(getattr(self.llm.engine, "input", None), "mm", None), self.llm.engine.args
        self.media = MediaConnector(a.allowed_local_media_path, a.allowed_media_domains) if mm is not None else None
        self._mm = MultiModalProcessor(mm.source, mm.image_token_id, mm.rows_per_image, mm.limit) if mm else None

    async def off_loop(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """fn(*args, **kwargs) on the model's tokenizer thread."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    @functools.cached_property
    def _chars_per_token(self) -> int:
        tok = self._tokenizer
        # (a vocabulary with holes gives None for the missing ids)
        return max((len(t) for t in tok.convert_ids_to_tokens(list(range(len(tok)))) if t), default=1)

    def check_text_length(self, chars: int, param: str) -> None:
        """A 400 before any tokenizing for text that cannot fit the context whatever its
        tokens (the exact count is checked after tokenizing)."""
        if self._tokenizer is None:
            return
        bound = self.max_model_len * self._chars_per_token * TEXT_BOUND_SLACK
        if chars > bound:
            raise APIError(400, f"{param} holds {chars} characters, far more than this model's maximum context of "
                                f"{self.max_model_len} tokens can hold (its tokens are at most {self._chars_per_token} "
                                "characters); shorten it", param)

    def end_requests(self) -> None:
        """The shutdown timeout is near: end every running request now (each gets an error
        saying so) rather than have uvicorn cancel it mid-response."""
        self.cut_short = True
        for gen in list(self.live):
            gen.abort()

    @property
    def engine(self) -> LLMEngine:
        return self.llm.engine

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def sampling_defaults(self) -> dict[str, Any]:
        gen = self.engine.generation_config or {}
        return {k: gen[k] for k in _SAMPLING_DEFAULTS if gen.get(k) is not None}

    def tokenizer(self, what: str):
        tok = self._tokenizer
        if tok is None:
            raise APIError(400, f"model '{self.name}' was loaded without a tokenizer, so it cannot {what}; "
                                "send prompts as token ids")
        return tok

    @property
    def template_takes_tools(self) -> bool:
        return "tools" in (self.engine.chat_template or "")

    def encode(self, text: str, **kwargs) -> list[int]:
        """Token ids of a text prompt (after `check_text_length`)."""
        self.check_text_length(len(text), "prompt")
        return list(self.tokenizer("tokenize")(text, **kwargs).input_ids)

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> dict[str, Any]:
        """The engine prompt of a conversation under the model's chat template (`tools` go to a
        template that reads them): token ids, and for a VLM the images of its content parts,
        fetched and preprocessed here (the tokenizer thread)."""
        try:
            messages, images = chat_images(messages, self.media)
        except ValueError as exc:
            raise APIError(400, str(exc), "messages") from None
        self.check_text_length(sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str)) +
                               sum(len(p.get("text", "")) for m in messages if isinstance(m.get("content"), list)
                                   for p in m["content"]), "messages")
        tok = self.tokenizer("apply a chat template")
        template = self.engine.chat_template
        if template is None:
            raise APIError(400, f"model '{self.name}' has no chat template; use /v1/completions", "messages")
        try:
            out = tok.apply_chat_template(messages, chat_template=template, add_generation_prompt=add_generation_prompt,
                                          tokenize=self.media is None, return_dict=False, tools=tools)
        except Exception as exc:  # jinja raises on conversations the template forbids (role order, ...)
            raise APIError(400, f"the chat template rejected the messages: {exc}", "messages") from None
        if self.media is None:
            return {"prompt_token_ids": [int(t) for t in out]}
        try:
            ids, items = self._mm.process(out, images, "messages", add_special_tokens=False)
        except (ValueError, TypeError) as exc:
            raise APIError(400, str(exc), "messages") from None
        return {"prompt_token_ids": ids, "multi_modal_items": items}

    def describe(self) -> dict[str, Any]:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "infer",
                "root": self.engine.args.model, "parent": None, "max_model_len": self.max_model_len}


class AdapterModel:
    """A LoRA adapter served by name: its base model's `ServedModel` (engine, tokenizer,
    limits) under the adapter's name, whose requests carry the adapter."""

    def __init__(self, base: ServedModel, lora):
        self.base, self.lora, self.name = base, lora, lora.lora_name
        self.created = int(time.time())

    def __getattr__(self, attr: str):
        return getattr(self.base, attr)

    def describe(self) -> dict[str, Any]:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "infer",
                "root": self.lora.lora_path, "parent": self.base.name, "max_model_len": self.base.max_model_len}


class ModelRegistry:
    def __init__(self, models: list[ServedModel]):
        if not models:
            raise ValueError("serve at least one model")
        names = [m.name for m in models]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"served model names must be unique; {', '.join(dupes)} given twice "
                             "(use --served-model-name)")
        self.models = {m.name: m for m in models}
        self.default = models[0]
        self.adapters: dict[str, AdapterModel] = {}
        for m in models:  # adapters given with --lora-modules
            manager = m.engine.lora
            for lora in manager.known.values() if manager is not None else ():
                self.add_adapter(m, lora)

    def get(self, name: str | None) -> ServedModel | AdapterModel:
        """The model (or adapter) a request names, the first served model when it names none; 404 otherwise."""
        if name is None:
            return self.default
        model = self.models.get(name) or self.adapters.get(name)
        if model is None:
            served = ", ".join([*self.models, *self.adapters])
            raise APIError(404, f"the model '{name}' does not exist; served: {served}", "model")
        return model

    def generating(self, name: str | None, route: str) -> ServedModel | AdapterModel:
        """`get`, for a route that generates text: a pooling model is a 400 naming its routes."""
        model = self.get(name)
        if getattr(model.engine, "task", None) is not None:  # a PoolingEngine
            raise APIError(400, f"the model '{model.name}' is a pooling model ({model.engine.architecture}); it cannot "
                                f"serve {route}: use /v1/embeddings, /v1/score, /v1/rerank or /classify", "model")
        return model

    def add_adapter(self, base: ServedModel, lora) -> AdapterModel:
        if lora.lora_name in self.models or lora.lora_name in self.adapters:
            raise APIError(400, f"the name '{lora.lora_name}' is already served", "lora_name")
        adapter = self.adapters[lora.lora_name] = AdapterModel(base, lora)
        return adapter

    def lora_base(self) -> ServedModel:
        """The served model adapters load onto: the first one started with LoRA."""
        model = next((m for m in self if m.engine.lora is not None), None)
        if model is None:
            raise APIError(400, "no served model runs with LoRA; start the server with --enable-lora")
        return model

    def __iter__(self):
        return iter(self.models.values())
