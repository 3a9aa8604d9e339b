"""The newer families through the engine, as a user runs them: `LLM(<folder>)` and `jaxinfer
generate --model <folder>` on a tiny random Gemma 3 (windows of 6 tokens, far shorter than the
prompts; the other families' logits are tests/test_model_parity.py's). Greedy text equals transformers' `generate`, a prompt batched with
others equals it alone, and a pool too small for the batch preempts and still gives the same
tokens (the recomputed prefill crosses the windows again)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from jaxinfer import LLM, SamplingParams
from tiny_models import save_hf_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT_LENGTHS = (5, 13, 21)  # within, across and well past a 6-token window


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gemma3")
    return directory, save_hf_model("gemma3", directory)


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


def test_cli_generate_runs_a_gemma3_folder(family_dir, capsys):
    from jaxinfer.cli import main

    directory, hf = family_dir
    assert main(["generate", "--model", str(directory), "--max-tokens", "4", "--max-model-len", "64", "a prompt"]) == 0
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    ids = tokenizer.encode("a prompt")
    with torch.no_grad():  # greedy, stopping at EOS as the CLI does
        want = hf.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)[0, len(ids):].tolist()
    assert capsys.readouterr().out == tokenizer.decode(want, skip_special_tokens=True) + "\n"
