"""The public API (`LLM`, `SamplingParams`, `RequestOutput`) on a tiny random model with a real tokenizer."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from jaxinfer import LLM, SamplingParams
from jaxinfer.engine.config import EngineConfig
from jaxinfer.runtime.compiles import compiles
from tiny_models import save_hf_model

ENGINE_ARGS = dict(max_model_len=96, page_size=4, num_pages=200, max_num_batched_tokens=32, max_num_seqs=8, progress=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama")
    hf = save_hf_model("smollm2", directory)
    return directory, hf


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir[0]), **ENGINE_ARGS)


def hf_logprobs(hf, ids) -> np.ndarray:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), dim=-1).numpy()


GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def test_prompt_forms_give_the_same_output(llm):
    ids = llm.get_tokenizer().encode("hello there")
    a, b, c = llm.generate(["hello there", ids, {"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    assert a.prompt == "hello there" and a.prompt_token_ids == ids
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
    assert len(a.outputs[0].token_ids) == 6 and a.outputs[0].finish_reason == "length"
    assert a.outputs[0].text == llm.get_tokenizer().decode(a.outputs[0].token_ids, skip_special_tokens=True)


def test_greedy_tokens_and_logprobs_match_transformers(llm, model_dir):
    _, hf = model_dir
    ids = llm.get_tokenizer().encode("the paged cache")
    out = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=3, prompt_logprobs=2), use_tqdm=False)[0]
    gen = out.outputs[0].token_ids
    truth = hf_logprobs(hf, ids + gen)
    for i, tok in enumerate(gen):
        row = truth[len(ids) - 1 + i]
        assert tok == int(np.argmax(row))  # greedy = HF's argmax
        entry = out.outputs[0].logprobs[i]
        assert list(entry)[0] == tok and entry[tok].rank == 1
        assert abs(entry[tok].logprob - row[tok]) < 1e-4
        assert len(entry) == 3  # the sampled token is the top-1, plus two more of the top 3
    assert abs(out.outputs[0].cumulative_logprob - sum(truth[len(ids) - 1 + i][t] for i, t in enumerate(gen))) < 1e-3
    # prompt logprobs: None for the first token, then the logprob of each actual prompt token
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for pos in range(1, len(ids)):
        entry = out.prompt_logprobs[pos]
        assert abs(entry[ids[pos]].logprob - truth[pos - 1][ids[pos]]) < 1e-4
        assert len(entry) <= 3



# ----------------------------------------------------------------------------- prompt logprobs and the prefix cache
def prompt_logprob_values(out) -> list[dict[int, tuple[float, int]] | None]:
    """An answer's prompt logprobs as plain values: per position {token id: (logprob, rank)}."""
    return [None if e is None else {t: (lp.logprob, lp.rank) for t, lp in e.items()} for e in out.prompt_logprobs]


def assert_prompt_logprobs_are_the_truth(out, ids, truth, tol=1e-4):
    """One entry per prompt token: None first, then each token's logprob as `truth` (log-softmax
    rows of the uncached prompt) scores it."""
    assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    for pos in range(1, len(ids)):
        assert abs(out.prompt_logprobs[pos][ids[pos]].logprob - truth[pos - 1][ids[pos]]) < tol, pos


def random_ids(n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 250, n)]


def test_a_repeated_prompt_gets_every_prompt_logprob_again(llm, model_dir):
    """The second time, its pages are in the prefix cache: the answer is still the first's."""
    ids = random_ids(40, seed=33)
    p = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=1)
    first = llm.generate(ids, p, use_tqdm=False)[0]
    assert llm.engine.block_manager.num_cached_prefix_pages(ids) == (len(ids) - 1) // 4  # cached for the second
    second = llm.generate(ids, p, use_tqdm=False)[0]
    assert_prompt_logprobs_are_the_truth(first, ids, hf_logprobs(model_dir[1], ids))
    assert len(second.prompt_logprobs) == len(ids)
    for a, b in zip(prompt_logprob_values(first)[1:], prompt_logprob_values(second)[1:]):
        assert a.keys() == b.keys() and all(abs(a[t][0] - b[t][0]) < 1e-5 and a[t][1] == b[t][1] for t in a)
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_a_prompt_sharing_a_cached_page_aligned_prefix_gets_every_prompt_logprob(llm, model_dir):
    shared = random_ids(32, seed=34)  # 8 full pages
    llm.generate(shared + random_ids(9, seed=35), GREEDY, use_tqdm=False)  # caches the shared pages
    ids = shared + random_ids(8, seed=36)
    assert llm.engine.block_manager.num_cached_prefix_pages(ids) == 8
    out = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    assert_prompt_logprobs_are_the_truth(out, ids, hf_logprobs(model_dir[1], ids))


def test_a_cached_prompt_longer_than_a_chunk_gets_every_prompt_logprob_in_each_of_n_completions(llm, model_dir):
    """80 tokens with a 32-token budget: three chunks, the prompt's pages all cached beforehand;
    n=2 forks after the prompt, and the request still has one entry per prompt token."""
    ids = random_ids(80, seed=37)
    llm.generate(ids, GREEDY, use_tqdm=False)
    assert llm.engine.block_manager.num_cached_prefix_pages(ids) == (len(ids) - 1) // 4
    out = llm.generate(ids, SamplingParams(n=2, temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=0),
                       use_tqdm=False)[0]
    assert_prompt_logprobs_are_the_truth(out, ids, hf_logprobs(model_dir[1], ids))
    assert all(len(e) == 1 for e in out.prompt_logprobs[1:])  # prompt_logprobs=0: the prompt token alone


def test_a_one_token_prompt_has_one_prompt_logprob_entry(llm):
    out = llm.generate([42], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1), use_tqdm=False)[0]
    assert out.prompt_logprobs == [None]

def test_seeded_sampling_reproduces_whatever_shares_the_batch(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=8, ignore_eos=True)
    alone = llm.generate("a seeded request", p, use_tqdm=False)[0].outputs[0].token_ids
    crowd = llm.generate(
        ["other prompt one", "a seeded request", "x" * 40],
        [SamplingParams(temperature=0.7, max_tokens=12), p, SamplingParams(temperature=0.0, max_tokens=3)],
        use_tqdm=False,
    )[1].outputs[0].token_ids
    assert alone == crowd
    other_seed = llm.generate("a seeded request", SamplingParams(**{**p.__dict__, "seed": 99}), use_tqdm=False)[0]
    assert other_seed.outputs[0].token_ids != alone


def test_n_completions(llm):
    out = llm.generate("abc", SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # different samples
    greedy = llm.generate("abc", SamplingParams(n=2, temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids


def test_stop_conditions(llm):
    base = llm.generate("stop here", SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    third = base.token_ids[2]
    by_id = llm.generate("stop here", SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, stop_token_ids=[third]), use_tqdm=False)[0].outputs[0]
    assert by_id.token_ids == base.token_ids[: base.token_ids.index(third) + 1]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == third
    text = base.text
    stop = text[-1]  # a character the greedy continuation produces
    by_str = llm.generate("stop here", SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert by_str.finish_reason == "stop" and by_str.stop_reason == stop
    assert by_str.text == text[: text.index(stop)]
    with_stop = llm.generate("stop here", SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, stop=stop, include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert with_stop.text == text[: text.index(stop) + 1]


def test_eos_ends_generation_unless_ignored(llm):
    tokens = llm.generate("zz", SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    saved = llm.engine.eos_token_ids
    llm.engine.eos_token_ids = {tokens[2]}  # pretend the third greedy token is the model's EOS
    try:
        out = llm.generate("zz", SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)[0].outputs[0]
        ignored = llm.generate("zz", SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    finally:
        llm.engine.eos_token_ids = saved
    assert out.token_ids == tokens[: tokens.index(tokens[2]) + 1]
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert ignored.token_ids == tokens and ignored.finish_reason == "length"


def test_chat_applies_the_template(llm):
    out = llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)[0]
    assert out.prompt == "<s>user\nhi</s>\n<s>assistant\n"
    assert len(out.outputs[0].token_ids) == 6


def test_bfloat16_parameters_stay_close_to_float32(model_dir):
    _, hf = model_dir
    llm16 = LLM(str(model_dir[0]), dtype="bfloat16", **ENGINE_ARGS)
    ids = llm16.get_tokenizer().encode("low precision weights")
    out = llm16.generate(ids, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    truth = hf_logprobs(hf, ids)
    errors = [abs(out.prompt_logprobs[i][ids[i]].logprob - truth[i - 1][ids[i]]) for i in range(1, len(ids))]
    assert max(errors) < 0.1  # bf16 weights, f32 activations


def test_cli_generate(model_dir, tmp_path, capsys):
    from jaxinfer.cli import main

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first prompt\nsecond prompt\n")
    args = ["generate", "--model", str(model_dir[0]), "--max-tokens", "3", "--max-model-len", "64", "--prompts-file", str(prompts)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "### first prompt" in printed and "### second prompt" in printed
    assert main(["generate", "--model", str(model_dir[0] / "missing"), "x"]) == 1
    assert "does not exist" in capsys.readouterr().err
    # speculative decoding from the command line: the same greedy text
    assert main(args + ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']) == 0
    assert capsys.readouterr().out == printed
    assert main(args + ["--speculative-config", '{"method": "jacobi", "num_speculative_tokens": 2}']) == 1
    assert "speculative_config['method']='jacobi'" in capsys.readouterr().err


def test_cli_streams_one_prompt_and_times_the_start(model_dir, capsys):
    """One prompt is printed as it is generated (the same text as generate), and --verbose tells
    where the start's seconds went, compiles included."""
    from jaxinfer.cli import main

    args = ["generate", "--model", str(model_dir[0]), "--max-tokens", "4", "--max-model-len", "64", "a prompt"]
    assert main(args + ["--verbose"]) == 0
    captured = capsys.readouterr()
    llm = LLM(str(model_dir[0]), max_model_len=64, progress=False)
    expected = llm.generate("a prompt", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0].outputs[0].text
    assert captured.out == expected + "\n"
    report = captured.err
    for phase in ("imports (jax, flax, jaxinfer)", "LLM: weights", "LLM: tokenizer", "LLM: KV cache and engine",
                  "generate", "first token printed", "compiling, inside the phases above"):
        assert phase in report, phase
    assert "4 tokens" in report


# ----------------------------------------------------------------------------- buckets
def test_ten_prompt_lengths_compile_no_more_variants_than_buckets(model_dir):
    llm = LLM(str(model_dir[0]), **ENGINE_ARGS)
    for n in [1, 2, 3, 5, 8, 13, 21, 30, 47, 70]:  # one at a time: each prefill picks its own bucket
        llm.generate([[5 + i % 200 for i in range(n)]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    model_programs = llm.runner.step_fn.num_model_compiles
    assert model_programs == len(llm.runner.keys_seen)  # every bucket compiled exactly once
    assert model_programs <= len(llm.buckets.all_keys())


def test_nothing_compiles_after_warmup(model_dir):
    llm = LLM(str(model_dir[0]), warmup=True, **ENGINE_ARGS)
    assert llm.runner.step_fn.num_model_compiles == len(llm.buckets.all_keys())
    before = compiles(), llm.runner.num_compiles
    prompts = [[7] * n for n in (4, 9, 17, 33, 60, 2, 1)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    llm.generate(prompts[::-1], [SamplingParams(temperature=0.8, top_p=0.5, seed=i, max_tokens=1 + i) for i in range(7)], use_tqdm=False)
    assert (compiles(), llm.runner.num_compiles) == before


RESTART = """
import sys
from jaxinfer import LLM, SamplingParams
from jaxinfer.runtime.compiles import cache_loads, compiles
llm = LLM(sys.argv[1], warmup=True, compilation_cache_dir=sys.argv[2], max_model_len=32, page_size=4, num_pages=64,
          max_num_batched_tokens=8, max_num_seqs=2, progress=False)
llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False)
print(compiles(), cache_loads())
"""


def test_a_restart_with_the_same_model_compiles_nothing(model_dir, tmp_path):
    """Two processes, one after the other, warm up the same model and serve a request with one
    compilation cache: the second loads every executable from it and compiles none."""
    import os
    import subprocess
    import sys

    run = lambda: subprocess.run([sys.executable, "-c", RESTART, str(model_dir[0]), str(tmp_path / "xla")],  # noqa: E731
                                 capture_output=True, text=True, check=True, timeout=300,
                                 env={**os.environ, "JAX_PLATFORMS": "cpu"}).stdout.split()[-2:]
    produced, loaded = map(int, run())
    assert produced > 10 and loaded == 0  # the first start compiled everything
    produced_again, loaded_again = map(int, run())
    assert produced_again == loaded_again == produced  # the second loaded all of it


def test_no_bucket_copies_the_kv_pool(model_dir):
    """The cache is donated and updated in place: no compiled variant holds a pool-sized copy.
    (A 1-token bucket with a short max_model_len used to copy the pool twice per layer.)"""
    from sharding.hlo import pool_sized_copies

    llm = LLM(str(model_dir[0]), **{**ENGINE_ARGS, "max_model_len": 64, "max_num_batched_tokens": 16})
    for key in llm.buckets.all_keys():
        copies = pool_sized_copies(llm.runner.compiled_hlo(key), llm.runner.kv.k.size)
        assert copies == 0, f"{key}: {copies} whole-pool copies"


def test_bfloat16_weights_are_converted_one_layer_at_a_time(model_dir):
    """XLA:CPU computes a bfloat16 dot in float32; the step must convert each layer's weights inside
    the layer loop, never the whole [L, K, N] stack before it (what loop-invariant code motion
    did: every step converted the whole model)."""
    import re

    llm = LLM(str(model_dir[0]), dtype="bfloat16", **ENGINE_ARGS)
    stacked = llm.runner.params["layers"]["gate_up_proj"].get_value().shape  # [L, K, N]
    decode = min((k for k in llm.buckets.all_keys() if k.query_block == 1), key=lambda k: k.num_tokens)
    batch = llm.runner._empty_batch(decode)
    lowered = llm.runner.step_fn.lower(llm.runner.params, llm.runner.kv, batch, llm.runner.token_buffer, decode)
    # compiled as outside the tests (conftest turns XLA's optimizations down for compile speed)
    hlo = lowered.compile({"xla_backend_optimization_level": 2, "xla_cpu_use_fusion_emitters": True}).as_text()
    whole = ",".join(map(str, stacked))
    assert re.search(rf"bf16\[{whole}\]", hlo)  # the parameter is there
    written = re.findall(rf"= f32\[{whole}\]\S* fusion\(", hlo)  # a fusion writing a float32 stack out
    assert not written, "the whole stacked gate_up_proj is converted to float32 before the layer loop"


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "field,value",
    [("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5), ("n", 0), ("top_k", -2), ("max_tokens", 0),
     ("logprobs", -1), ("prompt_logprobs", -3), ("stop_token_ids", [-1]), ("stop", [""]), ("seed", "7"),
     ("min_p", 1.5), ("repetition_penalty", 0.0), ("presence_penalty", 3.0), ("frequency_penalty", -2.5), ("min_tokens", -1)],
)
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}="):
        SamplingParams(**{field: value})


def test_empty_prompt_is_rejected_by_index(llm):
    with pytest.raises(ValueError, match="prompt 1: the prompt is empty"):
        llm.generate(["fine", ""], GREEDY, use_tqdm=False)


def test_prompt_over_max_model_len_is_rejected_by_index(llm):
    with pytest.raises(ValueError, match=r"prompt 0: the prompt has 120 tokens, over max_model_len=96"):
        llm.generate([[5] * 120, [5] * 3], GREEDY, use_tqdm=False)
    # the engine is still fine afterwards
    assert len(llm.generate([[5] * 3], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 6


def test_token_id_outside_vocabulary_is_rejected(llm):
    with pytest.raises(ValueError, match="token id 100000 is outside the vocabulary"):
        llm.generate([[1, 100000]], GREEDY, use_tqdm=False)


def test_unknown_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unknown architecture.*gpt2"):
        LLM(str(tmp_path), progress=False)


def test_missing_model_path_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        LLM(str(tmp_path / "nowhere"), progress=False)


def test_folder_converted_in_an_older_layout_is_named(tmp_path):
    """A converted folder whose marker names another format (v1: separate q/k/v and gate/up
    params) is refused with the folder and the fix, not an orbax shape error."""
    save_hf_model("qwen2", tmp_path)
    (tmp_path / "jaxinfer.json").write_text(json.dumps({"format": "jaxinfer-orbax-v1"}))
    with pytest.raises(ValueError, match=r"converted in format 'jaxinfer-orbax-v1'.*run `jaxinfer convert`"):
        LLM(str(tmp_path), max_model_len=64, progress=False)


def test_engine_config_is_checked_before_anything_loads_and_then_frozen():
    for bad, message in ((dict(preemption_mode="later"), "preemption_mode='later'"),
                         (dict(kernel_impl="triton"), "kernel_impl='triton'"),
                         (dict(dtype="float64"), "dtype='float64'"),
                         (dict(quantization="int3"), "quantization='int3'"),
                         (dict(page_size=0), "page_size=0"),
                         (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 9}), "num_speculative_tokens")):
        with pytest.raises(ValueError, match=message):
            EngineConfig(**bad)
        with pytest.raises(ValueError, match=message):
            LLM("/no/such/model", **bad)  # the settings are wrong before the model is looked for
    config = EngineConfig(max_num_seqs=64, max_num_batched_tokens=16, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert config.max_num_seqs == 16 and config.speculative_config.spec_block == 4  # a sequence needs a token of the budget
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_num_seqs = 3
    with pytest.raises(TypeError, match="max_num_sequences"):
        LLM(max_num_sequences=4)  # a misspelt setting names itself
