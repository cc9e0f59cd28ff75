"""A request's way in and out of the engine, apart from scheduling and the model.

`InputProcessor`: a prompt and its parameters checked and turned into token ids
(the tokenizer, the vocabulary, max_model_len), max_tokens bounded, the grammar's
compile started. `OutputProcessor`: the engine's requests (`RequestState`, one
`CompletionState` per sequence), each new token through its grammar, logprobs,
detokenizer and stop strings, and the `RequestOutput`s of a step.
"""

from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import Future
from typing import Any

import numpy as np

from .detokenizer import IncrementalDetokenizer
from .outputs import RequestOutput
from .request import Request, SeqId
from .request_state import CompletionState, RequestState
from .sampling_params import SamplingParams
from .scheduler_output import StepOutput, StepResult


class InputProcessor:
    def __init__(self, tokenizer, no_tokenizer: str | None, vocab_size: int, max_model_len: int, structured):
        self.tokenizer, self.no_tokenizer, self.structured = tokenizer, no_tokenizer, structured
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.mm = None  # a VLM's `multimodal.MultiModalProcessor`

    def tokenize(self, prompt: str | dict, request_id: str = "") -> tuple[str | None, list[int], list]:
        """A prompt's text and ids: a string, {"prompt": str}, {"prompt_token_ids": [...]}; for a VLM
        {"prompt": str, "multi_modal_data": {"image": image or [images]}} (``add_special_tokens``:
        False for chat-template text), or ids already processed with their `multimodal.ImageItem`s
        (``multi_modal_items``, what the server's tokenizer thread makes). Returns (text, ids, image items)."""
        if isinstance(prompt, dict) and prompt.get("multi_modal_items"):
            if self.mm is None:
                raise ValueError(f"request {request_id!r} has images, but this is a text-only model")
            ids = [int(t) for t in prompt["prompt_token_ids"]]
            items = list(prompt["multi_modal_items"])
            if any(it.end > len(ids) or any(ids[i] != self.mm.image_token_id for i in (it.offset, it.end - 1))
                   for it in items):
                raise ValueError(f"request {request_id!r}: an image item does not sit on its placeholder tokens")
            return prompt.get("prompt"), ids, items
        if isinstance(prompt, dict):
            images = (prompt.get("multi_modal_data") or {})
            unknown = set(images) - {"image"}
            if unknown:
                raise ValueError(f"request {request_id!r}: multi_modal_data has {sorted(unknown)}; only 'image' "
                                 "inputs are supported")
            images = images.get("image")
            if images is not None:
                if self.mm is None:
                    raise ValueError(f"request {request_id!r} has images, but this is a text-only model")
                if "prompt_token_ids" in prompt:
                    raise ValueError(f"request {request_id!r}: give images with a text prompt (the processor "
                                     "expands its placeholders), not prompt_token_ids")
                text = prompt.get("prompt", "")
                ids, items = self.mm.process(text, images if isinstance(images, (list, tuple)) else [images],
                                             f"request {request_id!r}", prompt.get("add_special_tokens", True))
                return text, ids, items
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]], []
            prompt = prompt.get("prompt", "")
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")
        if self.tokenizer is None:
            raise ValueError(f"a text prompt needs the tokenizer, but {self.no_tokenizer}: pass "
                             "{'prompt_token_ids': [...]} instead")
        return prompt, list(self.tokenizer(prompt).input_ids), []

    def process(self, request_id: str, prompt: str | dict, params: SamplingParams):
        """(text, token ids, image items, params with max_tokens bounded, grammar Future or None); ValueError
        naming the problem."""
        text, ids, items = self.tokenize(prompt, request_id)
        if self.mm is not None and not items and self.mm.image_token_id in ids:
            raise ValueError(f"request {request_id!r}: the prompt holds image placeholder tokens but no image "
                             "was given (multi_modal_data={'image': ...})")
        if not ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty; give at least one token")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"request {request_id!r}: token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"request {request_id!r}: the prompt has {len(ids)} tokens but max_model_len is "
                             f"{self.max_model_len}, which leaves no room to generate; shorten the prompt")
        self._check_params(request_id, params)
        room = self.max_model_len - len(ids)
        if params.max_tokens is None or params.max_tokens > room:
            params = dataclasses.replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))
        grammar = self.structured.compile(params.structured_outputs) if params.structured_outputs else None
        failure = compile_failure(grammar) if grammar is not None and grammar.done() else None
        if failure is not None:
            raise ValueError(f"request {request_id!r}: {failure}")
        return text, ids, items, params, grammar

    def _check_params(self, request_id: str, p: SamplingParams) -> None:
        # Checked here, not in the sampler: an out-of-vocabulary id would fail the
        # whole step, and every later one, for all requests in the batch.
        for name, ids in (("logit_bias", p.logit_bias or {}), ("stop_token_ids", p.stop_token_ids)):
            bad = [t for t in ids if not 0 <= int(t) < self.vocab_size]
            if bad:
                raise ValueError(f"request {request_id!r}: SamplingParams.{name} has token ids {bad[:5]} outside "
                                 f"the vocabulary [0, {self.vocab_size})")
        if p.stop_strings and (self.tokenizer is None or not p.detokenize):
            why = f"there is no tokenizer ({self.no_tokenizer})" if self.tokenizer is None else \
                "detokenize=False turns it off"
            raise ValueError(f"request {request_id!r}: SamplingParams.stop needs the generated text, and "
                             f"{why}; use stop_token_ids instead")


class OutputProcessor:
    def __init__(self, tokenizer, reasoning, seed: int | None):
        self.tokenizer, self.reasoning = tokenizer, reasoning
        self.states: dict[str, RequestState] = {}
        self.completions: dict[SeqId, CompletionState] = {}
        self._rng = np.random.default_rng(seed)
        decode = tokenizer.decode if tokenizer is not None else None
        self._decode_token = (lambda t: decode([t])) if decode is not None else (lambda t: None)

    def track(self, state: RequestState, req: Request, index: int) -> None:
        """A sequence of `state` (index 0, or a fork of it) to follow."""
        p = state.params
        seed = p.seed + index if p.seed is not None else int(self._rng.integers(0, 2**62))
        detok = None
        if self.tokenizer is not None and p.detokenize:
            detok = IncrementalDetokenizer(self.tokenizer, state.prompt_token_ids, p.skip_special_tokens)
        comp = CompletionState(index, req, p, seed, detok)
        if state.grammar is not None and not req.is_finished:
            comp.matcher = state.grammar.matcher()  # compiled at admission: the step never waits for one
            if self.reasoning is not None and detok is not None and state.completions:
                comp.reasoning = state.completions[0].reasoning  # a fork, made before its parent's first token
            elif self.reasoning is not None and detok is not None:
                # The grammar waits for the end of the reasoning, unless the prompt already closed it.
                tail = self.tokenizer.decode(state.prompt_token_ids[-64:])
                comp.reasoning = None if _closed(tail, self.reasoning) else self.reasoning
        state.completions.append(comp)
        self.completions[req.request_id] = comp

    def process(self, step: StepOutput, result: StepResult) -> dict[SeqId, int]:
        """Per new token: grammar, logprobs and text. Returns the sequences a stop string
        or the grammar's end finished, with how many output tokens each keeps (a
        speculative step's tokens after the stop are dropped here)."""
        stopped: dict[Any, int] = {}
        left: dict[Any, int] = {}  # tokens of this step each request has still to process
        for p in result.progressed:
            left[p.request.request_id] = left.get(p.request.request_id, 0) + 1
        for p in result.progressed:
            rid = p.request.request_id
            left[rid] -= 1
            if rid in stopped:
                continue
            if self.completions[rid].on_token(step, p.row, self._decode_token, left[rid]) and p.status is None:
                stopped[rid] = p.request.num_output_tokens - left[rid]
        for rid, keep in stopped.items():
            self.completions[rid].request.truncate_output(keep)
        return stopped

    def outputs(self, touched) -> tuple[list[RequestOutput], list[RequestState]]:
        """The outputs of the requests in `touched`, and those that finished (forgotten here)."""
        results, done = [], []
        for rid in touched:
            state = self.states.get(rid)
            if state is None:
                continue
            results.append(_output(state))
            if state.finished:
                del self.states[rid]
                for c in state.completions:
                    self.completions.pop(c.request.request_id, None)
                done.append(state)
        return results, done

    def fail_non_finite(self, comps: list[CompletionState]) -> list[SeqId]:
        """The live sequences of `comps`, whose logits held nan or inf: a token sampled from
        them would be garbage (token 0); logged, to end with 'error'."""
        ids = list(dict.fromkeys(c.request.request_id for c in comps if not c.request.is_finished))
        for rid in ids:
            logging.getLogger("infer").error("request %r: the model's logits hold nan or inf; the request ends with "
                                             "finish_reason 'error'", rid.request_id)
        return ids


def _output(state: RequestState) -> RequestOutput:
    metrics = {"arrival_time": state.arrival_time}
    first = [c.first_token_time for c in state.completions if c.first_token_time]
    if first:
        metrics["first_token_time"] = min(first)
    return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids,
                         [c.output() for c in state.completions], state.finished, metrics)


def compile_failure(fut: Future) -> BaseException | None:
    """Why a finished compile gave no grammar (a cancelled one counts), or None."""
    if fut.cancelled():
        return ValueError("its grammar's compilation was cancelled")
    return fut.exception()


def _closed(text: str, parser) -> bool:
    """The text's last reasoning block is closed (its end marker follows its last start marker)."""
    end = text.rfind(parser.end_marker)
    return end != -1 and end > text.rfind(parser.start_marker)
