"""Images -> Gemma 3's pixel_values, through transformers' Gemma3ImageProcessor (its numpy /
Pillow implementation, `Gemma3ImageProcessorPil`: no torch) as the model folder saves it.

    processor = load_image_processor(model_dir)          # preprocessor_config.json
    pixel_values = preprocess_images([image, ...], processor)   # float32 [N, 3, H, W]

An image is a `PIL.Image.Image`, a numpy array (H x W x C or C x H x W, uint8 0..255 or float,
as transformers takes it), a file path (str or os.PathLike), the encoded bytes of a file, or a
`data:` URI (`data:image/png;base64,...`). URLs are not fetched. Each image is decoded in full here,
so a corrupt or truncated one raises ValueError naming it (its index and what it was) before the
processor sees any, and one image's failure in the processor is reported the same way.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import urllib.parse
from pathlib import Path
from typing import Sequence, Union

import numpy as np
import PIL.Image
from transformers import Gemma3ImageProcessorPil

ImageInput = Union[PIL.Image.Image, np.ndarray, str, os.PathLike, bytes]

# What Pillow raises for data it cannot decode (UnidentifiedImageError and "image file is
# truncated" are OSErrors; some decoders raise SyntaxError or ValueError; DecompressionBombError
# for images over Pillow's pixel limit).
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, PIL.Image.DecompressionBombError)


def load_processor(model_dir: str | os.PathLike, processor_class):
    """The folder's saved image processor (preprocessor_config.json) as `processor_class` (one of
    transformers' numpy / Pillow processors). Never downloads: `model_dir` must be a local folder."""
    path = Path(model_dir)
    if not path.is_dir():
        raise ValueError(f"{model_dir}: not a folder (the image processor is read from the model's folder)")
    try:
        return processor_class.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"{model_dir}: cannot read the image processor (preprocessor_config.json): {e}") from e


def load_image_processor(model_dir: str | os.PathLike) -> Gemma3ImageProcessorPil:
    """The folder's saved image processor (preprocessor_config.json), as transformers' numpy /
    Pillow Gemma3ImageProcessor. Never downloads: `model_dir` must be a local folder."""
    processor = load_processor(model_dir, Gemma3ImageProcessorPil)
    if processor.do_pan_and_scan:
        raise ValueError(f"{model_dir}: the image processor asks for pan-and-scan crops (do_pan_and_scan), "
                         "which are not supported yet")
    return processor


def describe(image) -> str:
    """What to call an image in an error message (never the whole of its data)."""
    if isinstance(image, PIL.Image.Image):
        return f"PIL image {image.mode} {image.size[0]}x{image.size[1]}"
    if isinstance(image, np.ndarray):
        return f"numpy array {list(image.shape)} {image.dtype}"
    if isinstance(image, (bytes, bytearray)):
        return f"{len(image)} bytes"
    if isinstance(image, str) and image.startswith("data:"):
        header = image[5:image.find(",")] if "," in image else image[5:40]
        return f"data URI ({header[:60] or 'no media type'}, {len(image)} characters)"
    if isinstance(image, (str, os.PathLike)):
        return f"file {os.fspath(image)!r}"
    return type(image).__name__


def _decode(data: bytes, label: str) -> PIL.Image.Image:
    try:
        image = PIL.Image.open(io.BytesIO(data))
        image.load()  # decode every pixel now: a truncated file fails here, not in the processor
    except _DECODE_ERRORS as e:
        raise ValueError(f"{label}: not a decodable image ({type(e).__name__}: {e})") from e
    return image


def _data_uri_bytes(uri: str, label: str) -> bytes:
    """The payload of `data:[<media type>][;base64],<data>`."""
    header, comma, payload = uri[5:].partition(",")
    if not comma:
        raise ValueError(f"{label}: a data URI needs a ',' before its data")
    if header.split(";")[-1].strip().lower() == "base64":
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ValueError(f"{label}: invalid base64 data ({e})") from e
    return urllib.parse.unquote_to_bytes(payload)


def load_image(image: ImageInput, index: int = 0) -> PIL.Image.Image | np.ndarray:
    """One image decoded (a PIL image) or checked (a numpy array), as the processor takes it.
    ValueError naming the image (`image {index} (...)`) when it cannot be."""
    label = f"image {index} ({describe(image)})"
    if isinstance(image, PIL.Image.Image):
        try:
            image.load()  # a lazily opened file decodes here
        except _DECODE_ERRORS as e:
            raise ValueError(f"{label}: not a decodable image ({type(e).__name__}: {e})") from e
        return image
    if isinstance(image, np.ndarray):
        channels_ok = image.ndim == 2 or (image.ndim == 3 and (image.shape[-1] in (1, 3, 4) or image.shape[0] in (1, 3, 4)))
        if not channels_ok or min(image.shape) == 0:
            raise ValueError(f"{label}: expected H x W, H x W x C or C x H x W with C in 1, 3, 4")
        if image.dtype != np.uint8 and image.dtype.kind != "f":
            raise ValueError(f"{label}: expected uint8 or floating-point pixels")
        if image.dtype.kind == "f" and not np.isfinite(image).all():
            raise ValueError(f"{label}: pixels that are not finite")
        return image
    if isinstance(image, (bytes, bytearray)):
        return _decode(bytes(image), label)
    if isinstance(image, str) and image.startswith("data:"):
        return _decode(_data_uri_bytes(image, label), label)
    if isinstance(image, str) and image.lower().startswith(("http://", "https://")):
        raise ValueError(f"{label}: URLs are not fetched; pass the image's file, bytes or a data: URI")
    if isinstance(image, (str, os.PathLike)):
        path = Path(image)
        if not path.is_file():
            raise ValueError(f"{label}: no such file")
        try:
            data = path.read_bytes()
        except OSError as e:
            raise ValueError(f"{label}: cannot read the file ({e})") from e
        return _decode(data, label)
    raise ValueError(f"{label}: expected a PIL image, a numpy array, a file path, bytes or a data: URI")


def preprocess_images(images: Sequence[ImageInput], processor: Gemma3ImageProcessorPil) -> np.ndarray:
    """pixel_values float32 [N, 3, H, W] for N images, equal to `processor(images=..., return_tensors="np")`."""
    if isinstance(images, (PIL.Image.Image, np.ndarray, str, bytes, bytearray, os.PathLike)):
        images = [images]
    if len(images) == 0:
        raise ValueError("no images to preprocess")
    out = []
    for i, image in enumerate(images):
        decoded = load_image(image, i)
        try:  # one at a time, so a failure names its image (the processor treats each alone anyway)
            pixels = processor(images=[decoded], return_tensors="np")["pixel_values"]
        except (ValueError, TypeError, OSError) as e:
            raise ValueError(f"image {i} ({describe(image)}): the image processor refused it ({type(e).__name__}: {e})") from e
        out.append(np.asarray(pixels, np.float32))
    return np.concatenate(out)
