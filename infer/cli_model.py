"""`infer run` (generate with a real model, streaming) and `infer graph`."""

from __future__ import annotations

import argparse
import sys
import time

from .core.engine import EngineArgs


def block_size_arg(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of tokens or 'auto', got {text!r}") from None


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags under vLLM's names, shared by run, serve and bench."""
    p.add_argument("--model", default="smollm2", help="HF directory, .gguf file or alias (default: smollm2)")
    p.add_argument("--runner", default="auto", choices=["auto", "generate", "pooling"],
                   help="generate text, or pool (embeddings, scores); auto: pooling for encoder, bare-backbone and "
                        "classifier architectures (vLLM's --runner)")
    p.add_argument("--backend", default="auto", help="auto|cpu_ref|torch|cuda|ascend|<plugin> (auto: cuda, ascend, torch)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--device", default=None, help="torch device for the backend (default: the backend's)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=EngineArgs.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--block-size", type=block_size_arg, default=None, metavar="{N,auto}",
                   help="tokens per KV block (default: the backend's); auto: 8/16/32-token blocks (multiples of the "
                        "backend's smallest page) chosen per request by its expected length")
    p.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache size in bytes (all layers)")
    p.add_argument("--gpu-memory-utilization", type=float, default=EngineArgs.gpu_memory_utilization,
                   help="fraction of accelerator memory for weights, activations and KV cache")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None)
    p.add_argument("--kv-offload-bytes", type=int, default=0, metavar="BYTES",
                   help="a second KV tier of this many bytes (all layers) under the device pool: prefix-cache blocks "
                        "it evicts and swapped-out requests wait there (host memory; a memory-mapped file on the CPU "
                        "backend); 0: none")
    p.add_argument("--kv-offload-path", default=None, metavar="FILE",
                   help="the file the host tier maps (default on the CPU backend: an unlinked temporary file)")
    p.add_argument("--preemption-mode", default="auto", choices=["auto", "recompute", "swap"],
                   help="when the pool runs out: swap a request's blocks to the host tier (auto: if it holds a full "
                        "block and the tier has room) or free them and recompute on resuming")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                   help="keep every block of every layer: no per-group block tables freeing the blocks sliding-window "
                        "layers have passed")
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--long-prefill-token-threshold", type=int, default=0)
    p.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--structured-outputs-backend", default="auto", choices=["auto", "xgrammar", "guidance"],
                   help="grammar library for structured outputs (auto: xgrammar, llguidance for what it cannot compile)")
    p.add_argument("--reasoning-parser", default=None, metavar="NAME",
                   help="split <think>...</think> reasoning from the answer (deepseek_r1, qwen3, or a plugin's); "
                        "structured outputs then constrain the answer after the reasoning")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 5, '
                        '"prompt_lookup_max": 4}\' (docs/speculative_decoding.md)')
    p.add_argument("--quantization", default="auto", choices=["auto", "none", "fp8"],
                   help="auto: keep a quantized checkpoint (GGUF Q4_0/Q4_1/Q8_0, AWQ, GPTQ, fp8) quantized with a 16-bit "
                        "--dtype (dequantized for float32); "
                        "none: dequantize it to --dtype; fp8: quantize a float model's projections to fp8 at load. "
                        "On CPU, steps with more rows than the quantized kernels take use dequantized copies "
                        "(up to $INFER_DEQUANT_CACHE_MB, default 1024 MiB, in all)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="fp8: KV cache as e4m3 (1 byte a value: 2x the tokens of a 16-bit cache)")
    lora = p.add_argument_group("LoRA adapters (docs/lora.md)")
    lora.add_argument("--enable-lora", action="store_true", help="serve PEFT LoRA adapters over the base model")
    lora.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                      help='adapters known from the start: name=path or JSON {"name": ..., "path": ...}; a request '
                           "picks one by its model name")
    lora.add_argument("--max-loras", type=int, default=1, help="distinct adapters in one batch (device slots)")
    lora.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank served")
    lora.add_argument("--max-cpu-loras", type=int, default=None,
                      help="adapters kept in host memory (default: --max-loras)")
    mm = p.add_argument_group("vision-language models (docs/multimodal.md)")
    mm.add_argument("--limit-mm-per-prompt", type=_json_limits, default=None, metavar="JSON",
                    help='the most images one prompt may hold, e.g. \'{"image": 2}\' (default: no limit)')
    mm.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                    help="serve file:// image URLs under DIR (default: none)")
    mm.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                    help="fetch http(s) image URLs from these hosts only (default: any)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run every step eagerly: capture no decode graphs (CUDA graphs on the cuda backend)")
    p.add_argument("--cuda-graph-sizes", type=int, nargs="+", default=None, metavar="N",
                   help="decode batch sizes to capture as CUDA graphs (default: 1 2 4 and every multiple of 8 up "
                        "to --max-num-seqs)")
    d = p.add_argument_group("distributed (docs/distributed.md)")
    d.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="ranks each layer is split over")
    d.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, help="pipeline stages (layer ranges)")
    d.add_argument("--data-parallel-size", "-dp", type=int, default=1, help="engine replicas behind one server")
    d.add_argument("--distributed-executor-backend", default=None, choices=["mp", "external_launcher", "ray"],
                   help="mp: worker processes on this host (default when ranks > 1); external_launcher: every rank "
                        "started by torchrun; ray: Ray actors")
    d.add_argument("--nnodes", type=int, default=1, help="hosts the ranks are spread over (mp)")
    d.add_argument("--node-rank", type=int, default=0, help="this host's index among --nnodes (mp)")
    d.add_argument("--master-addr", default="127.0.0.1", help="address of node 0, where ranks rendezvous")
    d.add_argument("--master-port", type=int, default=None, help="rendezvous port on node 0 (default: a free one; "
                                                                 "required with --nnodes > 1)")


def _json_limits(text: str) -> dict:
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError('give an object, e.g. {"image": 2}')
    return value


def engine_args(args: argparse.Namespace, **overrides) -> EngineArgs:
    names = ("model", "runner", "backend", "dtype", "device", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
             "block_size", "kv_cache_memory", "gpu_memory_utilization", "num_gpu_blocks_override", "enable_prefix_caching",
             "disable_hybrid_kv_cache_manager", "enable_chunked_prefill", "long_prefill_token_threshold", "scheduling_policy", "seed",
             "structured_outputs_backend", "reasoning_parser", "speculative_config",
             "quantization", "kv_cache_dtype", "enforce_eager", "cuda_graph_sizes", "tensor_parallel_size",
             "pipeline_parallel_size", "data_parallel_size", "distributed_executor_backend", "nnodes", "node_rank",
             "master_addr", "master_port", "kv_offload_bytes", "kv_offload_path", "preemption_mode", "enable_lora",
             "max_loras", "max_lora_rank", "max_cpu_loras", "limit_mm_per_prompt", "allowed_local_media_path")
    lora = {"lora_modules": tuple(args.lora_modules or ()),
            "allowed_media_domains": tuple(args.allowed_media_domains) if args.allowed_media_domains else None}
    return EngineArgs(**({n: getattr(args, n) for n in names} | lora | overrides))


# -- infer run ------------------------------------------------------------------
def add_run(sub) -> None:
    p = sub.add_parser("run", help="generate text with a model, streamed to the terminal")
    p.add_argument("prompt", nargs="?", help="the prompt (default: read from stdin)")
    add_engine_args(p)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=None,
                   help="default: the model's generation_config, else 0 (greedy)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="apply the chat template (default: when the model has one)")
    p.add_argument("--system", default=None, help="system message for --chat")
    p.add_argument("--trace-dispatch", action="store_true",
                   help="after the run, print which implementation (primitive, fast path, fused node, fallback "
                        "backend) served every call, and how often")
    p.set_defaults(func=cmd_run)


def cmd_run(args: argparse.Namespace) -> int:
    from .core.engine import LLMEngine
    from .core.sampling_params import SamplingParams

    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    if not prompt.strip():
        print("infer run: empty prompt; pass one as an argument or on stdin", file=sys.stderr)
        return 2
    t0 = time.time()
    try:
        from .core.pooling import is_pooling

        if is_pooling(engine_args(args)):
            return _run_pooling(args, prompt, t0)
        # One request: a KV pool for one full context, not max_num_seqs of them.
        engine = LLMEngine(engine_args(args, max_num_seqs=1, show_progress=None, trace_dispatch=args.trace_dispatch))
    except (ValueError, RuntimeError, FileNotFoundError) as exc:
        print(f"infer run: {exc}", file=sys.stderr)
        return 2
    load_s = time.time() - t0
    gen = engine.generation_config
    params = SamplingParams(
        temperature=args.temperature if args.temperature is not None else float(gen.get("temperature", 0.0)),
        top_p=args.top_p if args.top_p is not None else float(gen.get("top_p", 1.0)),
        top_k=args.top_k if args.top_k is not None else int(gen.get("top_k", 0)),
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, max_tokens=args.max_tokens, seed=args.seed,
    )
    use_chat = args.chat if args.chat is not None else engine.chat_template is not None
    request = prompt
    if use_chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [{"role": "user", "content": prompt}]
        if engine.chat_template is None:
            print("infer run: --chat given but the model has no chat template", file=sys.stderr)
            return 2
        ids = engine.tokenizer.apply_chat_template(messages, chat_template=engine.chat_template,
                                                   add_generation_prompt=True, tokenize=True, return_dict=False)
        request = {"prompt_token_ids": list(ids)}
    try:
        engine.add_request("run", request, params)
    except ValueError as exc:
        print(f"infer run: {exc}", file=sys.stderr)
        return 2
    start, first, shown, out = time.time(), None, 0, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
            if len(text) > shown:
                first = first or time.time()
                sys.stdout.write(text[shown:])
                sys.stdout.flush()
                shown = len(text)
    end = time.time()
    sys.stdout.write("\n")
    sys.stdout.flush()
    comp = out.outputs[0]
    n = len(comp.token_ids)
    decode_s = end - (first or end)
    print(f"[{engine.backend.name}, {engine.dtype}] load {load_s:.1f} s | prompt {len(out.prompt_token_ids)} tokens, "
          f"first token {((first or end) - start) * 1000:.0f} ms | {n} tokens in {end - start:.2f} s"
          + (f", decode {max(n - 1, 0) / decode_s:.1f} tok/s" if decode_s > 0 else "")
          + f" | finish: {comp.finish_reason}", file=sys.stderr)
    for line in getattr(getattr(engine.worker, "runner", None), "load_report", ()):
        if not line.startswith("warning: "):  # warnings were logged at load
            print(line, file=sys.stderr)
    if engine.dispatch_trace is not None:
        print(f"dispatch on backend '{engine.backend.name}' (node, call, implementation, calls):", file=sys.stderr)
        print(engine.dispatch_trace.format(), file=sys.stderr)
    return 0


def _run_pooling(args: argparse.Namespace, prompt: str, t0: float) -> int:
    """`infer run` on a pooling model: the prompt's embedding (or a classifier's scores) as JSON on stdout."""
    import json

    from .core.pooling import PoolingEngine

    engine = PoolingEngine(engine_args(args, max_num_seqs=1, show_progress=None, trace_dispatch=args.trace_dispatch))
    load_s = time.time() - t0
    try:
        engine.add_request("run", prompt)
    except ValueError as exc:
        print(f"infer run: {exc}", file=sys.stderr)
        return 2
    start = time.time()
    (out,) = engine.step()
    print(json.dumps([round(float(v), 7) for v in out.outputs.data]))
    what = "scores" if engine.classifier else f"embedding of {len(out.outputs.data)} dims"
    print(f"[{engine.backend.name}, {engine.dtype}] load {load_s:.1f} s | {engine.architecture}: {what} of "
          f"{len(out.prompt_token_ids)} tokens in {(time.time() - start) * 1000:.0f} ms", file=sys.stderr)
    return 0


# -- infer graph ------------------------------------------------------------------
def add_graph(sub) -> None:
    p = sub.add_parser("graph", help="print a model's graph lowered to meta-primitives; export it to ONNX")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--runner", default="auto", choices=["auto", "generate", "pooling"],
                   help="generate text, or pool (embeddings, scores); auto: pooling for encoder, bare-backbone and "
                        "classifier architectures (vLLM's --runner)")
    p.add_argument("--backend", default="auto", help="whose fused nodes to honour while lowering")
    p.add_argument("--onnx", default=None, metavar="PATH", help="write the lowered graph as ONNX (domain 'infer')")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="show one rank's program of this tensor-parallel size (its collectives included)")
    p.add_argument("--rank", type=int, default=0, help="which tensor-parallel rank to show")
    p.set_defaults(func=cmd_graph)


def cmd_graph(args: argparse.Namespace) -> int:
    from .core.loader import load_model
    from .core.lowering import lower
    from .core.parallel import shard_graph
    from .registry import get_backend, registry

    reg = registry()
    try:
        backend = get_backend(args.backend)
        m = load_model(args.model, load_weights=False, load_tokenizer=False, supported_architectures=reg.models)
    except (ValueError, RuntimeError, FileNotFoundError) as exc:
        print(f"infer graph: {exc}", file=sys.stderr)
        return 2
    from .core.executor.rank import pooling_runner
    from .core.loader.pooling_config import read_pooling_config
    from .core.models.pooling import build_pooling

    try:
        if pooling_runner(args.runner, m.architecture, m.source):
            method = read_pooling_config(m.source).method
            graph = build_pooling({**m.config, "infer_pooling": {"method": method}})
        else:
            graph = reg.models[m.architecture](m.config)
        graph = shard_graph(graph, args.rank, args.tensor_parallel_size)
    except ValueError as exc:
        print(f"infer graph: {exc}", file=sys.stderr)
        return 2
    program = lower(graph, fuses=lambda op, attrs: bool(backend.fuses(op, **attrs)))
    try:
        print(program.format())
    except BrokenPipeError:  # `infer graph | head`
        return 0
    if args.onnx:
        from .core.onnx_export import to_onnx

        import onnx

        onnx.save(to_onnx(program, backend.preferred_block_size), args.onnx)
        print(f"wrote {args.onnx} (ops of domain 'infer' checked by onnx.checker)", file=sys.stderr)
    return 0
