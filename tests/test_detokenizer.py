"""Incremental detokenization gives, delta by delta, exactly the text of a full decode; and the
text a request shows while it runs only ever grows into its final text, stop strings included."""

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

from jaxinfer.engine.detokenizer import IncrementalDetokenizer
from jaxinfer.engine.model_runner import RowResult
from jaxinfer.engine.output_processor import OutputProcessor
from jaxinfer.engine.request import Request, Sequence
from jaxinfer.sampling_params import SamplingParams
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


# ----------------------------------------------------------------------------- stop strings, streamed
def shown_texts(text: str, stop: list[str], *, min_tokens: int = 0, include: bool = False) -> tuple[list[str], str | None]:
    """Feeds `text`'s tokens (one per byte) through the engine's OutputProcessor, as the core does;
    returns the text of the RequestOutput after each token (what a streaming client sees, in
    order) and the finish reason."""
    tok = byte_tokenizer()
    prompt = tok.encode("Once upon a time", add_special_tokens=False)
    ids = tok.encode(text, add_special_tokens=False)
    params = SamplingParams(stop=stop, max_tokens=len(ids), min_tokens=min(min_tokens, len(ids)),
                            include_stop_str_in_output=include, ignore_eos=True)
    request = Request("r", None, prompt, params, seed=0, max_len=len(prompt) + len(ids))
    seq = Sequence(request, 0, list(prompt), seed=0)
    request.seqs.append(seq)
    request.forked = True
    processor = OutputProcessor(tok, eos_token_ids=[tok.eos_token_id], max_model_len=1024)
    shown = []
    for token in ids:
        seq.token_ids.append(token)
        processor.on_token(seq, RowResult(token, 0.0, np.zeros(0, np.int32), np.zeros(0, np.float32)),
                           len(seq.token_ids) - 1, now=0.0)
        shown.append(OutputProcessor.output(request).outputs[0].text)
        if seq.finish_reason is not None:
            break
    return shown, seq.finish_reason


def cut_at_first_stop(text: str, stop: list[str], include: bool) -> str:
    """The text up to the first stop string to complete (the longest, of those ending at once)."""
    for end in range(1, len(text) + 1):
        starts = [end - len(s) for s in stop if text[:end].endswith(s)]
        if starts:
            return text[:end] if include else text[: min(starts)]
    return text


@hypothesis.settings(max_examples=150, deadline=None)
@hypothesis.given(text=st.text(alphabet="abé ", min_size=1, max_size=24),
                  stop=st.lists(st.text(alphabet="abé ", min_size=1, max_size=4), min_size=1, max_size=3),
                  include=st.booleans())
def test_streamed_text_only_grows_and_ends_as_the_whole_answer(text, stop, include):
    """Each output's text extends the one before (a stop string that a later token completes is
    never shown in part and then taken back), and the last is the text cut at the first stop."""
    shown, _ = shown_texts(text, stop, include=include)
    assert all(later.startswith(earlier) for earlier, later in zip(shown, shown[1:])), shown
    assert shown[-1] == cut_at_first_stop(text, stop, include)


def test_only_what_may_begin_a_stop_string_is_held_back():
    shown, reason = shown_texts("say STOP", ["STOP"])
    assert shown == ["s", "sa", "say", "say ", "say ", "say ", "say ", "say "] and reason == "stop"
    assert shown_texts("a STEP", ["STOP"])[0] == ["a", "a ", "a ", "a ", "a STE", "a STEP"]  # "STE" cannot begin "STOP"
    shown, reason = shown_texts("a ST", ["STOP"])
    assert shown == ["a", "a ", "a ", "a ST"] and reason == "length"  # at the end, what was held back comes out


def test_stop_strings_are_not_checked_before_min_tokens():
    """As in vLLM: a stop string ending within the first min_tokens tokens does not stop."""
    text = "abcSTOPdefSTOPgh"
    assert shown_texts(text, ["STOP"])[0][-1] == "abc"
    assert shown_texts(text, ["STOP"], min_tokens=7)[0][-1] == "abcSTOPdef"  # the first STOP ends at token 7
    assert shown_texts(text, ["STOP"], min_tokens=6)[0][-1] == "abc"  # ... which is past 6
    # a short stop string inside min_tokens is not found later by a longer one's search window
    shown, reason = shown_texts("a\nbcEND", ["\n", "END"], min_tokens=3)
    assert shown[-1] == "a\nbc" and reason == "stop"
    assert all(later.startswith(earlier) for earlier, later in zip(shown, shown[1:]))  # nothing streamed is taken back
