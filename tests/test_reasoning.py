"""Reasoning content (`jaxinfer serve --reasoning-parser qwen3|deepseek_r1`): the parsers on text,
whole and streamed at every split point; the constraint that lets a model think freely before its
structured answer; and through a server, message.reasoning_content and delta.reasoning_content
(deltas adding up exactly), structured outputs and tool calls after the reasoning.

The server tests serve a scripted tiny model: its layers add nothing to the residual stream and
its embeddings and head make a bigram table, so that greedy decoding after a newline writes
"ab</think>xyz" and EOS, and where a constraint forbids the next character, the allowed token of
the lowest id (all logits but the script's are 0)."""

from __future__ import annotations

import contextlib
import json

import jsonschema
import openai
import pytest
import torch
from tokenizers import AddedToken

from jaxinfer import LLM
from jaxinfer.cli import main
from jaxinfer.engine.grammar import GrammarBackend
from jaxinfer.sampling_params import StructuredOutputsParams
from jaxinfer.server.app import build_app
from jaxinfer.server.reasoning import ReasoningParser
from http_server import running
from tiny_models import CHAT_TEMPLATE, build_hf_model, byte_tokenizer

SCRIPT = "ab</think>xyz"
THINKING_TEMPLATE = CHAT_TEMPLATE.replace("<s>assistant\n", "<s>assistant\n<think>\n")  # Qwen3-Thinking-2507 style
ANSWER = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
          "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}}, "required": ["city"], "additionalProperties": False}}}

CASES = [  # (parser, opened, text, reasoning, content)
    ("qwen3", False, "<think>hm, 2+2</think>\n\nIt is 4.", "hm, 2+2", "\n\nIt is 4."),
    ("qwen3", False, "\n<think>\nhm</think>", "\nhm", None),
    ("qwen3", False, "<think>cut off while thinking", "cut off while thinking", None),
    ("qwen3", False, "It is 4.", None, "It is 4."),
    ("qwen3", False, "no block, so all content: a</think>b", None, "no block, so all content: a</think>b"),
    ("qwen3", False, "  <thi", None, "  <thi"),
    ("qwen3", False, "", None, ""),
    ("qwen3", True, "hm</think>It is 4.", "hm", "It is 4."),
    ("qwen3", True, "hm", "hm", None),
    ("deepseek_r1", False, "hm, 2+2</think>It is 4.</think>", "hm, 2+2", "It is 4.</think>"),
    ("deepseek_r1", False, "<think>hm</think>4", "hm", "4"),
    ("deepseek_r1", False, "hm, still thinking </thi", "hm, still thinking </thi", None),
    ("deepseek_r1", False, "</think></think>", None, "</think>"),
    ("deepseek_r1", False, "<think>", None, None),
]


@pytest.mark.parametrize("name, opened, text, reasoning, content", CASES)
def test_whole_replies_split_as_vllms_parsers(name, opened, text, reasoning, content):
    assert ReasoningParser(name).extract(text, opened) == (reasoning, content)


def test_streamed_deltas_add_up_to_the_whole_split_at_any_split_points():
    """Every way of cutting a reply into three pieces, and token by token: the reasoning and
    content deltas concatenate to the non-streamed split (tags split across deltas included)."""
    for name, opened, text, _, _ in CASES:
        parser = ReasoningParser(name)
        reasoning, content = parser.extract(text, opened)
        cuts = [(i, j) for i in range(len(text) + 1) for j in range(i, len(text) + 1)] + [tuple(range(len(text) + 1))]
        for points in cuts:
            stream, got = parser.stream(opened), ["", ""]
            for end in points:  # the text so far, then the whole text, finished
                r, c = stream.update(text[:end])
                got = [got[0] + r, got[1] + c]
            r, c = stream.update(text, finished=True)
            assert [got[0] + r, got[1] + c] == [reasoning or "", content or ""], (name, opened, text, points)


def test_the_stream_holds_back_only_what_may_be_a_tag():
    stream = ReasoningParser("deepseek_r1").stream()
    assert stream.update("hm </") == ("hm ", "")  # "</" may begin </think>
    assert stream.update("hm </b") == ("</b", "")
    assert stream.update("hm </b></think") == (">", "")
    assert stream.update("hm </b></think>It") == ("", "It")
    assert stream.update("hm </b></think>It</think>", finished=True) == ("", "</think>")
    qwen3 = ReasoningParser("qwen3").stream()
    assert qwen3.update(" <th") == ("", "")  # may become <think>
    assert qwen3.update(" <th>") == ("", " <th>")  # did not: non-thinking mode, all content


def test_a_constraint_after_reasoning_lets_free_text_then_the_answer():
    """The grammar of a constraint with reasoning_*: free text up to </think> (whitespace after
    it), then the answer; optional reasoning (qwen3 not opened): the answer alone, or a think
    block first. Tags that are one added token each (Qwen3's) are matched as those tokens."""
    def accepts(tok, constraint, text) -> bool:
        backend = GrammarBackend(tok, len(tok), [tok.eos_token_id])
        matcher = backend.matcher(backend.compile(constraint))
        return all(matcher.accept(t) for t in tok.encode(text, add_special_tokens=False)) and matcher._m.is_accepting()

    required = StructuredOutputsParams(json=ANSWER, reasoning_end="</think>", reasoning_start="<think>")
    optional = StructuredOutputsParams(json=ANSWER, reasoning_end="</think>", reasoning_start="<think>", reasoning_optional=True)
    with_tags = byte_tokenizer()
    with_tags.add_tokens([AddedToken("<think>", normalized=False), AddedToken("</think>", normalized=False)])
    for tok in (byte_tokenizer(), with_tags):
        assert len(tok.encode("</think>", add_special_tokens=False)) == (8 if tok is not with_tags else 1)
        assert ("<[" in GrammarBackend(tok, len(tok), [2]).compile(required)) == (tok is with_tags)  # <[id]>: the token
        assert accepts(tok, required, 'free {"text" </thin</think>\n\n{"answer": "no"}')
        assert accepts(tok, required, '<think>hm</think>{"answer": "yes"}')
        assert not accepts(tok, required, '{"answer": "no"}')  # the reasoning must end first
        assert not accepts(tok, required, 'hm</think>{"answer": "maybe"}')
        assert accepts(tok, optional, '{"answer": "no"}')
        assert accepts(tok, optional, '<think>hm {</think> {"answer": "no"}')
        assert not accepts(tok, optional, 'hm</think>{"answer": "no"}')
    with pytest.raises(ValueError, match="reasoning_start and reasoning_optional need reasoning_end"):
        StructuredOutputsParams(json=ANSWER, reasoning_start="<think>")


# ----------------------------------------------------------------------------- through a server
def save_scripted_model(directory, script: str):
    """A tiny model that, greedy after a newline, writes `script` (distinct characters) then EOS."""
    tok = byte_tokenizer()
    ids = [tok.encode(ch, add_special_tokens=False)[0] for ch in "\n" + script] + [tok.eos_token_id]
    assert len(set(ids)) == len(ids), "each character of the script once"
    model = build_hf_model("qwen2")  # untied embeddings
    hidden = model.config.hidden_size
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()  # the layers add nothing: the last position's logits depend on its token alone
        model.model.norm.weight.fill_(1.0)
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        embed.zero_()
        embed[:, hidden - 1] = 1.0  # a dimension the head reads nothing from: all logits 0
        head.zero_()
        for dim, (token, following) in enumerate(zip(ids, ids[1:])):
            embed[token] = 0.0
            embed[token, dim] = 1.0
            head[following, dim] = 10.0
    model.save_pretrained(directory)
    tok.save_pretrained(directory)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    directory = tmp_path_factory.mktemp("scripted-model")
    save_scripted_model(directory, SCRIPT)
    return LLM(str(directory), max_model_len=256, page_size=8, num_pages=64, max_num_batched_tokens=64, max_num_seqs=4,
               progress=False)


@contextlib.contextmanager
def serving(llm, **kw):
    """An OpenAI client of a server of `llm` (one at a time: each app runs the engine's thread)."""
    with running(build_app(llm, served_model_name="tiny", **kw)) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def chat(client, **kw):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Is it?"}],
                                          **{"temperature": 0, "max_tokens": 60, **kw})


def streamed(client, **kw) -> tuple[str, str, list]:
    """(reasoning, content, chunks) of a streamed reply, the deltas concatenated."""
    chunks = list(chat(client, stream=True, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    return ("".join(getattr(d, "reasoning_content", None) or "" for d in deltas),
            "".join(d.content or "" for d in deltas), chunks)


def test_deepseek_r1_reasoning_content_whole_and_streamed(llm):
    with serving(llm, reasoning_parser="deepseek_r1") as client:
        reply = chat(client)
        message = reply.choices[0].message
        assert (message.reasoning_content, message.content, reply.choices[0].finish_reason) == ("ab", "xyz", "stop")
        reasoning, content, chunks = streamed(client)
        assert (reasoning, content) == ("ab", "xyz")
        pieces = [getattr(c.choices[0].delta, "reasoning_content", None) for c in chunks if c.choices]
        assert sum(bool(p) for p in pieces) >= 2  # sent as it comes (one byte token per step)
        truncated = chat(client, max_tokens=5)  # cut off while thinking: all reasoning
        assert (truncated.choices[0].message.reasoning_content, truncated.choices[0].message.content) == ("ab</t", None)
        assert streamed(client, max_tokens=5)[:2] == ("ab</t", "")


def test_qwen3_reasoning_needs_a_think_block(llm):
    """With a template whose generation prompt opens <think> the reply's thinking is split off;
    with one that does not (Qwen3's non-thinking mode) the reply is all content."""
    with serving(llm, reasoning_parser="qwen3", chat_template=THINKING_TEMPLATE) as client:
        message = chat(client).choices[0].message
        assert (message.reasoning_content, message.content) == ("ab", "xyz")
        assert streamed(client)[:2] == ("ab", "xyz")
    with serving(llm, reasoning_parser="qwen3") as client:
        message = chat(client).choices[0].message
        assert (message.reasoning_content, message.content) == (None, SCRIPT)
        assert streamed(client)[:2] == ("", SCRIPT)


def test_structured_outputs_and_tool_calls_apply_after_the_reasoning(llm):
    """The model thinks freely ("ab", which the schema would forbid), then the constraint holds:
    the content is JSON of the schema; a forced tool call is parsed from the content alone."""
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
    with serving(llm, reasoning_parser="deepseek_r1") as client:
        message = chat(client, response_format=fmt).choices[0].message
        assert message.reasoning_content == "ab"
        jsonschema.validate(json.loads(message.content), ANSWER)
        reasoning, content, _ = streamed(client, response_format=fmt)
        assert (reasoning, content) == ("ab", message.content)
        call_kw = dict(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_tokens=120)
        reply = chat(client, **call_kw)
        [call] = reply.choices[0].message.tool_calls
        assert reply.choices[0].message.reasoning_content == "ab" and reply.choices[0].finish_reason == "tool_calls"
        assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Oslo", "Rome")
        reasoning, content, chunks = streamed(client, **call_kw)
        assert reasoning == "ab" and not content
        assert [tc.function.name for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []] == ["get_weather"]
    with serving(llm) as client:  # without a reasoning parser the constraint starts at once
        assert json.loads(chat(client, response_format=fmt).choices[0].message.content) == {"answer": "no"}


def test_an_unknown_reasoning_parser_is_refused(llm, capsys):
    with pytest.raises(ValueError, match="reasoning_parser='nope'"):
        build_app(llm, reasoning_parser="nope")
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "some-model", "--reasoning-parser", "nope"])
    assert exit_.value.code == 2 and "--reasoning-parser" in capsys.readouterr().err
