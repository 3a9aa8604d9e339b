"""The whole model with the Pallas kernels (interpret mode) gives the reference model's logits.

One tiny model (untied LM head, biases, 6 query heads of 128 on 3 KV heads) runs the same steps twice,
once on the XLA reference paths and once with a platform's Pallas kernels: a long fresh prefill
(which takes the flash attention kernel), then a mixed step of decodes and prefill chunks with
cached prefixes (the ragged paged attention kernel, over combined pages on TPU), then a decode
step. Every step also runs the RoPE + KV write (a kernel on GPU) and the fused add + RMSNorm; the weights are int4 except gate/up, so the
quantized matmul kernel and the SwiGLU matmul kernel (float weights only) both run. Each step's
log-probabilities must agree.
"""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.ops.attention import FLASH_MIN_TOKENS
from jaxinfer.ops.batch import Buckets, SequenceChunk, pack_batch, stack_replicas
from jaxinfer.ops.kernels import Kernels, resolve_kernels
from jaxinfer.ops.kv_cache import KVCache
from pallas_kernels.ragged_paged_attention.combined import combined_head_dim
from jaxinfer.runtime.loading import load_params, read_config, resolve_model
from jaxinfer.ops.quantization import quantize_model
from jaxinfer.runtime.step import StepFunction
from tiny_models import save_hf_model

PAGE_SIZE = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-qwen2-kernels")
    save_hf_model("qwen2", directory, intermediate_size=128,  # 128: the TPU SwiGLU kernel's column tile
                  hidden_size=96, head_dim=128, num_attention_heads=6, num_key_value_heads=3)  # head_dim 128: no lane padding on TPU
    return directory


def run_steps(model_dir, kernels: Kernels, quantization: str | None) -> list[np.ndarray]:
    """Log-softmax [rows, V] of every requested row of the two steps, in order."""
    source = resolve_model(model_dir)
    config = read_config(source)
    graphdef, params = load_params(source, config, jnp.float32, jnp.float32, kernels=kernels, progress=False)
    if quantization:
        graphdef, params = quantize_model(graphdef, params, quantization, group_size=32, skip=("layers.gate_up_proj",))
    step = StepFunction(graphdef, num_top_logprobs=0)
    kv = KVCache.create(config, 80, PAGE_SIZE, kernels=kernels)
    if kernels.platform == "tpu":  # TPU pools: one row of K and V per token, exactly the model's heads
        assert kv.combined and kv.kv.shape[3:] == (config.num_kv_heads * 2 * combined_head_dim(config.head_dim),)
    buckets = Buckets((16, FLASH_MIN_TOKENS), max_num_seqs=4, pages_per_seq=32)
    rng = np.random.default_rng(0)
    a, b, c = (list(rng.integers(3, 250, size=n)) for n in (150, 90, 30))
    pages = {name: [list(range(1 + 24 * i, 25 + 24 * i))] for i, name in enumerate("abc")}  # one KV layer group

    steps = [
        # a long step of fresh prefills only (every sequence starts at 0): flash attention
        [SequenceChunk(a[:140], 0, pages["a"], [0, 77, 139]), SequenceChunk(b[:80], 0, pages["b"], [5, 79])],
        # decodes and chunks on top of cached prefixes, plus one fresh prompt: ragged paged attention
        [
            SequenceChunk(a[140:141], 140, pages["a"], [0]),
            SequenceChunk(b[80:90], 80, pages["b"], [0, 9]),
            SequenceChunk(c[:30], 0, pages["c"], [0, 15, 29]),
        ],
        # a decode-only step
        [SequenceChunk(a[141:142], 141, pages["a"], [0]), SequenceChunk(b[90 - 1 : 90], 89, pages["b"], [0])],
    ]
    out = []
    for chunks in steps:
        key, batch, rows = pack_batch(chunks, buckets, PAGE_SIZE)
        logits, kv = step.forward(params, kv, step.place_inputs(stack_replicas([batch])), query_block=key.query_block)
        logprobs = np.asarray(jax.nn.log_softmax(logits[0], axis=-1), np.float64)
        out += [logprobs[r] for r in rows]
    return out


@pytest.fixture(scope="module")
def reference_logprobs(model_dir):
    return run_steps(model_dir, Kernels(), "int4")


# int4 weights but a float gate/up: one run exercises every kernel the model has (attention, flash,
# RoPE + KV write, quantized matmul, SwiGLU matmul, add+RMSNorm); the kernels' own tests cover
# the other dtypes and every quantization mode.
@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_model_with_pallas_kernels_matches_the_reference_model(model_dir, reference_logprobs, platform):
    got = run_steps(model_dir, Kernels(platform, interpret=True), "int4")
    want = reference_logprobs
    assert len(got) == len(want) == 7
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-4)


def pallas_calls(jaxpr) -> dict[str, bool]:
    """Name -> "declares a cost estimate" for every pallas_call in a (closed) jaxpr, nested jaxprs
    (loops, conds, jits) included."""
    calls = {}
    for eqn in jaxpr.jaxpr.eqns if hasattr(jaxpr, "jaxpr") else jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            calls[eqn.params["name"]] = eqn.params.get("cost_estimate") is not None
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr)):
                    calls.update(pallas_calls(sub))
    return calls


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_every_kernel_is_in_the_step(model_dir, platform):
    """The step traced with a platform's kernels calls each of them (none silently falls back; a TPU
    writes its combined KV rows with XLA, pallas_kernels.rope_kv_write), and each declares its cost
    to XLA (a pl.CostEstimate)."""
    source = resolve_model(model_dir)
    config = read_config(source)
    graphdef, params = load_params(source, config, jnp.float32, jnp.float32, kernels=Kernels(platform, True), progress=False)
    graphdef, params = quantize_model(graphdef, params, "int8", skip=("layers.gate_up_proj",))
    step = StepFunction(graphdef, num_top_logprobs=0)
    kv = KVCache.create(config, 80, PAGE_SIZE, kernels=Kernels(platform, True))
    buckets = Buckets((16, FLASH_MIN_TOKENS), max_num_seqs=4, pages_per_seq=32)
    key, batch, _ = pack_batch([SequenceChunk(list(range(3, 203)), 0, [list(range(1, 26))], [0])], buckets, PAGE_SIZE)
    forward = lambda params, kv, batch: step.forward(params, kv, batch, query_block=key.query_block)  # noqa: E731
    calls = pallas_calls(jax.make_jaxpr(forward)(params, kv, step.place_inputs(stack_replicas([batch]))))
    kernels = ("add_rms_norm", "swiglu_matmul", "ragged_paged_attention", "flash_attention", "quantized_matmul")
    kernels += ("rope_kv_write",) if platform == "gpu" else ()
    assert [k for k in kernels if not any(name.startswith(k) for name in calls)] == [], calls
    assert [name for name, has_cost in calls.items() if not has_cost] == []


def test_kernel_impl_resolves_per_backend():
    assert resolve_kernels("auto", "cpu") == Kernels("reference")
    assert resolve_kernels("auto", "tpu") == Kernels("tpu", interpret=False)
    assert resolve_kernels("auto", "cuda") == Kernels("gpu", interpret=False)
    assert resolve_kernels("pallas", "cpu") == Kernels("tpu", interpret=True)
    assert resolve_kernels("pallas-gpu", "cpu") == Kernels("gpu", interpret=True)
    assert resolve_kernels("reference", "tpu") == Kernels("reference")
    with pytest.raises(ValueError, match="kernel_impl='triton'"):
        resolve_kernels("triton", "cpu")


def test_the_kernel_table_names_one_function_per_operation():
    """Every platform fills every entry; the XLA table has no flash path; the TPU table combines
    KV pools (quantized ones too: their scales in one pool, read by the XLA attention), and its XLA fallback for
    attention brings the separate layout back. Tables compare by platform and interpret flag alone."""
    entries = ("ragged_attention", "rope_kv_write", "quantized_matmul", "add_rms_norm", "swiglu_matmul", "grouped_matmul")
    for table in (Kernels(), Kernels("tpu", interpret=True), Kernels("gpu", interpret=True)):
        assert all(callable(getattr(table, name)) for name in entries), table
    assert Kernels().flash_attention is None and callable(Kernels("gpu", interpret=True).flash_attention)
    tpu = Kernels("tpu", interpret=True)
    assert tpu.combines_kv  # every dtype, quantized ones included
    assert not Kernels("tpu", interpret=True, xla=("ragged_attention",)).combines_kv
    assert not Kernels().combines_kv and not Kernels("gpu", interpret=True).combines_kv
    assert Kernels("tpu", interpret=True) == resolve_kernels("pallas", "cpu") and len({Kernels(), Kernels()}) == 1
    with pytest.raises(ValueError, match="platform='cuda'"):
        Kernels("cuda")


def test_tpu_pools_with_padded_lanes_match_the_reference(tmp_path_factory):
    """head_dim 16, below the 64 lanes a combined row gives K and V of a head (combined.py): the
    TPU pool stores each in 64 lanes with zeros past 16, and K and V share one 128-lane row the
    attention kernel multiplies whole (the Ds = 64 case of SmolLM2 and Llama-3.2-1B)."""
    directory = tmp_path_factory.mktemp("tiny-qwen2-narrow-heads")
    save_hf_model("qwen2", directory, intermediate_size=128)  # 4 query heads of 16 on 1 KV head
    got = run_steps(directory, Kernels("tpu", interpret=True), None)
    want = run_steps(directory, Kernels(), None)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-4)


def test_gemma4_groups_of_two_row_widths_on_tpu_pools_match_the_reference(tmp_path_factory):
    """Gemma 4 on a TPU pool: the global layers' rows (1 KV head of 128) are twice the sliding
    layers' (1 of 64), so a sliding group's page is two pages of 8 tokens side by side in the lanes
    (`lane_blocks`: the kernel and the KV write address them; a reshape would make XLA copy the pool
    every layer). Prompts past the window of 6, one in two chunks (the second reading K/V the first
    wrote): the reference model's log-probs."""
    from jaxinfer.kv_groups import kv_groups
    from jaxinfer.ops.kv_cache import page_factors

    directory = tmp_path_factory.mktemp("tiny-gemma4-lanes")
    save_hf_model("gemma4", directory, head_dim=64, global_head_dim=128, num_key_value_heads=1, num_global_key_value_heads=1,
                  num_hidden_layers=3, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                  num_kv_shared_layers=0, enable_moe_block=False, hidden_size_per_layer_input=0)  # the attention is what differs
    prompts = [list(np.random.default_rng(i).integers(3, 250, size=n)) for i, n in enumerate((13, 20))]

    def run(kernels: Kernels) -> list[np.ndarray]:
        source = resolve_model(directory)
        config = read_config(source)
        graphdef, params = load_params(source, config, jnp.float32, jnp.float32, kernels=kernels, progress=False)
        groups = kv_groups(config)
        factors = page_factors(groups, combined=kernels.combines_kv)
        assert factors == (2, 2, 1)  # the sliding groups' pages hold twice the tokens, either way
        step, kv = StepFunction(graphdef, num_top_logprobs=0), KVCache.create(config, 40, PAGE_SIZE, kernels=kernels)
        buckets = Buckets((32,), max_num_seqs=2, pages_per_seq=4, num_groups=groups.num_groups)
        pages = [[list(range(1 + 12 * i + 4 * g, 5 + 12 * i + 4 * g)) for g in range(groups.num_groups)] for i in range(2)]
        # prefills: the first chunk of one prompt, the whole of the other; then the rest of the first
        steps = [[SequenceChunk(prompts[0][:8], 0, pages[0], list(range(8))), SequenceChunk(prompts[1], 0, pages[1], [0, 19])],
                 [SequenceChunk(prompts[0][8:], 8, pages[0], list(range(5)))]]
        out = []
        for chunks in steps:
            key, batch, rows = pack_batch(chunks, buckets, [PAGE_SIZE * f for f in factors])
            logits, kv = step.forward(params, kv, step.place_inputs(stack_replicas([batch])), query_block=key.query_block)
            out += list(np.asarray(jax.nn.log_softmax(logits[0], axis=-1), np.float64)[np.concatenate(rows)])
        return out

    for got, want in zip(run(Kernels("tpu", interpret=True)), run(Kernels())):
        np.testing.assert_allclose(got, want, atol=1e-4)
