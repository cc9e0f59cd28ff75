"""SmolLM2's Q4_1 GGUF kept quantized against the same file dequantized to fp32.

The reference greedily generates 64 tokens for each of 8 prompts; the
quantized model then reads each reference sequence (teacher forcing, so one
early difference does not count 64 times) and its top-1 token is compared
at each of those 64 positions. Perplexity of both on a fixed text as well.
"""

from __future__ import annotations

import numpy as np
import pytest

from infer.core.loader import load_model
from infer.core.lowering import lower
from infer.core.model_runner import ModelRunner
from infer.core.models.llama import build_llama
from infer.dispatch import Ops
from infer.registry import get_backend

from conftest import require_smollm2
from tiny_models import meta_for

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "Water boils at a temperature of", "To make a cup of tea, first",
           "The largest planet in the solar system", "Machine learning is"]
TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
        "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, "
        "it was the season of Darkness, it was the spring of hope, it was the winter of despair, we had everything "
        "before us, we had nothing before us, we were all going direct to Heaven, we were all going direct the "
        "other way. In short, the period was so far like the present period, that some of its noisiest authorities "
        "insisted on its being received, for good or for evil, in the superlative degree of comparison only.")
NEW_TOKENS, BLOCK, BLOCKS_PER_SEQ = 64, 16, 12


class Model:
    def __init__(self, m, quantized: bool, dtype: str):
        self.backend = get_backend("torch")
        self.runner = ModelRunner(lower(build_llama(m.config)), self.backend, Ops(self.backend),
                                  m.lazy_weights(quantized=quantized), dtype, 1024)
        self.runner.allocate_kv_caches(num_blocks=BLOCKS_PER_SEQ * len(PROMPTS), block_size=BLOCK)
        self.tables = [list(range(i * BLOCKS_PER_SEQ, (i + 1) * BLOCKS_PER_SEQ)) for i in range(len(PROMPTS))]

    def step(self, chunks, ids, rows):
        """Logits of `rows` after adding `ids` (chunk b: q tokens after c cached ones)."""
        b = self.backend
        meta = meta_for(chunks, BLOCK, self.tables[:len(chunks)])
        positions = np.concatenate([np.arange(c, c + q) for c, q in chunks])
        out = self.runner.forward(b.asarray(np.asarray(ids)), b.asarray(positions), b.asarray(np.asarray(rows)),
                                  self.runner.prepare_metadata(meta)).logits
        return b.to_numpy(out).astype(np.float64)

    def greedy(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        seqs = [list(p) for p in prompts]
        ends = np.cumsum([len(p) for p in prompts]) - 1
        nxt = self.step([(0, len(p)) for p in prompts], np.concatenate(prompts), ends).argmax(-1)
        for _ in range(n - 1):
            chunks = [(len(s), 1) for s in seqs]
            for s, t in zip(seqs, nxt):
                s.append(int(t))
            nxt = self.step(chunks, nxt, np.arange(len(seqs))).argmax(-1)
        for s, t in zip(seqs, nxt):
            s.append(int(t))
        return seqs

    def decode_hits(self, prompts: list[list[int]], seqs: list[list[int]]) -> np.ndarray:
        """Teacher-forced decode: after each prompt, one reference token per step for all
        sequences at once (the decode path: a few rows per step); whether each step's top-1
        is the reference's next token."""
        hits = [self.step([(0, len(p)) for p in prompts], np.concatenate(prompts),
                          np.cumsum([len(p) for p in prompts]) - 1).argmax(-1) == [s[len(p)] for p, s in zip(prompts, seqs)]]
        for i in range(NEW_TOKENS - 1):
            ids = [s[len(p) + i] for p, s in zip(prompts, seqs)]
            top = self.step([(len(p) + i, 1) for p in prompts], np.asarray(ids), np.arange(len(seqs))).argmax(-1)
            hits.append(top == [s[len(p) + i + 1] for p, s in zip(prompts, seqs)])
        return np.concatenate(hits)

    def all_logits(self, seqs: list[list[int]]) -> list[np.ndarray]:
        """Every position's logits of every sequence, in one prefill step."""
        total = sum(len(s) for s in seqs)
        out = self.step([(0, len(s)) for s in seqs], np.concatenate(seqs), np.arange(total))
        return np.split(out, np.cumsum([len(s) for s in seqs])[:-1])

    def perplexity(self, ids: list[int]) -> float:
        logits = self.all_logits([ids])[0][:-1]
        top = logits.max(-1, keepdims=True)
        logz = np.log(np.exp(logits - top).sum(-1)) + top[:, 0]
        return float(np.exp(np.mean(logz - logits[np.arange(len(ids) - 1), ids[1:]])))


def test_smollm2_kept_quantized_agrees_with_dequantized_fp32():
    """float32: exact quantized kernels, so agreement must be >= 99% (the
    issue's bar). bfloat16 (the fast CPU path) also rounds activations to
    bf16; its bar is lower and its figure is reported. One test, so the
    reference is generated once whatever the xdist split."""
    require_smollm2()
    m = load_model("smollm2", load_weights=False)
    prompts = [m.tokenizer(p)["input_ids"] for p in PROMPTS]
    ref = Model(m, quantized=False, dtype="float32")
    seqs = ref.greedy(prompts, NEW_TOKENS)
    text = m.tokenizer(TEXT)["input_ids"][:BLOCK * BLOCKS_PER_SEQ]
    # The harness itself: reading its own greedy sequences back, the reference predicts them.
    own = [lg[len(p) - 1:-1].argmax(-1) == s[len(p):] for p, s, lg in zip(prompts, seqs, ref.all_logits(seqs))]
    assert np.mean(np.concatenate(own)) >= 0.99
    ref_ppl = ref.perplexity(text)
    del ref
    for dtype, min_agreement in (("float32", 0.99), ("bfloat16", 0.95)):
        quant = Model(m, quantized=True, dtype=dtype)
        kinds = {h.kind for h in quant.runner._handles.values()}
        assert kinds == {"int4_group", "int8_group"}, kinds  # Q4_1 projections, Q8_0 tied lm_head
        hits = [lg[len(p) - 1:-1].argmax(-1) == s[len(p):] for p, s, lg in zip(prompts, seqs, quant.all_logits(seqs))]
        agreement = float(np.mean(np.concatenate(hits)))
        decode = float(np.mean(quant.decode_hits(prompts, seqs)))  # the same positions through the decode kernels
        ppl = quant.perplexity(text)
        print(f"\nSmolLM2 Q4_1 kept quantized ({dtype}) vs dequantized fp32: top-1 agreement {agreement:.2%} over "
              f"{len(PROMPTS)}x{NEW_TOKENS} greedy tokens ({decode:.2%} decoding them one step at a time); "
              f"perplexity {ppl:.4f} vs {ref_ppl:.4f} ({ppl / ref_ppl - 1:+.3%})")
        assert agreement >= min_agreement and decode >= min_agreement, dtype
        assert abs(ppl / ref_ppl - 1) < 0.01, dtype
