"""Images in the engine: a prompt's images become placeholder tokens and encoder inputs, the
encoder runs once per image, and each step's image tokens read their encoder rows.

    prompt = {"prompt": "<start_of_image> What is this?", "multi_modal_data": {"image": img}}

1. `PromptImages.process` (the caller's thread, with the other input checks): each image is
   decoded and preprocessed by the folder's image processor (numpy / Pillow); each image
   placeholder the prompt text holds (the chat template writes one per image content part) is
   expanded as transformers' processor does (Gemma 3: "\\n\\n<start_of_image>" + 256 soft tokens
   + "<end_of_image>\\n\\n"; Qwen2.5-VL, Qwen3-VL: one <|image_pad|> per merged patch), then tokenized. Each
   image's run of image tokens becomes a `PromptImage`: where it sits in the prompt, how many
   tokens, its pixels and a content hash.
2. The scheduler never cuts an image a model attends both ways (Gemma 3) across two chunks, and
   encodes at most `max_num_encoder_input_tokens` image tokens per step
   (`Scheduler._image_cut`).
3. `ImageEncoder` runs the vision tower for the images a step's chunks reach that its cache does
   not hold (`EncoderCache`: by content hash, LRU, bounded in rows) and gives each chunk the rows
   of its image tokens (`chunk_inputs`), which the step scatters over their embeddings
   (RaggedBatch.mm_embeds / mm_mask); Qwen3-VL's deepstack rows too, which the first decoder
   layers add to those tokens (RaggedBatch.mm_deepstack); with bidirectional images each image
   token's query also sees up to its image's last position (RaggedBatch.span_end).
4. Prefix caching keys a page by token ids; image tokens are all the same id, so the key of each
   image token is derived from its image's hash instead (`PromptImage.key_ids`): two prompts
   share cached pages only where their images are the same.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import threading
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from jaxinfer.models.mrope import mrope_positions
from jaxinfer.models.vision import (image_features, load_gemma3_vision, load_image_processor, load_qwen2_5_vl_vision,
                                    load_qwen3_vl_vision, load_qwen_image_processor, preprocess_images,
                                    preprocess_qwen_images, qwen3_vl, qwen_vl)
from jaxinfer.models.vision.preprocess import describe, load_image

# An image over this many pixels is refused before preprocessing (Pillow warns past ~89 M).
MAX_IMAGE_PIXELS = 50_000_000
MAX_IMAGES_PER_PROMPT = 16  # default of LLM(limit_mm_per_prompt={"image": N})
MAX_IMAGE_BYTES = 20 * 2**20  # a fetched image's size limit

SUPPORTED = {"gemma3": "Gemma3ForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
             "qwen3_vl": "Qwen3VLForConditionalGeneration"}
MROPE_KINDS = ("qwen2_5_vl", "qwen3_vl")  # the Qwen VL models: patch grids, <|image_pad|> per merged patch, M-RoPE


@dataclasses.dataclass(eq=False)
class PromptImage:
    """One image of a prompt: its run of image tokens and what the encoder reads."""

    key: bytes  # content hash of the preprocessed pixels (and grid)
    offset: int  # position of its first image token in the prompt
    length: int  # image tokens = rows the encoder gives
    pixels: np.ndarray  # Gemma 3: [3, H, W]; Qwen2.5-VL, Qwen3-VL: [t*h*w, C*T*P*P] patches
    grid: tuple[int, int, int] | None = None  # Qwen2.5-VL, Qwen3-VL: (t, h, w) patches
    both_ways: bool = False  # its tokens attend to each other in both directions (Gemma 3)

    @property
    def end(self) -> int:
        return self.offset + self.length

    def key_ids(self) -> list[int]:
        """Stand-ins for its tokens in prefix-cache keys: negative (never a token id), one per
        token, derived from the image's hash."""
        blocks = [hashlib.blake2b(self.key + b.to_bytes(4, "little"), digest_size=64).digest()  # 16 ids per block
                  for b in range(-(-self.length // 16))]
        return [-1 - (v & 0x7FFFFFFF) for v in np.frombuffer(b"".join(blocks), "<u4")[: self.length].tolist()]


def prompt_key_ids(prompt_ids: Sequence[int], images: Sequence[PromptImage]) -> list[int]:
    """The prompt's ids with each image's tokens replaced by its `key_ids`."""
    ids = list(prompt_ids)
    for image in images:
        ids[image.offset : image.end] = image.key_ids()
    return ids


def _image_hash(pixels: np.ndarray, grid) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(str((pixels.shape, str(pixels.dtype), grid)).encode())
    h.update(np.ascontiguousarray(pixels).tobytes())
    return h.digest()


def _read_config(folder: Path) -> dict:
    try:
        return json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return {}


class PromptImages:
    """A vision model's prompt processing: images -> expanded token ids and PromptImages."""

    def __init__(self, kind: str, folder: Path, hf_config: dict, tokenizer, *, max_images: int = MAX_IMAGES_PER_PROMPT,
                 allowed_media_domains: Sequence[str] = ()):
        self.kind = kind
        self.folder = folder
        self.tokenizer = tokenizer
        self.max_images = max_images
        self.allowed_media_domains = tuple(d.lower() for d in allowed_media_domains)
        token = lambda i: tokenizer.convert_ids_to_tokens(int(i))  # noqa: E731
        if kind == "gemma3":
            self.processor = load_image_processor(folder)
            self.image_token_id = int(hf_config.get("image_token_index", hf_config.get("image_token_id", 262144)))
            boi = token(hf_config.get("boi_token_index", 255999))
            eoi = token(hf_config.get("eoi_token_index", 256000))
            self.tokens_per_image = int(hf_config.get("mm_tokens_per_image", 256))
            self.placeholder = boi  # what the chat template writes per image
            self.expansion = lambda grid: f"\n\n{boi}{token(self.image_token_id) * self.tokens_per_image}{eoi}\n\n"  # noqa: E731
            self.both_ways = True
        elif kind in MROPE_KINDS:
            self.processor = load_qwen_image_processor(folder)
            self.image_token_id = int(hf_config.get("image_token_id", 151655))
            self.placeholder = token(self.image_token_id)  # <|image_pad|>
            self.merge = int(self.processor.merge_size)
            self.expansion = lambda grid: self.placeholder * (int(np.prod(grid)) // self.merge**2)  # noqa: E731
            self.both_ways = False
        else:
            raise ValueError(f"{folder}: images for model_type {kind!r} are not supported (supported: {', '.join(SUPPORTED)})")
        self.image_token = token(self.image_token_id)

    @classmethod
    def for_model(cls, folder: str | os.PathLike | None, tokenizer, **options) -> "PromptImages | None":
        """The folder's image processing if its model reads images (a vision_config in config.json), else None."""
        if folder is None:
            return None
        path = Path(folder)
        hf = _read_config(path)
        if hf.get("model_type") not in SUPPORTED or "vision_config" not in hf:
            return None
        return cls(hf["model_type"], path, hf, tokenizer, **options)

    # ------------------------------------------------------------------ a prompt's images
    def images_of(self, data: Any, label: str) -> list:
        """multi_modal_data -> its list of images (ValueError for anything else)."""
        if not isinstance(data, dict):
            raise ValueError(f"{label}: multi_modal_data must be a dict like {{'image': image or [images]}}")
        unknown = set(data) - {"image"}
        if unknown:
            raise ValueError(f"{label}: multi_modal_data: unsupported modality {sorted(unknown)[0]!r} (supported: 'image')")
        images = data.get("image", [])
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        if len(images) > self.max_images:
            raise ValueError(f"{label}: {len(images)} images exceed limit_mm_per_prompt={{'image': {self.max_images}}}")
        return [self._fetch_if_allowed(image, f"{label}: image {i}") for i, image in enumerate(images)]

    def _fetch_if_allowed(self, image, label: str):
        """A remote URL is read only from a domain the user allowed (allowed_media_domains)."""
        if not (isinstance(image, str) and image.lower().startswith(("http://", "https://"))):
            return image
        host = (urllib.parse.urlparse(image).hostname or "").lower()
        if not any(host == d or host.endswith("." + d) for d in self.allowed_media_domains):
            raise ValueError(f"{label}: remote image URL on {host!r} refused (fetch it yourself and pass the bytes or a "
                             f"data: URI, or allow the domain with allowed_media_domains)")
        try:
            with urllib.request.urlopen(image, timeout=10) as response:  # noqa: S310 - an allowed domain
                data = response.read(MAX_IMAGE_BYTES + 1)
        except OSError as e:
            raise ValueError(f"{label}: cannot fetch {image[:200]!r}: {e}") from e
        if len(data) > MAX_IMAGE_BYTES:
            raise ValueError(f"{label}: more than {MAX_IMAGE_BYTES} bytes at {image[:200]!r}")
        return data

    def preprocess(self, images: list, label: str) -> list[tuple[np.ndarray, tuple | None]]:
        """Each image's (pixels, grid), as the processor gives them; ValueError naming a bad one."""
        out = []
        for i, image in enumerate(images):
            try:
                decoded = load_image(image, i)
            except ValueError as e:
                raise ValueError(f"{label}: {e}") from None
            size = decoded.size if hasattr(decoded, "size") and not isinstance(decoded, np.ndarray) else decoded.shape[:2]
            if int(np.prod(size)) > MAX_IMAGE_PIXELS:
                raise ValueError(f"{label}: image {i} ({describe(image)}): {size[0]}x{size[1]} pixels exceed the "
                                 f"limit of {MAX_IMAGE_PIXELS}")
            try:
                if self.kind == "gemma3":
                    out.append((preprocess_images([decoded], self.processor)[0], None))
                else:
                    pixels, grid = preprocess_qwen_images([decoded], self.processor)
                    out.append((pixels, tuple(int(g) for g in grid[0])))
            except ValueError as e:
                raise ValueError(f"{label}: {str(e).replace('image 0', f'image {i}', 1)}") from None
        return out

    def process(self, text: str, data: Any, label: str, *, add_special_tokens: bool = True
                ) -> tuple[list[int], "MultiModalInputs"]:
        """(token ids, images with their M-RoPE positions) of a prompt text holding one
        placeholder per image and its multi_modal_data."""
        images = self.images_of(data, label)
        count = text.count(self.placeholder)
        if count != len(images):
            raise ValueError(f"{label}: the prompt holds {count} image placeholder(s) {self.placeholder!r} but "
                             f"{len(images)} image(s) were given (the chat template writes one per image content part)")
        if self.image_token != self.placeholder and self.image_token in text:
            raise ValueError(f"{label}: the prompt holds {self.image_token!r} itself; write {self.placeholder!r} once per image")
        processed = self.preprocess(images, label)
        pieces = text.split(self.placeholder)
        expanded = pieces[0] + "".join(self.expansion(grid) + piece for (_, grid), piece in zip(processed, pieces[1:]))
        ids = self.tokenizer.encode(expanded, add_special_tokens=add_special_tokens)
        runs = _runs(ids, self.image_token_id)
        lengths = [self._tokens(grid) for _, grid in processed]
        if [n for _, n in runs] != lengths:
            raise ValueError(f"{label}: the tokenizer did not keep each image's {self.image_token!r} tokens together "
                             f"(runs {[n for _, n in runs]}, expected {lengths})")
        prompt_images = [PromptImage(_image_hash(pixels, grid), start, n, pixels, grid, self.both_ways)
                         for (start, n), (pixels, grid) in zip(runs, processed)]
        if self.kind not in MROPE_KINDS:
            return ids, MultiModalInputs(prompt_images)
        rope, delta = mrope_positions(ids, [image.grid for image in prompt_images], image_token_id=self.image_token_id,
                                      spatial_merge_size=self.merge)
        return ids, MultiModalInputs(prompt_images, rope, delta)

    def _tokens(self, grid) -> int:
        return self.tokens_per_image if self.kind == "gemma3" else int(np.prod(grid)) // self.merge**2


def _runs(ids: Sequence[int], token: int) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of `token` in ids."""
    runs, i = [], 0
    while i < len(ids):
        if ids[i] == token:
            j = i
            while j < len(ids) and ids[j] == token:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs


Encoded = tuple[np.ndarray, "np.ndarray | None"]  # an image's rows [n, H] and deepstack rows [K, n, H] (Qwen3-VL) or None


def _num_rows(entry: Encoded) -> int:
    rows, deepstack = entry
    return len(rows) * (1 + (0 if deepstack is None else len(deepstack)))


class EncoderCache:
    """Encoder outputs by image hash, least recently used first out, at most `max_rows` rows
    (deepstack rows counted too)."""

    def __init__(self, max_rows: int):
        self.max_rows = max_rows
        self._rows: collections.OrderedDict[bytes, Encoded] = collections.OrderedDict()
        self._size = 0
        self.hits = self.misses = 0
        self._lock = threading.Lock()

    def __contains__(self, key: bytes) -> bool:
        return key in self._rows

    def get(self, key: bytes) -> Encoded | None:
        with self._lock:
            rows = self._rows.get(key)
            if rows is not None:
                self._rows.move_to_end(key)
            return rows

    def put(self, key: bytes, entry: Encoded) -> None:
        with self._lock:
            if key in self._rows:
                return
            self._rows[key] = entry
            self._size += _num_rows(entry)
            while self._size > self.max_rows and len(self._rows) > 1:
                _, dropped = self._rows.popitem(last=False)
                self._size -= _num_rows(dropped)


class ImageEncoder:
    """The vision tower of a model folder, run once per image (its rows cached by content hash)."""

    LOADERS = {"gemma3": load_gemma3_vision, "qwen2_5_vl": load_qwen2_5_vl_vision, "qwen3_vl": load_qwen3_vl_vision}

    def __init__(self, kind: str, folder: Path, *, param_dtype, cache_rows: int):
        self.kind = kind
        self.model = self.LOADERS[kind](folder, param_dtype=param_dtype)
        self.cache = EncoderCache(cache_rows)

    @property
    def deepstack_rows(self) -> int:
        """Deepstack rows per image token (Qwen3-VL), else 0."""
        return len(self.model.cfg.deepstack_visual_indexes) if self.kind == "qwen3_vl" else 0

    def warmup(self) -> None:
        """Compiles the encoder where an image's shape is fixed (Gemma 3: the processor's size); a
        Qwen ViT compiles per image grid, on first use."""
        if self.kind == "gemma3":
            side = self.model.cfg.vision.image_size
            image_features(self.model, np.zeros((1, 3, side, side), np.float32)).block_until_ready()

    def encode(self, image: PromptImage) -> Encoded:
        """Its encoder rows [length, H] float32 and (Qwen3-VL) deepstack rows [K, length, H], else
        None (computed now unless cached)."""
        entry = self.cache.get(image.key)
        if entry is not None:
            self.cache.hits += 1
            return entry
        self.cache.misses += 1
        deepstack = None
        if self.kind == "gemma3":
            out = image_features(self.model, image.pixels[None])[0]  # [tokens, H]
        elif self.kind == "qwen3_vl":
            out, deepstack = qwen3_vl.image_features(self.model, image.pixels, np.asarray([image.grid]))
            deepstack = np.asarray(deepstack, np.float32)
        else:
            out = qwen_vl.image_features(self.model, image.pixels, np.asarray([image.grid]))
        rows = np.asarray(out, np.float32)
        if rows.shape[0] != image.length:
            raise ValueError(f"the encoder gave {rows.shape[0]} rows for an image of {image.length} tokens")
        self.cache.put(image.key, (rows, deepstack))
        return rows, deepstack


@dataclasses.dataclass
class MultiModalInputs:
    """A processed prompt's images (PromptImages.process), as the Request keeps them."""

    images: list[PromptImage]
    rope_positions: np.ndarray | None = None  # [3, prompt length]: M-RoPE positions (Qwen2.5-VL, Qwen3-VL), else None
    rope_delta: int = 0  # generated tokens' M-RoPE position - their position


def chunk_inputs(images: Sequence[PromptImage], start: int, num_tokens: int, encoder: ImageEncoder
                 ) -> tuple[list[tuple[int, np.ndarray, np.ndarray | None]], list[tuple[int, int, int]]]:
    """What chunk [start, start + num_tokens) of a prompt with these images brings to the step, as
    batch.SequenceChunk's `mm_rows` (offset in the chunk, rows [k, H], deepstack rows [K, k, H] or
    None, per image piece) and `span_ends` (first offset, end offset, last position seen, per
    both-ways piece)."""
    end = start + num_tokens
    rows, spans = [], []
    for image in images:
        lo, hi = max(start, image.offset), min(end, image.end)
        if lo >= hi:
            continue
        image_rows, deepstack = encoder.encode(image)
        piece = slice(lo - image.offset, hi - image.offset)
        rows.append((lo - start, image_rows[piece], None if deepstack is None else deepstack[:, piece]))
        if image.both_ways:
            spans.append((lo - start, hi - start, image.end - 1))
    return rows, spans


def chunk_rope_positions(prompt_rope: np.ndarray, delta: int, start: int, num_tokens: int) -> np.ndarray:
    """M-RoPE positions [3, n] of tokens start .. start + n: the prompt's own ([3, prompt length]),
    then position + delta for generated tokens (all three the same)."""
    pos = np.arange(start, start + num_tokens)
    out = np.repeat((pos + delta)[None], 3, axis=0).astype(np.int32)
    inside = pos < prompt_rope.shape[1]
    out[:, inside] = prompt_rope[:, pos[inside]]
    return out


def attach_image_inputs(chunk, request, start: int, num_tokens: int, encoder: ImageEncoder | None) -> None:
    """Sets a SequenceChunk's image rows (with their deepstack rows), both-ways spans and M-RoPE
    positions from its request's images."""
    if request.images:
        chunk.mm_rows, chunk.span_ends = chunk_inputs(request.images, start, num_tokens, encoder)
    if request.rope_positions is not None:
        chunk.rope_positions = chunk_rope_positions(request.rope_positions, request.rope_delta, start, num_tokens)


IMAGE_PART_TYPES = ("image_url", "image", "input_image")


def split_images(messages: list[dict]) -> tuple[list[dict], list]:
    """OpenAI-style messages -> (the messages with each image part as {"type": "image"}, which the
    chat templates of vision models render as their image placeholder; the images in order).
    An image part is {"type": "image_url", "image_url": {"url": ...}} (a data: URI, a file path,
    or a URL the engine may refuse) or {"type": "image", "image": <image>}."""
    images, out = [], []
    for m, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES for p in content):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in IMAGE_PART_TYPES:
                parts.append(part)
                continue
            image = part.get(kind)
            if isinstance(image, dict):  # {"url": ..., "detail": ...}
                image = image.get("url")
            if image is None or (isinstance(image, str) and not image):
                raise ValueError(f"messages[{m}].content[{j}]: an {kind} part needs its image ({kind}.url)")
            images.append(image)
            parts.append({"type": "image"})
        out.append({**message, "content": parts})
    return out, images
