"""Multi-LoRA: PEFT adapters made with `peft` (random weights, ``init_lora_weights=False``)
on the tiny Llama; infer's greedy tokens must equal transformers' with each adapter
merged into the model, with several adapters and the base model in one batch."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from test_engine import VOCAB, Tiny, generate, make_llm, tiny  # noqa: F401  (fixtures)

from infer.core.lora import LoRAError, LoRARequest, load_adapter, parse_lora_modules
from infer.core.sampling_params import SamplingParams

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (name, rank, alpha, targets, rslora): different ranks, scalings and module sets.
SPECS = [
    ("all8", 8, 16, ALL, False),
    ("attn4", 4, 8, ["q_proj", "v_proj"], False),
    ("mlp16", 16, 32, ["gate_proj", "up_proj", "down_proj"], True),
    ("ko2", 2, 4, ["k_proj", "o_proj"], False),
]


def make_adapter(base, path, r, alpha, targets, rslora, seed, bf16=False, **config):
    """Save a random PEFT adapter to `path` (its weights as bfloat16 with `bf16`); return
    the base model with it merged."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=r, lora_alpha=alpha, target_modules=targets,
                                                            init_lora_weights=False, use_rslora=rslora, **config))
    with torch.no_grad():  # peft's random B is small; make every adapter move the tokens
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(4.0)
            if "lora_" in name and bf16:
                p.data = p.data.to(torch.bfloat16)
    model.save_pretrained(path)
    if bf16:
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.data = p.data.float()
    return model.merge_and_unload()


@pytest.fixture(scope="module")
def adapters(tiny, tmp_path_factory):
    """name -> (LoRARequest, Tiny of the merged model)."""
    out = {}
    for i, (name, r, alpha, targets, rslora) in enumerate(SPECS):
        path = tmp_path_factory.mktemp(f"lora-{name}")
        merged = make_adapter(tiny.model, path, r, alpha, targets, rslora, seed=100 + i)
        out[name] = (LoRARequest(name, i + 1, str(path)), Tiny(merged, path))
    return out


_rng = np.random.default_rng(7)
PROMPTS = [_rng.integers(3, VOCAB, n).tolist() for n in (9, 23, 4, 31, 14, 17)]


@pytest.mark.parametrize("backend", ["torch", "cpu_ref"])
def test_adapters_and_base_in_one_batch_match_merged_transformers(make_llm, tiny, adapters, backend):
    llm = make_llm(backend=backend, enable_lora=True, max_loras=4, max_lora_rank=16)
    names = [None, "all8", "attn4", "mlp16", "ko2", "all8"]
    loras = [adapters[n][0] if n else None for n in names]
    got = generate(llm, PROMPTS, lora_request=loras)
    want = [(adapters[n][1] if n else tiny).greedy(p, 12) for n, p in zip(names, PROMPTS)]
    assert got == want
    # The adapters do change the tokens (so equality above is about them).
    assert all(adapters[n][1].greedy(PROMPTS[1], 12) != tiny.greedy(PROMPTS[1], 12) for n in ("all8", "attn4"))


def test_more_adapters_than_slots_wait_their_turn(make_llm, tiny, adapters):
    llm = make_llm(enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=2)
    names = ["all8", "attn4", "mlp16", "ko2", None, "mlp16"]
    got = generate(llm, PROMPTS, lora_request=[adapters[n][0] if n else None for n in names])
    assert got == [(adapters[n][1] if n else tiny).greedy(p, 12) for n, p in zip(names, PROMPTS)]
    manager = llm.engine.lora
    assert manager.loads >= 4 and len(manager.host) <= 2  # slots reused, host copies evicted and read again


def test_prefix_cache_never_shares_blocks_between_adapters(make_llm, tiny, adapters):
    llm = make_llm(enable_lora=True, max_loras=2, max_lora_rank=16, block_size=4)
    prompt = PROMPTS[3]
    base = generate(llm, [prompt])[0]
    tuned = generate(llm, [prompt], lora_request=adapters["all8"][0])[0]
    again = generate(llm, [prompt], lora_request=adapters["all8"][0])[0]
    assert base == tiny.greedy(prompt, 12) and tuned == again == adapters["all8"][1].greedy(prompt, 12)
    stats = llm.engine.scheduler.block_manager.prefix_cache_stats
    assert stats.hits == 28  # only the second adapter request hit (7 full blocks), not the base's blocks


def test_lora_needs_enable_lora_and_bad_adapters_fail_their_request(make_llm, tiny, adapters, tmp_path):
    plain = make_llm()
    out = plain.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=2),
                         lora_request=adapters["all8"][0], use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "error" and "enable_lora" in out.error
    llm = make_llm(enable_lora=True, max_loras=1, max_lora_rank=4)
    too_big = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=2),
                           lora_request=adapters["all8"][0], use_tqdm=False)[0]
    assert too_big.outputs[0].finish_reason == "error" and "max_lora_rank" in too_big.error
    missing = LoRARequest("nope", 9, str(tmp_path / "absent"))
    with pytest.raises(LoRAError, match="adapter_config.json"):
        llm.engine.add_request("x", {"prompt_token_ids": PROMPTS[0]}, lora_request=missing)
    # An unsupported target module is named.
    src = adapters["attn4"][0].lora_path
    bad = tmp_path / "bad"
    bad.mkdir()
    from safetensors.numpy import load_file, save_file

    tensors = load_file(f"{src}/adapter_model.safetensors")
    tensors["base_model.model.lm_head.lora_A.weight"] = np.zeros((4, 8), np.float32)
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    (bad / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "peft_type": "LORA"}))
    with pytest.raises(LoRAError, match="lm_head"):
        load_adapter(bad, "bad", 16)
    with pytest.raises(ValueError, match="enable_lora"):
        make_llm(lora_modules=("a=/x",))


def test_lora_modules_parse_like_vllm():
    reqs = parse_lora_modules(["sql=/a/b", '{"name": "chat", "path": "/c"}'])
    assert [(r.lora_name, r.lora_int_id, r.lora_path) for r in reqs] == [("sql", 1, "/a/b"), ("chat", 2, "/c")]
    with pytest.raises(ValueError, match="name=path"):
        parse_lora_modules(["justaname"])
    with pytest.raises(ValueError, match="unique"):
        parse_lora_modules(["a=/x", "a=/y"])


def test_bf16_adapters_and_peft_alpha_patterns(make_llm, tiny, tmp_path):
    """A bfloat16-saved adapter reads exactly; alpha_pattern scales as PEFT does."""
    bf16 = make_adapter(tiny.model, tmp_path / "bf16", 8, 16, ALL, False, seed=31, bf16=True)
    pattern = make_adapter(tiny.model, tmp_path / "pattern", 4, 8, ALL, False, seed=32,
                           alpha_pattern={"q_proj": 64, "model.layers.1.mlp.down_proj": 2})
    llm = make_llm(enable_lora=True, max_loras=2, max_lora_rank=8)
    got = generate(llm, PROMPTS[:2], lora_request=[LoRARequest("bf16", 1, str(tmp_path / "bf16")),
                                                   LoRARequest("pattern", 2, str(tmp_path / "pattern"))])
    assert got == [Tiny(bf16, "").greedy(PROMPTS[0], 12), Tiny(pattern, "").greedy(PROMPTS[1], 12)]


def test_an_adapter_of_another_model_fails_its_request_and_the_engine_lives(make_llm, tiny, tmp_path):
    import transformers

    other = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1))
    make_adapter(other, tmp_path / "other", 4, 8, ALL, False, seed=1)
    llm = make_llm(enable_lora=True, max_loras=1, max_lora_rank=8)
    outs = llm.generate([{"prompt_token_ids": PROMPTS[0]}] * 2, SamplingParams(max_tokens=3, ignore_eos=True),
                        lora_request=[LoRARequest("other", 1, str(tmp_path / "other")), None], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error" and "another base model" in outs[0].error
    assert len(outs[1].outputs[0].token_ids) == 3


def test_a_name_loaded_again_is_another_adapter_and_running_requests_keep_theirs(make_llm, tiny, adapters):
    """Unload 'x' (adapter all8) while a request runs on it, load 'x' again from attn4: the
    running request finishes with all8, the new one runs attn4, and no prefix block is shared."""
    llm = make_llm(enable_lora=True, max_loras=1, max_lora_rank=16, max_cpu_loras=1)
    engine, manager = llm.engine, llm.engine.lora
    first = LoRARequest("x", 1, adapters["all8"][0].lora_path)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": PROMPTS[3]}, params, lora_request=first)
    engine.step()
    manager.unregister("x")
    assert first in manager.host  # still in use: kept
    with pytest.raises(LoRAError, match="unloaded"):
        manager.register(first)
    second = LoRARequest("x", manager.next_id(), adapters["attn4"][0].lora_path)
    engine.add_request("b", {"prompt_token_ids": PROMPTS[3]}, params, lora_request=second)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert done["a"] == adapters["all8"][1].greedy(PROMPTS[3], 12)
    assert done["b"] == adapters["attn4"][1].greedy(PROMPTS[3], 12)
    assert first not in manager.host and not manager.users  # the unloaded one's memory went with its last request
    assert engine.scheduler.block_manager.prefix_cache_stats.hits == 0
