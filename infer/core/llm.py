"""LLM: the offline API (vLLM's `LLM.generate` / `LLM.chat`)."""

from __future__ import annotations

import dataclasses
import itertools
import sys
from typing import Any, Sequence

import numpy as np
from tqdm import tqdm

from ..openmp import release_pool
from .engine import EngineArgs, LLMEngine
from .lora import LoRARequest
from .multimodal import MediaConnector, chat_images
from .pooling import PoolingEngine, PoolingOutput, PoolingParams, PoolingRequestOutput, is_pooling
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str = "smollm2", backend: str = "auto", **kwargs: Any):
        if kwargs.get("data_parallel_size", 1) > 1:
            raise ValueError("data_parallel_size > 1 runs replicas behind `infer serve --data-parallel-size N`; "
                             "LLM runs one engine (use tensor_parallel_size / pipeline_parallel_size to split it)")
        args = EngineArgs(model=model, backend=backend, **kwargs)
        self.engine = PoolingEngine(args) if is_pooling(args) else LLMEngine(args)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | dict | Sequence[str | dict], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; outputs in the order of `prompts`.

        `lora_request`: one adapter for every prompt, or one (or None: the base
        model) per prompt; the engine needs ``enable_lora=True``.

        A prompt the engine refuses (empty, too long, ...) does not stop the
        others: its output is finished at once with ``finish_reason='error'``
        and the reason in ``RequestOutput.error``.
        """
        if isinstance(self.engine, PoolingEngine):
            raise ValueError(f"{self.engine.args.model} is a pooling model ({self.engine.architecture}); it has no "
                             "language-model head to generate with: use embed(), score() or classify()")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, Sequence) else [sampling_params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priority values for {len(prompts)} prompts")
        loras = list(lora_request) if isinstance(lora_request, Sequence) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} LoRA requests for {len(prompts)} prompts")
        results: dict[str, RequestOutput] = {}
        order = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            rid = str(next(self._ids))
            order.append(rid)
            try:
                if p is not None and p.structured_outputs is not None:
                    # Compiled before it is queued, so a bad grammar is this prompt's error, not an abort.
                    self.engine.structured.compile(p.structured_outputs).exception()
                self.engine.add_request(rid, prompt, p, priority=priority[i] if priority else 0, lora_request=loras[i])
            except (ValueError, TypeError) as exc:
                results[rid] = _failed(rid, prompt, str(exc))
        live = len(prompts) - len(results)
        bar = tqdm(total=live, desc="Processed prompts", file=sys.stderr, disable=not use_tqdm or live == 0, leave=False)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        finally:
            bar.close()
            release_pool()  # the next call may come from another thread (infer/openmp.py)
        return [results[rid] for rid in order]

    # -- pooling models --------------------------------------------------------------
    def embed(self, prompts: str | dict | Sequence[str | dict], pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True, truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
        """Embeddings of an embedding model (``outputs.embedding``), in the order of `prompts`."""
        params = pooling_params or PoolingParams(task="embed")
        if truncate_prompt_tokens is not None:
            params = dataclasses.replace(params, truncate_prompt_tokens=truncate_prompt_tokens)
        return self._pool(prompts, params, use_tqdm)

    def classify(self, prompts: str | dict | Sequence[str | dict], use_tqdm: bool = True,
                 pooling_params: PoolingParams | None = None) -> list[PoolingRequestOutput]:
        """A sequence classifier's class probabilities (``outputs.probs``; one label: its sigmoid)."""
        return self._pool(prompts, pooling_params or PoolingParams(task="classify"), use_tqdm)

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str], use_tqdm: bool = True,
              truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
        """Relevance of each (text_1, text_2) pair (``outputs.score``): a cross-encoder scores the pair
        together (the sigmoid of its one label), an embedding model gives the cosine of the two
        embeddings. One text_1 against many text_2 pairs it with each (vLLM's rules)."""
        first = [text_1] if isinstance(text_1, str) else list(text_1)
        second = [text_2] if isinstance(text_2, str) else list(text_2)
        if len(first) == 1:
            first = first * len(second)
        if len(first) != len(second) or not second:
            raise ValueError(f"score needs one text_1 or as many as text_2: got {len(first)} and {len(second)}")
        if isinstance(self.engine, PoolingEngine) and self.engine.classifier:
            params = PoolingParams(task="classify", truncate_prompt_tokens=truncate_prompt_tokens)
            return self._pool([{"text": a, "text_pair": b} for a, b in zip(first, second)], params, use_tqdm)
        emb = self.embed(first + second, PoolingParams(task="embed", truncate_prompt_tokens=truncate_prompt_tokens),
                         use_tqdm)
        outs = []
        for a, b in zip(emb[: len(first)], emb[len(first):]):
            bad = a.error or b.error
            if bad:
                outs.append(PoolingRequestOutput(a.request_id, a.prompt_token_ids + b.prompt_token_ids, None, True,
                                                 error=bad))
                continue
            x, y = (np.asarray(o.outputs.data, np.float64) for o in (a, b))
            cos = float(x @ y / max(np.linalg.norm(x) * np.linalg.norm(y), 1e-12))
            outs.append(PoolingRequestOutput(a.request_id, a.prompt_token_ids + b.prompt_token_ids,
                                             PoolingOutput(np.array([cos], np.float32))))
        return outs

    def _pool(self, prompts, params: PoolingParams, use_tqdm: bool) -> list[PoolingRequestOutput]:
        if not isinstance(self.engine, PoolingEngine):
            raise ValueError(f"{self.engine.args.model} is a generating model; embed, classify and score need a "
                             "pooling model (runner='pooling')")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        results: dict[str, PoolingRequestOutput] = {}
        order = []
        for prompt in prompts:
            rid = str(next(self._ids))
            order.append(rid)
            try:
                self.engine.add_request(rid, prompt, params)
            except (ValueError, TypeError) as exc:
                results[rid] = PoolingRequestOutput(rid, [], None, True, prompt if isinstance(prompt, str) else None,
                                                    error=str(exc))
        live = len(prompts) - len(results)
        bar = tqdm(total=live, desc="Pooled prompts", file=sys.stderr, disable=not use_tqdm or live == 0, leave=False)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    results[out.request_id] = out
                    bar.update(1)
        finally:
            bar.close()
            release_pool()
        return [results[rid] for rid in order]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True, chat_template: str | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        if self.engine.input.mm is None:
            prompts = [{"prompt_token_ids": self.apply_chat_template(chat_images(c, None)[0], add_generation_prompt,
                                                                     chat_template)} for c in conversations]
            return self.generate(prompts, sampling_params, use_tqdm)
        a = self.engine.args  # a VLM: image parts (image_url, image_pil) go to the processor with the text
        media = MediaConnector(a.allowed_local_media_path, a.allowed_media_domains)
        prompts = []
        for c in conversations:
            parts, images = chat_images(c, media)
            text = self.apply_chat_template(parts, add_generation_prompt, chat_template, tokenize=False)
            prompts.append({"prompt": text, "multi_modal_data": {"image": images}, "add_special_tokens": False})
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, conversation: list[dict], add_generation_prompt: bool = True,
                            chat_template: str | None = None, tokenize: bool = True) -> list[int] | str:
        tok = self.engine.tokenizer
        template = chat_template or self.engine.chat_template
        if tok is None or template is None:
            raise ValueError("this model has no chat template (or no tokenizer); use generate() with a plain prompt")
        out = tok.apply_chat_template(conversation, chat_template=template, add_generation_prompt=add_generation_prompt,
                                      tokenize=tokenize, return_dict=False)
        return list(out) if tokenize else out


def _failed(rid: str, prompt: Any, error: str) -> RequestOutput:
    text = prompt if isinstance(prompt, str) else None
    out = RequestOutput(rid, text, [], [CompletionOutput(0, "", [], finish_reason="error")], True)
    out.error = error
    return out
