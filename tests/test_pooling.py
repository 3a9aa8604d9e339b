"""Pooling models (runner="pooling"): embeddings and reranker scores equal transformers' float32
ones, offline (`LLM.embed`, `LLM.score`, `LLM.classify`) and over HTTP (/v1/embeddings through
the `openai` client, /v1/score, /v1/rerank); a pooling request holds no pages once answered; bad
requests are refused naming the fault and the engine goes on."""

from __future__ import annotations

import json

import httpx
import numpy as np
import openai
import pytest
import torch
import transformers

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.pooling import PoolerConfig
from jaxinfer.pooling_params import PoolingParams
from jaxinfer.server.app import build_app
from http_server import running
from tiny_models import FAMILIES, build_hf_model, byte_tokenizer

SETTINGS = dict(runner="pooling", max_model_len=64, page_size=4, num_pages=64, max_num_batched_tokens=16, max_num_seqs=4,
                progress=False)
PROMPTS = ["a prompt longer than one sixteen-token step", "short", "a third one, of middling size"]


def _random_base_model():
    """A tiny Llama base model (no LM head: what AutoModel saves, as Qwen3-Embedding ships)."""
    cls, kw = FAMILIES["llama3.2"]
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(cls(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight") else torch.randn_like(p) / p.shape[-1] ** 0.5)
    return model


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    """(folder, transformers model): a sentence-transformers folder pooling MEAN and normalizing,
    trained (so its config says) to truncate to 32 dimensions."""
    folder = tmp_path_factory.mktemp("embedder")
    model = _random_base_model()
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [32, 64]}))
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64,
                                                                  "pooling_mode_mean_tokens": True}))
    return folder, model


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    """(folder, transformers model): a one-label LlamaForSequenceClassification (a cross-encoder)."""
    folder = tmp_path_factory.mktemp("reranker")
    cls, kw = FAMILIES["llama3.2"]
    torch.manual_seed(1)
    model = transformers.LlamaForSequenceClassification(cls(**kw, num_labels=1)).eval()
    with torch.no_grad():
        base = build_hf_model("llama3.2", seed=1).model
        model.model.load_state_dict(base.state_dict())
        model.score.weight.copy_(torch.randn_like(model.score.weight) * 0.5)
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder, model


@pytest.fixture(scope="module")
def embed_llm(embedder):
    return LLM(str(embedder[0]), **SETTINGS)


@pytest.fixture(scope="module")
def rerank_llm(reranker):
    return LLM(str(reranker[0]), **SETTINGS)


def _truth(model, ids, pooling: str, dimensions=None) -> np.ndarray:
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0].double().numpy()  # [T, H], after the final norm
    v = hidden.mean(0) if pooling == "MEAN" else hidden[-1]
    v = v[:dimensions] if dimensions else v
    return v / np.linalg.norm(v)


def test_embeddings_equal_transformers_pooled_as_configured_or_as_asked(embedder, embed_llm):
    _, model = embedder
    tokenizer = byte_tokenizer()
    for params, pooling, dims in ((None, "MEAN", None), (PoolingParams(pooling_type="LAST"), "LAST", None),
                                  (PoolingParams(dimensions=32), "MEAN", 32)):
        outs = embed_llm.embed(PROMPTS, params, use_tqdm=False)  # the first prompt runs in three chunks
        for prompt, out in zip(PROMPTS, outs):
            ids = tokenizer(prompt)["input_ids"]
            assert out.prompt_token_ids == ids and out.finished
            np.testing.assert_allclose(out.outputs.embedding, _truth(model, ids, pooling, dims), atol=1e-4)


def test_a_pooling_request_holds_no_pages_once_answered(embed_llm):
    embed_llm.embed(PROMPTS * 2, use_tqdm=False)
    stats = embed_llm.engine.get_stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.kv_cache_usage == 0.0 and stats.kv_pages_in_use_by_group == (0,)


def test_bad_pooling_requests_are_refused_naming_the_fault_and_the_engine_goes_on(embed_llm):
    with pytest.raises(ValueError, match="dimensions=65 exceeds the embedding size 64"):
        embed_llm.embed("x", PoolingParams(dimensions=65))
    with pytest.raises(ValueError, match="task 'classify' needs a sequence-classification model"):
        embed_llm.classify("x")
    with pytest.raises(ValueError, match="does not generate"):
        embed_llm.generate("x", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="over max_model_len=64"):
        embed_llm.embed("y" * 65)
    with pytest.raises(ValueError, match="pooling_type='SUM'"):
        PoolingParams(pooling_type="sum")
    assert len(embed_llm.embed("still works", use_tqdm=False)[0].outputs.embedding) == 64


def test_the_score_of_an_embedding_model_is_the_cosine_of_its_embeddings(embed_llm):
    a, b, c = (np.asarray(o.outputs.embedding) for o in embed_llm.embed(PROMPTS, use_tqdm=False))
    scores = [s.outputs.score for s in embed_llm.score(PROMPTS[0], PROMPTS[1:], use_tqdm=False)]
    np.testing.assert_allclose(scores, [a @ b, a @ c], atol=1e-6)


def test_a_reranker_scores_each_pair_as_transformers_does(reranker, rerank_llm):
    _, model = reranker
    tokenizer = byte_tokenizer()
    query, documents = "where is paris", ["paris is in france", "a cat", "the capital of france is paris, on the seine"]
    with torch.no_grad():
        truth = [torch.sigmoid(model(torch.tensor([tokenizer(query, d)["input_ids"]])).logits[0, 0]).item() for d in documents]
    scores = [s.outputs.score for s in rerank_llm.score(query, documents, use_tqdm=False)]
    np.testing.assert_allclose(scores, truth, atol=1e-5)
    assert rerank_llm.classify(query, use_tqdm=False)[0].outputs.probs[0] == pytest.approx(
        torch.sigmoid(model(torch.tensor([tokenizer(query)["input_ids"]])).logits[0, 0]).item(), abs=1e-5)


def test_embeddings_over_http_with_the_openai_client(embedder, embed_llm):
    _, model = embedder
    tokenizer = byte_tokenizer()
    with running(build_app(embed_llm, served_model_name="emb")) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        got = client.embeddings.create(model="emb", input=PROMPTS)  # the client asks for base64 and decodes it
        for prompt, item in zip(PROMPTS, got.data):
            np.testing.assert_allclose(item.embedding, _truth(model, tokenizer(prompt)["input_ids"], "MEAN"), atol=1e-4)
        assert got.usage.prompt_tokens == sum(len(tokenizer(p)["input_ids"]) for p in PROMPTS)
        ids = tokenizer(PROMPTS[1])["input_ids"]
        floats = client.embeddings.create(model="emb", input=[ids], encoding_format="float", dimensions=32)
        np.testing.assert_allclose(floats.data[0].embedding, _truth(model, ids, "MEAN", 32), atol=1e-4)
        for body, names in (({"input": []}, "input"), ({"input": "x", "dimensions": 100}, "dimensions"),
                            ({"input": "x", "encoding_format": "hex"}, "encoding_format"), ({"input": "x", "foo": 1}, "foo")):
            r = httpx.post(url + "/v1/embeddings", json=body, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == names, r.text
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=60)
        assert r.status_code == 400 and "does not generate" in r.json()["error"]["message"]
    stats = embed_llm.engine.get_stats()
    assert stats.kv_cache_usage == 0.0 and stats.num_running == 0


def test_score_and_rerank_over_http_in_vllms_shapes(rerank_llm):
    query, documents = "where is paris", ["a cat", "paris is in france", "the capital of france is paris"]
    expected = [s.outputs.score for s in rerank_llm.score(query, documents, use_tqdm=False)]
    with running(build_app(rerank_llm, served_model_name="rr")) as url:
        scored = httpx.post(url + "/v1/score", json={"model": "rr", "text_1": query, "text_2": documents}, timeout=60).json()
        np.testing.assert_allclose([d["score"] for d in scored["data"]], expected, atol=1e-6)
        ranked = httpx.post(url + "/v1/rerank", json={"query": query, "documents": documents, "top_n": 2}, timeout=60).json()
        order = sorted(range(3), key=lambda i: -expected[i])[:2]
        assert [r["index"] for r in ranked["results"]] == order
        assert [r["document"]["text"] for r in ranked["results"]] == [documents[i] for i in order]
        r = httpx.post(url + "/v1/score", json={"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "text_1"
        r = httpx.post(url + "/v1/rerank", json={"query": "q", "documents": [], "top_n": 1}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "documents"


def test_the_pooler_follows_the_sentence_transformers_config_and_refuses_what_it_cannot(tmp_path):
    assert PoolerConfig.from_folder(tmp_path, {}, 64) == PoolerConfig(64, "LAST", True)  # no config: last token, normalized
    (tmp_path / "modules.json").write_text(json.dumps([{"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    assert PoolerConfig.from_folder(tmp_path, {}, 64) == PoolerConfig(64, "CLS", False)  # no Normalize module
    assert PoolerConfig.from_folder(tmp_path, {}, 64, {"pooling_type": "mean"}).pooling_type == "MEAN"
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="1_Pooling/config.json: expected exactly one of"):
        PoolerConfig.from_folder(tmp_path, {}, 64)
