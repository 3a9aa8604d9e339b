"""Image encoders that turn pixels into a text model's soft tokens (issue 39: images in).

- `siglip`: Gemma 3's SigLIP vision tower and multimodal projector (`load_gemma3_vision`,
  `image_features`: pixel_values [N, 3, H, W] -> soft tokens [N, mm_tokens_per_image, E]);
- `preprocess`: images (PIL, numpy, files, bytes, data: URIs) -> pixel_values through the folder's
  Gemma3ImageProcessor (numpy / Pillow);
- `qwen_vl`: Qwen2.5-VL's vision transformer and patch merger (`load_qwen2_5_vl_vision`;
  `qwen_vl.image_features`: pixel_values [sum t*h*w, C*T*P*P], image_grid_thw [N, 3] ->
  [sum t*h*w / merge**2, out_hidden_size]) and its Qwen2VLImageProcessor preprocessing
  (`preprocess_qwen_images`);
- `qwen3_vl`: Qwen3-VL's vision transformer, patch merger and deepstack mergers
  (`load_qwen3_vl_vision`; `qwen3_vl.image_features`: the same inputs -> ([n, out_hidden_size],
  deepstack [K, n, out_hidden_size])), preprocessed as Qwen2.5-VL's images.
"""

from jaxinfer.models.vision.preprocess import load_image, load_image_processor, preprocess_images
from jaxinfer.models.vision.qwen3_vl import Qwen3VisionConfig, Qwen3VisionTransformer, load_qwen3_vl_vision
from jaxinfer.models.vision.qwen_vl import (
    Qwen2_5_VisionConfig,
    Qwen2_5_VisionTransformer,
    load_qwen2_5_vl_vision,
    load_qwen_image_processor,
    preprocess_qwen_images,
)
from jaxinfer.models.vision.siglip import (
    Gemma3MultiModalProjector,
    Gemma3VisionConfig,
    Gemma3VisionEncoder,
    SiglipVisionConfig,
    SiglipVisionTower,
    image_features,
    load_gemma3_vision,
)

__all__ = [
    "Gemma3MultiModalProjector",
    "Gemma3VisionConfig",
    "Gemma3VisionEncoder",
    "Qwen2_5_VisionConfig",
    "Qwen2_5_VisionTransformer",
    "Qwen3VisionConfig",
    "Qwen3VisionTransformer",
    "SiglipVisionConfig",
    "SiglipVisionTower",
    "image_features",
    "load_gemma3_vision",
    "load_image",
    "load_image_processor",
    "load_qwen2_5_vl_vision",
    "load_qwen3_vl_vision",
    "load_qwen_image_processor",
    "preprocess_images",
    "preprocess_qwen_images",
]
