"""`infer serve` with pooling models beside a generating one, through the official `openai`
client and plain HTTP: embeddings (float and base64) equal sentence-transformers', rerank and
score equal CrossEncoder.predict, bad inputs are 400s naming the field."""

from __future__ import annotations

import base64
import concurrent.futures

import httpx
import numpy as np
import openai
import pytest

from server_harness import Server, make_tiny_model_dir, metric
from tiny_pooling import save_cross_encoder, save_embedding_model, sentences, st_encode, st_predict

TEXTS = sentences(10, seed=5, min_words=2, max_words=50)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("pool-serve")
    embed = save_embedding_model(root / "embed", "bert", "mean", True, max_position_embeddings=64)
    rerank = save_cross_encoder(root / "rerank", "xlm-roberta")
    chat = make_tiny_model_dir(root / "chat")
    srv = Server(["--backend", "torch", "--dtype", "float32", "--model", str(chat), "--served-model-name", "chat",
                  "--model", embed, "--served-model-name", "embed", "--model", rerank, "--served-model-name", "rerank"])
    yield srv, embed, rerank
    srv.stop()


def _client(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def test_openai_client_embeddings_equal_sentence_transformers(served):
    srv, embed, _ = served
    want = st_encode(embed, TEXTS)
    client = _client(srv)
    # Not given: the client asks for base64 and decodes it itself; asked for base64, it hands back the text.
    for fmt in (None, "float", "base64"):
        kw = {} if fmt is None else {"encoding_format": fmt}
        res = client.embeddings.create(model="embed", input=TEXTS, **kw)
        rows = [d.embedding for d in sorted(res.data, key=lambda d: d.index)]
        if fmt == "base64":
            rows = [np.frombuffer(base64.b64decode(r), "<f4") for r in rows]
        got = np.array(rows, np.float64)
        cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
        assert cos.min() >= 0.99999, fmt
        assert res.usage.prompt_tokens == res.usage.total_tokens > len(TEXTS)
    one = client.embeddings.create(model="embed", input=TEXTS[0])
    assert len(one.data) == 1 and np.allclose(one.data[0].embedding, want[0], atol=2e-5)


def test_embeddings_beside_generation_change_nothing(served):
    """Embedding requests racing each other and chat completions to the other model."""
    srv, embed, _ = served
    want = st_encode(embed, TEXTS)
    client = _client(srv)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        chats = [pool.submit(client.completions.create, model="chat", prompt="Once upon", max_tokens=8)
                 for _ in range(3)]
        embs = [pool.submit(client.embeddings.create, model="embed", input=[t], encoding_format="float")
                for t in TEXTS]
        got = np.array([f.result().data[0].embedding for f in embs])
        assert all(c.result().choices[0].text for c in chats)
    np.testing.assert_allclose(got, want, atol=2e-5)


def test_rerank_and_score_equal_cross_encoder_predict(served):
    srv, _, rerank = served
    query, docs = TEXTS[0], TEXTS[1:7]
    want = st_predict(rerank, [(query, d) for d in docs])
    with srv.client() as c:
        for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
            r = c.post(path, json={"model": "rerank", "query": query, "documents": docs, "top_n": 3})
            assert r.status_code == 200, r.text
            results = r.json()["results"]
            assert [x["index"] for x in results] == list(np.argsort(-want)[:3])
            np.testing.assert_allclose([x["relevance_score"] for x in results], np.sort(want)[::-1][:3], atol=1e-5)
            assert results[0]["document"]["text"] == docs[results[0]["index"]]
        r = c.post("/rerank", json={"model": "rerank", "query": query, "documents": [{"text": d} for d in docs],
                                    "return_documents": False})
        assert len(r.json()["results"]) == len(docs) and "document" not in r.json()["results"][0]
        r = c.post("/v1/score", json={"model": "rerank", "text_1": query, "text_2": docs})
        assert r.status_code == 200, r.text
        np.testing.assert_allclose([d["score"] for d in r.json()["data"]], want, atol=1e-5)
        # An embedding model scores by cosine.
        r = c.post("/score", json={"model": "embed", "text_1": [query, query], "text_2": docs[:2]})
        assert r.status_code == 200 and len(r.json()["data"]) == 2 and all(-1 <= d["score"] <= 1 for d in r.json()["data"])
        r = c.post("/classify", json={"model": "rerank", "input": docs[:2]})
        assert r.status_code == 200 and r.json()["data"][0]["num_classes"] == 1


def test_bad_pooling_requests_are_400s_naming_the_field(served):
    srv, _, _ = served
    long = " ".join(["the"] * 100)
    cases = [
        ("/v1/embeddings", {"model": "embed", "input": []}, "input"),
        ("/v1/embeddings", {"model": "embed", "input": long}, "input"),
        ("/v1/embeddings", {"model": "embed", "input": "x", "dimensions": 8}, "dimensions"),
        ("/v1/embeddings", {"model": "embed", "input": "x", "encoding_format": "int8"}, "encoding_format"),
        ("/v1/embeddings", {"model": "chat", "input": "x"}, "model"),
        ("/v1/embeddings", {"model": "rerank", "input": "x"}, "model"),
        ("/v1/rerank", {"model": "rerank", "query": "x", "documents": []}, "documents"),
        ("/v1/score", {"model": "rerank", "text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_1"),
        ("/v1/chat/completions", {"model": "embed", "messages": [{"role": "user", "content": "hi"}]}, "model"),
    ]
    with srv.client() as c:
        for path, body, field in cases:
            r = c.post(path, json=body)
            assert r.status_code == 400, (path, body, r.text)
            assert r.json()["error"]["param"] == field, (path, body, r.json())
        ok = c.post("/v1/embeddings", json={"model": "embed", "input": long, "truncate_prompt_tokens": 16})
        assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == 16
    samples = srv.metrics()
    assert metric(samples, "infer:pooling_requests_total", "embed") > 0
    assert metric(samples, "infer:generation_tokens_total", "embed") == 0
