"""The tables tools/mutation.py works from: which fast tests guard each module,
the hand-made mutants, and the auto mutants known to be equivalent (with why).
Edit these as the code and the tests move; the script itself rarely needs to."""

from __future__ import annotations

# A fast-suite test that alone takes minutes here: per mutant it would cost more than all the others.
TOO_SLOW = ["tests/test_engine.py::test_greedy_output_does_not_depend_on_scheduling"]

# -- which fast tests guard which module (most likely killers first: -x stops at the first failure) ----------
SCHED = ["tests/test_scheduler_edges.py", "tests/test_scheduler.py", "tests/test_scheduler_pipeline.py",
         "tests/test_block_manager.py"]
ENGINE = ["tests/test_nonascii_output.py", "tests/test_detokenizer_multibyte.py", "tests/test_engine.py",
          "tests/test_async_engine.py", "tests/test_stream_errors.py"]
KERNELS = ["tests/test_sampling_boundaries.py", "tests/test_cpu_ref.py", "tests/test_conformance.py", "tests/test_speculative.py",
           "tests/test_properties.py"]
MODELS = ["tests/test_model_logits.py", "tests/test_loader.py", "tests/test_engine.py"]
TESTS = {
    "infer/core/block_manager.py": SCHED + ["tests/test_engine.py"],
    "infer/core/scheduler.py": SCHED + ["tests/test_engine.py", "tests/test_speculative.py"],
    "infer/core/scheduler_output.py": SCHED + ["tests/test_engine.py", "tests/test_speculative.py"],
    "infer/core/request.py": SCHED + ENGINE + ["tests/test_speculative.py"],
    "infer/core/speculative.py": ["tests/test_speculative.py"],
    "infer/core/config.py": ["tests/test_cache_config.py", *SCHED, "tests/test_kv_sizing.py", "tests/test_engine.py"],
    "infer/core/detokenizer.py": ENGINE,
    "infer/core/request_state.py": ENGINE,
    "infer/core/sampling_params.py": ["tests/test_sampling_boundaries.py", *ENGINE],
    "infer/core/sampling_batch.py": ["tests/test_sampling_boundaries.py", *ENGINE, "tests/test_structured_outputs.py",
                                     "tests/test_speculative.py"],
    "infer/core/structured.py": ["tests/test_structured_outputs.py"],
    "infer/core/outputs.py": ["tests/test_outputs.py", *ENGINE],
    "infer/core/processor.py": ENGINE + ["tests/test_structured_outputs.py"],
    "infer/core/executor/sampler.py": ["tests/test_speculative.py", *ENGINE, "tests/test_structured_outputs.py"],
    "infer/core/executor/worker.py": ENGINE + ["tests/test_kv_sizing.py", "tests/test_decode_graphs.py", "tests/test_lora.py"],
    "infer/core/executor/executor.py": ENGINE + [f"tests/test_distributed.py::{t}" for t in (
        "test_tp2_generates_what_one_process_does", "test_pipeline_stages_generate_what_one_process_does",
        "test_a_dead_worker_fails_the_engine_naming_the_rank")],
    "infer/core/engine.py": ENGINE + ["tests/test_kv_sizing.py", "tests/test_scheduler_pipeline.py",
                                      "tests/test_speculative.py", "tests/test_structured_outputs.py"],
    # Distributed serving: the one-process tests of the sharded graph first, then real gloo ranks.
    "infer/core/parallel.py": [f"tests/test_distributed.py::{t}" for t in (
        "test_head_layout_splits_or_replicates_kv_heads", "test_head_layout_pairs_every_query_head_with_its_kv_head",
        "test_shard_graph_param_shapes_and_slices", "test_row_parallel_bias_is_added_once",
        "test_moe_experts_are_split_inside_each_expert", "test_shared_expert_is_reduced_with_the_moe_not_alone",
        "test_program_reduces_each_block_once_and_gathers_logits", "test_tp2_generates_what_one_process_does",
        "test_lora_adapters_on_parallel_ranks_generate_what_one_process_does")],
    "infer/core/distributed.py": [f"tests/test_distributed.py::{t}" for t in (
        "test_parallel_config_defaults_are_the_engine_args_defaults", "test_stage_layers_split_evenly",
        "test_tp2_generates_what_one_process_does",
        "test_pipeline_stages_generate_what_one_process_does", "test_a_dead_worker_fails_the_engine_naming_the_rank",
        "test_torchrun_external_launcher", "test_ranks_that_disagree_fail_at_startup")],
    "infer/core/worker.py": ["tests/test_distributed.py::test_a_worker_rank_runs_the_drivers_calls_and_stops_on_stop",
                             "tests/test_distributed.py::test_headless_is_refused_on_node_0_and_without_mp",
                             "tests/test_distributed.py::test_tp2_generates_what_one_process_does",
                             "tests/test_distributed.py::test_pipeline_stages_generate_what_one_process_does"],
    "infer/core/data_parallel.py": ["tests/test_distributed.py::test_data_parallel_engine_is_the_first_replicas",
                                    "tests/test_distributed.py::test_data_parallel_routing_and_abort",
                                    "tests/test_distributed.py::test_data_parallel_replicas_behind_one_server"],
    "infer/core/llm.py": ENGINE,
    "infer/core/async_engine.py": ["tests/test_async_engine.py", "tests/test_stream_errors.py",
                                   "tests/test_nonascii_output.py", "tests/test_server_metrics.py"],
    "infer/core/model_runner.py": ["tests/test_model_logits.py", "tests/test_model_variants.py", "tests/test_engine.py",
                                   "tests/test_decode_graphs.py", "tests/test_quant_hf.py", "tests/test_quant.py"],
    "infer/core/graph.py": ["tests/test_graph.py", "tests/test_program_export.py", "tests/test_decode_graphs.py",
                            "tests/test_engine.py"],
    "infer/core/lowering.py": ["tests/test_graph.py", "tests/test_program_export.py", "tests/test_model_logits.py",
                               "tests/test_distributed.py::test_program_reduces_each_block_once_and_gathers_logits",
                               "tests/test_distributed.py::test_a_moe_block_reduces_its_hidden_output_alone_not_its_expert_counts",
                               "tests/test_engine.py"],
    "infer/core/rope.py": ["tests/test_graph.py", "tests/test_model_logits.py", "tests/test_engine.py"],
    "infer/core/memory.py": ["tests/test_kv_sizing.py", "tests/test_engine.py"],
    "infer/core/expert_load.py": ["tests/test_expert_load.py", "tests/test_moe_stats.py",
                                  "tests/test_server_metrics.py"],
    "infer/core/xy_plan.py": ["tests/test_plan_defaults.py", "tests/test_planner.py"],
    "infer/core/onnx_export.py": ["tests/test_program_export.py", "tests/test_graph.py"],
    "infer/core/quant_params.py": ["tests/test_quant.py", "tests/test_quant_hf.py",
                                   "tests/test_distributed.py::test_fp8_shards_keep_a_per_tensor_scale_and_cut_per_channel_ones",
                                   "tests/test_distributed.py::test_gguf_shards_read_only_their_blocks_and_match_the_whole_tensor"],
    "infer/core/ray_executor.py": [f"tests/test_distributed.py::{t}" for t in (
        "test_ray_ranks_each_reserve_the_device_or_core_their_actor_runs_on",
        "test_releasing_ray_ranks_kills_the_actors_still_running", "test_ray_executor_on_a_local_cluster")],
    "infer/core/models/": ["tests/test_model_logits.py", "tests/test_model_variants.py", "tests/test_loader_edges.py",
                           "tests/test_cache_config.py", "tests/test_moe_models.py", "tests/test_engine.py"],
    "infer/core/loader/": ["tests/test_loader_edges.py", "tests/test_loader.py", "tests/test_gguf_header.py",
                           "tests/test_quant_hf.py", "tests/test_quant.py", "tests/test_moe_models.py"],
    "infer/primitives/": ["tests/test_int4_packing.py", "tests/test_backend_memory.py", *KERNELS,
                          "tests/test_registry.py", "tests/test_quant.py",
                          *(f"tests/test_moe_primitive.py::{t}" for t in (  # check_moe's arguments
                              "test_top_k_from_one_expert_to_every_expert_passes_the_check",
                              "test_top_k_outside_one_to_the_number_of_experts_is_refused",
                              "test_shared_expert_arguments_are_checked",
                              "test_valid_shared_expert_arguments_pass_the_check"))],
    "infer/backends/cpu_ref/": KERNELS + ["tests/test_moe_primitive.py", "tests/test_quant.py"],
    "infer/backends/torch_native/": KERNELS + ["tests/test_torch_backend.py"],
    "infer/server/": ["tests/test_stream_errors.py", "tests/test_nonascii_output.py", "tests/test_server_metrics.py",
                      "tests/test_server.py"],
}


# -- hand-made mutants: (id, file, text, its replacement, what the bug does, the test meant to catch it) ---
HAND = [
    ("detok-utf8-guard", "infer/core/detokenizer.py",
     'if len(full) <= len(prefix) or full.endswith("\\ufffd"):', "if len(full) <= len(prefix):",
     "emits partial UTF-8 as U+FFFD", "tests/test_detokenizer_multibyte.py"),
    ("detok-offsets", "infer/core/detokenizer.py",
     "self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)",
     "self._read_offset = len(self._ids)",
     "the decode window never slides", "tests/test_detokenizer_multibyte.py"),
    ("stop-span", "infer/core/detokenizer.py",
     "start = max(0, len(text) - new_chars - len(stop) + 1)", "start = max(0, len(text) - new_chars)",
     "misses stop strings spanning tokens", "tests/test_detokenizer_multibyte.py"),
    ("sse-done-on-error", "infer/server/generation.py",
     "        yield sse(error_body(503, str(exc)))\n",
     "        yield sse(error_body(503, str(exc)))\n        return\n",
     "a dead engine ends the stream without [DONE]", "tests/test_stream_errors.py"),
    ("chat-usage", "infer/server/chat.py",
     "completion_tokens += len(tokens)", "completion_tokens = len(tokens)",
     "chat include_usage counts the last delta only", "tests/test_nonascii_output.py"),
    ("top-p-boundary", "infer/backends/cpu_ref/sampling.py",
     "keep[order[preceding < top_p]] = True", "keep[order[preceding <= top_p]] = True",
     "top_p keeps the token that reaches top_p exactly", "tests/test_sampling_boundaries.py"),
    ("top-p-boundary-torch", "infer/backends/torch_native/ranking.py",
     "n = (preceding < limit)", "n = (preceding <= limit)",
     "same, in the torch backend", "tests/test_sampling_boundaries.py"),
    ("min-p-before-temperature", "infer/backends/cpu_ref/sampling.py",
     "        probs = softmax(x)\n        x = np.where(probs >= min_p",
     "        probs = softmax(x * float(p.temperature[b]))\n        x = np.where(probs >= min_p",
     "min_p on the untempered logits", "tests/test_sampling_boundaries.py"),
    ("min-p-strict", "infer/backends/cpu_ref/sampling.py",
     "probs >= min_p * probs.max()", "probs > min_p * probs.max()",
     "min_p drops tokens tied with the maximum", "tests/test_sampling_boundaries.py"),
    ("top-k-strict", "infer/backends/cpu_ref/sampling.py",
     "x = np.where(x >= kth, x, -np.inf)", "x = np.where(x > kth, x, -np.inf)",
     "top_k drops the k-th value", "tests/test_sampling_boundaries.py"),
    ("top-k-off-by-one", "infer/backends/cpu_ref/sampling.py",
     "kth = np.sort(x)[::-1][top_k - 1]", "kth = np.sort(x)[::-1][top_k]",
     "top_k keeps k+1", "tests/test_sampling_boundaries.py"),
    ("repetition-penalty-sign", "infer/backends/cpu_ref/sampling.py",
     "np.where(x[seen] > 0, x[seen] / r, x[seen] * r)", "np.where(x[seen] > 0, x[seen] * r, x[seen] / r)",
     "rewards repeated tokens", "tests/test_conformance.py"),
    ("presence-as-frequency", "infer/backends/cpu_ref/sampling.py",
     "float(p.presence_penalty[b]) * (counts > 0)", "float(p.presence_penalty[b]) * counts",
     "presence penalty scales with the count", "tests/test_sampling_boundaries.py"),
    ("rank-ties", "infer/backends/cpu_ref/sampling.py",
     "out.ranks = 1 + (raw > raw", "out.ranks = 1 + (raw >= raw",
     "ranks count the token itself", "tests/test_conformance.py"),
    ("admit-zero-budget", "infer/core/scheduler.py",
     "while (self.waiting and not preempted and not blocked and budget > 0",
     "while (self.waiting and not preempted and not blocked and budget >= 0",
     "admits waiting requests with 0 tokens", "tests/test_scheduler_edges.py"),
    ("running-zero-budget", "infer/core/scheduler.py",
     "if budget == 0 or len(num_new) == cap:", "if len(num_new) == cap:",
     "schedules running requests for 0 tokens", "tests/test_scheduler_edges.py"),
    ("victim-oldest", "infer/core/scheduler.py",
     "return candidates[-1]  # the newest admitted", "return candidates[0]",
     "fcfs preempts the oldest request", "tests/test_scheduler.py"),
    ("cache-uncomputed", "infer/core/block_manager.py",
     "num_full = min(request.num_computed_tokens // self.block_size",
     "num_full = min(request.num_tokens // self.block_size",
     "caches a block holding a token with no KV", "tests/test_scheduler_edges.py"),
    ("last-token-hit", "infer/core/block_manager.py",
     "(request.num_tokens - 1) // self.block_size", "request.num_tokens // self.block_size",
     "the last prompt token can be a cache hit", "tests/test_block_manager.py"),
    ("free-order", "infer/core/block_manager.py",
     "for block in reversed(blocks):", "for block in blocks:",
     "a freed prefix's head is evicted first", "tests/test_block_manager.py"),
    ("evictable-hits", "infer/core/block_manager.py",
     "num_evictable_hits = sum(1 for b in hit if b.ref_cnt == 0)", "num_evictable_hits = 0",
     "over-commits the pool with cached free blocks", "tests/test_block_manager.py"),
    ("stream-abort", "infer/core/async_engine.py",
     "            if not finished:  # the consumer left early", "            if finished:  # the consumer left early",
     "an abandoned stream is never aborted", "tests/test_stream_errors.py"),
    ("delta-hold", "infer/server/generation.py",
     "self.hold = max((len(s) for s in stops), default=1) - 1", "self.hold = 0",
     "streams the start of a stop string before it is cut", "tests/test_server.py"),
]

# -- auto mutants that cannot be killed: (file, original line, mutated line) -> why --------------------------
_NUMPY_RESHAPE = "NumPy reads any negative size in reshape as the one inferred dimension: -2 acts as -1"
_GGUF_CHUNK = ("the chunk size trades peak memory against the number of dequantize calls: the weights read are the "
               "same, and test_gguf_reads_hold_one_row_chunk_of_temporaries bounds the temporaries relative to it")
_GGUF_STEP = ("rows per chunk a third more or a fifth fewer (or at least 2): the same weights, temporaries within "
              "the bound test_gguf_reads_hold_one_row_chunk_of_temporaries sets")
EQUIVALENT: dict[tuple[str, str, str], str] = {
    ("infer/core/onnx_export.py", "onnx.checker.check_model(model, full_check=True)", "pass"):
        "a self-check of our own export: every graph it writes passes it, so without it nothing we export changes",
    ("infer/core/structured.py",
     "self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)",
     "self.compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)"):
        "threads xgrammar may use inside one compile: the same grammar either way, only its speed differs",
    ("infer/core/lowering.py",
     'calls.append(Call("all_reduce", node.name, node.outputs[:1], node.outputs[:1], {}, {"group": TP_GROUP},',
     'calls.append(Call("all_reduce", node.name, node.outputs[:1], node.outputs[:2], {}, {"group": TP_GROUP},'):
        "every partial node of today's graphs has one output (a MoE's expert counts come from its expansion, "
        "not the graph node), so [:2] names the same one",
    ("infer/core/sampling_batch.py", "banned = [t for t in c.banned_tokens() if 0 <= t < vocab_size]",
     "banned = [t for t in c.banned_tokens() if 0 <= t <= vocab_size]"):
        "no banned id equals vocab_size: stop_token_ids are refused at add_request unless < vocab_size, "
        "and EOS ids are the model's own",
    ("infer/core/expert_load.py", "counts = {layer: c + 0 for layer, c in counts.items()}",
     "counts = {layer: c - 0 for layer, c in counts.items()}"):
        "either copies the backend's counts tensor (the point of the op); the values are the same",
    ("infer/core/ray_executor.py", "_ray().kill(self.actor, no_restart=True)",
     "_ray().kill(self.actor, no_restart=False)"):
        "rank actors are created with Ray's default max_restarts=0: a killed one is never restarted either way",
    ("infer/core/distributed.py", "TAG_MESSAGE, TAG_CARRY, TAG_LOGITS = 1, 2, 3",
     "TAG_MESSAGE, TAG_CARRY, TAG_LOGITS = 2, 2, 3"):
        "between one pair of ranks step messages and carries are sent and received in the same order "
        "(message n, carry n, message n+1 ...), so a shared tag matches the same messages",
    ("infer/core/models/moe.py", "shared_gate: bool = False", "shared_gate: bool = True"):
        "the default is read only with a shared expert, and moe_spec passes shared_gate whenever it makes one",
    ("infer/core/expert_load.py", "return np.where(mean > 0, counts.max(axis=1) / mean, np.nan)",
     "return np.where(mean >= 0, counts.max(axis=1) / mean, np.nan)"):
        "counts are never negative, so a zero mean has a zero max and 0/0 is nan either way",
    ("infer/core/llm.py", "use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:",
     "use_tqdm: bool = False, priority: Sequence[int] | None = None) -> list[RequestOutput]:"):
        "the progress bar's default: display on stderr only",
    ("infer/core/memory.py",
     "gc.collect() # objects in reference cycles (a GGUF reader's) hold their memory until collected",
     "pass # objects in reference cycles (a GGUF reader's) hold their memory until collected"):
        "when cyclic garbage is freed changes the RSS, never a result",
    ("infer/core/sampling_batch.py", "width = max((len(r) for r in rows), default=0)",
     "width = max((len(r) for r in rows), default=1)"):
        "the next line takes max(width, 1): defaults 0 and 1 give the same array",
    ("infer/core/sampling_batch.py",
     "max_num_logprobs=max((max(p.logprobs, 1) for p in ps if p.logprobs is not None), default=0),",
     "max_num_logprobs=max((max(p.logprobs, 1) for p in ps if p.logprobs is not None), default=1),"):
        "a step where no row asks for logprobs: K=1 only makes the backend also compute top-1 and ranks, "
        "which no row records (CompletionState keeps logprobs only when params.logprobs is set)",
    ("infer/core/scheduler_output.py", "request: Request = field(repr=False)", "request: Request = field(repr=True)"):
        "repr only",
    ("infer/core/memory.py", "ctypes.CDLL(None).malloc_trim(0)", "ctypes.CDLL(None).malloc_trim(1)"):
        "malloc_trim's pad argument: how much heap glibc keeps, RSS only",
    ("infer/core/request.py", "FINISHED_ABORTED = 5", "FINISHED_ABORTED = 6"):
        "the last status's number: order kept, nothing reads the value",
    ("infer/core/memory.py", "ctypes.CDLL(None).malloc_trim(0)", "pass"): "returns heap pages to the OS: RSS only",
    ("infer/core/llm.py", "bar.update(1)", "bar.update(0)"): "the progress bar: display only",
    ("infer/core/request.py", "num_preemptions: int = 0", "num_preemptions: int = 1"):
        "Request.num_preemptions is counted but nothing reads it (the scheduler's total is what is reported)",
    ("infer/backends/cpu_ref/sampling.py", "if 0 < top_k < x.shape[0]:", "if 0 < top_k <= x.shape[0]:"):
        "top_k equal to the vocabulary keeps every token, filtered or not",
    ("infer/core/sampling_batch.py", "out = np.full((len(rows), max(width, 1)), -1, dtype=np.int64)",
     "out = np.full((len(rows), max(width, 0)), -1, dtype=np.int64)"):
        "cpu_ref and torch read a [B, 0] id array as no ids, like a [B, 1] of -1 (a kernel might not)",
    ("infer/core/config.py",
     "return tuple(sorted({s for s in (1, 2, 4, *range(8, max_num_seqs + 1, 8)) "
     "if s <= max_num_seqs} | {max_num_seqs}))",
     "return tuple(sorted({s for s in (1, 2, 4, *range(8, max_num_seqs + 1, 8)) "
     "if s < max_num_seqs} | {max_num_seqs}))"):
        "the union with {max_num_seqs} on the same line adds back the one size `<` drops",
    ("infer/core/loader/config.py",
     'hint = " (NumPy has no bfloat16)" if "bfloat16" in name or name == "bf16" else ""',
     'hint = " (NumPy has no bfloat16)" if "bfloat16" in name or name != \'bf16\' else ""'):
        "the wording of an error message's hint",
    ("infer/core/loader/hf_dir.py",
     "return AutoTokenizer.from_pretrained(str(self.path), local_files_only=True, trust_remote_code=False)",
     "return AutoTokenizer.from_pretrained(str(self.path), local_files_only=False, trust_remote_code=False)"):
        "from_pretrained of an existing local directory reads only that directory either way",
    ("infer/core/loader/load.py", "disable=not show, leave=False)", "disable=not show, leave=True)"):
        "whether the finished progress bar stays on screen: display only",
    ("infer/core/engine.py", "weights.close()", "pass"): "closes the load's progress bar: display only",
    ("infer/core/loader/load.py", "self._bar.update(self._ckpt.nbytes(name))", "pass"):
        "the progress bar: display only",
    ("infer/core/request.py", "block_hashes: list[bytes] = field(init=False, repr=False)",
     "block_hashes: list[bytes] = field(init=False, repr=True)"): "repr only",
    ("infer/core/async_engine.py", "self._streams.clear()", "pass"):
        "the engine thread returns right after _fail_all; nothing reads _streams again",
    ("infer/core/xy_plan.py", "core_of = (np.arange(len(cost)) * num_cores) // max(len(cost), 1)",
     "core_of = (np.arange(len(cost)) * num_cores) // max(len(cost), 0)"):
        "max(n, 0) differs from max(n, 1) only for n == 0, where the array divided is empty: the same empty result",
    ("infer/core/xy_plan.py", "core_of = (np.arange(len(cost)) * num_cores) // max(len(cost), 1)",
     "core_of = (np.arange(len(cost)) * num_cores) // max(len(cost), 2)"):
        "max(n, 2) differs from max(n, 1) only for n <= 1, where the only index is 0 and 0 // 1 == 0 // 2",
    ("infer/core/loader/gguf_file.py", "CHUNK_BYTES = 4 << 20",
     "CHUNK_BYTES = 3 << 20"):
        _GGUF_CHUNK,
    ("infer/core/loader/gguf_file.py", "CHUNK_BYTES = 4 << 20",
     "CHUNK_BYTES = 4 << 19"):
        _GGUF_CHUNK,
    ("infer/core/loader/gguf_file.py", "CHUNK_BYTES = 4 << 20",
     "CHUNK_BYTES = 4 << 21"):
        _GGUF_CHUNK,
    ("infer/core/loader/gguf_file.py", "CHUNK_BYTES = 4 << 20",
     "CHUNK_BYTES = 5 << 20"):
        _GGUF_CHUNK,
    ("infer/core/loader/gguf_file.py", "step = max(1, CHUNK_BYTES // max(1, w.shape[1] * 4))",
     "step = max(1, CHUNK_BYTES // max(0, w.shape[1] * 4))"):
        "a tensor has at least one column: max(0, n) == max(1, n)",
    ("infer/core/loader/gguf_file.py", "step = max(1, CHUNK_BYTES // max(1, w.shape[1] * 4))",
     "step = max(1, CHUNK_BYTES // max(1, w.shape[1] * 3))"):
        _GGUF_STEP,
    ("infer/core/loader/gguf_file.py", "step = max(1, CHUNK_BYTES // max(1, w.shape[1] * 4))",
     "step = max(1, CHUNK_BYTES // max(1, w.shape[1] * 5))"):
        _GGUF_STEP,
    ("infer/core/loader/gguf_file.py", "step = max(1, CHUNK_BYTES // max(1, w.shape[1] * 4))",
     "step = max(1, CHUNK_BYTES // max(2, w.shape[1] * 4))"):
        "a row is at least 4 bytes: max(2, n) == max(1, n)",
    ("infer/core/loader/gguf_file.py", "step = max(1, CHUNK_BYTES // max(1, w.shape[1] * 4))",
     "step = max(2, CHUNK_BYTES // max(1, w.shape[1] * 4))"):
        _GGUF_STEP,
    ("infer/core/models/config.py",
     "tie_word_embeddings: bool = False",
     "tie_word_embeddings: bool = True"):
        "ModelConfig is built by normalize_config alone (moe_model_config replaces fields of its result), which passes every field: the class defaults are never read",
    ("infer/core/models/config.py",
     "qkv_bias: bool = False",
     "qkv_bias: bool = True"):
        "ModelConfig is built by normalize_config alone (moe_model_config replaces fields of its result), which passes every field: the class defaults are never read",
    ("infer/core/models/config.py",
     "o_bias: bool = False",
     "o_bias: bool = True"):
        "ModelConfig is built by normalize_config alone (moe_model_config replaces fields of its result), which passes every field: the class defaults are never read",
    ("infer/core/models/config.py",
     "mlp_bias: bool = False",
     "mlp_bias: bool = True"):
        "ModelConfig is built by normalize_config alone (moe_model_config replaces fields of its result), which passes every field: the class defaults are never read",
    ("infer/core/models/config.py",
     "qk_norm: bool = False",
     "qk_norm: bool = True"):
        "ModelConfig is built by normalize_config alone (moe_model_config replaces fields of its result), which passes every field: the class defaults are never read",
    ("infer/core/models/config.py",
     "raw: dict[str, Any] = field(default_factory=dict, repr=False)",
     "raw: dict[str, Any] = field(default_factory=dict, repr=True)"):
        "repr only",
    ("infer/core/loader/load.py",
     "def __init__(self, ckpt: Checkpoint, dtype: np.dtype, progress: bool | None = None, quantized: bool = False):",
     "def __init__(self, ckpt: Checkpoint, dtype: np.dtype, progress: bool | None = None, quantized: bool = True):"):
        "LazyWeights is built by LoadedModel.lazy_weights alone, which passes `quantized`: the default is never read",
    ("infer/core/loader/gguf_file.py",
     "stored = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float64).reshape(-1)",
     "stored = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float64).reshape(-2)"):
        _NUMPY_RESHAPE,
    ("infer/core/loader/gguf_file.py",
     "data = t.data.reshape(-1, t.data.shape[-1]) if t.data.ndim > 1 else t.data.reshape(1, -1)",
     "data = t.data.reshape(-1, t.data.shape[-1]) if t.data.ndim > 1 else t.data.reshape(1, -2)"):
        _NUMPY_RESHAPE,
    ("infer/core/loader/gguf_file.py",
     "data = t.data.reshape(-1, t.data.shape[-1]) if t.data.ndim > 1 else t.data.reshape(1, -1)",
     "data = t.data.reshape(-2, t.data.shape[-1]) if t.data.ndim > 1 else t.data.reshape(1, -1)"):
        _NUMPY_RESHAPE,
    ("infer/core/loader/quant_hf.py",
     "q = _nibbles(qweight)[..., inverse].reshape(qweight.shape[0], -1)",
     "q = _nibbles(qweight)[..., inverse].reshape(qweight.shape[0], -2)"):
        _NUMPY_RESHAPE,
    ("infer/core/loader/quant_hf.py",
     "z = _nibbles(qzeros)[..., inverse].reshape(qzeros.shape[0], -1)",
     "z = _nibbles(qzeros)[..., inverse].reshape(qzeros.shape[0], -2)"):
        _NUMPY_RESHAPE,
    ("infer/core/loader/quant_hf.py",
     "q = _nibbles(qweight).transpose(0, 2, 1).reshape(k, -1) # k = 8r + j",
     "q = _nibbles(qweight).transpose(0, 2, 1).reshape(k, -2) # k = 8r + j"):
        _NUMPY_RESHAPE,
    ("infer/core/loader/quant_hf.py",
     "z = _nibbles(qzeros).reshape(qzeros.shape[0], -1).astype(np.int16)",
     "z = _nibbles(qzeros).reshape(qzeros.shape[0], -2).astype(np.int16)"):
        _NUMPY_RESHAPE,
    ("infer/core/loader/quant_hf.py",
     "scales = np.asarray(get(\"weight_scale\"), dtype=np.float32).reshape(-1)",
     "scales = np.asarray(get(\"weight_scale\"), dtype=np.float32).reshape(-2)"):
        _NUMPY_RESHAPE,
    ("infer/core/model_runner.py",
     "pair = tuple(float(np.asarray(weights[prefix + n], dtype=np.float32).reshape(-1)[0])",
     "pair = tuple(float(np.asarray(weights[prefix + n], dtype=np.float32).reshape(-2)[0])"):
        _NUMPY_RESHAPE,
    ("infer/primitives/dequant.py",
     "return np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], -1)",
     "return np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], -2)"):
        _NUMPY_RESHAPE,
    ("infer/primitives/fp8.py",
     "return codes, scales.reshape(-1).astype(np.float32)",
     "return codes, scales.reshape(-2).astype(np.float32)"):
        _NUMPY_RESHAPE,
    ("infer/backends/cpu_ref/attention.py",
     "k = kv_cache[0, block_ids].reshape(-1, hk, d)[:seq_len]",
     "k = kv_cache[0, block_ids].reshape(-2, hk, d)[:seq_len]"):
        _NUMPY_RESHAPE,
    ("infer/backends/cpu_ref/attention.py",
     "v = kv_cache[1, block_ids].reshape(-1, hk, d)[:seq_len]",
     "v = kv_cache[1, block_ids].reshape(-2, hk, d)[:seq_len]"):
        _NUMPY_RESHAPE,
    ("infer/primitives/types.py", "prepared: Any = field(default=None, repr=False)",
     "prepared: Any = field(default=None, repr=True)"): "repr only (the same line in every weight handle class)",
    ("infer/core/executor/worker.py",
     "step = StepInput(np.zeros(n, np.int64), np.arange(n, dtype=np.int64), np.array([n - 1], np.int64), meta)",
     "step = StepInput(np.zeros(n, np.int64), np.arange(n, dtype=np.int64), np.array([n - 2], np.int64), meta)"):
        "the profiling forward samples one row: which one changes no buffer, so not the peak it measures",
    ("infer/core/detokenizer.py", "_CONTEXT_TOKENS = 5", "_CONTEXT_TOKENS = 6"):
        "prompt tokens re-decoded for context: any count from 1 up gives the leading-space rule of BPE and "
        "sentencepiece tokenizers the token before; one more changes no text",
    ("infer/core/detokenizer.py", "_CONTEXT_TOKENS = 5", "_CONTEXT_TOKENS = 4"):
        "prompt tokens re-decoded for context: any count from 1 up gives the leading-space rule of BPE and "
        "sentencepiece tokenizers the token before; one fewer changes no text",
}
