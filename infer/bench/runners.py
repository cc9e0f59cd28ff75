"""One runtime per function, each meant to run in its own process: infer, and transformers' `generate`.

Both get the same token ids, greedy, with exact output lengths (infer's
``ignore_eos``, transformers' ``min_new_tokens``), warm up first, and report
throughput, single-stream decode, prefill and RSS.
"""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import fields, is_dataclass, replace
from typing import Any

import numpy as np

from .workload import BenchConfig, Workload, model_costs, set_threads

HF_BATCH = 32  # transformers' padded batch


def _proc_status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            line = next((x for x in f if x.startswith(field + ":")), None)
    except OSError:
        return None
    return int(line.split()[1]) * 1024 if line else None  # "VmRSS:   1234 kB"


def _rss_now() -> int:
    return _proc_status_bytes("VmRSS") or _rss_peak()


def _baseline_rss() -> int:
    """RSS once torch and transformers are imported: what any run of either runtime starts from."""
    import torch  # noqa: F401
    import transformers  # noqa: F401

    return _rss_now()


def _rss_peak() -> int:
    """Peak RSS of this process.

    Linux's VmHWM belongs to the address space, so it starts afresh at exec;
    ru_maxrss survives exec and would report the parent's RSS at spawn time
    if that was larger than anything this process reached.
    """
    hwm = _proc_status_bytes("VmHWM")
    if hwm:
        return hwm
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


def _rate(tokens: int, seconds: float) -> float:
    return tokens / max(seconds, 1e-9)


def _throughput(work: Workload, elapsed: float) -> dict[str, float]:
    out = len(work.prompts) * work.output_len
    prompt = sum(len(p) for p in work.prompts)
    return dict(elapsed_s=elapsed, output_tok_s=_rate(out, elapsed), total_tok_s=_rate(out + prompt, elapsed))


def _stream_summary(runs: list[tuple[float, float]], n: int, prompt_len: int) -> dict[str, float]:
    """runs: (time to first token, time from first to last token) of each repeat."""
    ttft = min(r[0] for r in runs)
    decode = min(r[1] for r in runs)
    out = dict(ttft_s=ttft, prefill_tok_s=_rate(prompt_len, ttft))
    return out | dict(decode_tok_s=_rate(n - 1, decode)) if n > 1 else out


def _check_lengths(outputs: list[list[int]], n: int, who: str) -> None:
    bad = [len(o) for o in outputs if len(o) != n]
    if bad:
        raise RuntimeError(f"{who} produced {bad[:4]} tokens where {n} were asked (ignore_eos not honoured?)")


def held_bytes(runner) -> int:
    """Bytes of the distinct buffers behind the runner's weights and the backend's prepared copies of them."""
    seen: dict[tuple, int] = {}

    def add(x) -> None:
        if hasattr(x, "untyped_storage"):  # torch: views of one buffer count once
            st = x.untyped_storage()
            seen[("torch", st.data_ptr())] = st.nbytes()
        elif hasattr(x, "nbytes"):
            seen[("id", id(x))] = int(x.nbytes)
        elif is_dataclass(x):
            for f in fields(x):
                add(getattr(x, f.name))

    for t in runner.tensors.values():
        add(t)
    for handle in getattr(runner, "_handles", {}).values():
        add(handle)
    return sum(seen.values())


# -- infer --------------------------------------------------------------------------
def _infer_stream(engine, ids: list[int], n: int, tag: str) -> tuple[float, float, list[int]]:
    """(time to first token, time from first to last token, tokens) of one request on an idle engine."""
    from ..core.sampling_params import SamplingParams

    t0 = time.perf_counter()
    engine.add_request(tag, {"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    first, tokens = None, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
            if first is None and tokens:
                first = time.perf_counter()
    return first - t0, time.perf_counter() - first, list(tokens)


def run_infer(cfg: BenchConfig, work: Workload, kwargs: dict[str, Any]) -> dict[str, Any]:
    from ..core.llm import LLM
    from ..core.sampling_params import SamplingParams

    set_threads(cfg)
    baseline = _baseline_rss()
    t = time.perf_counter()
    llm = LLM(**kwargs)
    load_s = time.perf_counter() - t
    loaded, load_peak = _rss_now(), _rss_peak()
    engine = llm.engine
    greedy = SamplingParams(temperature=0.0, max_tokens=work.output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in work.warmup_prompts], replace(greedy, max_tokens=4), use_tqdm=False)
    if engine.expert_load is not None:
        engine.expert_load.reset()  # the report's expert load is the workload's alone
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in work.prompts], greedy, use_tqdm=False)
    elapsed = time.perf_counter() - t
    expert_load = engine.expert_load.snapshot().as_dict() if engine.expert_load is not None else None
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    _check_lengths(tokens, work.output_len, "infer")
    decode = [_infer_stream(engine, p, cfg.decode_len, f"decode-{i}")[:2] for i, p in enumerate(work.decode_prompts)]
    prefill = [_infer_stream(engine, p, 1, f"prefill-{i}")[:2] for i, p in enumerate(work.prefill_prompts)]
    spec = engine.get_stats().spec_decode
    spec_decode = None if engine.speculative_config is None else dict(
        num_drafts=spec.num_drafts, num_draft_tokens=spec.num_draft_tokens,
        num_accepted_tokens=spec.num_accepted_tokens, acceptance_rate=spec.acceptance_rate,
        mean_accepted_length=spec.mean_accepted_length, accepted_per_position=list(spec.accepted_per_position))
    runner = engine.worker.runner
    costs = model_costs(runner, engine.model_config, cfg.decode_prompt_len + cfg.decode_len / 2, cfg.prefill_len)
    return dict(
        model=costs, workload=_throughput(work, elapsed), tokens=tokens, load_s=load_s, expert_load=expert_load,
        spec_decode=spec_decode,
        decode=_stream_summary(decode, cfg.decode_len, cfg.decode_prompt_len),
        prefill=_stream_summary(prefill, 1, cfg.prefill_len),
        memory=dict(baseline_rss=baseline, loaded_rss=loaded, load_peak_rss=load_peak, end_rss=_rss_now(), peak_rss=_rss_peak(),
                    weights_bytes=costs["weight_bytes"],
                    runner_weight_bytes=held_bytes(runner),
                    kv_pool_bytes=sum(int(c.nbytes) for c in runner.kv_caches)),
        engine=dict(block_size=engine.cache_config.block_size, num_blocks=engine.cache_config.num_blocks,
                    dtype=engine.dtype, backend=engine.backend.name, device=str(getattr(engine.backend, "device", "")),
                    max_num_batched_tokens=engine.scheduler.config.max_num_batched_tokens),
    )


# -- transformers -------------------------------------------------------------------
def build_transformers_peer(model: str, dtype: str = "float32"):
    """A transformers CausalLM with exactly the weights infer loads, in `dtype`, and the config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..core.loader import load_model

    try:  # skip the random init: its pages, touched, would count in the peer's peak RSS
        from transformers.initialization import no_init_weights
    except ImportError:
        from contextlib import nullcontext as no_init_weights

    m = load_model(model, load_tokenizer=False)
    cfg = {k: v for k, v in m.config.items() if k not in ("architectures", "model_type", "dtype")}
    hf_config = AutoConfig.for_model(m.config["model_type"], **cfg)
    with no_init_weights():
        peer = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    state = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in m.weights.items()}
    missing, unexpected = peer.load_state_dict(state, strict=False, assign=True)
    allowed = {"lm_head.weight"} if m.config.get("tie_word_embeddings") else set()
    if set(missing) - allowed or unexpected:
        raise RuntimeError(f"transformers peer: missing {missing}, unexpected {unexpected}")
    peer.tie_weights()
    return peer.to(getattr(torch, dtype)).eval(), m.config


class _Clock:
    """A transformers streamer that only notes when each put() (prompt, then each token) happens."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_transformers(cfg: BenchConfig, work: Workload, dtype: str = "float32") -> dict[str, Any]:
    import torch
    from transformers import GenerationConfig

    set_threads(cfg)
    baseline = _baseline_rss()
    t = time.perf_counter()
    peer, config = build_transformers_peer(cfg.model, dtype)
    load_s = time.perf_counter() - t
    loaded, load_peak = _rss_now(), _rss_peak()
    pad = config.get("pad_token_id")
    pad = config.get("eos_token_id") if pad is None else pad
    pad = pad[0] if isinstance(pad, list) else (0 if pad is None else pad)

    def generate(prompts: list[list[int]], n: int, streamer=None) -> list[list[int]]:
        width = max(len(p) for p in prompts)  # left padding: every prompt ends where generation starts
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        gen = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=config.get("eos_token_id"),
                               pad_token_id=pad)
        with torch.inference_mode():
            out = peer.generate(input_ids=ids, attention_mask=mask, generation_config=gen, streamer=streamer)
        return out[:, width:].tolist()

    def stream(ids: list[int], n: int) -> tuple[float, float]:
        clock = _Clock()
        t0 = time.perf_counter()
        generate([ids], n, clock)
        return clock.times[1] - t0, clock.times[-1] - clock.times[1]

    generate(work.warmup_prompts, 4)
    t = time.perf_counter()
    batched = []
    for lo in range(0, len(work.prompts), HF_BATCH):
        batched += generate(work.prompts[lo:lo + HF_BATCH], work.output_len)
    batch_s = time.perf_counter() - t
    t = time.perf_counter()
    single = [generate([p], work.output_len)[0] for p in work.prompts]
    single_s = time.perf_counter() - t
    _check_lengths(batched, work.output_len, "transformers")
    return dict(
        batch=_throughput(work, batch_s), single=_throughput(work, single_s), tokens=single, load_s=load_s,
        decode=_stream_summary([stream(p, cfg.decode_len) for p in work.decode_prompts], cfg.decode_len, cfg.decode_prompt_len),
        prefill=_stream_summary([stream(p, 1) for p in work.prefill_prompts], 1, cfg.prefill_len),
        memory=dict(baseline_rss=baseline, loaded_rss=loaded, load_peak_rss=load_peak, end_rss=_rss_now(), peak_rss=_rss_peak()),
    )
