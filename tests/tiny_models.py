"""Tiny random Hugging Face models, one per supported family, built and saved locally.

Every weight is random (norm weights around 1, biases non-zero) and scaled so the log-softmax is
far from uniform: parity tests then compare real distributions, not near-constant ones.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import transformers

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]
VOCAB = len(SPECIAL_TOKENS) + 256  # byte-level tokenizer: three specials + one token per byte
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def _common(**kw):
    base = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    base.update(kw)
    return base


# family name -> (config class, kwargs)
FAMILIES = {
    # Llama 2: MHA, no scaling
    "llama2": (transformers.LlamaConfig, _common(num_key_value_heads=4)),
    # Llama 3 / 3.1 style: GQA, llama3 rope scaling across the three frequency bands
    "llama3.1": (transformers.LlamaConfig, _common(rope_theta=10000.0, max_position_embeddings=256, rope_scaling={
        "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16})),
    # Llama 3.2 small: tied embeddings, MQA, attention bias (Llama's optional q/k/v/o bias)
    "llama3.2": (transformers.LlamaConfig, _common(num_key_value_heads=1, tie_word_embeddings=True, attention_bias=True, mlp_bias=True)),
    "llama-linear": (transformers.LlamaConfig, _common(rope_scaling={"rope_type": "linear", "factor": 2.0})),
    # dynamic NTK: prompts run past max_position_embeddings so the scaling is exercised
    "llama-dynamic": (transformers.LlamaConfig, _common(max_position_embeddings=24, rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
    "mistral": (transformers.MistralConfig, _common(sliding_window=12, head_dim=16)),
    "qwen2": (transformers.Qwen2Config, _common(num_key_value_heads=1, tie_word_embeddings=False)),
    "qwen3": (transformers.Qwen3Config, _common(head_dim=24, attention_bias=False)),
    # SmolLM2 is a Llama with tied embeddings and GQA 3:1
    "smollm2": (transformers.LlamaConfig, _common(num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True, hidden_size=96)),
    # mixtures of experts: Mixtral (top-2 of 4, renormalised), Qwen2-MoE (q/k/v bias, a shared
    # expert behind a sigmoid gate, top-k not renormalised), Qwen3-MoE (q/k norms, renormalised)
    "mixtral": (transformers.MixtralConfig, _common(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": (transformers.Qwen2MoeConfig, _common(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                       shared_expert_intermediate_size=48, norm_topk_prob=False)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, _common(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                       norm_topk_prob=True, head_dim=24)),
    # ---- per-layer attention kinds (windows of 6 tokens, shorter than the test prompts)
    # Gemma 2: sliding / global alternating (3 layers: a whole period and one more), soft-capped
    # scores and logits, query_pre_attn_scalar, GeGLU, (1 + w) norms on both sides of each branch
    "gemma2": (transformers.Gemma2Config, _common(num_hidden_layers=3, head_dim=16, sliding_window=6, query_pre_attn_scalar=24,
                                                  attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    # Gemma 3: two sliding layers per global one, the sliding layers on their own RoPE base, the
    # global ones with linear scaling; q/k norms per head
    "gemma3": (transformers.Gemma3TextConfig, _common(
        num_hidden_layers=4, head_dim=16, sliding_window=6, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}})),
    # SmolLM3: every fourth layer without RoPE (NoPE)
    "smollm3": (transformers.SmolLM3Config, _common(num_hidden_layers=4, tie_word_embeddings=True)),
    # OLMo 2: norms after each branch, q/k norms over the whole projection
    "olmo2": (transformers.Olmo2Config, _common(num_key_value_heads=4)),
    # OLMo 3: three sliding layers, then a global one with YaRN
    "olmo3": (transformers.Olmo3Config, _common(
        num_hidden_layers=4, num_key_value_heads=4, sliding_window=6,
        rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                                            "rope_theta": 500000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0}})),
    # GPT-OSS: sliding / global alternating, attention sinks, q/k/v/o biases, YaRN; experts stored
    # stacked with gate and up interleaved, biases, a clamped SwiGLU; a router with a bias
    "gpt_oss": (transformers.GptOssConfig, _common(
        head_dim=16, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, sliding_window=6, swiglu_limit=1.5,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 16, "rope_theta": 150000.0})),
    # Phi-3 / Phi-4-mini: fused qkv and gate/up tensors, half the head rotated, LongRoPE (prompts
    # run past original_max_position_embeddings, so the long factors are exercised), a window on every layer
    "phi3": (transformers.Phi3Config, _common(
        head_dim=16, sliding_window=10, original_max_position_embeddings=20, pad_token_id=0,
        rope_parameters={"rope_type": "longrope", "partial_rotary_factor": 0.5, "rope_theta": 10000.0,
                         "short_factor": [1.0, 1.2, 1.5, 2.0], "long_factor": [1.5, 2.5, 4.0, 8.0]})),
    # MiniMax-M2: experts picked by sigmoid scores plus a correction bias (randomised below), q/k
    # norms over the whole projection, half the head rotated (the released configs' rotary_dim)
    "minimax_m2": (transformers.MiniMaxM2Config, _common(
        head_dim=16, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, rotary_dim=8)),
    # GLM-4.5: a dense first layer, then experts picked by sigmoid scores plus a correction bias from
    # the better of two groups, renormalised and scaled, beside an ungated shared expert; q/k/v
    # biases, q/k norms per head, half the head rotated
    "glm4_moe": (transformers.Glm4MoeConfig, _common(
        num_hidden_layers=3, head_dim=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
        attention_bias=True, use_qk_norm=True)),
    # DeepSeek-V3: multi-head latent attention (queries through q_lora_rank, a latent of 32 and a
    # shared RoPE key of 8 dims, interleaved), YaRN with mscale_all_dim (the score scale), GLM-4.5's
    # routing with a dense first layer
    "deepseek_v3": (transformers.DeepseekV3Config, _common(
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, rope_interleave=True,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0})),
    # DeepSeek-V2-Lite's layout: one q_proj (no q_lora_rank), rope dims rotated as complex pairs,
    # softmax routing limited to the best group (by its best expert), scaled, never renormalised
    "deepseek_v2": (transformers.DeepseekV2Config, _common(
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, topk_method="group_limited_greedy",
        n_group=2, topk_group=1, routed_scaling_factor=2.0,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707,
                         "mscale_all_dim": 0.707, "original_max_position_embeddings": 64, "rope_theta": 10000.0})),
    # GLM-5: DeepSeek-V3's layout with DeepSeek sparse attention: an indexer (16 heads of 16 dims, its
    # key LayerNormed, RoPE on its first 8 dims as pairs) picks the 4 best earlier tokens per query
    "glm_moe_dsa": (transformers.GlmMoeDsaConfig, _common(
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, index_topk=4, index_n_heads=16, index_head_dim=16)),
    # DeepSeek-V3.2: the same sparse attention, its indexer's RoPE over halves instead of pairs
    "deepseek_v32": (transformers.DeepseekV32Config, _common(
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, index_topk=4, index_n_heads=16, index_head_dim=16)),
    # Qwen3-Next: three Gated DeltaNet layers (2 key heads of 16 serving 4 value heads of 8, a
    # convolution of 4 taps) then one full-attention layer (gated output, q/k norms, a quarter of
    # each head rotated), every MLP a mixture of experts with a gated shared one
    "qwen3_next": (transformers.Qwen3NextConfig, _common(
        num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48)),
    # Qwen3.5: the same layers with a dense MLP, its projections stored apart
    "qwen3_5_text": (transformers.Qwen3_5TextConfig, _common(
        num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=8, linear_conv_kernel_dim=4)),
    # Qwen3.5-MoE: Qwen3.5's layers with Qwen3-Next's experts (a gated shared one) in every layer
    "qwen3_5_moe_text": (transformers.Qwen3_5MoeTextConfig, _common(
        num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48)),
    # Llama 4 (Maverick's layout): chunks of 8 on three RoPE layers (L2 q/k norms), a NoPE layer
    # with attention temperature tuning (floor_scale 4: the prompts reach its steps), experts in
    # every other layer (top 2 of 4, weighing their inputs, beside a shared expert), dense layers
    # of intermediate_size_mlp between, llama3 RoPE scaling; RoPE turns adjacent dims
    "llama4": (transformers.Llama4TextConfig, _common(
        num_hidden_layers=4, head_dim=16, intermediate_size=32, intermediate_size_mlp=96, num_local_experts=4,
        num_experts_per_tok=2, interleave_moe_layer_step=2, attention_chunk_size=8, floor_scale=4,
        rope_parameters={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 16, "rope_theta": 500000.0})),
    # Gemma 4: two sliding layers per global one; the global layers with a head dim and KV heads of
    # their own (twice the sliding layers' K/V row: their pages hold half the tokens, a page factor of
    # 2 for the sliding groups), values from the key projection and "proportional" RoPE over a
    # quarter of the head; the last two layers read the K/V of layers 3 and 2 and have a double-wide
    # MLP; per-layer input embeddings; experts (top 2 of 4) beside every dense MLP
    "gemma4": (transformers.Gemma4TextConfig, _common(
        num_hidden_layers=6, head_dim=16, global_head_dim=32, num_global_key_value_heads=2, attention_k_eq_v=True,
        sliding_window=6, layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        num_kv_shared_layers=2, use_double_wide_mlp=True, hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
        enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=24, final_logit_softcapping=30.0,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0}})),
}


MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
# The families with their own model file (jaxinfer.models.registry): one-token pages are the
# Llama families' test, the attention kinds these add are tested on pages of 16.
LAYER_KIND_FAMILIES = ("gemma2", "gemma3", "smollm3", "olmo2", "olmo3", "gpt_oss", "phi3", "minimax_m2", "glm4_moe",
                       "llama4", "gemma4", "deepseek_v2", "deepseek_v3", "glm_moe_dsa", "deepseek_v32",
                       "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")


def build_hf_model(family: str, seed: int = 0, **overrides):
    """A random model of `family`; `overrides` change its config (e.g. intermediate_size=128)."""
    cls, kw = FAMILIES[family]
    config = cls(**{**kw, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        # Qwen3-Next / Qwen3.5 scale by 1 + w (zeros by default): norms near 1 there too, but for
        # the Gated DeltaNet's own norm, a plain w
        offset = config.model_type in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_((0.0 if offset and "linear_attn" not in name else 1.0) + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5 * (2.0 if "embed" in name or "lm_head" in name else 1.0))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a buffer, zero unless set: make it change the picks
                b.copy_(0.3 * torch.randn_like(b))
            if name.endswith("layer_scalar"):  # Gemma 4's per-layer output scale, 1 unless set
                b.copy_(1.0 + 0.2 * torch.randn_like(b))
    return model


def byte_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A real byte-level BPE tokenizer (no merges): one token per byte, plus <pad> <s> </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(alphabet)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token=None
    )
    fast.add_special_tokens({"additional_special_tokens": []})
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_hf_model(family: str, directory: Path, seed: int = 0, max_shard_size: str | None = None, **overrides):
    """Saves model (safetensors, config.json) and the byte tokenizer into directory."""
    model = build_hf_model(family, seed, **overrides)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    byte_tokenizer().save_pretrained(directory)
    return model


FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [..., K] (K a multiple of 32) -> (blocks [..., K/32, 16] uint8, scales [..., K/32] uint8):
    each 32 values share 2^s with s the smallest exponent that fits their absmax in E2M1's 6."""
    groups = w.reshape(*w.shape[:-1], -1, 32).astype(np.float32)
    absmax = np.abs(groups).max(axis=-1)
    exponent = np.ceil(np.log2(np.maximum(absmax, 1e-30) / 6.0)).astype(np.int32)
    scaled = groups / np.ldexp(1.0, exponent)[..., None]
    codes = np.abs(scaled[..., None] - FP4_VALUES).argmin(axis=-1).astype(np.uint8)  # nearest E2M1 value
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return np.ascontiguousarray(blocks, np.uint8), np.ascontiguousarray(exponent + 127, np.uint8)  # (save_file writes raw memory)


def save_mxfp4_gpt_oss(directory: Path, **overrides) -> dict[str, np.ndarray]:
    """The tiny GPT-OSS model saved with its experts in MXFP4, as the released checkpoints are
    (`<name>_blocks` [E, out, in / 32, 16], `<name>_scales` [E, out, in / 32], a
    quantization_config naming mxfp4); returns the tensors as saved."""
    from safetensors.numpy import save_file

    model = save_hf_model("gpt_oss", directory, **overrides)
    tensors = {name: t.detach().numpy() for name, t in model.state_dict().items()}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        stored = tensors.pop(name)  # [E, in, out]: blocks hold [E, out, in / 32, 16]
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = quantize_mxfp4(np.swapaxes(stored, 1, 2))
    for f in directory.glob("*.safetensors"):
        f.unlink()
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                         "model.layers.*.mlp.router"]}
    (directory / "config.json").write_text(json.dumps(config))
    return tensors


def save_deepseek_with_mtp(directory: Path, seed: int = 0, family: str = "deepseek_v3"):
    """The tiny DeepSeek-V3 (or another MLA `family`: GLM-5) with a multi-token-prediction layer
    after its last, as DeepSeek-V3's checkpoint stores it (layer num_hidden_layers: a decoder block plus enorm, hnorm, eh_proj and
    shared_head; num_nextn_predict_layers = 1). transformers does not run that layer: the model
    is built with one layer more, whose block becomes the MTP layer's. Returns (the 3-layer target
    as transformers loads it, the 4-layer model whose last block is the MTP layer's, the MTP
    layer's extra tensors as torch tensors)."""
    import json

    from safetensors.numpy import load_file, save_file

    cls, kw = FAMILIES[family]
    full = build_hf_model(family, seed, num_hidden_layers=kw["num_hidden_layers"] + 1)
    full.save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    N, H = kw["num_hidden_layers"], full.config.hidden_size
    generator = torch.Generator().manual_seed(seed + 1)
    extra = {
        "enorm.weight": 1.0 + 0.2 * torch.randn(H, generator=generator),
        "hnorm.weight": 1.0 + 0.2 * torch.randn(H, generator=generator),
        "eh_proj.weight": torch.randn(H, 2 * H, generator=generator) / (2 * H) ** 0.5,
        "shared_head.norm.weight": 1.0 + 0.2 * torch.randn(H, generator=generator),
    }
    tensors = load_file(directory / "model.safetensors")
    tensors.update({f"model.layers.{N}.{name}": t.numpy() for name, t in extra.items()})
    tensors[f"model.layers.{N}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].copy()  # the shared copies
    tensors[f"model.layers.{N}.shared_head.head.weight"] = tensors["lm_head.weight"].copy()
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config.update(num_hidden_layers=N, num_nextn_predict_layers=1)
    for key in ("layer_types", "mlp_layer_types", "indexer_types"):  # per-layer lists (GLM-5's) of the N layers
        if config.get(key):
            config[key] = config[key][:N]
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    target = transformers.AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32).eval()
    target.config._attn_implementation = "eager"
    return target, full, extra
