"""Pooling models against sentence-transformers (nobody here wrote it): embeddings equal
`SentenceTransformer.encode`, cross-encoder scores equal `CrossEncoder.predict`, batching
changes nothing, bad inputs are refused naming the field."""

from __future__ import annotations

import numpy as np
import pytest


from infer import LLM  # noqa: E402
from infer.core.pooling import PoolingParams  # noqa: E402
from tiny_pooling import save_cross_encoder, save_embedding_model, sentences, st_encode, st_predict  # noqa: E402

TEXTS = sentences(12, seed=3, min_words=1, max_words=60)


def _cosines(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("pooling")
    made = {}

    def get(kind: str, arch: str, pooling: str = "mean", normalize: bool = True, **cfg) -> str:
        key = (kind, arch, pooling, normalize, tuple(sorted(cfg.items())))
        if key not in made:
            path = root / "-".join(map(str, key[:4])) / str(len(made))
            made[key] = (save_embedding_model(path, arch, pooling, normalize, **cfg) if kind == "embed"
                         else save_cross_encoder(path, arch, **cfg))
        return made[key]

    return get


@pytest.mark.parametrize("arch, pooling, normalize", [
    ("bert", "mean", True), ("bert", "cls", True), ("bert", "max", False), ("xlm-roberta", "mean", True),
    ("xlm-roberta", "cls", False), ("qwen3", "lasttoken", True), ("qwen2", "mean", True)])
def test_embeddings_equal_sentence_transformers(models, arch, pooling, normalize):
    path = models("embed", arch, pooling, normalize)
    want = st_encode(path, TEXTS, batch_size=4)
    llm = LLM(path, backend="torch", dtype="float32")
    outs = llm.embed(TEXTS, use_tqdm=False)
    got = np.array([o.outputs.embedding for o in outs])
    assert got.shape == want.shape
    assert _cosines(got, want).min() >= 0.99999
    np.testing.assert_allclose(got, want, atol=2e-5 * max(1.0, float(np.abs(want).max())))
    if normalize:
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_the_reference_backend_gives_the_same_embeddings(models):
    path = models("embed", "bert", "mean", True)
    want = st_encode(path, TEXTS[:4])
    got = [o.outputs.embedding for o in LLM(path, backend="cpu_ref", dtype="float32").embed(TEXTS[:4], use_tqdm=False)]
    assert _cosines(got, want).min() >= 0.99999


@pytest.mark.parametrize("arch", ["bert", "xlm-roberta", "qwen3"])
def test_rerank_scores_equal_cross_encoder_predict(models, arch):
    path = models("score", arch)
    query, docs = TEXTS[0], TEXTS[1:9]
    want = st_predict(path, [(query, d) for d in docs])
    llm = LLM(path, backend="torch", dtype="float32")
    got = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_batching_with_other_lengths_changes_nothing(models):
    path = models("embed", "qwen3", "lasttoken", True)  # a decoder: its scratch KV blocks are shared per step
    llm = LLM(path, backend="torch", dtype="float32", max_num_batched_tokens=256)
    alone = [llm.embed(t, use_tqdm=False)[0].outputs.data for t in TEXTS[:5]]
    together = [o.outputs.data for o in llm.embed(TEXTS * 3, use_tqdm=False)]  # several steps of mixed lengths
    for i, a in enumerate(alone):
        for j in (i, i + len(TEXTS), i + 2 * len(TEXTS)):
            np.testing.assert_allclose(together[j], a, atol=1e-6)


def test_embedding_models_score_by_cosine(models):
    path = models("embed", "bert", "mean", True)
    both = st_encode(path, TEXTS[:4])
    a, b = both[:1], both[1:]
    want = (b @ a[0]) / np.linalg.norm(b, axis=1) / np.linalg.norm(a[0])
    got = [o.outputs.score for o in LLM(path, backend="torch", dtype="float32").score(TEXTS[0], TEXTS[1:4],
                                                                                       use_tqdm=False)]
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_bad_inputs_are_refused_naming_the_problem(models):
    path = models("embed", "bert", "cls", True, max_position_embeddings=32)
    llm = LLM(path, backend="torch", dtype="float32")
    long = " ".join(["the"] * 60)
    empty, too_long, ok = llm.embed([{"prompt_token_ids": []}, long, "hello world"], use_tqdm=False)
    assert "empty" in empty.error and empty.outputs is None
    assert "more than 32" in too_long.error and "truncate_prompt_tokens" in too_long.error
    assert ok.error is None and len(ok.outputs.embedding) == 64
    cut = llm.embed(long, truncate_prompt_tokens=20, use_tqdm=False)[0]
    assert cut.error is None and len(cut.prompt_token_ids) == 20
    dims = llm.embed("hello", PoolingParams(dimensions=8), use_tqdm=False)[0]
    assert "dimensions" in dims.error and "Matryoshka" in dims.error
    assert "serves task 'embed', not 'classify'" in llm.classify("hello", use_tqdm=False)[0].error
    with pytest.raises(ValueError, match="pooling model"):
        llm.generate("hello")


def test_matryoshka_dimensions_cut_then_normalise(models, tmp_path):
    import json
    import shutil

    path = tmp_path / "mrl"
    shutil.copytree(models("embed", "bert", "mean", True), path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "matryoshka_dimensions": [16, 32, 64]}))
    want = st_encode(str(path), TEXTS[:3], truncate_dim=16)
    assert want.shape == (3, 16)
    llm = LLM(str(path), backend="torch", dtype="float32")
    got = [o.outputs.embedding for o in llm.embed(TEXTS[:3], PoolingParams(dimensions=16), use_tqdm=False)]
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert _cosines(got, want).min() >= 0.99999
    assert "must be one of [16, 32, 64]" in llm.embed("x", PoolingParams(dimensions=10), use_tqdm=False)[0].error


def test_encoder_and_classifier_programs_export_to_onnx(models, tmp_path, capsys):
    import onnx

    from infer.cli import main

    for kind, arch, ops in (("embed", "bert", {"EncoderAttention", "LayerNorm", "Activation", "Pool"}),
                            ("score", "xlm-roberta", {"EncoderAttention", "Pool", "Linear"})):
        out = tmp_path / f"{arch}.onnx"
        assert main(["graph", "--model", models(kind, arch), "--onnx", str(out)]) == 0
        graph = onnx.load(str(out)).graph
        assert ops <= {n.op_type for n in graph.node}
        assert graph.output[0].name.startswith("pooled")
        assert "Attention" not in {n.op_type for n in graph.node}  # an encoder has no paged attention


def test_encoders_allocate_no_kv_cache_and_decoders_only_one_steps_scratch(models):
    enc = LLM(models("embed", "bert", "mean", True), backend="torch", dtype="float32")
    assert enc.engine.worker.runner.kv_caches == [] and enc.engine.num_blocks == 0
    dec = LLM(models("embed", "qwen3", "lasttoken", True), backend="torch", dtype="float32",
              max_num_batched_tokens=256, max_num_seqs=4)
    bs = dec.engine.block_size
    assert dec.engine.num_blocks == -(-256 // bs) + 4  # one step's tokens, a partial block per input
    assert len(dec.engine.worker.runner.kv_caches) == 2  # its layers' pages, no more
    dec.embed(TEXTS, use_tqdm=False)
    assert not dec.engine.has_unfinished_requests() and not dec.engine.waiting


def test_infer_run_prints_a_pooling_models_embedding(models, capsys):
    import json

    from infer.cli import main

    path = models("embed", "bert", "mean", True)
    assert main(["run", "--model", path, "--backend", "torch", "--dtype", "float32", TEXTS[0]]) == 0
    out, err = capsys.readouterr()
    want = st_encode(path, [TEXTS[0]])[0]
    np.testing.assert_allclose(json.loads(out.strip().splitlines()[-1]), want, atol=2e-5)
    assert "embedding of 64 dims" in err


def test_a_causal_lm_saved_by_sentence_transformers_is_served_as_an_embedding_model(models, tmp_path):
    """Qwen3-Embedding's layout: architectures names the causal LM, modules.json says how to pool."""
    import json
    import shutil

    path = tmp_path / "qwen3-embedding"
    shutil.copytree(models("embed", "qwen3", "lasttoken", True), path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "architectures": ["Qwen3ForCausalLM"]}))
    want = st_encode(str(path), TEXTS[:4])
    got = [o.outputs.embedding for o in LLM(str(path), backend="torch", dtype="float32").embed(TEXTS[:4],
                                                                                              use_tqdm=False)]
    assert _cosines(got, want).min() >= 0.99999
    with pytest.raises(KeyError, match="checkpoint lacks lm_head.weight"):
        LLM(str(path), backend="torch", runner="generate")  # no head to generate with: said, not garbage
