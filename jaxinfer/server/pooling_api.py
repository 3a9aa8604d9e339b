"""The pooling routes of a server running a pooling model (`jaxinfer serve --runner pooling`):

    POST /v1/embeddings   OpenAI's: {"input": str | [str] | [int] | [[int]], "model", "dimensions",
                          "encoding_format": "float" | "base64"} -> {"data": [{"embedding", "index"}], "usage"}
    POST /v1/score        vLLM's: {"text_1": str | [str], "text_2": str | [str]} -> {"data": [{"index", "score"}]}
    POST /v1/rerank       vLLM's (Jina / Cohere shape): {"query", "documents": [str], "top_n"} ->
                          {"results": [{"index", "document": {"text"}, "relevance_score"}]}, best first

Each input is one pooling request in the engine (engine.pooling): its prompt computed once,
its pages freed as soon as it is read. Scores are a cross-encoder's (a sequence-classification
model: each pair tokenized together, its first label's probability) or, for an embedding model,
the cosine similarity of the two texts' embeddings. Errors are 400s naming the field.
"""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Any, Callable

import numpy as np
from fastapi import APIRouter, Request

from jaxinfer.engine.pooling import cosine
from jaxinfer.outputs import PoolingRequestOutput
from jaxinfer.pooling_params import PoolingParams
from jaxinfer.server import protocol
from jaxinfer.server.protocol import ApiError

EMBEDDING_FIELDS = {"input", "model", "dimensions", "encoding_format", "user"}
SCORE_FIELDS = {"model", "text_1", "text_2", "user"}
RERANK_FIELDS = {"model", "query", "documents", "top_n", "user"}


def add_pooling_routes(v1: APIRouter, *, llm, engine, model_name: str, body_of: Callable, until_done: Callable,
                       last: Callable, request_timeout: float | None) -> None:
    """Adds /embeddings, /score and /rerank to `v1` (app.build_app's /v1 router) for `llm`, a
    pooling LLM served by `engine` (server.async_engine.AsyncEngine)."""
    pooler = llm.engine.core.pooler

    async def pool(request: Request, prompts: list, params: PoolingParams, prefix: str) -> list[PoolingRequestOutput]:
        """Every prompt's finished output; ClientLeft if the client disconnects first (its
        requests are then aborted)."""
        request_id = protocol.new_id(prefix)
        outputs = await until_done(request, [last(engine.generate(p, params, request_id=f"{request_id}-{i}",
                                                                  timeout=request_timeout))
                                             for i, p in enumerate(prompts)])
        if outputs is None:
            raise ClientLeft
        return outputs

    def check_model(body: dict) -> str:
        model = body.get("model")
        if model is not None and model != model_name:
            raise ApiError(f"model {model!r} is not served here; this server serves [{model_name!r}]", status=404,
                           param="model", type="not_found_error")
        return model_name

    async def scores(request: Request, first: list[str], second: list[str]) -> tuple[list[float], int]:
        """One score per pair, and the prompt tokens computed."""
        if pooler.classifier is not None:
            pairs = await asyncio.to_thread(lambda: [{"prompt_token_ids": llm.tokenizer(a, b)["input_ids"]}
                                                     for a, b in zip(first, second)])
            outs = await pool(request, pairs, PoolingParams(task="classify"), "score")
            return [o.outputs.score for o in outs], sum(len(o.prompt_token_ids) for o in outs)
        unique = list(dict.fromkeys(first + second))
        outs = await pool(request, unique, PoolingParams(), "score")
        vectors = {text: np.asarray(o.outputs.embedding) for text, o in zip(unique, outs)}
        return [cosine(vectors[a], vectors[b]) for a, b in zip(first, second)], sum(len(o.prompt_token_ids) for o in outs)

    @v1.post("/embeddings")
    async def embeddings(request: Request):
        body = _checked(await body_of(request), EMBEDDING_FIELDS)
        model = check_model(body)
        inputs = embedding_inputs(body.get("input"))
        encoding = body.get("encoding_format", "float")
        if encoding not in ("float", "base64"):
            raise ApiError(f"encoding_format={encoding!r}: expected 'float' or 'base64'", param="encoding_format")
        try:
            params = PoolingParams(task="embed", dimensions=body.get("dimensions"))
            pooler.check(params, "dimensions")
        except ValueError as e:
            raise ApiError(str(e), param="dimensions") from None
        outs = await pool(request, inputs, params, "embd")
        data = [{"object": "embedding", "index": i, "embedding": encode_vector(o.outputs.embedding, encoding)}
                for i, o in enumerate(outs)]
        tokens = sum(len(o.prompt_token_ids) for o in outs)
        return {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    @v1.post("/score")
    async def score(request: Request):
        body = _checked(await body_of(request), SCORE_FIELDS)
        model = check_model(body)
        first, second = _texts(body.get("text_1"), "text_1"), _texts(body.get("text_2"), "text_2")
        if len(first) == 1:
            first = first * len(second)
        if len(first) != len(second):
            raise ApiError(f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or as many as "
                           f"text_2", param="text_1")
        values, tokens = await scores(request, first, second)
        return {"id": protocol.new_id("score"), "object": "list", "created": int(time.time()), "model": model,
                "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(values)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    @v1.post("/rerank")
    async def rerank(request: Request):
        body = _checked(await body_of(request), RERANK_FIELDS)
        model = check_model(body)
        query = body.get("query")
        if not isinstance(query, str) or not query:
            raise ApiError("'query' must be a non-empty string", param="query")
        documents = _texts(body.get("documents"), "documents")
        top_n = body.get("top_n", len(documents))
        if isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1:
            raise ApiError(f"top_n={top_n!r}: expected a positive integer", param="top_n")
        values, tokens = await scores(request, [query] * len(documents), documents)
        order = sorted(range(len(documents)), key=lambda i: -values[i])[:top_n]
        return {"id": protocol.new_id("rerank"), "model": model, "usage": {"total_tokens": tokens},
                "results": [{"index": i, "document": {"text": documents[i]}, "relevance_score": values[i]} for i in order]}


class ClientLeft(Exception):
    """The client disconnected before its inputs were pooled (app.build_app answers 499)."""


def encode_vector(vector: list[float], encoding: str) -> list[float] | str:
    """OpenAI's encodings: a list of floats, or base64 of little-endian float32s (the openai
    client's default)."""
    if encoding == "base64":
        return base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode("ascii")
    return vector


def embedding_inputs(value: Any) -> list:
    """OpenAI's `input`: a string, a list of strings, a list of token ids, or a list of such lists."""
    is_ids = lambda x: isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x)  # noqa: E731
    if isinstance(value, str) and value:
        return [value]
    if is_ids(value):
        return [list(value)]
    if isinstance(value, list) and value and all(isinstance(x, str) and x for x in value):
        return list(value)
    if isinstance(value, list) and value and all(is_ids(x) for x in value):
        return [list(x) for x in value]
    raise ApiError("'input' must be a non-empty string, a list of them, a list of token ids or a list of such lists",
                   param="input")


def _texts(value: Any, field: str) -> list[str]:
    if isinstance(value, str) and value:
        return [value]
    if isinstance(value, list) and value and all(isinstance(x, str) and x for x in value):
        return list(value)
    raise ApiError(f"'{field}' must be a non-empty string or a non-empty list of them", param=field)


def _checked(body: Any, fields: set[str]) -> dict:
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    unknown = sorted(set(body) - fields)
    if unknown:
        raise ApiError(f"unknown field {unknown[0]!r}", param=unknown[0])
    return body
