"""DeepSeek-V3 (multi-head latent attention, DeepSeekMoE) through the engine, as a user runs it.

A tiny random DeepSeek-V3 (tests/tiny_models.py: queries through a low rank, a latent of 32 and
a shared RoPE key of 8, interleaved, YaRN with mscale_all_dim, a dense first layer then routed
and shared experts); its logits are tests/test_model_parity.py's and its meshes
tests/test_sharded_model.py's. Greedy text equals transformers' `generate` batched, alone, under
preemption and with prefix-cache hits; the cache holds the latent row alone, kv_lora_rank +
qk_rope_head_dim values per token and layer.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams
from jaxinfer.config import ConfigError
from test_model_families import hf_greedy
from tiny_models import save_hf_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("deepseek_v3")
    return directory, save_hf_model("deepseek_v3", directory)


def test_greedy_decoding_equals_transformers_batched_alone_preempted_and_from_the_prefix_cache(deepseek_dir):
    directory, hf = deepseek_dir
    rng = np.random.default_rng(11)
    shared = [int(t) for t in rng.integers(3, 250, 12)]
    prompts = [shared + [int(t) for t in rng.integers(3, 250, n)] for n in (1, 9, 17)]
    want = [hf_greedy(hf, ids, GREEDY.max_tokens) for ids in prompts]
    # prefills in chunks of 8; 3 layers x pages of 4 tokens: 16 pages cannot hold all three at once
    llm = LLM(str(directory), max_model_len=48, page_size=4, num_pages=17, max_num_batched_tokens=8, max_num_seqs=3,
              enable_prefix_caching=True, progress=False)
    kv = llm.runner.kv  # the latent rows alone: (kv_lora_rank + qk_rope_head_dim) x 4 bytes per token and layer
    assert kv.v is None and kv.kv_scale is None and kv.pages.shape == (3, 17, 4, 32 + 8)
    assert kv.nbytes() / (3 * 17 * 4) == (32 + 8) * 4
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert llm.engine.get_stats().num_preemptions > 0
    assert batched == want
    alone = [llm.generate([ids], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for ids in prompts]
    assert alone == want
    assert llm.engine.get_stats().prefix_cache_hit_rate > 0  # the shared 12 tokens: 3 whole pages


def test_lora_on_latent_attention_is_refused_by_name(deepseek_dir):
    with pytest.raises(ConfigError, match="multi-head latent attention"):
        LLM(str(deepseek_dir[0]), enable_lora=True, max_model_len=32, progress=False)
