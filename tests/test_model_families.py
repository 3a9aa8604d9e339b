"""The newer families through the engine, as a user runs them: `LLM(<folder>)` and `jaxinfer
generate --model <folder>` on tiny random Gemma 3 and GPT-OSS models (windows of 6 tokens, far
shorter than the prompts). Greedy text equals transformers' `generate`, a prompt batched with
others equals it alone, and a pool too small for the batch preempts and still gives the same
tokens (the recomputed prefill crosses the windows again)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jaxinfer import LLM, SamplingParams
from tiny_models import save_hf_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT_LENGTHS = (5, 13, 21)  # within, across and well past a 6-token window


@pytest.fixture(scope="module", params=["gemma3", "gpt_oss"])
def family_dir(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    return directory, save_hf_model(request.param, directory)


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [[int(t) for t in rng.integers(3, 250, n)] for n in PROMPT_LENGTHS]


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(ids):].tolist()


def test_greedy_generation_equals_transformers_batched_alone_and_preempted(family_dir):
    directory, hf = family_dir
    # chunks of 8 tokens: prefills cross the windows in pieces; 12 pages of 4 tokens hold two of
    # the three sequences at their full length, so the third is preempted and recomputed
    llm = LLM(str(directory), max_model_len=48, page_size=4, num_pages=13, max_num_batched_tokens=8, max_num_seqs=4,
              progress=False)
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]
    assert llm.engine.get_stats().num_preemptions > 0
    assert batched == [hf_greedy(hf, ids, GREEDY.max_tokens) for ids in prompts()]
    alone = [llm.generate([ids], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for ids in prompts()]
    assert alone == batched


def test_cli_generate_runs_a_gemma3_folder(tmp_path, capsys):
    from jaxinfer.cli import main

    save_hf_model("gemma3", tmp_path)
    assert main(["generate", "--model", str(tmp_path), "--max-tokens", "4", "--max-model-len", "64", "a prompt"]) == 0
    expected = LLM(str(tmp_path), max_model_len=64, progress=False).generate(
        "a prompt", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0].outputs[0].text
    assert capsys.readouterr().out == expected + "\n"
