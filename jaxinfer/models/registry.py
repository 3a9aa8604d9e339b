"""Which model file runs which architecture: HF `model_type` -> the family's Decoder subclass.

`ModelConfig.from_hf_dict` maps `architectures` names to a model_type first, so a config read from
a checkpoint always lands on one of these keys (or is refused there, by name).
"""

from __future__ import annotations

from jaxinfer.config import ConfigError, ModelConfig
from jaxinfer.models.decoder import Decoder
from jaxinfer.models.deepseek import DeepseekForCausalLM
from jaxinfer.models.deepseek_mtp import DeepseekMTP
from jaxinfer.models.gemma import GemmaForCausalLM
from jaxinfer.models.gemma4 import Gemma4ForCausalLM
from jaxinfer.models.glm4_moe import Glm4MoeForCausalLM
from jaxinfer.models.gpt_oss import GptOssForCausalLM
from jaxinfer.models.llama import LlamaForCausalLM
from jaxinfer.models.llama4 import Llama4ForCausalLM
from jaxinfer.models.minimax_m2 import MiniMaxM2ForCausalLM
from jaxinfer.models.olmo import OlmoForCausalLM
from jaxinfer.models.qwen3_next import Qwen3NextForCausalLM

MODEL_CLASSES: dict[str, type[Decoder]] = {
    **{t: LlamaForCausalLM for t in ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "smollm3",
                                               "phi3")},
    "qwen2_5_vl": LlamaForCausalLM,  # Qwen2.5-VL's text decoder (Qwen2 with M-RoPE: models.mrope)
    "qwen3_vl": LlamaForCausalLM,  # Qwen3-VL's text decoder (Qwen3 with interleaved M-RoPE; deepstack: models.decoder)
    "gemma2": GemmaForCausalLM,
    "gemma3_text": GemmaForCausalLM,
    "gemma3": GemmaForCausalLM,  # a multimodal folder's text decoder
    "gemma4_text": Gemma4ForCausalLM,
    "gemma4": Gemma4ForCausalLM,  # a multimodal folder's text decoder
    "olmo2": OlmoForCausalLM,
    "olmo3": OlmoForCausalLM,
    "gpt_oss": GptOssForCausalLM,
    "minimax_m2": MiniMaxM2ForCausalLM,
    "glm4_moe": Glm4MoeForCausalLM,
    "llama4_text": Llama4ForCausalLM,
    "llama4": Llama4ForCausalLM,  # a multimodal folder's text decoder
    "deepseek_v2": DeepseekForCausalLM,
    "deepseek_v3": DeepseekForCausalLM,
    "deepseek_v32": DeepseekForCausalLM,  # with the sparse-attention indexer (ModelConfig.index_topk)
    "glm_moe_dsa": DeepseekForCausalLM,
    **{t: Qwen3NextForCausalLM for t in ("qwen3_next", "qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe")},
}


def model_class(config: ModelConfig) -> type[Decoder]:
    """The Decoder subclass that runs `config`'s family."""
    if config.mtp_module:
        return DeepseekMTP
    try:
        return MODEL_CLASSES[config.model_type]
    except KeyError:
        raise ConfigError(f"no model file runs model_type={config.model_type!r} "
                          f"(known: {', '.join(sorted(MODEL_CLASSES))})") from None
