"""Incremental detokenization gives, delta by delta, exactly the text of a full decode."""

import hypothesis
import hypothesis.strategies as st
import pytest

from jaxinfer.engine.detokenizer import IncrementalDetokenizer
from tiny_models import byte_tokenizer

TEXTS = ["plain ascii text", "héllo wörld", "日本語のテキスト", "emoji 🤖🚀 and more", "tabs\tand\nnewlines", "  leading spaces"]


@pytest.fixture(scope="module")
def tokenizers():
    out = {"bytes": byte_tokenizer()}
    try:  # the real SmolLM2 tokenizer (a GPT-2 style BPE), when the default model is installed
        from jaxinfer.runtime.loading import resolve_model
        from jaxinfer.tokenizer import load_tokenizer

        out["smollm2"] = load_tokenizer(resolve_model(None))
    except FileNotFoundError:
        pass
    return out


def stream(tokenizer, prompt_ids, output_ids, skip=True):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip)
    deltas = [detok.add(t) for t in output_ids]
    deltas.append(detok.flush())
    return deltas, detok.text


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_the_full_decode(tokenizers, text):
    for name, tok in tokenizers.items():
        prompt = tok.encode("Once upon a time", add_special_tokens=False)
        output = tok.encode(" " + text, add_special_tokens=False)
        deltas, final = stream(tok, prompt, output)
        assert "".join(deltas) == final == tok.decode(output, skip_special_tokens=True), name
        assert not any("\ufffd" in d for d in deltas), name  # never emits half a character


def test_multibyte_characters_are_held_back_until_complete(tokenizers):
    tok = tokenizers["bytes"]  # one token per byte: "é" is two tokens, "🤖" four
    output = tok.encode("a🤖b", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [])
    deltas = [detok.add(t) for t in output]
    assert deltas == ["a", "", "", "", "🤖", "b"]


def test_special_tokens_are_skipped_or_kept(tokenizers):
    tok = tokenizers["bytes"]
    output = tok.encode("hi", add_special_tokens=False) + [tok.eos_token_id]
    assert stream(tok, [], output, skip=True)[1] == "hi"
    assert stream(tok, [], output, skip=False)[1] == "hi</s>"


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(st.text(min_size=1, max_size=30))
def test_random_text_round_trips(text):
    tok = byte_tokenizer()
    output = tok.encode(text, add_special_tokens=False)
    deltas, final = stream(tok, [], output)
    assert "".join(deltas) == final == tok.decode(output, skip_special_tokens=True)
