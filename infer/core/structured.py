"""Structured outputs: grammars that decide which tokens a request may sample next.

A request's `StructuredOutputsParams` (vLLM's names: ``json``, ``regex``,
``choice``, ``grammar``, ``json_object``) is compiled once per distinct spec by
a grammar backend, off the step loop, and cached. Each completion then owns a
`Matcher` that follows its output: before a step the engine asks it for the
allowed-token bitmask of its row (`SamplingTensors.token_bitmask`, applied by
every backend's `sample`), after the step it accepts the sampled token.

Two grammar backends sit behind one small interface (compile; matcher:
accept, fill the bitmask, rollback, is-terminated): xgrammar (the default, as
in vLLM) and llguidance (``guidance``). ``auto`` takes xgrammar and falls back
to llguidance for what xgrammar cannot do (a ``whitespace_pattern``, or a spec
xgrammar fails to compile that llguidance accepts).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

BACKENDS = ("auto", "xgrammar", "guidance")
KINDS = ("json", "regex", "choice", "grammar", "json_object")
CACHE_SIZE = 256  # compiled specs kept (least recently used dropped)


@dataclass
class StructuredOutputsParams:
    """What a request's output must match; exactly one of the first five fields.

    json                 a JSON schema (dict or its JSON text).
    regex                a regular expression the whole output matches.
    choice               the output is exactly one of these strings.
    grammar              a context-free grammar: GBNF/EBNF (rules with ``::=``,
                         root rule ``root``) or Lark (root rule ``start``).
    json_object          True: any JSON object (OpenAI's ``json_object``).
    disable_any_whitespace  JSON without optional whitespace between tokens.
    whitespace_pattern   a regex for the whitespace JSON may hold (llguidance).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None
    # Where the spec came from, for error messages (the server sets e.g. "response_format").
    source: str = field(default="structured_outputs", compare=False, repr=False)

    def __post_init__(self):
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"{self.source} must set exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) if given else 'none'}")
        kind = given[0]
        if kind == "json" and isinstance(self.json, str):
            try:
                json.loads(self.json)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{self.source}.json is not valid JSON: {exc}") from None
        elif kind == "json" and not isinstance(self.json, dict):
            raise ValueError(f"{self.source}.json must be a JSON schema (an object), got {type(self.json).__name__}")
        if kind == "choice" and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                 or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError(f"{self.source}.choice must be a non-empty list of non-empty strings")
        if kind in ("regex", "grammar") and (not isinstance(getattr(self, kind), str) or not getattr(self, kind)):
            raise ValueError(f"{self.source}.{kind} must be a non-empty string")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def field_name(self) -> str:
        """The request field an error names, e.g. ``structured_outputs.json``."""
        return f"{self.source}.{self.kind}" if self.source == "structured_outputs" else self.source

    def schema_text(self) -> str:
        s = self.json
        return s if isinstance(s, str) else json.dumps(s)  # key order is the order JSON is written in

    def key(self) -> tuple:
        """Cache key: equal specs compile once."""
        value = self.schema_text() if self.kind == "json" else getattr(self, self.kind)
        return (self.kind, tuple(value) if isinstance(value, list) else value,
                self.disable_any_whitespace, self.whitespace_pattern)

    @classmethod
    def coerce(cls, value: StructuredOutputsParams | dict | None) -> StructuredOutputsParams | None:
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - set(cls.__dataclass_fields__)
            if unknown:
                raise ValueError(f"structured_outputs has unknown fields {sorted(unknown)}; known: "
                                 f"{', '.join(k for k in cls.__dataclass_fields__ if k != 'source')}")
            return cls(**value)
        raise ValueError(f"structured_outputs must be StructuredOutputsParams or a dict, got {type(value).__name__}")


class Matcher:
    """One completion's position in its grammar."""

    @staticmethod
    def fill_bitmasks(pairs: list[tuple[Matcher, int]], bitmask: np.ndarray) -> None:
        """Fill the rows of several matchers of this class at once (a library may do it in parallel)."""
        for m, row in pairs:
            m.fill_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        """Advance past a sampled token; False (state unchanged) when the grammar forbids it."""
        raise NotImplementedError

    def allows(self, token: int) -> bool:
        """The grammar accepts `token` next (state unchanged): far cheaper than a bitmask."""
        raise NotImplementedError

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed next tokens into row `row` of an int32 [B, ceil(V/32)] bitmask."""
        raise NotImplementedError

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""
        raise NotImplementedError

    def is_terminated(self) -> bool:
        """The grammar has ended (its stop token was accepted)."""
        raise NotImplementedError


class GrammarBackend:
    """Compiles specs for one tokenizer; makes matchers of compiled grammars."""

    name = ""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.vocab_size = vocab_size

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar; ValueError with the grammar library's reason when it cannot."""
        raise NotImplementedError

    def matcher(self, compiled: Any) -> Matcher:
        raise NotImplementedError


def _choice_ebnf(choices: list[str]) -> str:
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _is_gbnf(grammar: str) -> bool:
    return "::=" in grammar


class _XGrammarMatcher(Matcher):
    def __init__(self, compiled):
        import xgrammar

        self.m = xgrammar.GrammarMatcher(compiled)  # rollback is unbounded

    def accept(self, token: int) -> bool:
        return bool(self.m.accept_token(int(token)))

    def allows(self, token: int) -> bool:
        if not self.m.accept_token(int(token)):
            return False
        self.m.rollback(1)
        return True

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        import torch

        self.m.fill_next_token_bitmask(torch.from_numpy(bitmask), row)

    def rollback(self, num_tokens: int) -> None:
        self.m.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return bool(self.m.is_terminated())


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]):
        import xgrammar

        super().__init__(tokenizer, vocab_size, eos_token_ids)
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=list(eos_token_ids) or None)
        # No cache of its own (unbounded by default): StructuredOutputs keeps the compiled specs.
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, spec: StructuredOutputsParams) -> Any:
        if spec.whitespace_pattern is not None:
            raise ValueError("xgrammar does not support whitespace_pattern; use the guidance backend")
        c, kind = self.compiler, spec.kind
        try:
            if kind in ("json", "json_object"):  # json_object: any object, as OpenAI's (not any JSON value)
                schema = spec.schema_text() if kind == "json" else '{"type": "object"}'
                return c.compile_json_schema(schema, any_whitespace=not spec.disable_any_whitespace)
            if kind == "regex":
                return c.compile_regex(spec.regex)
            if kind == "choice":
                return c.compile_grammar(_choice_ebnf(spec.choice))
            return c.compile_grammar(spec.grammar) if _is_gbnf(spec.grammar) else c.compile_lark(spec.grammar)
        except RuntimeError as exc:  # xgrammar reports bad specs as RuntimeError with a C++ location
            raise ValueError(str(exc).strip().split("\n")[0].split(": ", 1)[-1]) from None

    def matcher(self, compiled: Any) -> Matcher:
        return _XGrammarMatcher(compiled)


_EXECUTOR: list = []  # llguidance's thread pool for batched masks, made on first use


class _GuidanceMatcher(Matcher):
    @staticmethod
    def fill_bitmasks(pairs: list[tuple[Matcher, int]], bitmask: np.ndarray) -> None:
        import llguidance
        import llguidance.numpy

        if not _EXECUTOR:
            _EXECUTOR.append(llguidance.LLExecutor())
        llguidance.numpy.fill_next_token_bitmask_par(_EXECUTOR[0], [(m.m, row) for m, row in pairs], bitmask)

    def __init__(self, tokenizer, grammar: str):
        import llguidance

        self.m = llguidance.LLMatcher(tokenizer, grammar)

    def accept(self, token: int) -> bool:
        # try_consume leaves a matcher that refuses the token as it was (consume_token would stop it).
        return self.m.try_consume_tokens([int(token)]) == 1

    def allows(self, token: int) -> bool:
        return self.m.validate_tokens([int(token)]) == 1

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        import llguidance.numpy

        llguidance.numpy.fill_next_token_bitmask(self.m, bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        self.m.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return bool(self.m.is_stopped())


class GuidanceBackend(GrammarBackend):
    name = "guidance"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]):
        import llguidance.hf

        super().__init__(tokenizer, vocab_size, eos_token_ids)
        eos = list(eos_token_ids) or None
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)

    def compile(self, spec: StructuredOutputsParams) -> Any:
        import llguidance

        kind = spec.kind
        if kind in ("json", "json_object"):
            schema = json.loads(spec.schema_text()) if kind == "json" else {"type": "object"}
            options = {"whitespace_flexible": not spec.disable_any_whitespace}
            if spec.whitespace_pattern is not None:
                options["whitespace_pattern"] = spec.whitespace_pattern
            if isinstance(schema, dict):
                schema = {**schema, "x-guidance": {**options, **schema.get("x-guidance", {})}}
            grammar = llguidance.grammar_from("json_schema", json.dumps(schema))
        elif kind == "choice":
            grammar = llguidance.grammar_from("choice", json.dumps(spec.choice))
        else:
            grammar = llguidance.grammar_from(kind, getattr(spec, kind))
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if failed:
            raise ValueError("; ".join(m.strip() for m in messages) or "llguidance rejected the grammar")
        return grammar

    def matcher(self, compiled: Any) -> Matcher:
        return _GuidanceMatcher(self.tokenizer, compiled)


_BACKEND_CLASSES = {"xgrammar": XGrammarBackend, "guidance": GuidanceBackend}


@dataclass
class Compiled:
    """A compiled spec and the backend whose matchers follow it."""

    backend: GrammarBackend
    grammar: Any

    def matcher(self) -> Matcher:
        return self.backend.matcher(self.grammar)


class StructuredOutputs:
    """An engine's grammar compiler: one worker thread, a cache of compiled specs.

    `compile` is thread-safe and returns at once: a Future of `Compiled`
    (already done on a cache hit). A spec that fails to compile gives a
    Future whose exception is a ValueError naming the request field.
    """

    def __init__(self, backend: str, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]):
        if backend not in BACKENDS:
            raise ValueError(f"structured_outputs_backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
        self.backend_name = backend
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._backends: dict[str, GrammarBackend] = {}
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def compile(self, spec: StructuredOutputsParams) -> Future:
        if self.tokenizer is None:
            raise ValueError(f"{spec.field_name}: structured outputs need the tokenizer, and this engine has "
                             "none (skip_tokenizer_init=True, or a model that ships none)")
        key = spec.key()
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None and not fut.cancelled():
                self._cache.move_to_end(key)
                return fut
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="infer-grammar")
            fut = self._pool.submit(self._compile, spec)
            self._cache[key] = fut
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            return fut

    def _backend(self, name: str) -> GrammarBackend:
        be = self._backends.get(name)
        if be is None:  # the tokenizer tables take ~0.3-0.7 s: built on first use, on the worker
            be = self._backends[name] = _BACKEND_CLASSES[name](self.tokenizer, self.vocab_size, self.eos_token_ids)
        return be

    def _compile(self, spec: StructuredOutputsParams) -> Compiled:
        order = ("xgrammar", "guidance") if self.backend_name == "auto" else (self.backend_name,)
        errors = []
        for name in order:
            backend = self._backend(name)
            try:
                return Compiled(backend, backend.compile(spec))
            except ValueError as exc:
                errors.append(f"{name}: {exc}" if len(order) > 1 else str(exc))
        raise ValueError(f"{spec.field_name} cannot be compiled: {'; '.join(errors)}")

    def shutdown(self) -> None:
        """Stop the worker thread, dropping unfinished compiles; a later `compile` starts a new one."""
        with self._lock:
            pool, self._pool = self._pool, None
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
            for key in [k for k, f in self._cache.items() if not f.done() or f.cancelled()]:
                del self._cache[key]
