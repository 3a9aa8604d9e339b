"""Structured outputs: JSON schemas, regular expressions, choices and grammars constrain what a
request generates, in the batched engine, without changing any unconstrained request's output.

The model is a tiny random Llama over a byte-level tokenizer (one token per byte), so its
choices among the allowed tokens are arbitrary: every property below holds because of the
constraint, not because the model knows JSON. Constrained requests speculate (n-gram drafts cut
by the grammar, each verification row masked by the state after the drafts before it), also
through the server, whose /metrics counts the drafts.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import numpy as np
import pytest

import jaxinfer
from jaxinfer import LLM, SamplingParams, StructuredOutputsParams, cli
from jaxinfer.ops.sampling import allowed_mask
from jaxinfer.server.app import build_app
from http_server import running
from tiny_models import save_hf_model

SETTINGS = dict(max_model_len=512, page_size=8, num_pages=1024, max_num_batched_tokens=256, max_num_seqs=64, progress=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("structured-model")
    save_hf_model("llama3.2", directory, max_position_embeddings=1024)
    return str(directory)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, **SETTINGS)


def texts(outputs):
    return [o.outputs[0].text for o in outputs]


# ----------------------------------------------------------------------------- the parameters
def test_exactly_one_constraint_is_given():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{not json")
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])


def test_the_older_guided_names_become_structured_outputs():
    assert SamplingParams(guided_regex="[a-z]+").structured_outputs == StructuredOutputsParams(regex="[a-z]+")
    assert SamplingParams(guided_choice=["x", "y"]).structured_outputs.choice == ["x", "y"]
    assert SamplingParams(guided_json='{"type": "integer"}').structured_outputs.json == {"type": "integer"}
    assert SamplingParams(guided_grammar='start: "a"').structured_outputs.grammar == 'start: "a"'
    assert SamplingParams(structured_outputs={"regex": "a"}).structured_outputs.regex == "a"
    with pytest.raises(ValueError, match="one constraint"):
        SamplingParams(guided_regex="a", guided_choice=["b"])


def test_a_constraint_survives_the_round_trip_other_processes_replay():
    """Serving on several processes sends SamplingParams as dataclasses.asdict (server.lockstep)."""
    import dataclasses

    for so in (StructuredOutputsParams(json={"type": "object"}), StructuredOutputsParams(choice=["a", "b"]),
               StructuredOutputsParams(grammar='start: "x"', disable_any_whitespace=True)):
        p = SamplingParams(temperature=0.5, structured_outputs=so)
        assert SamplingParams(**json.loads(json.dumps(dataclasses.asdict(p)))) == p


# ----------------------------------------------------------------------------- the device mask
def test_the_bitmask_allows_exactly_its_set_bits():
    rng = np.random.default_rng(0)
    V = 100
    words = rng.integers(-(2**31), 2**31, (3, 4), dtype=np.int64).astype(np.int32)
    expected = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :V].astype(bool)
    assert (np.asarray(allowed_mask(words, V)) == expected).all()
    # a vocabulary wider than the mask (the model's padding rows): the tokens past it are not allowed
    assert not np.asarray(allowed_mask(words, 140))[:, 128:].any()


# ----------------------------------------------------------------------------- regex, choice, grammar
def test_regex_outputs_match_in_full_under_greedy_and_sampling(llm):
    pattern = r"(cat|dog)-[0-9]{2,4}\.(png|jpg)"
    params = [SamplingParams(temperature=t, seed=i, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=pattern))
              for i, t in enumerate([0.0, 1.0, 1.0, 0.7])]
    outputs = llm.generate(["Name a file: "] * len(params), params, use_tqdm=False)
    for o in outputs:
        assert re.fullmatch(pattern, o.outputs[0].text), o.outputs[0].text
        assert o.outputs[0].finish_reason == "stop"


def test_a_choice_picks_one_of_the_choices(llm):
    choices = ["positive", "negative", "neutral", "positively not"]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=20, structured_outputs=StructuredOutputsParams(choice=choices))
              for i in range(12)]
    for text in texts(llm.generate(["Sentiment: "] * 12, params, use_tqdm=False)):
        assert text in choices


def test_a_lark_grammar_and_a_gbnf_grammar(llm):
    lark = 'start: expr\nexpr: NUM | "(" expr OP expr ")"\nOP: "+" | "*"\nNUM: /[1-9]/'
    gbnf = 'root ::= "yes" | "no" | "maybe " [0-9]'
    out = texts(llm.generate(["Calc: ", "Q: "], [
        SamplingParams(temperature=1.0, seed=3, max_tokens=60, structured_outputs=StructuredOutputsParams(grammar=lark)),
        SamplingParams(temperature=1.0, seed=4, max_tokens=20, structured_outputs=StructuredOutputsParams(grammar=gbnf)),
    ], use_tqdm=False))
    assert re.fullmatch(r"[0-9+*()]+", out[0]) and out[0].count("(") == out[0].count(")"), out[0]
    assert re.fullmatch(r"yes|no|maybe [0-9]", out[1]), out[1]


# ----------------------------------------------------------------------------- JSON schemas
def random_schema(rng: np.random.Generator, depth: int = 0) -> dict:
    """A JSON schema whose instances are bounded (strings with maxLength, arrays with maxItems,
    numbers with bounds and a multipleOf, no additional properties), so any allowed path ends."""
    kinds = ["string", "integer", "number", "boolean", "enum", "pattern"] + (["object", "array", "anyOf"] if depth < 2 else [])
    kind = kinds[int(rng.integers(len(kinds)))]
    if kind == "string":
        lo = int(rng.integers(0, 3))
        return {"type": "string", "minLength": lo, "maxLength": lo + int(rng.integers(1, 8))}
    if kind == "pattern":
        return {"type": "string", "pattern": ["^[A-Z]{2}-[0-9]{3}$", "^[a-f0-9]{4}$", "^(red|green|blue)$"][int(rng.integers(3))]}
    if kind == "integer":
        lo = int(rng.integers(-1000, 1000))
        return {"type": "integer", "minimum": lo, "maximum": lo + int(rng.integers(0, 5000))}
    if kind == "number":
        lo = float(rng.integers(-50, 50))
        # multipleOf bounds the decimals: a number's grammar alone lets a model that favours one
        # digit write it forever (a random model did: -38.2222...)
        return {"type": "number", "minimum": lo, "maximum": lo + float(rng.integers(1, 100)), "multipleOf": 0.25}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": ["alpha", "beta", 3, None, True][: int(rng.integers(1, 6))]}
    if kind == "array":
        lo = int(rng.integers(0, 3))
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": lo, "maxItems": lo + int(rng.integers(0, 3))}
    if kind == "anyOf":
        return {"anyOf": [random_schema(rng, depth + 1) for _ in range(int(rng.integers(2, 4)))]}
    return object_schema(rng, depth)


def object_schema(rng: np.random.Generator, depth: int) -> dict:
    names = [f"field_{i}" for i in range(int(rng.integers(1, 5)))]
    required = [n for n in names if rng.random() < 0.7]
    return {"type": "object", "properties": {n: random_schema(rng, depth + 1) for n in names}, "required": required,
            "additionalProperties": False}


def test_200_generated_schemas_give_valid_json_greedy_and_sampled(llm):
    """Every request shares a long prompt prefix, so most of them run from cached pages."""
    rng = np.random.default_rng(0)
    schemas = [object_schema(rng, depth=0) if i % 2 else random_schema(rng) for i in range(200)]  # half nested objects
    for temperature in (0.0, 1.0):
        params = [SamplingParams(temperature=temperature, seed=i, max_tokens=400,
                                 structured_outputs=StructuredOutputsParams(json=schema)) for i, schema in enumerate(schemas)]
        hits_before = llm.engine.get_stats().prefix_cache_hit_rate
        outputs = llm.generate(["Answer in JSON, following the schema you were given: "] * len(schemas), params,
                               use_tqdm=False)
        assert llm.engine.get_stats().prefix_cache_hit_rate > hits_before  # prefix caching at work
        for schema, o in zip(schemas, outputs):
            completion = o.outputs[0]
            assert completion.finish_reason == "stop", (schema, completion.text)
            jsonschema.validate(json.loads(completion.text), schema)


def test_json_object_gives_an_object(llm):
    [o] = llm.generate(["{"], SamplingParams(temperature=0.8, seed=1, max_tokens=200,
                                             structured_outputs=StructuredOutputsParams(json_object=True)), use_tqdm=False)
    if o.outputs[0].finish_reason == "stop":  # a random model may open strings it never closes within max_tokens
        assert isinstance(json.loads(o.outputs[0].text), dict)
    else:
        assert o.outputs[0].text.startswith("{")


# ----------------------------------------------------------------------------- in the batched engine
def test_unconstrained_requests_batched_with_constrained_ones_are_unchanged(llm):
    rng = np.random.default_rng(1)
    plain_prompts = [[int(t) for t in rng.integers(3, 250, int(rng.integers(2, 30)))] for _ in range(8)]
    plain = [SamplingParams(temperature=[0.0, 0.9][i % 2], seed=i, max_tokens=24, ignore_eos=True) for i in range(8)]
    alone = [llm.generate([p], [sp], use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(plain_prompts, plain)]
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a"],
              "additionalProperties": False}
    constrained = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema))
                   for i in range(8)]
    prompts = [x for pair in zip(plain_prompts, ["JSON: "] * 8) for x in pair]
    params = [x for pair in zip(plain, constrained) for x in pair]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs[0::2]] == alone
    for o in outputs[1::2]:
        jsonschema.validate(json.loads(o.outputs[0].text), schema)


def test_a_constrained_request_alone_equals_it_in_a_batch(llm):
    so = StructuredOutputsParams(regex=r"[a-z]{3,12}@[a-z]{3,8}\.(com|org)")
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=40, structured_outputs=so)
    alone = texts(llm.generate(["Email: "], params, use_tqdm=False))
    batch = texts(llm.generate(["Email: ", "Other: ", "x"], [params, SamplingParams(max_tokens=30, seed=1),
                                                            SamplingParams(max_tokens=10, seed=2)], use_tqdm=False))
    assert batch[0] == alone[0]


def test_n_completions_each_follow_the_constraint(llm):
    pattern = r"[0-9]{3}-[0-9]{4}"
    [o] = llm.generate(["Phone: "], SamplingParams(n=6, temperature=1.0, seed=5, max_tokens=20,
                                                   structured_outputs=StructuredOutputsParams(regex=pattern)), use_tqdm=False)
    assert len(o.outputs) == 6
    assert all(re.fullmatch(pattern, c.text) for c in o.outputs), [c.text for c in o.outputs]
    assert len({c.text for c in o.outputs}) > 1  # independent completions


def test_a_malformed_constraint_fails_its_request_alone(llm):
    for bad in (StructuredOutputsParams(regex="a(b"), StructuredOutputsParams(json={"type": "objekt"}),
                StructuredOutputsParams(grammar="start: (")):
        with pytest.raises(ValueError, match="structured_outputs"):
            llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=bad), use_tqdm=False)
    engine = llm.engine
    engine.add_request("good", "hello", SamplingParams(max_tokens=5, seed=0, ignore_eos=True))
    with pytest.raises(ValueError, match="request 'bad'.*structured_outputs.regex"):
        engine.add_request("bad", "hello", SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(regex="(")))
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert set(finished) == {"good"} and len(finished["good"].outputs[0].token_ids) == 5


def test_constrained_requests_survive_preemption(model_dir):
    """Few pages: sequences are preempted and recomputed mid-output; their matchers keep their
    place and every output still follows its constraint."""
    small = LLM(model_dir, **{**SETTINGS, "num_pages": 40, "max_num_seqs": 8})
    pattern = r"\[([0-9]{1,3}, ){4,8}[0-9]{1,3}\]"
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=60, structured_outputs=StructuredOutputsParams(regex=pattern))
              for i in range(10)]
    outputs = small.generate([f"List {i}: " for i in range(10)], params, use_tqdm=False)
    assert small.engine.get_stats().num_preemptions > 0
    for o in outputs:
        assert re.fullmatch(pattern, o.outputs[0].text), o.outputs[0].text


# ----------------------------------------------------------------------------- speculative decoding
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "id": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"}},
          "required": ["name", "id", "ok"], "additionalProperties": False}
# prompts whose n-grams the drafts come from: JSON the schema's keys repeat, and "ab" followed
# by letters the pattern forbids (so some drafts are cut by the grammar)
PERSON_PROMPT = '{"name": "abxy", "id": 12, "ok": true} {"name": "q", "id": 7, "ok": false} '
AB_PROMPT = "abxabyabzabw: "


@pytest.fixture(scope="module")
def spec_llm(model_dir):
    return LLM(model_dir, **SETTINGS, speculative_config=NGRAM)


def spec_counters(llm):
    core = llm.engine.core
    return np.array([core.num_draft_tokens, core.num_accepted_tokens, core.num_draft_tokens_cut_by_grammar])


def test_drafts_are_checked_and_masked_without_moving_the_matcher(llm):
    """A chain's drafts end before the first forbidden token; a tree keeps the nodes whose paths
    the grammar allows; each verification row's mask is the state after the drafts before it."""
    backend = llm.engine.grammar
    a, b, c, x = (llm.get_tokenizer().encode(ch, add_special_tokens=False)[0] for ch in "abcx")
    eos = sorted(llm.engine.output.eos_token_ids)
    matcher = backend.matcher(backend.compile(StructuredOutputsParams(regex=r"(ab){2,4}c")))

    def allowed(rows):
        return [set(np.flatnonzero(np.unpackbits(r.view(np.uint8), bitorder="little"))) for r in rows]

    assert matcher.valid_prefix([a, b, x, a]) == 2 and matcher.valid_prefix([b]) == 0
    assert matcher.valid_nodes([a, x, b, c, a], [-1, -1, 0, 0, 2]) == [True, False, True, False, True]
    chain = np.empty((5, backend.num_words), np.int32)
    backend.fill_bitmasks([matcher], chain, [[a, b, a, b]])
    assert allowed(chain) == [{a}, {b}, {a}, {b}, {a, c}]
    tree = np.empty((7, backend.num_words), np.int32)  # "abab", then "a" or "c" (which completes it: EOS only)
    backend.fill_bitmasks([matcher], tree, [[a, b, a, b, a, c]], [[-1, 0, 1, 2, 3, 3]])
    assert allowed(tree) == [{a}, {b}, {a}, {b}, {a, c}, {b}, set(eos)]
    assert matcher.valid_prefix([a]) == 1 and matcher.valid_prefix([b]) == 0  # nothing was consumed


def test_constrained_greedy_speculation_equals_unspeculated_decoding(llm, spec_llm):
    """Drafts are cut where the grammar forbids them and each verification row is masked as
    decoding would mask it: greedy output is token for token the unspeculated constrained output
    (and an unconstrained request speculating beside them is unchanged too)."""
    repetitive = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6, 7]
    prompts = [PERSON_PROMPT, AB_PROMPT, repetitive]
    params = [SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=StructuredOutputsParams(json=PERSON)),
              SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=r"(ab){3,10}c")),
              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)]
    before = spec_counters(spec_llm)
    speculated = spec_llm.generate(prompts, params, use_tqdm=False)
    drafted, accepted, cut = spec_counters(spec_llm) - before
    plain = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in speculated] == [o.outputs[0].token_ids for o in plain]
    jsonschema.validate(json.loads(speculated[0].outputs[0].text), PERSON)
    assert re.fullmatch(r"(ab){3,10}c", speculated[1].outputs[0].text)
    assert drafted > 0 and accepted > 0 and cut > 0, (drafted, accepted, cut)
    stats = spec_llm.engine.get_stats()  # each accepted draft counted at its position, the first the most
    per_pos = stats.num_accepted_tokens_per_pos
    assert sum(per_pos) == stats.num_accepted_tokens and list(per_pos) == sorted(per_pos, reverse=True)


def test_a_grammar_that_forbids_every_draft_still_decodes(llm, spec_llm):
    """Every draft prompt lookup finds here continues the digits the wrong way: all are cut, none verified."""
    params = SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex="0123456789"))
    before = spec_counters(spec_llm)
    [o] = spec_llm.generate(["9876543210 9876543210 "], params, use_tqdm=False)
    drafted, accepted, cut = spec_counters(spec_llm) - before
    assert o.outputs[0].text == "0123456789" and o.outputs[0].finish_reason == "stop"
    assert drafted == 0 and cut > 0


def test_sampled_constrained_speculation_follows_the_constraint(spec_llm):
    pattern = r"(ab){2,6}(c|d)[0-9]{2}"
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=pattern))
              for i in range(4)]
    params.append(SamplingParams(temperature=0.8, seed=9, max_tokens=80, structured_outputs=StructuredOutputsParams(json=PERSON)))
    before = spec_counters(spec_llm)
    outputs = spec_llm.generate([AB_PROMPT] * 4 + [PERSON_PROMPT], params, use_tqdm=False)
    assert (spec_counters(spec_llm) - before)[0] > 0
    for o in outputs[:4]:
        assert re.fullmatch(pattern, o.outputs[0].text), o.outputs[0].text
    jsonschema.validate(json.loads(outputs[4].outputs[0].text), PERSON)


def test_the_server_speculates_constrained_requests_and_reports_acceptance(spec_llm):
    """`jaxinfer serve --speculative-config` (the CLI passes it to LLM: test_serve_and_generate_pass_the_speculative_config)."""
    def metric(text, name, position=None):
        label = "" if position is None else f'{{position="{position}"}}'
        return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(f"jaxinfer:{name}{label} ")))

    with running(build_app(spec_llm, served_model_name="tiny")) as url:
        before = httpx.get(url + "/metrics").text
        reply = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": PERSON_PROMPT, "max_tokens": 80, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}})
        assert reply.status_code == 200, reply.text
        jsonschema.validate(json.loads(reply.json()["choices"][0]["text"]), PERSON)
        after = httpx.get(url + "/metrics").text
    for name in ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total"):
        assert metric(after, name) > metric(before, name), name
    assert metric(after, "spec_decode_num_accepted_tokens_per_pos_total", 0) > metric(before, "spec_decode_num_accepted_tokens_per_pos_total", 0)
    assert metric(after, "spec_decode_num_accepted_tokens_per_pos_total", NGRAM["num_speculative_tokens"] - 1) >= 0
    assert 0 < metric(after, "spec_decode_acceptance_rate") <= 1


def test_serve_and_generate_pass_the_speculative_config(monkeypatch, model_dir):
    seen = []

    class Stop(Exception):
        pass

    def fake_llm(*args, **kwargs):
        seen.append(kwargs["speculative_config"])
        raise Stop

    monkeypatch.setattr(jaxinfer, "LLM", fake_llm)
    flag = ["--speculative-config", json.dumps(NGRAM)]
    for argv in (["generate", "hi", "--model", model_dir, *flag], ["serve", model_dir, *flag]):
        with pytest.raises(Stop):
            cli.main(argv)
    assert seen == [NGRAM, NGRAM]


def test_beam_search_refuses_a_constraint():
    from jaxinfer import BeamSearchParams

    with pytest.raises(ValueError, match="BeamSearchParams.structured_outputs: beam search cannot be constrained"):
        BeamSearchParams(beam_width=2, max_tokens=4, structured_outputs=StructuredOutputsParams(regex="a+"))
