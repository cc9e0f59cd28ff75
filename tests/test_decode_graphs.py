"""The engine's captured decode steps (CUDA graphs on the cuda backend), run on the CPU.

There is no CUDA graph off a GPU, so these tests give the engine a
`DecodeGraphs` with ``use_graphs=False`` through the backend hook it calls:
every decode step the engine hands over is written into the static buffers,
padded to a captured batch size (padding rows: token 0, seq_len 0, slot -1)
and run eagerly, which is exactly what a replay computes. What they check is
the engine's side (which steps go to the graphs, which logits rows come back),
the padding (no KV written, no output changed, no expert count added), and
the flags. transformers is the oracle for the tokens.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from tiny_moe_models import save_moe_model

from infer.backends.cuda.graphs import DecodeGraphs
from infer.backends.torch_native.backend import TorchBackend
from infer.cli import build_parser
from infer.cli_model import engine_args
from infer.core.config import graph_batch_sizes
from infer.core.engine import EngineArgs, LLMEngine
from infer.core.llm import LLM
from infer.core.sampling_params import SamplingParams
from infer.primitives.types import AttentionMetadata

VOCAB = 211


def greedy(model, prompt, n):
    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture
def static_graphs(monkeypatch):
    """Make the torch backend's hook return eager static-buffer graphs; records each call."""
    calls = []

    def hook(self, forward, *, max_model_len, block_size, batch_sizes, progress=iter):
        graphs = DecodeGraphs(forward, self.device, max_model_len, block_size, batch_sizes, use_graphs=False)
        graphs.capture(progress)
        calls.append(dict(max_model_len=max_model_len, block_size=block_size, batch_sizes=batch_sizes, graphs=graphs))
        return graphs

    monkeypatch.setattr(TorchBackend, "decode_graphs", hook)
    return calls


def make(path, leak_check, **kw):
    llm = LLM(path, **({"backend": "torch", "skip_tokenizer_init": True, "max_num_seqs": 8} | kw))
    leak_check.append(llm.engine)
    return llm


def test_decode_steps_padded_into_captured_sizes_give_transformers_tokens(tiny_llama, static_graphs, leak_check):
    model, path = tiny_llama
    llm = make(path, leak_check)
    asked = static_graphs[0]
    assert asked["batch_sizes"] == (1, 2, 4, 8) and asked["max_model_len"] == llm.engine.max_model_len
    graphs = llm.engine.worker.decode_graphs
    assert graphs is static_graphs[0]["graphs"]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, VOCAB, n).tolist() for n in (21, 5, 37, 16, 2)]
    # Different lengths: the batch shrinks 5 -> 1, so steps pad 5 to 8, 3 to 4, ...
    lengths = (12, 3, 9, 6, 1)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [greedy(model, p, n) for p, n in zip(prompts, lengths)]
    assert graphs.replays >= 11  # every decode step but none of the prefills


def test_a_one_token_prompt_chunk_in_a_decode_shaped_step_samples_nothing(tiny_llama, static_graphs, leak_check):
    """Three requests decoding and a long prompt's first chunk of one token (budget 4):
    every row has one query, so the step goes to the graphs, but only three rows sample."""
    model, path = tiny_llama
    llm = make(path, leak_check, max_num_seqs=4, max_num_batched_tokens=4)
    engine, graphs = llm.engine, llm.engine.worker.decode_graphs
    seen = []
    forward = graphs.forward


    def spy(ids, positions, meta):
        seen.append(np.asarray(positions).copy())
        return forward(ids, positions, meta)

    graphs.forward = spy
    rng = np.random.default_rng(1)
    short = [rng.integers(3, VOCAB, 2).tolist() for _ in range(3)]
    long = rng.integers(3, VOCAB, 9).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for i, p in enumerate(short):
        engine.add_request(f"s{i}", {"prompt_token_ids": p}, params)
    engine.step()  # the three short prompts
    engine.add_request("long", {"prompt_token_ids": long}, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    # Position 0 in a replayed step is the long prompt's first token (short prompts decode from position 2).
    assert any((pos == 0).any() and len(pos) == 4 for pos in seen)
    assert done == {**{f"s{i}": greedy(model, p, 8) for i, p in enumerate(short)}, "long": greedy(model, long, 8)}


def test_one_token_prefill_chunks_run_through_the_graphs_and_only_prompt_ends_sample(tiny_llama, static_graphs,
                                                                                       leak_check):
    """long_prefill_token_threshold=1 cuts every prompt into one-token chunks, so every step
    has one query per request and goes to the graphs: rows that do not sample (a prompt's
    inner tokens) sit anywhere in the batch, and the engine must sample the right rows."""
    model, path = tiny_llama
    llm = make(path, leak_check, long_prefill_token_threshold=1)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, VOCAB, n).tolist() for n in (9, 2, 5, 3)]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [greedy(model, p, 5) for p in prompts]
    graphs = llm.engine.worker.decode_graphs
    assert graphs.replays == max(len(p) + 5 - 1 for p in prompts)  # every step, prefill included


def test_preemption_forks_and_seeded_sampling_give_what_eager_steps_give(tiny_llama, static_graphs, leak_check):
    """Small blocks (wide block tables), a pool too small for every request (preemption and
    recompute), n=3 forks sharing blocks copy-on-write, seeded sampling with logprobs."""
    _, path = tiny_llama
    rng = np.random.default_rng(3)
    prompts = [{"prompt_token_ids": rng.integers(3, VOCAB, n).tolist()} for n in (21, 5, 37, 16)]
    params = [SamplingParams(temperature=1.0, seed=11 + i, max_tokens=14, ignore_eos=True, logprobs=2,
                             n=3 if i == 1 else 1) for i in range(len(prompts))]
    got = {}
    for eager in (True, False):
        llm = make(path, leak_check, block_size=4, max_model_len=64, num_gpu_blocks_override=24, enforce_eager=eager)
        outs = llm.generate(prompts, params, use_tqdm=False)
        got[eager] = [(c.token_ids, [[step[t].logprob for t in sorted(step)] for step in c.logprobs])
                      for o in outs for c in o.outputs]
        assert llm.engine.scheduler.get_stats().num_preemptions > 0
    assert llm.engine.worker.decode_graphs.replays > 0
    assert [t for t, _ in got[False]] == [t for t, _ in got[True]]
    for (_, a), (_, b) in zip(got[False], got[True]):
        np.testing.assert_allclose(np.concatenate(a), np.concatenate(b), atol=1e-5)


def test_moe_expert_counts_leave_the_padding_out(tmp_path, static_graphs, leak_check):
    save_moe_model("mixtral", tmp_path)
    rng = np.random.default_rng(2)
    prompts = [{"prompt_token_ids": rng.integers(3, VOCAB, n).tolist()} for n in (7, 3, 11)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (6, 2, 4)]
    got = {}
    for eager in (True, False):
        llm = make(str(tmp_path), leak_check, enforce_eager=eager)
        outs = llm.generate(prompts, params, use_tqdm=False)
        snap = llm.engine.expert_load.snapshot()
        got[eager] = ([o.outputs[0].token_ids for o in outs], snap.tokens_per_expert)
    assert llm.engine.worker.decode_graphs.replays > 0
    assert got[False][0] == got[True][0]
    np.testing.assert_array_equal(got[False][1], got[True][1])
    # Every prompt token and every sampled token but the last was routed to top_k = 2 experts.
    ran = sum(len(p["prompt_token_ids"]) for p in prompts) + sum(p.max_tokens - 1 for p in params)
    assert got[False][1].sum(axis=1).tolist() == [2 * ran] * got[False][1].shape[0]


def test_enforce_eager_asks_the_backend_for_no_graphs(tiny_llama, static_graphs, leak_check):
    _, path = tiny_llama
    llm = make(path, leak_check, enforce_eager=True)
    assert llm.engine.worker.decode_graphs is None and not static_graphs


def test_cuda_graph_sizes_are_what_the_backend_captures(tiny_llama, static_graphs, leak_check):
    _, path = tiny_llama
    llm = make(path, leak_check, cuda_graph_sizes=[3, 1])
    assert static_graphs[0]["batch_sizes"] == (1, 3)
    assert sorted(llm.engine.worker.decode_graphs.pad_counts) == [1, 3]
    # A batch of 5 has no graph: it runs eagerly.
    meta = AttentionMetadata(np.arange(6, dtype=np.int32), np.full(5, 4, np.int32), np.zeros((5, 1), np.int32),
                             np.zeros(5, np.int64), 1, 4, 16)
    assert not llm.engine.worker.decode_graphs.can_replay(meta)


def test_a_failed_capture_is_reported_and_the_engine_runs_eagerly(tiny_llama, monkeypatch, caplog, leak_check):
    model, path = tiny_llama

    def broken(self, forward, **kw):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(TorchBackend, "decode_graphs", broken)
    with caplog.at_level(logging.WARNING, logger="infer"):
        llm = make(path, leak_check)
    assert llm.engine.worker.decode_graphs is None
    assert "failed to capture decode graphs" in caplog.text and "stream is capturing" in caplog.text
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    assert out[0].outputs[0].token_ids == greedy(model, [5, 6, 7], 3)


def test_the_torch_backend_captures_nothing(tiny_llama, leak_check):
    _, path = tiny_llama
    assert make(path, leak_check).engine.worker.decode_graphs is None


def test_which_steps_can_replay(tiny_llama, leak_check):
    _, path = tiny_llama
    runner = make(path, leak_check, max_model_len=64).engine.worker.runner
    graphs = DecodeGraphs(runner.forward, "cpu", max_model_len=64, block_size=16, batch_sizes=(1, 4), use_graphs=False)

    def meta(q_lens, seq_lens, width=1):
        qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        return AttentionMetadata(qsl, np.array(seq_lens, np.int32), np.zeros((len(q_lens), width), np.int32),
                                 np.zeros(int(qsl[-1]), np.int64), max(q_lens, default=0), max(seq_lens, default=0), 16)

    assert graphs.can_replay(meta([1, 1, 1], [5, 9, 30]))
    assert not graphs.can_replay(meta([2, 1], [5, 9]))  # a prefill chunk
    assert not graphs.can_replay(meta([1] * 5, [5] * 5))  # beyond the largest size
    assert not graphs.can_replay(meta([1], [65], width=5))  # beyond max_model_len
    assert not graphs.can_replay(meta([], []))


def test_cuda_graphs_need_a_cuda_device(tiny_llama, leak_check):
    _, path = tiny_llama
    runner = make(path, leak_check).engine.worker.runner
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device, not cpu"):
        DecodeGraphs(runner.forward, "cpu", max_model_len=64, block_size=16, batch_sizes=(1,))


def test_default_graph_sizes_follow_vllm_up_to_max_num_seqs():
    assert graph_batch_sizes(1) == (1,)
    assert graph_batch_sizes(12) == (1, 2, 4, 8, 12)
    assert graph_batch_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert graph_batch_sizes(64, [16, 2, 2]) == (2, 16)


@pytest.mark.parametrize("sizes", [[], [0], [4, -1], [2.5]])
def test_bad_cuda_graph_sizes_are_rejected_before_loading(sizes):
    with pytest.raises(ValueError, match="cuda_graph_sizes must be positive integers"):
        LLMEngine(EngineArgs(model="/nonexistent", cuda_graph_sizes=sizes))


def test_cli_flags_reach_the_engine_args():
    args = build_parser().parse_args(["run", "hi", "--enforce-eager", "--cuda-graph-sizes", "1", "4", "16"])
    e = engine_args(args)
    assert e.enforce_eager is True and list(e.cuda_graph_sizes) == [1, 4, 16]
    e = engine_args(build_parser().parse_args(["serve"]))
    assert e.enforce_eager is False and e.cuda_graph_sizes is None
