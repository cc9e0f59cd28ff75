"""Multi-LoRA on the real SmolLM2: four random PEFT adapters (made with `peft` on
transformers' SmolLM2 holding the very weights infer loads) and the base model in one
batch; each request's greedy tokens equal transformers' with its adapter merged."""

from __future__ import annotations

import pytest
import torch
from test_lora import ALL, make_adapter
from test_smollm2 import hf_model  # noqa: F401  (fixture)

from infer.core.llm import LLM
from infer.core.lora import LoRARequest
from infer.core.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
NUM_TOKENS = 20
SPECS = [("all16", 16, 32, ALL), ("attn8", 8, 16, ["q_proj", "k_proj", "v_proj", "o_proj"]),
         ("mlp8", 8, 8, ["gate_proj", "up_proj", "down_proj"]), ("qv4", 4, 16, ["q_proj", "v_proj"])]
TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
         "The three primary colors are", "Water boils at"]


def _greedy(model, ids: list[int]) -> list[int]:
    t = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(t, attention_mask=torch.ones_like(t), do_sample=False, max_new_tokens=NUM_TOKENS,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_four_adapters_and_the_base_in_one_batch_match_merged_transformers(hf_model, tmp_path, leak_check):
    torch.set_num_threads(1)
    llm = LLM("smollm2", backend="torch", dtype="float32", max_model_len=512, enable_lora=True, max_loras=4,
              max_lora_rank=16)
    leak_check.append(llm.engine)
    tok = llm.get_tokenizer()
    prompts = [tok(t).input_ids for t in TEXTS]
    merged, loras = {None: hf_model}, {None: None}
    for i, (name, r, alpha, targets) in enumerate(SPECS):
        merged[name] = make_adapter(hf_model, tmp_path / name, r, alpha, targets, False, seed=7 + i).eval()
        loras[name] = LoRARequest(name, i + 1, str(tmp_path / name))
    names = [None, "all16", "attn8", "mlp8", "qv4"]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=[loras[n] for n in names])
    got = [o.outputs[0].token_ids for o in outs]
    want = [_greedy(merged[n], p) for n, p in zip(names, prompts)]
    assert got == want
    # Every adapter moved the tokens away from the base model's.
    assert all(_greedy(merged[n], p) != _greedy(hf_model, p) for n, p in zip(names[1:], prompts[1:]))
