"""Architectures by name, for planning a deployment without the checkpoint at hand.

Each is the part of the model's Hugging Face config.json that decides shapes (as published with
the model); `jaxinfer aot --model llama-3.1-70b` uses it, nothing is downloaded. A path to a
config.json, a model folder or a .gguf file works as well.
"""

from __future__ import annotations

import json
from pathlib import Path

from jaxinfer.config import ModelConfig
from jaxinfer.runtime.loading import read_config, resolve_model

_LLAMA3 = dict(model_type="llama", hidden_act="silu", rms_norm_eps=1e-5, rope_theta=500000.0, vocab_size=128256,
               max_position_embeddings=131072, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
               rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192))

_GPT_OSS = dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8,
                head_dim=64, vocab_size=201088, rms_norm_eps=1e-5, max_position_embeddings=131072, sliding_window=128,
                num_experts_per_tok=4, attention_bias=True, swiglu_limit=7.0, tie_word_embeddings=False,
                rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                 "original_max_position_embeddings": 4096, "rope_theta": 150000.0},
                bos_token_id=199998, eos_token_id=[200002, 199999, 200012],
                quantization_config={"quant_method": "mxfp4"})  # experts as released: mxfp4

PRESETS: dict[str, dict] = {
    "llama-3.1-8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8),
    "llama-3.1-70b": dict(_LLAMA3, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                          num_attention_heads=64, num_key_value_heads=8),
    "llama-3.2-1b": dict(_LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
                         rope_scaling=dict(_LLAMA3["rope_scaling"], factor=32.0)),
    "mistral-7b": dict(model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=32768, rms_norm_eps=1e-5,
                       rope_theta=1000000.0, max_position_embeddings=32768, tie_word_embeddings=False, hidden_act="silu",
                       bos_token_id=1, eos_token_id=2),
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, rms_norm_eps=1e-6,
                       rope_theta=1000000.0, max_position_embeddings=32768, tie_word_embeddings=False, hidden_act="silu",
                       bos_token_id=151643, eos_token_id=151645),
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936, rms_norm_eps=1e-6,
                     rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=False, hidden_act="silu",
                     attention_bias=False, bos_token_id=151643, eos_token_id=151645),
    # hybrids of Gated DeltaNet and full attention (three linear layers, then a full one)
    "qwen3.5-27b": dict(model_type="qwen3_5_text", hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                        num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                        linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
                        linear_conv_kernel_dim=4, vocab_size=248320, rms_norm_eps=1e-6, max_position_embeddings=262144,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
                        tie_word_embeddings=False, eos_token_id=248044),
    "qwen3.5-35b-a3b": dict(model_type="qwen3_5_moe_text", hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
                            num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                            linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=256,
                            num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
                            vocab_size=248320, rms_norm_eps=1e-6, max_position_embeddings=262144, tie_word_embeddings=False,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
                            eos_token_id=248044),
    "qwen3-next-80b-a3b": dict(model_type="qwen3_next", hidden_size=2048, intermediate_size=5632, num_hidden_layers=48,
                               num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                               linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                               linear_conv_kernel_dim=4, num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
                               shared_expert_intermediate_size=512, norm_topk_prob=True, vocab_size=151936,
                               rms_norm_eps=1e-6, max_position_embeddings=262144, tie_word_embeddings=False,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
                               eos_token_id=151645),
    "mixtral-8x7b": dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, rms_norm_eps=1e-5,
                         rope_theta=1000000.0, max_position_embeddings=32768, tie_word_embeddings=False, hidden_act="silu",
                         num_local_experts=8, num_experts_per_tok=2, bos_token_id=1, eos_token_id=2),
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, rms_norm_eps=1e-5,
                         rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True, hidden_act="silu",
                         bos_token_id=1, eos_token_id=2),
    # the newer families (issue 35): Gemma 3's text decoder, GPT-OSS
    "gemma-3-27b": dict(model_type="gemma3_text", hidden_size=5376, intermediate_size=21504, num_hidden_layers=62,
                        num_attention_heads=32, num_key_value_heads=16, head_dim=128, vocab_size=262208,
                        rms_norm_eps=1e-6, max_position_embeddings=131072, query_pre_attn_scalar=168, sliding_window=1024,
                        sliding_window_pattern=6, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
                        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
                        bos_token_id=2, eos_token_id=[1, 106]),
    "gpt-oss-120b": dict(_GPT_OSS, num_hidden_layers=36, num_local_experts=128),
    "gpt-oss-20b": dict(_GPT_OSS, num_hidden_layers=24, num_local_experts=32),
    # Llama-4-Scout-17B-16E's text decoder: 16 experts in every layer, chunks of 8192 on the RoPE layers
    "llama-4-scout": dict(model_type="llama4_text", hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384,
                          num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
                          vocab_size=202048, num_local_experts=16, num_experts_per_tok=1, interleave_moe_layer_step=1,
                          attention_chunk_size=8192, use_qk_norm=True, attn_temperature_tuning=True, floor_scale=8192,
                          attn_scale=0.1, rms_norm_eps=1e-5, max_position_embeddings=10485760, tie_word_embeddings=False,
                          rope_parameters={"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                                           "original_max_position_embeddings": 8192, "rope_theta": 500000.0},
                          bos_token_id=200000, eos_token_id=[200001, 200007, 200008]),
    # Gemma-4-31B's text decoder: 5 sliding layers (16 KV heads of 256) per global one (4 KV heads of
    # 512, values from the key projection): the global layers' K/V row is half the sliding layers'
    "gemma-4-31b": dict(model_type="gemma4_text", hidden_size=5376, intermediate_size=21504, num_hidden_layers=60,
                        num_attention_heads=32, num_key_value_heads=16, head_dim=256, global_head_dim=512,
                        num_global_key_value_heads=4, attention_k_eq_v=True, vocab_size=262144, rms_norm_eps=1e-6,
                        max_position_embeddings=262144, sliding_window=1024, final_logit_softcapping=30.0,
                        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, hidden_size_per_layer_input=0,
                        rope_parameters={"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                            "rope_theta": 1000000.0},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
                        bos_token_id=2, eos_token_id=[1, 106]),
    # DeepSeek-V3 (and R1, the same shapes): 671B, multi-head latent attention (128 heads, latent
    # 512 + RoPE 64), 3 dense layers then 256 routed experts (top 8 from 4 of 8 groups) and a shared
    # one; the release's weights e4m3 in 128 x 128 blocks
    "deepseek-v3": dict(model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
                        n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
                        qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4,
                        num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True, hidden_act="silu",
                        max_position_embeddings=163840, rms_norm_eps=1e-6, vocab_size=129280, tie_word_embeddings=False,
                        rope_parameters={"rope_type": "yarn", "factor": 40.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                         "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                         "rope_theta": 10000.0},
                        bos_token_id=0, eos_token_id=1,
                        quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": [128, 128]}),
}
# Gemma-3-27B-it as released (Gemma3ForConditionalGeneration): the text decoder above, SigLIP so400m
# at 896 pixels and its projector to 256 soft tokens per image
PRESETS["gemma-3-27b-it"] = dict(
    model_type="gemma3", architectures=["Gemma3ForConditionalGeneration"], mm_tokens_per_image=256,
    boi_token_index=255999, eoi_token_index=256000, image_token_index=262144, bos_token_id=2, eos_token_id=[1, 106],
    text_config={k: v for k, v in PRESETS["gemma-3-27b"].items() if k not in ("bos_token_id", "eos_token_id")},
    vision_config=dict(model_type="siglip_vision_model", hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
                       num_attention_heads=16, image_size=896, patch_size=14, vision_use_head=False))


def read_hf_dict(model: str) -> dict | None:
    """The Hugging Face config dict behind a preset, a config.json or a model folder (None for a
    .gguf file, which carries no vision tower): what `read_model_config` parses, whole."""
    if model.lower() in PRESETS:
        return PRESETS[model.lower()]
    path = Path(model).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file() and path.name.endswith(".json"):
        return json.loads(path.read_text())
    return None


def read_model_config(model: str):
    """A preset name, a config.json, a model folder or a .gguf file -> ModelConfig (no weights read)."""
    if model.lower() in PRESETS:
        return ModelConfig.from_hf_dict(PRESETS[model.lower()], source=f"preset {model}")
    path = Path(model).expanduser()
    if path.is_file() and path.name.endswith(".json"):
        return ModelConfig.from_json_file(path)
    if not path.exists():
        raise FileNotFoundError(f"model {model!r}: not a preset ({', '.join(PRESETS)}) and no such file or folder")
    return read_config(resolve_model(path))
