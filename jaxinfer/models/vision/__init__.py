"""Image encoders that turn pixels into a text model's soft tokens (issue 39: images in).

- `siglip`: Gemma 3's SigLIP vision tower and multimodal projector (`load_gemma3_vision`,
  `image_features`: pixel_values [N, 3, H, W] -> soft tokens [N, mm_tokens_per_image, E]);
- `preprocess`: images (PIL, numpy, files, bytes, data: URIs) -> pixel_values through the folder's
  Gemma3ImageProcessor (numpy / Pillow).
"""

from jaxinfer.models.vision.preprocess import load_image, load_image_processor, preprocess_images
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
    "SiglipVisionConfig",
    "SiglipVisionTower",
    "image_features",
    "load_gemma3_vision",
    "load_image",
    "load_image_processor",
    "preprocess_images",
]
