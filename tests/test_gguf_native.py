"""A GGUF model runs from its own quantized grid: no float copy of a matrix, the logits of the
float-dequantized model, and the memory its bits say.

The tiny model is a GGUF file written here, mixing block types the way llama.cpp's Q4_K_M files
do, so every joining rule is exercised: q and k in Q4_K with v in Q6_K (one fused parameter: int8,
groups of 16, offsets), the output projection in Q4_0 (int4, no offsets), gate and up in Q4_1
(int4 with float16 offsets), the down projection Q4_K in layer 0 and Q5_K in layer 1 (int8, groups
of 32, offsets), the tied embedding in Q8_0 (int8 in the LM head's orientation).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter

from jaxinfer.ops.quantization import QuantizedWeight, param_bytes
from jaxinfer.runtime.evaluate import prompt_log_softmax
from jaxinfer.runtime.loading import load_params, read_config, resolve_model
from jaxinfer.tree import nested_to_flat
from test_checkpoints_gguf import quantized_tensor

H, I, V, HQ, HKV, L = 256, 512, 300, 4, 2, 2
D = H // HQ
TYPES = {"attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q6_K, "attn_output": Q.Q4_0, "ffn_gate": Q.Q4_1,
         "ffn_up": Q.Q4_1, "ffn_down": (Q.Q4_K, Q.Q5_K)}
SHAPES = {"attn_q": (HQ * D, H), "attn_k": (HKV * D, H), "attn_v": (HKV * D, H), "attn_output": (H, HQ * D),
          "ffn_gate": (I, H), "ffn_up": (I, H), "ffn_down": (H, I)}


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf-native") / "tiny.gguf"
    rng = np.random.default_rng(0)
    w = GGUFWriter(path, "llama")
    w.add_block_count(L)
    w.add_embedding_length(H)
    w.add_feed_forward_length(I)
    w.add_head_count(HQ)
    w.add_head_count_kv(HKV)
    w.add_context_length(256)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(V)
    raw, _ = quantized_tensor(Q.Q8_0, V, H)
    w.add_tensor("token_embd.weight", raw, raw_dtype=Q.Q8_0)
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(H)).astype(np.float32))
    for layer in range(L):
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{layer}.{norm}.weight", (1 + 0.1 * rng.standard_normal(H)).astype(np.float32))
        for name, qtype in TYPES.items():
            qtype = qtype[layer] if isinstance(qtype, tuple) else qtype
            raw, _ = quantized_tensor(qtype, *SHAPES[name], scale_exponents=(-13, -10))
            w.add_tensor(f"blk.{layer}.{name}.weight", raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    source = resolve_model(path)
    config = read_config(source)
    native = load_params(source, config, jnp.float32, jnp.float32, progress=False)
    floats = load_params(source, config, jnp.float32, jnp.float32, progress=False, keep_quantized=False)
    return config, native, floats


def test_every_matrix_keeps_a_layout_that_holds_its_blocks_exactly(gguf_model):
    _, (_, params), _ = gguf_model
    flat = nested_to_flat(nnx.to_pure_dict(params))
    layouts = {name: (w.mode, w.group_size, w.offsets is not None, w.scales.dtype, w.qweight.shape)
               for name, w in flat.items() if isinstance(w, QuantizedWeight)}
    assert layouts == {
        "embed": ("int8", 32, False, jnp.float16, (H, V)),                                  # Q8_0, as the LM head reads it
        "layers.qkv_proj": ("int8", 16, True, jnp.float32, (L, H, (HQ + 2 * HKV) * D)),   # Q4_K + Q4_K + Q6_K
        "layers.o_proj": ("int4", 32, False, jnp.float16, (L, HQ * D // 2, H)),           # Q4_0
        "layers.gate_up_proj": ("int4", 32, True, jnp.float16, (L, H // 2, 2 * I)),       # Q4_1
        "layers.down_proj": ("int8", 32, True, jnp.float32, (L, I, H)),                   # Q4_K, Q5_K
    }
    assert all(not isinstance(a, QuantizedWeight) and a.ndim <= 2 for name, a in flat.items() if name not in layouts)


def test_logits_equal_the_float_dequantized_model(gguf_model):
    config, (q_graphdef, q_params), (graphdef, params) = gguf_model
    ids = list(np.random.default_rng(1).integers(3, V, size=24))
    got = prompt_log_softmax(config, q_graphdef, q_params, ids)
    want = prompt_log_softmax(config, graphdef, params, ids)
    assert np.std(want) > 0.1  # a model whose distributions are not flat
    np.testing.assert_allclose(got, want, atol=2e-5)


def test_memory_is_what_the_bits_say(gguf_model):
    _, (_, params), (_, floats) = gguf_model
    flat = nested_to_flat(nnx.to_pure_dict(params))
    bits_per_weight = {  # value bits + (scale + offset bits) / group size
        "embed": 8 + 16 / 32, "layers.qkv_proj": 8 + 64 / 16, "layers.o_proj": 4 + 16 / 32,
        "layers.gate_up_proj": 4 + 32 / 32, "layers.down_proj": 8 + 64 / 32,
    }
    for name, bits in bits_per_weight.items():
        w = flat[name]
        assert w.nbytes * 8 == bits * np.prod(w.shape), name
    assert param_bytes(params) < 0.4 * param_bytes(floats)
