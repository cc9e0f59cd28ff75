"""Tensor parallelism: the sharded graph and program, then real multi-process runs
(gloo on the CPU) against one process: the mp executor, torchrun's
external launcher, two 'nodes' on loopback, and the failures users hit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from infer.core.graph import Graph
from infer.core.lowering import lower
from infer.core.models.llama import build_llama
from infer.core.models.moe import build_moe
from infer.core.parallel import HeadLayout, shard_graph

HERE = Path(__file__).parent
GENERATE = HERE / "distributed" / "generate.py"
PROMPTS = [[1, 5, 9, 33, 100], list(range(3, 40)), [7] * 20]


# -- the sharded graph (one process) ----------------------------------------------
def llama_config(**kw):
    cfg = dict(architectures=["LlamaForCausalLM"], hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=160, num_hidden_layers=2, vocab_size=211, max_position_embeddings=256,
               rms_norm_eps=1e-5, rope_theta=10000.0)
    return cfg | kw


def test_head_layout_splits_or_replicates_kv_heads():
    # SmolLM2: 9 query heads, 3 KV heads over 3 ranks: 3 query heads and 1 KV head each
    assert [HeadLayout.of(9, 3, r, 3) for r in range(3)] == [HeadLayout(3, 3 * r, (r,)) for r in range(3)]
    # fewer KV heads than ranks: each KV head is on the ranks whose query heads read it
    layouts = [HeadLayout.of(8, 2, r, 4) for r in range(4)]
    assert [x.kv_heads for x in layouts] == [(0,), (0,), (1,), (1,)]


@pytest.mark.parametrize("heads,kv,size", [(9, 3, 2), (9, 3, 3), (8, 2, 4), (12, 3, 4), (4, 2, 3), (9, 3, 4), (5, 1, 2)])
def test_head_layout_pairs_every_query_head_with_its_kv_head(heads, kv, size):
    """Whatever the split, the attention primitive's local pairing (query head j reads
    local KV head j // (local heads / local KV heads)) must find the model's KV head."""
    layouts = [HeadLayout.of(heads, kv, r, size) for r in range(size)]
    assert [x.first_head for x in layouts] == list(np.cumsum([0] + [x.num_heads for x in layouts[:-1]]))
    assert sum(x.num_heads for x in layouts) == heads and max(x.num_heads for x in layouts) - min(x.num_heads for x in layouts) <= 1
    for x in layouts:
        assert x.num_heads % x.num_kv_heads == 0
        local_group = x.num_heads // x.num_kv_heads
        for j in range(x.num_heads):
            assert x.kv_heads[j // local_group] == (x.first_head + j) // (heads // kv)
    with pytest.raises(ValueError, match="larger than num_attention_heads=9"):
        HeadLayout.of(9, 3, 0, 10)


def test_shard_graph_param_shapes_and_slices():
    g = build_llama(llama_config(tie_word_embeddings=False))
    full = {n: p.shape for n, p in g.params.items()}
    for rank in range(2):
        s = shard_graph(g, rank, 2)
        p = s.params
        # q/k/v: 2 of 4 query heads and 1 of 2 KV heads, read from the rank's rows of each tensor
        assert p["layers.0.qkv_proj"].shape == ((2 + 1 + 1) * 32, 128)
        assert p["layers.0.qkv_proj"].slices == ((0, ((64 * rank, 64 * rank + 64),)), (0, ((32 * rank, 32 * rank + 32),)),
                                                 (0, ((32 * rank, 32 * rank + 32),)))
        assert p["layers.0.qkv_proj"].parts == (64, 32, 32)
        assert p["layers.0.o_proj"].shape == (128, 64) and p["layers.0.o_proj"].slices == ((1, ((64 * rank, 64 * rank + 64),)),)
        assert p["layers.0.gate_up_proj"].shape == (160, 128)
        assert p["layers.0.gate_up_proj"].slices == ((0, ((80 * rank, 80 * rank + 80),)),) * 2
        assert p["layers.0.down_proj"].shape == (128, 80)
        # vocabulary 211 over 2 ranks: 106 rows each, the second shard padded with one zero row
        assert p["embed_tokens"].shape == (106, 128) and p["embed_tokens"].pad_rows == rank
        assert p["embed_tokens"].slices == ((0, ((106 * rank, min(211, 106 * rank + 106)),)),)
        assert p["norm"] == g.params["norm"]  # replicated
        attn = next(n for n in s.nodes if n.op == "attention")
        assert (attn.attrs["num_heads"], attn.attrs["num_kv_heads"]) == (2, 1)
        assert s.kv_heads() == 1
    assert {n: p.shape for n, p in g.params.items()} == full  # the original graph is untouched


def test_row_parallel_bias_is_added_once():
    cfg = llama_config(attention_bias=True, mlp_bias=True)
    g = build_llama(cfg)
    s0, s1 = shard_graph(g, 0, 2), shard_graph(g, 1, 2)
    for name in ("layers.0.o_bias", "layers.0.down_bias"):
        assert not s0.params[name].zeros and s0.params[name].sources == g.params[name].sources
        assert s1.params[name].zeros and s1.params[name].sources == ()


def test_moe_experts_are_split_inside_each_expert():
    cfg = dict(architectures=["MixtralForCausalLM"], hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2, vocab_size=211,
               max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0)
    s = shard_graph(build_moe(cfg), 1, 2)
    w13, w2 = s.params["layers.0.mlp.w13"], s.params["layers.0.mlp.w2"]
    assert w13.shape == (4, 48, 64) and w13.slices == ((1, ((24, 48), (72, 96))),)  # gate rows, then up rows
    assert w2.shape == (4, 64, 24) and w2.slices == ((2, ((24, 48),)),)
    assert s.params["layers.0.mlp.router"].slices == ()  # the router is replicated


def test_program_reduces_each_block_once_and_gathers_logits():
    g = shard_graph(build_llama(llama_config()), 0, 2)
    program = lower(g)
    prims = [c.primitive for c in program.calls]
    # embedding + (attention + mlp) per layer
    assert prims.count("all_reduce") == 1 + 2 * 2
    assert prims.count("all_gather") == 1
    for i, c in enumerate(program.calls):
        if c.primitive == "all_reduce":
            assert program.calls[i - 1].primitive in ("linear", "mask_rows") and c.attrs["group"] == "tp"
    text = program.format()
    assert "all_reduce(%attn_out, group=tp)" in text and "all_gather(%lm_head.shard, dim=-1, group=tp)" in text
    # the padding of the last vocabulary shard is cut off after the gather
    assert "split(%lm_head.gathered, sizes=(211, 1))" in text
    assert "all_reduce" not in lower(build_llama(llama_config())).format()  # one rank: no collectives


def test_a_moe_block_reduces_its_hidden_output_alone_not_its_expert_counts():
    """The moe node's outputs are (hidden, tokens per expert): only the first is a partial sum."""
    cfg = dict(architectures=["MixtralForCausalLM"], hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=1, vocab_size=211,
               max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0)
    program = lower(shard_graph(build_moe(cfg), 0, 2))
    reduces = [c for c in program.calls if c.primitive == "all_reduce"]
    assert reduces and all(len(c.inputs) == 1 and c.outputs == c.inputs for c in reduces)
    moe_node = next(c for c in program.calls if c.primitive == "moe")
    assert len(moe_node.outputs) == 2
    assert any(c.inputs == moe_node.outputs[:1] for c in reduces)


def test_a_worker_rank_runs_the_drivers_calls_and_stops_on_stop(monkeypatch):
    """The worker loop with a stand-in process group: each (method, args) runs on the
    rank's Worker (KV allocation reaches the runner, the tier file gets the rank), 'stop'
    returns cleanly, an unknown method is an error; the group is left either way."""
    from types import SimpleNamespace

    from infer.core import distributed, worker
    from infer.core.executor import worker as executor_worker

    class Dist:
        def __init__(self, messages):
            self.messages, self.closed, self.met = list(messages), False, False
            self.config, self.rank = SimpleNamespace(world_size=2), 1

        def check_agreement(self, fingerprint):
            pass

        def broadcast(self, _):
            return self.messages.pop(0)

        def meet(self):  # every rank waits for the others before leaving
            self.met = True

        def close(self):
            self.closed = True

    calls = []
    runner = SimpleNamespace(allocate_kv_caches=lambda n, b: calls.append(("kv", n, b)),
                             allocate_kv_tier=lambda n, path: calls.append(("tier", n, path)),
                             release_kv_caches=lambda: calls.append(("release",)))

    class Worker(executor_worker.Worker):
        def __init__(self, args, backend, dist, load_tokenizer=False):  # no model: the runner above
            self.dist, self.runner = dist, runner

    monkeypatch.setattr(executor_worker, "Worker", Worker)
    spec = {"engine_args": {"backend": "cpu_ref"}, "parallel": {}, "local_rank": 0, "rank": 1}
    dist = Dist([("allocate_kv", (4, 16)), ("allocate_kv", (4, 16, 8, "/x/tier")), ("release_kv", ()),
                 ("stop", ()), ("allocate_kv", (1, 1))])
    monkeypatch.setattr(distributed, "start", lambda *a, **k: dist)
    worker.run(spec)
    # A rank's tier file is its own: the path gets the rank.
    assert calls == [("kv", 4, 16), ("kv", 4, 16), ("tier", 8, "/x/tier.rank1"), ("release",)]
    assert dist.met and dist.closed and dist.messages == [("allocate_kv", (1, 1))]
    dist = Dist([("bogus", ())])
    monkeypatch.setattr(distributed, "start", lambda *a, **k: dist)
    with pytest.raises(AttributeError, match="bogus"):
        worker.run(spec)
    assert dist.closed


def test_shared_expert_is_reduced_with_the_moe_not_alone():
    cfg = dict(architectures=["Qwen2MoeForCausalLM"], hidden_size=64, num_attention_heads=2, num_key_value_heads=2,
               intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=4,
               shared_expert_intermediate_size=48, num_hidden_layers=1, vocab_size=64, max_position_embeddings=64,
               rms_norm_eps=1e-5, rope_theta=10000.0)
    g = shard_graph(build_moe(cfg), 0, 2)
    assert "layers.0.mlp.shared_expert" not in g.partial and "layers.0.mlp" in g.partial


def test_onnx_export_shows_the_collectives():
    onnx = pytest.importorskip("onnx")
    from infer.core.onnx_export import to_onnx

    model = to_onnx(lower(shard_graph(build_llama(llama_config()), 1, 2)))
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("AllReduce") == 5 and ops.count("AllGather") == 1
    assert isinstance(model, onnx.ModelProto)


# -- real ranks -------------------------------------------------------------------
def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", INFER_DIST_TIMEOUT_S="60")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent), env.get("PYTHONPATH")]))
    return env


def generate(model: str, engine: dict, prompts=PROMPTS, max_tokens: int = 8, launcher: list[str] | None = None,
             timeout: float = 300, **extra) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        spec = json.dumps({"model": model, "engine": engine, "prompts": prompts, "max_tokens": max_tokens, "out": out,
                           **extra})
        cmd = (launcher or [sys.executable]) + [str(GENERATE), spec]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env())
        assert proc.returncode == 0, proc.stderr[-3000:]
        return [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]


def assert_same_generation(a: dict, b: dict, atol: float = 1e-4) -> None:
    assert a["tokens"] == b["tokens"]
    for pa, pb in zip(a["logprobs"], b["logprobs"]):
        for sa, sb in zip(pa, pb):
            assert sa.keys() == sb.keys()
            np.testing.assert_allclose([sa[k] for k in sa], [sb[k] for k in sa], atol=atol)


def stop_server(server: subprocess.Popen) -> None:
    """SIGTERM, then a clean exit (0) within a minute; killed if not."""
    server.send_signal(signal.SIGTERM)
    try:
        assert server.wait(60) == 0
    finally:
        server.kill()


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    from tiny_models import random_model
    from tiny_moe_models import save_moe_model

    root = tmp_path_factory.mktemp("tp-models")
    model, _, _ = random_model("LlamaConfig", "LlamaForCausalLM", hidden_size=128, num_attention_heads=4,
                               num_key_value_heads=2, intermediate_size=160, num_hidden_layers=2, vocab_size=211,
                               max_position_embeddings=256)
    model.save_pretrained(root / "llama")
    # 3 query heads and 1 KV head, llama3 rope scaling: at TP=2 the heads split 2 + 1, the KV head on both ranks
    from tiny_models import make_model

    make_model("llama3")[0].save_pretrained(root / "llama3_uneven")
    save_moe_model("mixtral", root / "mixtral")
    save_moe_model("qwen2_moe", root / "qwen2_moe")
    # gpt-oss: sinks split with their heads, expert biases (gate/up split, down bias on rank 0), router bias
    save_moe_model("gpt_oss", root / "gpt_oss")
    # DeepSeek-V3: latent attention's heads split (q and kv_b rows, o columns), the latent replicated;
    # grouped routing with a selection bias; shared experts
    save_moe_model("deepseek_v3", root / "deepseek_v3")
    # Gemma 3 (tied, scaled embeddings; per-head q/k norms; local and global rope), Gemma 2 (soft-capped
    # logits after the gathered vocabulary), Phi-3 (fused qkv and gate_up tensors cut per part)
    # OLMo 2: q/k norms over all heads, each rank's q and k gathered for them
    for kind in ("gemma3", "gemma2", "phi3", "olmo2"):
        make_model(kind)[0].save_pretrained(root / kind)
    return {k: str(root / k) for k in ("llama", "llama3_uneven", "mixtral", "qwen2_moe", "gemma3", "gemma2", "phi3",
                                       "gpt_oss", "olmo2", "deepseek_v3")}


@pytest.mark.parametrize("kind", ["llama", "llama3_uneven", "mixtral", "qwen2_moe", "gemma3", "gemma2", "phi3",
                                  "gpt_oss", "olmo2", "deepseek_v3"])
def test_tp2_generates_what_one_process_does(tiny_dirs, kind):
    engine = {"backend": "torch", "dtype": "float32", "max_model_len": 128}
    [one] = generate(tiny_dirs[kind], engine)
    [two] = generate(tiny_dirs[kind], engine | {"tensor_parallel_size": 2})
    assert_same_generation(one, two)


def test_tp2_with_ngram_speculation_generates_what_one_process_does(tiny_dirs):
    """Verify steps (several query rows per request) through tensor-parallel ranks."""
    engine = {"backend": "torch", "dtype": "float32", "max_model_len": 128}
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": False}
    [one] = generate(tiny_dirs["llama"], engine, max_tokens=24)
    [two] = generate(tiny_dirs["llama"], engine | {"tensor_parallel_size": 2, "speculative_config": spec}, max_tokens=24)
    assert_same_generation(one, two)


@pytest.fixture(scope="module")
def lora_adapters(tiny_dirs, tmp_path_factory):
    """Two PEFT adapters of the tiny llama: every target at rank 8, and k/o at rank 2."""
    from test_lora import make_adapter
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"])
    out = []
    for i, (r, targets) in enumerate([(8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                           "down_proj"]), (2, ["k_proj", "o_proj"])]):
        path = tmp_path_factory.mktemp(f"tp-lora{i}")
        make_adapter(base, path, r, 2 * r, targets, False, seed=300 + i)
        out.append([f"lora{i}", i + 1, str(path)])
    return out


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_lora_adapters_on_parallel_ranks_generate_what_one_process_does(tiny_dirs, lora_adapters, tp, pp):
    """Each rank writes its cut of an adapter (B's rows of its q/k/v and gate/up outputs,
    A's columns of its o and down inputs; a pipeline stage its own layers' slots); two
    adapters and the base model in one batch."""
    engine = {"backend": "torch", "dtype": "float32", "max_model_len": 128, "enable_lora": True, "max_loras": 2,
              "max_lora_rank": 8}
    lora = {"loras": lora_adapters, "lora_of": [0, None, 1, 0][:len(PROMPTS)]}
    [base] = generate(tiny_dirs["llama"], engine | {"enable_lora": False})
    [one] = generate(tiny_dirs["llama"], engine, **lora)
    [many] = generate(tiny_dirs["llama"], engine | {"tensor_parallel_size": tp, "pipeline_parallel_size": pp}, **lora)
    assert_same_generation(one, many)
    changed = [a != b for a, b in zip(one["tokens"], base["tokens"])]
    assert changed == [i is not None for i in lora["lora_of"]], changed  # the adapters move the tokens


def test_tp2_with_a_draft_model_generates_what_one_process_does(tiny_dirs, tmp_path):
    """The draft runs whole on rank 0 while the target is sharded; greedy verification
    keeps the target's own tokens."""
    from tiny_models import random_model

    draft, _, _ = random_model("LlamaConfig", "LlamaForCausalLM", hidden_size=64, num_attention_heads=2,
                               num_key_value_heads=1, intermediate_size=96, num_hidden_layers=1, vocab_size=211,
                               max_position_embeddings=256)
    draft.save_pretrained(tmp_path / "draft")
    engine = {"backend": "torch", "dtype": "float32", "max_model_len": 128}
    spec = {"method": "draft_model", "model": str(tmp_path / "draft"), "num_speculative_tokens": 3,
            "adaptive": False}
    [plain] = generate(tiny_dirs["llama"], engine, max_tokens=16)
    [one] = generate(tiny_dirs["llama"], engine | {"speculative_config": spec}, max_tokens=16)
    [two] = generate(tiny_dirs["llama"], engine | {"speculative_config": spec, "tensor_parallel_size": 2},
                     max_tokens=16)
    assert_same_generation(one, two)
    assert_same_generation(plain, two)
    assert two["draft_tokens"] > 0 and (two["draft_tokens"], two["accepted_tokens"]) == (one["draft_tokens"],
                                                                                         one["accepted_tokens"])


@pytest.mark.parametrize("kind,tp,pp", [("llama", 1, 2), ("mixtral", 1, 2), ("llama", 2, 2), ("gemma2", 1, 2)])
def test_pipeline_stages_generate_what_one_process_does(tiny_dirs, kind, tp, pp):
    """PP=2: layer 0 on the first stage, layer 1 and the head on the second; with TP=2
    inside each stage, four processes."""
    engine = {"backend": "torch", "dtype": "float32", "max_model_len": 128}
    [one] = generate(tiny_dirs[kind], engine)
    [many] = generate(tiny_dirs[kind], engine | {"tensor_parallel_size": tp, "pipeline_parallel_size": pp})
    assert_same_generation(one, many)


def test_parallel_config_defaults_are_the_engine_args_defaults():
    """The defaults are written twice (ParallelConfig, EngineArgs): both describe one process."""
    from infer.core.distributed import ParallelConfig
    from infer.core.engine import EngineArgs

    assert ParallelConfig() == EngineArgs().parallel_config()
    assert ParallelConfig().executor is None


def test_stage_layers_split_evenly():
    from infer.core.distributed import stage_layers

    assert [stage_layers(30, s, 4) for s in range(4)] == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert [stage_layers(2, s, 2) for s in range(2)] == [(0, 1), (1, 2)]
    with pytest.raises(ValueError, match="larger than the model's 2 layers"):
        stage_layers(2, 0, 3)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 3])
def test_smollm2_tensor_parallel_matches_one_process(tp):
    """The packaged SmolLM2 (9 heads, 3 KV heads, Q4_1 GGUF kept quantized): TP=3 splits
    heads 3/3/3 with one KV head each; TP=2 splits them 5/4, each rank with its own copy
    of the KV heads its query heads read, and the int4 groups on column boundaries."""
    engine = {"max_model_len": 256}
    prompts = [[1, 504, 3458, 282, 4649, 314], list(range(100, 160))]
    [one] = generate("smollm2", engine, prompts=prompts, max_tokens=8)
    [many] = generate("smollm2", engine | {"tensor_parallel_size": tp}, prompts=prompts, max_tokens=8)
    assert_same_generation(one, many, atol=2e-3)


def test_tp2_on_the_reference_backend(tiny_dirs):
    engine = {"backend": "cpu_ref", "max_model_len": 128}
    [one] = generate(tiny_dirs["llama"], engine, max_tokens=4)
    [two] = generate(tiny_dirs["llama"], engine | {"tensor_parallel_size": 2}, max_tokens=4)
    assert_same_generation(one, two)


def test_torchrun_external_launcher(tiny_dirs):
    engine = {"backend": "torch", "dtype": "float32", "max_model_len": 128}
    [one] = generate(tiny_dirs["llama"], engine)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    ranks = generate(tiny_dirs["llama"], engine | {"tensor_parallel_size": 2,
                                                   "distributed_executor_backend": "external_launcher"},
                     launcher=torchrun)
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    for r in ranks:  # every rank ran the whole engine and sampled the same tokens
        assert_same_generation(one, r)
    ranks = generate(tiny_dirs["llama"], engine | {"pipeline_parallel_size": 2,
                                                   "distributed_executor_backend": "external_launcher"},
                     launcher=torchrun)
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    for r in ranks:  # pipeline stages: the last one's logits reach every rank's sampler
        assert_same_generation(one, r)


def test_ranks_that_disagree_fail_at_startup(tiny_dirs):
    spec = json.dumps({"model": tiny_dirs["llama"], "engine": {"backend": "torch", "tensor_parallel_size": 2,
                                                                 "distributed_executor_backend": "external_launcher"},
                       "rank_args": {"1": {"max_model_len": 64}}, "prompts": [[1, 2]]})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(GENERATE), spec]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env())
    assert proc.returncode != 0
    assert "ranks disagree: rank 1 runs {'max_model_len': 64}" in proc.stderr


def test_weights_per_rank_are_a_shard(tiny_dirs):
    engine = {"backend": "torch", "dtype": "float32", "max_model_len": 128}
    [one] = generate(tiny_dirs["llama"], engine, max_tokens=1, weight_bytes=True)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    ranks = generate(tiny_dirs["llama"], engine | {"tensor_parallel_size": 2,
                                                   "distributed_executor_backend": "external_launcher"},
                     max_tokens=1, launcher=torchrun, weight_bytes=True)
    norms = 4 * 128 * 5  # 2 layers x 2 norms + the final norm: replicated, float32
    for r in ranks:  # everything else is split in two (one padding row of the vocabulary aside)
        assert r["weight_bytes"] - norms == pytest.approx((one["weight_bytes"] - norms) / 2, rel=0.01)


def test_a_dead_worker_fails_the_engine_naming_the_rank(tiny_dirs):
    script = f"""
import os, signal, sys, time
import torch
from infer import LLM, SamplingParams
llm = LLM({tiny_dirs['llama']!r}, backend="torch", tensor_parallel_size=2, skip_tokenizer_init=True, max_model_len=128)
p = SamplingParams(max_tokens=4, temperature=0)
llm.generate([{{"prompt_token_ids": [1, 2, 3]}}], p, use_tqdm=False)
os.kill(llm.engine.executor.dist.workers[0].pid, signal.SIGKILL)
start = time.monotonic()
try:
    llm.generate([{{"prompt_token_ids": [1, 2, 3, 4]}}], p, use_tqdm=False)
except RuntimeError as exc:
    print("FAILED", round(time.monotonic() - start, 1), exc, flush=True)
    sys.exit(3)
print("NO ERROR")
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=_env())
    assert proc.returncode == 3, proc.stdout + proc.stderr[-2000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("FAILED"))
    assert "rank 1" in line
    assert float(line.split()[1]) < 30


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(1, 2), (3, 1)])
def test_nodes_on_loopback_serve_the_openai_client(tp, pp):
    """SmolLM2 (30 layers; 9 heads, 3 KV heads) with one rank per 'node' on loopback:
    PP=2 (two stages of 15 layers) over two nodes, TP=3 over three. Node 0 serves
    the API with rank 0, the others (--headless) run their ranks; the real `openai`
    client gets the text one process generates."""
    openai = pytest.importorskip("openai")
    from infer import LLM, SamplingParams
    from infer.core.distributed import free_port

    prompt = "The capital of France is"
    port, api, nodes = free_port(), free_port(), tp * pp
    base = ["--model", "smollm2", "--max-model-len", "256", "--tensor-parallel-size", str(tp),
            "--pipeline-parallel-size", str(pp), "--nnodes", str(nodes), "--master-addr", "127.0.0.1",
            "--master-port", str(port)]
    cli = [sys.executable, "-m", "infer", "serve"]
    head = subprocess.Popen(cli + base + ["--node-rank", "0", "--port", str(api)], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    workers = [subprocess.Popen(cli + base + ["--node-rank", str(n), "--headless"], env=_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for n in range(1, nodes)]
    try:
        line = head.stdout.readline()  # the server prints one line once it listens (or dies: EOF)
        assert "on http://" in line, head.stderr.read()[-3000:]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{api}/v1", api_key="x")
        got = client.completions.create(model="smollm2", prompt=prompt, max_tokens=12, temperature=0)
        llm = LLM("smollm2", max_model_len=256)
        want = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)[0]
        assert got.choices[0].text == want.outputs[0].text
    finally:
        stop_server(head)
        for w in workers:  # the driver stopped them: a clean exit
            assert w.wait(60) == 0, w.stderr.read()[-3000:]


def test_server_with_a_dead_rank_answers_503_then_exits_naming_it(tiny_dirs):
    """`infer serve -tp 2`: killing the worker rank turns /health to 503 and the
    server exits non-zero within seconds, saying which rank died."""
    import urllib.error
    import urllib.request

    from infer.core.distributed import free_port

    api = free_port()
    server = subprocess.Popen([sys.executable, "-m", "infer", "serve", "--model", tiny_dirs["llama"], "--backend", "torch",
                               "--max-model-len", "128", "--tensor-parallel-size", "2", "--port", str(api)],
                              env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def health() -> int:
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{api}/health", timeout=5).status
        except urllib.error.HTTPError as exc:
            return exc.code

    try:
        assert "on http://" in server.stdout.readline(), server.stderr.read()[-3000:]
        assert health() == 200
        worker = int(subprocess.run(["pgrep", "-P", str(server.pid), "-f", "infer.core.worker"], capture_output=True,
                                    text=True).stdout.split()[0])
        os.kill(worker, signal.SIGKILL)
        killed = time.monotonic()
        codes = []
        while server.poll() is None and time.monotonic() - killed < 30:
            try:
                codes.append(health())
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.2)
        assert server.wait(5) == 1
        assert time.monotonic() - killed < 15
        assert 503 in codes
        assert f"rank 1 (pid {worker}) exited with code -9" in server.stderr.read()
    finally:
        server.kill()


def test_data_parallel_replicas_behind_one_server(tiny_dirs):
    """--data-parallel-size 2: concurrent requests spread over both replicas (per-replica
    metrics), each answer is what one process generates, and nothing stays in flight."""
    openai = pytest.importorskip("openai")
    import asyncio
    import urllib.request

    from infer.core.distributed import free_port

    api = free_port()
    server = subprocess.Popen([sys.executable, "-m", "infer", "serve", "--model", tiny_dirs["llama"], "--backend", "torch",
                               "--dtype", "float32", "--max-model-len", "128", "--data-parallel-size", "2",
                               "--port", str(api)], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "on http://" in server.stdout.readline(), server.stderr.read()[-3000:]
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{api}/v1", api_key="x")

        async def ask_all():
            return await asyncio.gather(*(client.completions.create(model=tiny_dirs["llama"], prompt=p, max_tokens=8,
                                                                    temperature=0, logprobs=1) for p in PROMPTS * 2))

        answers = asyncio.run(ask_all())
        [one] = generate(tiny_dirs["llama"], {"backend": "torch", "dtype": "float32", "max_model_len": 128})
        for answer, want in zip(answers, one["logprobs"] * 2):
            np.testing.assert_allclose(answer.choices[0].logprobs.token_logprobs, [max(s.values()) for s in want],
                                       atol=1e-4)
        text = urllib.request.urlopen(f"http://127.0.0.1:{api}/metrics").read().decode()
        done = {e: sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("infer:request_success_total{") and f'engine="{e}"' in line) for e in "01"}
        assert done["0"] > 0 and done["1"] > 0 and done["0"] + done["1"] == 2 * len(PROMPTS)
        running = [line for line in text.splitlines() if line.startswith("infer:num_requests_running{")]
        assert len(running) == 2 and all(line.endswith(" 0.0") for line in running)
    finally:
        stop_server(server)


def _check_rank_handles(ray) -> None:
    """`RayRank`: a rank actor watched like a process (poll, wait, kill, exit codes)."""
    from infer.core.ray_executor import RayRank

    @ray.remote(num_cpus=0)
    class Rank:
        def pid(self):
            return os.getpid()

        def run(self, code, wait_s=0.0):
            time.sleep(wait_s)
            if code == "crash":
                raise RuntimeError("rank failed")
            return code

    def start(code, wait_s=0.0):
        actor = Rank.remote()
        pid = ray.get(actor.pid.remote())
        return RayRank(actor, actor.run.remote(code, wait_s), pid)

    done = start(3)
    assert done.wait(60) == 3 and done.poll() == 3 and done.returncode == 3
    assert start("crash").wait(60) == 1  # an exception in the rank is a failure exit
    busy = start(0, wait_s=60)
    assert busy.poll() is None and busy.pid > 0
    with pytest.raises(subprocess.TimeoutExpired):
        busy.wait(0.2)
    busy.kill()
    assert busy.poll() == -9


class _FakeRay:
    """Just enough of the `ray` module for `ray_executor`, recording what it is asked: the
    placement bundles, each actor's options, the actors killed. `results` holds the
    refs that have finished, with their value."""

    def __init__(self):
        self.bundles, self.options, self.killed, self.results = [], [], [], {}

    def modules(self) -> dict:
        """Stand-ins for the submodules `spawn` imports."""
        import types

        groups = types.ModuleType("ray.util.placement_group")
        groups.placement_group = lambda bundles, strategy: self.bundles.extend(bundles) or types.SimpleNamespace(
            ready=lambda: "ready")
        strategies = types.ModuleType("ray.util.scheduling_strategies")
        strategies.PlacementGroupSchedulingStrategy = lambda group, index: ("bundle", index)
        return {"ray.util.placement_group": groups, "ray.util.scheduling_strategies": strategies}

    def remote(self, cls):
        import types

        def options(**kw):
            self.options.append(kw)
            n = len(self.options)
            actor = types.SimpleNamespace(pid=types.SimpleNamespace(remote=lambda: 100 + n),
                                          run=types.SimpleNamespace(remote=lambda spec: f"actor{n}.run"))
            return types.SimpleNamespace(remote=lambda: actor)

        return types.SimpleNamespace(options=options)

    def get(self, ref, timeout=None):
        return self.results.get(ref, ref)

    def wait(self, refs, timeout=None):
        return [r for r in refs if r in self.results], [r for r in refs if r not in self.results]

    def kill(self, actor, no_restart=True):
        self.killed.append(actor)

    def available_resources(self) -> dict:
        return {}


@pytest.mark.parametrize("use_gpus, bundle", [(True, {"GPU": 1}), (False, {"CPU": 1})])
def test_ray_ranks_each_reserve_the_device_or_core_their_actor_runs_on(monkeypatch, use_gpus, bundle):
    """One placement bundle per worker rank, holding what that rank's actor asks for."""
    from infer.core import ray_executor
    from infer.core.distributed import ParallelConfig

    ray = _FakeRay()
    monkeypatch.setattr(ray_executor, "_ray", lambda: ray)
    for name, module in ray.modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    ranks = ray_executor.spawn(ParallelConfig(tensor_parallel_size=3), [1, 2], {}, use_gpus=use_gpus)
    assert [r.pid for r in ranks] == [101, 102]
    assert ray.bundles == [bundle, bundle]
    for options in ray.options:
        assert options["num_gpus"] == bundle.get("GPU", 0) and options["num_cpus"] == bundle.get("CPU", 0)


def test_releasing_ray_ranks_kills_the_actors_still_running(monkeypatch):
    """An actor left running would hold its bundle (a GPU) after the engine stopped."""
    from infer.core import ray_executor
    from infer.core.ray_executor import RayRank

    ray = _FakeRay()
    monkeypatch.setattr(ray_executor, "_ray", lambda: ray)
    running, done = RayRank("actor1", "actor1.run", 101), RayRank("actor2", "actor2.run", 102)
    ray.results["actor2.run"] = 0
    ray_executor.release([running, done])
    assert ray.killed == ["actor1"]
    assert running.returncode == -9 and done.returncode == 0


def test_ray_executor_on_a_local_cluster(tiny_dirs):
    """A Ray cluster the test starts (`ray start --head` on 127.0.0.1; one test, so no
    second cluster runs beside it): rank actors are watched like processes, and worker
    ranks as Ray actors generate the tokens one process does."""
    ray = pytest.importorskip("ray")
    from infer.core.distributed import free_port

    ray_cli = [str(Path(sys.executable).with_name("ray"))]
    port = free_port()
    start = subprocess.run(ray_cli + ["start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port),
                                      "--num-cpus", "2", "--disable-usage-stats", "--include-dashboard=false"],
                           capture_output=True, text=True, timeout=120, env=_env())
    assert start.returncode == 0, start.stderr[-2000:]
    try:
        ray.init(address=f"127.0.0.1:{port}", log_to_driver=False, configure_logging=False)
        try:
            _check_rank_handles(ray)
        finally:
            ray.shutdown()
        engine = {"backend": "torch", "dtype": "float32", "max_model_len": 128}
        [one] = generate(tiny_dirs["llama"], engine)
        os.environ["RAY_ADDRESS"] = f"127.0.0.1:{port}"
        try:
            [ray_run] = generate(tiny_dirs["llama"], engine | {"tensor_parallel_size": 2,
                                                               "distributed_executor_backend": "ray"})
        finally:
            del os.environ["RAY_ADDRESS"]
        assert_same_generation(one, ray_run)
    finally:
        subprocess.run(ray_cli + ["stop", "--force"], capture_output=True, timeout=120)


def test_a_hung_worker_times_the_collectives_out(tiny_dirs):
    """A worker that stops answering (SIGSTOP) makes rank 0's next collective fail after
    INFER_DIST_TIMEOUT_S instead of waiting forever."""
    script = f"""
import os, signal, sys, time
import torch
from infer import LLM, SamplingParams
llm = LLM({tiny_dirs['llama']!r}, backend="torch", tensor_parallel_size=2, skip_tokenizer_init=True, max_model_len=128)
p = SamplingParams(max_tokens=4, temperature=0)
llm.generate([{{"prompt_token_ids": [1, 2, 3]}}], p, use_tqdm=False)
worker = llm.engine.executor.dist.workers[0]
os.kill(worker.pid, signal.SIGSTOP)
start = time.monotonic()
try:
    llm.generate([{{"prompt_token_ids": [1, 2, 3, 4]}}], p, use_tqdm=False)
except RuntimeError as exc:
    print("FAILED", round(time.monotonic() - start, 1), exc, flush=True)
    # Torn down at the failure, not at interpreter exit: the hung rank is stopped, the group left.
    print("TORN DOWN", worker.poll() is not None, torch.distributed.is_initialized(), flush=True)
    try:
        llm.generate([{{"prompt_token_ids": [1, 2]}}], p, use_tqdm=False)
    except RuntimeError as again:
        print("AGAIN", again, flush=True)
    sys.exit(3)
print("NO ERROR")
"""
    env = _env() | {"INFER_DIST_TIMEOUT_S": "5"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 3, proc.stdout + proc.stderr[-2000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("FAILED"))
    assert 4 <= float(line.split()[1]) < 30
    assert "TORN DOWN True False" in proc.stdout, proc.stdout
    again = next(x for x in proc.stdout.splitlines() if x.startswith("AGAIN"))
    assert "a collective with the other ranks failed" in again  # the same reason, at once


def test_gguf_shards_read_only_their_blocks_and_match_the_whole_tensor():
    """The packaged SmolLM2 GGUF (Q4_1): a rank's rows of q (llama.cpp-permuted, unpermuted
    per whole head) and k, and its block-aligned columns of down, equal the same cut of
    the whole tensor, dequantized and as a quantized handle."""
    from infer.core.loader.gguf_file import GGUFCheckpoint
    from infer.core.loader.paths import resolve_model_path
    from infer.core.quant_params import slice_handle
    from infer.primitives.dequant import dequantize

    path, fmt = resolve_model_path("smollm2")
    assert fmt == "gguf"
    ckpt = GGUFCheckpoint(path)
    cases = [("model.layers.0.self_attn.q_proj.weight", 0, 192, 384),  # heads 3-5 of 9 (64 rows each)
             ("model.layers.0.self_attn.k_proj.weight", 0, 64, 128),  # KV head 1 of 3
             ("model.layers.1.mlp.down_proj.weight", 1, 512, 1024),  # input columns: 16 blocks of 32
             ("model.embed_tokens.weight", 0, 16384, 32768)]
    for name, axis, lo, hi in cases:
        cut = (slice(None),) * axis + (slice(lo, hi),)
        whole = ckpt.read(name)
        np.testing.assert_array_equal(ckpt.read_slice(name, axis, lo, hi), whole[cut])
        handle = ckpt.read_quantized_slice(name, axis, lo, hi)
        np.testing.assert_array_equal(dequantize(handle), dequantize(slice_handle(ckpt.read_quantized(name), axis, lo, hi)))
        np.testing.assert_allclose(dequantize(handle), whole[cut], rtol=0, atol=1e-6)
    # a cut through a block falls back to the whole tensor, still exact
    np.testing.assert_array_equal(ckpt.read_slice(cases[2][0], 1, 16, 48), ckpt.read(cases[2][0])[:, 16:48])


def test_each_rank_of_each_replica_gets_its_own_accelerator():
    from infer.core.args import EngineArgs
    from infer.core.executor.rank import device_index

    # 2 replicas of TP2 x PP2 on one node: replica 1's ranks take devices 4-7
    a = EngineArgs(tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_rank=1)
    assert [device_index(a, r) for r in range(4)] == [4, 5, 6, 7]
    # TP8 over 2 nodes: 4 ranks a node, local ranks 0-3 on each
    b = EngineArgs(tensor_parallel_size=8, nnodes=2, node_rank=1)
    assert [device_index(b, r) for r in range(4)] == [0, 1, 2, 3]
    assert device_index(EngineArgs(data_parallel_rank=3), 0) == 3


def test_a_rank_asks_its_backend_which_device_it_takes(monkeypatch):
    """The device of a rank comes from the backend (`Backend.rank_device`), not from device
    names known to the core: an accelerator's rank i takes ``<kind>:i`` (an ``npu:0`` default
    too), a host-memory backend keeps one device for all, and --device wins."""
    from infer.backends.cpu_ref import CpuRefBackend
    from infer.core.args import EngineArgs
    from infer.core.executor import rank

    made = []

    def get_backend(name, device=None):
        made.append(device)
        return CpuRefBackend(device=device or ("npu:0" if name == "chip" else None))

    monkeypatch.setattr(rank, "get_backend", get_backend)
    tp4 = dict(tensor_parallel_size=4)
    assert rank.rank_backend(EngineArgs(backend="chip", **tp4), 2).device == "npu:2"
    assert rank.rank_backend(EngineArgs(backend="chip", **tp4), 0).device == "npu:0"
    host = rank.rank_backend(EngineArgs(backend="cpu_ref", **tp4), 3)
    assert host.device == "cpu" and host.host_memory and host.rank_device(3) is None
    assert rank.rank_backend(EngineArgs(backend="chip", device="npu:7", **tp4), 2).device == "npu:7"
    assert made == [None, "npu:2", None, None, "npu:7"]


class _Replica:
    """An AsyncLLM stand-in: streams two outputs per request and records aborts."""

    def __init__(self):
        self.aborted: list[str] = []
        self.failure = None
        self.dead = None
        self.kv_usage = 0.0

    async def generate(self, request_id, prompt, params, priority=0, lora_request=None):
        async def stream():
            for i in range(2):
                yield (request_id, i)
        return stream()

    def abort(self, request_id):
        self.aborted.append(request_id)

    def shutdown(self, timeout):
        self.stopped = timeout


def test_data_parallel_engine_is_the_first_replicas():
    """What the server reads from `.engine` (tokenizer, limits, chat template) comes from the
    first replica, which every DataParallelLLM has, one replica or many."""
    from infer.core.data_parallel import DataParallelLLM

    replicas = [_Replica(), _Replica()]
    for i, r in enumerate(replicas):
        r.engine = f"engine {i}"
    assert DataParallelLLM(replicas).engine == "engine 0"
    assert DataParallelLLM(replicas[1:]).engine == "engine 1"


def test_data_parallel_routing_and_abort():
    """Requests spread to the least loaded replica; an abort reaches the replica that
    owns the request only, and an id never routed (or already finished) is aborted on
    every replica without error."""
    import asyncio

    from infer.core.data_parallel import DataParallelLLM

    replicas = [_Replica(), _Replica()]
    dp = DataParallelLLM(replicas)

    async def run():
        a = await dp.generate("a", "p", None)
        b = await dp.generate("b", "p", None)
        assert dp.in_flight == [1, 1] and dp._owner == {"a": 0, "b": 1}
        dp.abort("b")
        assert replicas[0].aborted == [] and replicas[1].aborted == ["b"]
        assert [o async for o in a] == [("a", 0), ("a", 1)]
        assert [o async for o in b] == [("b", 0), ("b", 1)]
        assert dp.in_flight == [0, 0] and dp._owner == {}
        dp.abort("never-routed")
        assert replicas[0].aborted == ["never-routed"] and replicas[1].aborted == ["b", "never-routed"]
        assert dp.dead is None and dp.failure is None
        replicas[0].kv_usage, replicas[1].kv_usage = 0.5, 0.25
        d = await dp.generate("d", "p", None)
        assert dp._owner == {"d": 1}  # as many in flight: the replica whose KV pool is emptier
        assert [o async for o in d] == [("d", 0), ("d", 1)]
        replicas[0].failure = "down"
        c = await dp.generate("c", "p", None)
        assert dp._owner == {"c": 1}  # a failed replica gets no new work
        assert dp.failure == "replica 0: down"
        await c.aclose()
        replicas[1].dead = error = RuntimeError("engine thread died")
        assert dp.dead is error
        dp.shutdown(7.0)
        assert [r.stopped for r in replicas] == [7.0, 7.0]

    asyncio.run(run())


def test_fp8_shards_keep_a_per_tensor_scale_and_cut_per_channel_ones():
    """Rows of an fp8 weight: a per-tensor scale ([1]) goes whole to every shard (also past
    row 0), per-channel scales are cut with the rows; columns keep the scales."""
    from infer.core.quant_params import slice_handle
    from infer.primitives.dequant import dequantize
    from infer.primitives.types import Fp8Weight

    rng = np.random.default_rng(0)
    q = rng.integers(0, 0x7F, (6, 8), dtype=np.uint8)  # positive finite e4m3 codes
    for scales in (np.array([0.5], np.float32), rng.random(6).astype(np.float32) + 0.5):
        w = Fp8Weight(q, scales)
        whole = dequantize(w)
        # fp8 has no groups: any column range, odd bounds too, is a valid shard.
        for axis, lo, hi in ((0, 2, 5), (0, 0, 3), (1, 4, 8), (1, 3, 7)):
            cut = (slice(None),) * axis + (slice(lo, hi),)
            np.testing.assert_array_equal(dequantize(slice_handle(w, axis, lo, hi)), whole[cut])


def test_headless_is_refused_on_node_0_and_without_mp(monkeypatch):
    """`--headless` is for nodes 1.. of a multi-node mp job; elsewhere it says so before starting anything."""
    from infer.core import distributed, worker
    from infer.core.engine import EngineArgs

    def started(*a, **k):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(distributed, "_spawn_worker", started)
    monkeypatch.setattr(worker, "main", started)
    where = dict(tensor_parallel_size=2, nnodes=2, master_addr="127.0.0.1", master_port=29999)
    for args in (EngineArgs(**where, node_rank=0),
                 EngineArgs(**where, node_rank=1, distributed_executor_backend="ray")):
        with pytest.raises(ValueError, match="--headless is for the other nodes"):
            worker.run_headless(args)
    with pytest.raises(AssertionError, match="a rank was started"):  # node 1 of an mp job does start its ranks
        worker.run_headless(EngineArgs(**where, node_rank=1))


def test_tp2_swapping_to_the_host_tier_generates_what_one_roomy_process_does(tiny_dirs):
    """A pool too small for the batch: ranks swap their own KV shards to their own tier
    stores (the ops travel with each step) and give the tokens of an unconstrained run."""
    engine = {"backend": "torch", "dtype": "float32", "max_model_len": 64, "block_size": 4}
    [one] = generate(tiny_dirs["llama"], engine | {"num_gpu_blocks_override": 400}, max_tokens=16)
    [two] = generate(tiny_dirs["llama"], engine | {"tensor_parallel_size": 2, "num_gpu_blocks_override": 16,
                                                    "kv_offload_bytes": 1 << 22, "preemption_mode": "swap"},
                     max_tokens=16)
    assert_same_generation(one, two)
    assert two["swapped_out"] > 0 and two["swapped_out"] == two["preemptions"] and one["preemptions"] == 0


def test_the_driver_ends_the_job_on_a_failed_collective_only():
    """A collective that fails inside rank 0's step ends the job (`lost`: the group torn
    down, the reason kept); any other error on rank 0 is the caller's and leaves the ranks
    running; once a rank is known dead, the next call tears the group down before sending."""
    from types import SimpleNamespace

    from infer.core.distributed import CollectiveError
    from infer.core.executor.executor import DriverExecutor

    class Dist:
        config = SimpleNamespace(pipeline_parallel_size=1)
        failed = aborted = None

        def __init__(self):
            self.sent, self.lost_with = [], []

        def broadcast(self, message):
            self.sent.append(message[0])

        def lost(self, exc):
            self.lost_with.append(exc)
            self.aborted = f"rank 0: a collective with the other ranks failed ({exc})"
            return RuntimeError(self.aborted)

    errors = {"execute_model": ValueError("a bad sampling parameter"), "write_lora": CollectiveError("peer gone")}

    class Worker:
        def __getattr__(self, method):
            def call(*args):
                raise errors[method]
            return call

    dist = Dist()
    executor = DriverExecutor(Worker(), dist)
    with pytest.raises(ValueError, match="bad sampling"):
        executor.execute_model(None, None)
    assert dist.sent == ["execute_model"] and not dist.lost_with and executor.failure is None
    with pytest.raises(RuntimeError, match="collective with the other ranks failed"):
        executor.collective_rpc("write_lora", 1, None)
    assert dist.sent == ["execute_model", "write_lora"] and len(dist.lost_with) == 1
    with pytest.raises(RuntimeError, match="collective"):  # the job is over: nothing more is sent
        executor.collective_rpc("allocate_kv", 4, 16)
    assert dist.sent == ["execute_model", "write_lora"] and len(dist.lost_with) == 1

    dist = Dist()
    dist.failed = "rank 1 (pid 7) exited with code -9"  # the monitor saw it die
    executor = DriverExecutor(Worker(), dist)
    with pytest.raises(RuntimeError):
        executor.collective_rpc("allocate_kv", 4, 16)
    assert dist.sent == [] and len(dist.lost_with) == 1  # torn down at once, nothing sent to the dead group
