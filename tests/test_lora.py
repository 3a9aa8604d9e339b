"""Multi-LoRA serving: PEFT adapters over one base model, in a slot table on the device.

The truth is transformers + peft on the same tiny model and adapter (random non-zero LoRA
weights, float32); a batch mixing adapters equals each request alone; adapters beyond the
table's slots cycle through it without a recompile; tensor-parallel LoRA equals one device; a
bad adapter fails its own request only.
"""

from __future__ import annotations

import json
import shutil
import threading

import jax

import numpy as np
import peft
import pytest
import torch
import transformers

from jaxinfer import LLM, LoRARequest, SamplingParams
from jaxinfer.ops.batch import Buckets, SequenceChunk, pack_batch, stack_replicas
from jaxinfer.runtime.compiles import compiles
from tiny_models import save_hf_model

SETTINGS = dict(max_model_len=128, page_size=4, num_pages=256, max_num_batched_tokens=64, max_num_seqs=16, progress=False)
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TARGET_SETS = {"attention q v": ("q_proj", "v_proj"), "all seven": ALL, "mlp": ("gate_proj", "up_proj", "down_proj"),
               "k o": ("k_proj", "o_proj")}
PROMPT = [5, 17, 99, 3, 42, 7, 8, 120, 33, 250, 4]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("lora-base")
    save_hf_model("llama3.2", directory)
    return directory


def make_adapter(base_dir, out_dir, targets=ALL, r=4, alpha=8, seed=0, **extra):
    """A PEFT adapter with random non-zero A and B, saved in PEFT's format."""
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    model = peft.get_peft_model(base, peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets),
                                                      init_lora_weights=False, **extra))
    model.save_pretrained(out_dir)
    return model


def peft_log_softmax(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1).numpy()


def jax_log_softmax(llm, ids, lora: LoRARequest | None):
    """Every position's next-token log-softmax [n, V] from the engine's own step, in the slot the
    engine's LoRA manager gives the adapter."""
    slot = 0
    if lora is not None:
        llm.engine.lora.check(lora)
        slot = llm.engine.lora.slot(lora.lora_int_id, {lora.lora_int_id})
    runner, n = llm.runner, len(ids)
    pages = list(range(1, -(-n // runner.page_size) + 1))
    key, batch, rows = pack_batch([SequenceChunk(ids, 0, [pages], list(range(n)), lora_slot=slot)],
                                  Buckets((16,), max_num_seqs=1, pages_per_seq=runner.buckets.pages_per_seq),
                                  runner.page_size, with_lora=True)
    logits, runner.kv = runner.step_fn.forward(runner.params, runner.kv, runner.step_fn.place_inputs(stack_replicas([batch])),
                                               query_block=key.query_block)
    return np.asarray(jax.nn.log_softmax(logits[0].astype(np.float64), axis=-1))[rows[0]]


@pytest.fixture(scope="module")
def llm(base_dir):
    return LLM(str(base_dir), enable_lora=True, max_loras=2, max_lora_rank=8, **SETTINGS)


# ----------------------------------------------------------------------------- the truth: peft
@pytest.mark.parametrize("name", list(TARGET_SETS))
def test_logits_with_an_adapter_equal_transformers_with_peft(llm, base_dir, tmp_path, name):
    model = make_adapter(base_dir, tmp_path / "adapter", TARGET_SETS[name], seed=len(name))
    lora = LoRARequest(name, 10 + list(TARGET_SETS).index(name), str(tmp_path / "adapter"))
    ours, truth = jax_log_softmax(llm, PROMPT, lora), peft_log_softmax(model, PROMPT)
    assert np.abs(ours - truth).max() < 1e-4
    assert np.abs(jax_log_softmax(llm, PROMPT, None) - truth).max() > 1e-2  # the adapter does change the logits


def test_rslora_and_a_smaller_rank_than_the_table(llm, base_dir, tmp_path):
    model = make_adapter(base_dir, tmp_path / "rs", ("q_proj", "down_proj"), r=2, alpha=6, seed=5, use_rslora=True)
    ours = jax_log_softmax(llm, PROMPT, LoRARequest("rs", 20, str(tmp_path / "rs")))
    assert np.abs(ours - peft_log_softmax(model, PROMPT)).max() < 1e-4


# ----------------------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def adapters(base_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    out = []
    for i, targets in enumerate([ALL, ("q_proj", "v_proj"), ("gate_proj", "up_proj", "down_proj"), ("k_proj", "o_proj"), ALL]):
        make_adapter(base_dir, root / f"a{i}", targets, seed=100 + i)
        out.append(LoRARequest(f"a{i}", i + 1, str(root / f"a{i}")))
    return out


def greedy(n=12):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_a_batch_mixing_four_adapters_and_the_base_equals_each_request_alone(base_dir, adapters):
    llm = LLM(str(base_dir), enable_lora=True, max_loras=4, max_lora_rank=8, **SETTINGS)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, 250, int(rng.integers(3, 30)))] for _ in range(10)]
    loras = [adapters[i % 4] if i % 5 else None for i in range(10)]  # four adapters and the base model
    alone = [llm.generate([p], greedy(), lora_request=lr, use_tqdm=False)[0].outputs[0].token_ids for p, lr in zip(prompts, loras)]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(), lora_request=loras, use_tqdm=False)]
    assert together == alone
    assert len({tuple(t) for t in alone}) > 5  # the adapters make different outputs


def test_more_adapters_than_slots_cycle_through_lru_after_warmup_without_compiling(base_dir, adapters):
    small_buckets = {**SETTINGS, "max_num_batched_tokens": 16, "max_num_seqs": 8}  # fewer programs to warm
    llm = LLM(str(base_dir), enable_lora=True, max_loras=2, max_lora_rank=8, warmup=True, **small_buckets)
    compiled = compiles(), llm.runner.num_compiles  # warm-up compiled the steps with and without LoRA
    prompt = [7, 8, 9, 10, 11, 12]
    first = {lr.lora_int_id: llm.generate([prompt], greedy(), lora_request=lr, use_tqdm=False)[0].outputs[0].token_ids
             for lr in adapters}
    loads = llm.engine.lora.num_loads
    # five adapters through two slots, all at once and again one by one: the same outputs
    batch = llm.generate([prompt] * 5, greedy(), lora_request=adapters, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in batch] == [first[lr.lora_int_id] for lr in adapters]
    for lr in reversed(adapters):
        assert llm.generate([prompt], greedy(), lora_request=lr, use_tqdm=False)[0].outputs[0].token_ids == first[lr.lora_int_id]
    assert (compiles(), llm.runner.num_compiles) == compiled  # nothing compiled for an adapter, a slot or the base
    assert llm.engine.lora.num_loads > loads + 5  # the slots were refilled


def test_the_prefix_cache_keeps_adapters_apart(base_dir, adapters):
    llm = LLM(str(base_dir), enable_lora=True, max_loras=2, max_lora_rank=8, **SETTINGS)
    prompt = list(range(3, 40))  # several full pages
    with_a = llm.generate([prompt], greedy(), lora_request=adapters[0], use_tqdm=False)[0].outputs[0].token_ids
    base = llm.generate([prompt], greedy(), use_tqdm=False)[0].outputs[0].token_ids  # must not reuse adapter 0's pages
    fresh = LLM(str(base_dir), **SETTINGS).generate([prompt], greedy(), use_tqdm=False)[0].outputs[0].token_ids
    assert base == fresh and with_a != base
    again = llm.generate([prompt], greedy(), lora_request=adapters[0], use_tqdm=False)[0].outputs[0].token_ids
    assert again == with_a and llm.engine.get_stats().prefix_cache_hit_rate > 0



def test_prompt_logprobs_of_an_adapter_whose_prompt_pages_are_cached(llm, base_dir, tmp_path):
    """A request asking for prompt logprobs gets one per prompt token, the adapter's truth, even
    when the prefix cache holds its prompt's pages under its adapter."""
    model = make_adapter(base_dir, tmp_path / "pl", ALL, seed=7)
    lora = LoRARequest("pl", 30, str(tmp_path / "pl"))
    prompt = [int(t) for t in np.random.default_rng(8).integers(3, 250, 30)]  # 7 full pages before its last token
    llm.generate([prompt], greedy(2), lora_request=lora, use_tqdm=False)  # computes and caches them
    hits = llm.engine.block_manager.stats.hits
    llm.generate([prompt], greedy(2), lora_request=lora, use_tqdm=False)
    assert llm.engine.block_manager.stats.hits - hits == 7  # cached under the adapter
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1), lora_request=lora,
                       use_tqdm=False)[0]
    truth = peft_log_softmax(model, prompt)
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    errors = [abs(out.prompt_logprobs[i][prompt[i]].logprob - truth[i - 1][prompt[i]]) for i in range(1, len(prompt))]
    assert max(errors) < 1e-4

def test_data_parallel_replicas_share_the_table(base_dir, adapters):
    """Two replicas, two slots: each replica runs one adapter at a time, the outputs are unchanged."""
    one = LLM(str(base_dir), enable_lora=True, max_loras=2, max_lora_rank=8, **SETTINGS)
    two = LLM(str(base_dir), enable_lora=True, max_loras=2, max_lora_rank=8, data_parallel_size=2, **SETTINGS)
    prompts = [[3 + i, 4, 5, 6 + i] for i in range(8)]
    loras = [adapters[i % 4] for i in range(8)]
    expected = [o.outputs[0].token_ids for o in one.generate(prompts, greedy(), lora_request=loras, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in two.generate(prompts, greedy(), lora_request=loras, use_tqdm=False)] == expected


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_the_models_delta_through_the_sgmv_kernels_gives_the_same_logits(llm, adapters, platform):
    """The model with its kernel table's LoRA entry set to a platform's SGMV kernels (interpret
    mode; the other entries stay on the XLA paths): a step mixing two adapters and the base model
    gives the XLA path's log-probabilities."""
    import dataclasses
    import functools

    from flax import nnx

    from jaxinfer.runtime.step import StepFunction
    from pallas_kernels.lora_sgmv import lora_delta_gpu, lora_delta_tpu

    kernel = {"tpu": lora_delta_tpu, "gpu": lora_delta_gpu}[platform]
    runner = llm.runner
    model = nnx.merge(runner.graphdef, runner.params)
    model.kernels = dataclasses.replace(model.kernels, lora_delta=functools.partial(kernel, interpret=True))
    with_kernel = StepFunction(nnx.split(model)[0], num_top_logprobs=0)
    slots = []
    for lr in adapters[:2]:
        llm.engine.lora.check(lr)
        slots.append(llm.engine.lora.slot(lr.lora_int_id, {a.lora_int_id for a in adapters[:2]}))
    prompts = [PROMPT, PROMPT[:7], PROMPT[3:]]
    chunks, first_page = [], 1
    for ids, slot in zip(prompts, [slots[0], 0, slots[1]]):
        pages = list(range(first_page, first_page + -(-len(ids) // runner.page_size)))
        chunks.append(SequenceChunk(ids, 0, [pages], list(range(len(ids))), lora_slot=slot))
        first_page += len(pages)
    key, batch, _ = pack_batch(chunks, Buckets((32,), max_num_seqs=4, pages_per_seq=runner.buckets.pages_per_seq),
                               runner.page_size, with_lora=True)
    log_probs = []
    for step in (runner.step_fn, with_kernel):
        logits, runner.kv = step.forward(runner.params, runner.kv, step.place_inputs(stack_replicas([batch])),
                                         query_block=key.query_block)
        log_probs.append(np.asarray(jax.nn.log_softmax(logits[0].astype(np.float64), axis=-1)))
    assert np.abs(log_probs[1] - log_probs[0]).max() < 1e-5


def test_tensor_and_pipeline_parallel_lora_equal_one_device(base_dir, adapters):
    """The slot table split like the weights: over tensor shards, and by layer over pipeline stages."""
    one = LLM(str(base_dir), enable_lora=True, max_loras=2, max_lora_rank=8, **SETTINGS)
    for sizes in (dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)):
        two = LLM(str(base_dir), enable_lora=True, max_loras=2, max_lora_rank=8, **sizes, **SETTINGS)
        for lr in adapters[:3]:
            assert np.abs(jax_log_softmax(two, PROMPT, lr) - jax_log_softmax(one, PROMPT, lr)).max() < 1e-4


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "llama4"])
def test_a_moe_model_serves_attention_adapters_and_refuses_mlp_ones(family, tmp_path):
    """A MoE model's experts take no adapter; its attention does, with peft's logits (Llama 4: on q/k rows
    reordered from RoPE pairs to halves at load, the adapter's B columns alike)."""
    save_hf_model(family, tmp_path / "base")
    model = make_adapter(tmp_path / "base", tmp_path / "attn", ("q_proj", "k_proj", "v_proj", "o_proj"), seed=7)
    llm = LLM(str(tmp_path / "base"), enable_lora=True, max_loras=1, max_lora_rank=8, **SETTINGS)
    ours, truth = jax_log_softmax(llm, PROMPT, LoRARequest("attn", 1, str(tmp_path / "attn"))), peft_log_softmax(model, PROMPT)
    assert np.abs(ours - truth).max() < 1e-4
    assert np.abs(jax_log_softmax(llm, PROMPT, None) - truth).max() > 1e-2  # the adapter does change the logits
    mlp = ("w1", "w3") if family == "mixtral" else ("gate_proj", "up_proj")  # Qwen2-MoE: its shared expert's
    shutil.copytree(tmp_path / "attn", tmp_path / "mlp")
    config = json.loads((tmp_path / "mlp" / "adapter_config.json").read_text())
    (tmp_path / "mlp" / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["q_proj", *mlp]}))
    with pytest.raises(ValueError, match=f"request 'mlp'.*{mlp[0]}.*not served"):
        llm.engine.add_request("mlp", [3, 4, 5], greedy(), lora_request=LoRARequest("mlp", 2, str(tmp_path / "mlp")))


# ----------------------------------------------------------------------------- bad adapters
def broken_adapters(base_dir, root):
    """name -> (folder, the words the error must contain)."""
    out = {}
    make_adapter(base_dir, root / "good", ("q_proj",), seed=1)

    def variant(name, edit_config=None, remove=None):
        shutil.copytree(root / "good", root / name)
        if edit_config:
            cfg = json.loads((root / name / "adapter_config.json").read_text())
            edit_config(cfg)
            (root / name / "adapter_config.json").write_text(json.dumps(cfg))
        if remove:
            (root / name / remove).unlink()
        return root / name

    out["dora"] = (variant("dora", lambda c: c.update(use_dora=True)), "DoRA")
    out["rank"] = (variant("rank", lambda c: c.update(r=64)), "max_lora_rank")
    out["embed"] = (variant("embed", lambda c: c.update(target_modules=["q_proj", "embed_tokens"])), "embed_tokens")
    out["saved"] = (variant("saved", lambda c: c.update(modules_to_save=["lm_head"])), "modules_to_save")
    out["missing"] = (variant("missing", remove="adapter_model.safetensors"), "adapter_model.safetensors")
    (root / "garbage").mkdir()
    (root / "garbage" / "adapter_config.json").write_text("{not json")
    (root / "garbage" / "adapter_model.safetensors").write_bytes(b"nope")
    out["garbage"] = (root / "garbage", "not valid JSON")
    return out


def test_bad_adapters_fail_only_their_request(llm, base_dir, tmp_path):
    engine = llm.engine
    engine.add_request("fine", [3, 4, 5], greedy(6))
    for i, (name, (folder, words)) in enumerate(broken_adapters(base_dir, tmp_path).items()):
        with pytest.raises(ValueError, match=f"request 'bad-{name}'.*{words}"):
            engine.add_request(f"bad-{name}", [3, 4, 5], greedy(), lora_request=LoRARequest(name, 50 + i, str(folder)))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert set(done) == {"fine"} and len(done["fine"].outputs[0].token_ids) == 6
    with pytest.raises(ValueError, match="enable_lora"):
        LLM(str(base_dir), **SETTINGS).generate([[3, 4]], greedy(), lora_request=LoRARequest("x", 1, str(tmp_path)))


# ----------------------------------------------------------------------------- the server
def test_the_server_serves_adapters_by_name_and_loads_them_at_run_time(base_dir, adapters):
    import httpx
    import openai

    from http_server import running
    from jaxinfer.server.app import build_app

    llm = LLM(str(base_dir), enable_lora=True, max_loras=2, max_lora_rank=8, **SETTINGS)
    expected = {lr.lora_name: llm.generate([[3, 4, 5, 6]], greedy(), lora_request=lr, use_tqdm=False)[0].outputs[0].text
                for lr in adapters[:3]}
    base = llm.generate([[3, 4, 5, 6]], greedy(), use_tqdm=False)[0].outputs[0].text
    closed = build_app(llm, served_model_name="tiny", lora_modules={"a0": adapters[0].lora_path})
    with running(closed) as root:  # loading adapters over HTTP reads server folders: only when asked for
        r = httpx.post(f"{root}/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": adapters[2].lora_path})
        assert r.status_code == 404 and "--allow-runtime-lora-updating" in r.json()["error"]["message"]
        assert httpx.post(f"{root}/v1/unload_lora_adapter", json={"lora_name": "a0"}).status_code == 404
    app = build_app(llm, served_model_name="tiny", lora_modules={"a0": adapters[0].lora_path, "a1": adapters[1].lora_path},
                    allow_runtime_lora_updating=True)
    with running(app) as root:
        url = root + "/v1"
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["tiny", "a0", "a1"]

        def tokens(model):  # the completion's text and the model the response names
            out = client.completions.create(model=model, prompt=[3, 4, 5, 6], max_tokens=12, temperature=0.0,
                                            extra_body={"ignore_eos": True})
            return out.choices[0].text, out.model

        for name in ("a0", "a1"):
            text, model = tokens(name)
            assert model == name and text == expected[name]
        assert tokens("tiny")[0] == base
        with pytest.raises(openai.NotFoundError, match="a2"):
            tokens("a2")
        r = httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "a2", "lora_path": adapters[2].lora_path})
        assert r.status_code == 200, r.text
        assert tokens("a2")[0] == expected["a2"]  # a third adapter through two slots
        bad = httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "bad", "lora_path": "/nonexistent"})
        assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
        assert httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "a1"}).status_code == 200
        assert [m.id for m in client.models.list().data] == ["tiny", "a0", "a2"]
        with pytest.raises(openai.NotFoundError):
            tokens("a1")
        assert httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "a1"}).status_code == 404
        unloading_an_adapter_a_request_is_being_tokenized_for_is_refused(app, url, llm, expected["a0"])


def unloading_an_adapter_a_request_is_being_tokenized_for_is_refused(app, url, llm, expected_text):
    """While a request naming "a0" is being tokenized and checked (held here, in the server's
    worker thread), "a0" cannot be unloaded (409); the request then runs with it."""
    import httpx

    processor, real = llm.engine.input, llm.engine.input.make_request
    tokenizing, go_on = threading.Event(), threading.Event()

    def held(*args, **kwargs):
        tokenizing.set()
        go_on.wait(30)
        return real(*args, **kwargs)

    result = {}
    body = {"model": "a0", "prompt": [3, 4, 5, 6], "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    client = threading.Thread(target=lambda: result.update(r=httpx.post(f"{url}/completions", json=body, timeout=60)))
    processor.make_request = held
    try:
        client.start()
        assert tokenizing.wait(30)
        refused = httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "a0"}, timeout=10)
        assert refused.status_code == 409 and "in use" in refused.json()["error"]["message"]
    finally:
        processor.make_request = real
        go_on.set()
        client.join(60)
    assert result["r"].status_code == 200 and result["r"].json()["choices"][0]["text"] == expected_text
    assert httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "a0"}).status_code == 200
    assert llm.engine.lora.pins(1) == 0 and 1 not in llm.engine.lora.held


def test_the_host_keeps_pinned_adapters_and_at_most_max_cpu_loras_others(llm, adapters):
    """Adapters read on several threads at once; pinned ones stay (and cannot be removed), the
    others are dropped least recently used first past max_cpu_loras (= max_loras here)."""
    manager = llm.engine.lora
    first = adapters[0]
    manager.pin(first.lora_int_id)
    try:
        errors = []

        def check_all():
            try:
                for lr in adapters:
                    manager.check(lr)
            except Exception as e:  # noqa: BLE001 - collected for the assertion below
                errors.append(e)

        threads = [threading.Thread(target=check_all) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert errors == []
        assert first.lora_int_id in manager.held and len(manager.held) <= manager.max_cpu_loras + 1
        with pytest.raises(ValueError, match="in use"):
            manager.remove(first.lora_int_id)
    finally:
        manager.unpin(first.lora_int_id)
    assert len(manager.held) <= manager.max_cpu_loras  # trimmed once nothing pins the extra one
    out = llm.generate([[3, 4, 5]], greedy(4), lora_request=adapters[2], use_tqdm=False)[0]  # read again, pinned while it ran
    assert len(out.outputs[0].token_ids) == 4 and manager.pins(adapters[2].lora_int_id) == 0


def test_a_request_the_engine_fails_gives_back_its_adapters_pin(llm, adapters):
    engine, lora = llm.engine, adapters[1]
    request = engine.add_request("doomed", [3, 4, 5, 6], greedy(4), lora_request=lora)
    assert engine.lora.pins(lora.lora_int_id) == 1
    request.seqs[0].token_ids[1] = 2**40  # no int32 holds it: packing its step fails, for it alone
    while engine.has_unfinished_requests():
        outs = engine.step()
    assert outs[-1].outputs[0].finish_reason == "error" and engine.lora.pins(lora.lora_int_id) == 0
    engine.lora.remove(lora.lora_int_id)  # nothing holds it now


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
                                  {"method": "draft_model", "num_layers": 1, "num_speculative_tokens": 2}])
def test_speculative_decoding_keeps_an_adapters_output(base_dir, adapters, spec):
    """Drafts come from the base model (n-gram lookup, or the target's first layer without the
    table); verification runs under the adapter, so the output is the adapter's."""
    prompt = [3, 4, 5, 6, 3, 4, 5, 6]
    plain = LLM(str(base_dir), enable_lora=True, max_loras=2, max_lora_rank=8, **SETTINGS)
    expected = plain.generate([prompt], greedy(20), lora_request=adapters[0], use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(str(base_dir), enable_lora=True, max_loras=2, max_lora_rank=8, speculative_config=spec, **SETTINGS)
    assert llm.generate([prompt], greedy(20), lora_request=adapters[0], use_tqdm=False)[0].outputs[0].token_ids == expected
    assert llm.engine.core.num_draft_tokens > 0
