"""M-RoPE, the multimodal rotary position embedding of Qwen2.5-VL's and Qwen3-VL's text decoders.

Each token has three positions, (temporal, height, width), rather than one. RoPE's rope_dim / 2
frequencies are cut into consecutive sections of `ModelConfig.mrope_section` sizes (Qwen2.5-VL:
[16, 24, 24] of 64): a frequency in section j turns by the token's position j; Qwen3-VL
interleaves them (`ModelConfig.mrope_interleaved`, [24, 20, 20] of 64: t h w t h w ... then t),
see `section_of_frequency`; `models.rope` builds the tables. A text token's three positions are
equal, so on text alone M-RoPE is plain RoPE.

A prompt's positions (`mrope_positions`, transformers' `get_rope_index` for images, the same for
Qwen2.5-VL and Qwen3-VL: an image is one frame, t = 1):

- text tokens count on one by one from the position after what came before;
- an image whose patch grid is (t, h, w), its patches merged in spatial_merge_size^2 blocks, is
  t * h' * w' tokens (h' = h / merge, w' = w / merge) in (frame, row, column) order; the token at
  (f, r, c) has positions (s + f, s + r, s + c), s being the position a text token there would have;
- the text after it continues from s + max(h', w') (an image has t = 1: its largest position + 1).

So positions stop counting tokens: a prompt of n tokens ends below position n - 1. Its `delta` is
the largest position + 1 - n, and a token at sequence position p >= n (a generated one) has
position p + delta in all three (`decode_rope_positions`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def section_of_frequency(mrope_section: Sequence[int], interleaved: bool = False) -> np.ndarray:
    """[sum(mrope_section)] int32: which of the (t, h, w) positions turns each frequency, as
    transformers: consecutive sections (section j reads position j % 3) or, `interleaved`
    (Qwen3-VL), frequency i reads h when i % 3 == 1 and i < 3 * mrope_section[1], w when
    i % 3 == 2 and i < 3 * mrope_section[2], else t (t h w t h w ... t t)."""
    if not interleaved:
        return np.repeat(np.arange(len(mrope_section)) % 3, mrope_section).astype(np.int32)
    i = np.arange(sum(mrope_section))
    rows = np.zeros(len(i), np.int32)
    for axis in (1, 2):
        rows[(i % 3 == axis) & (i < 3 * mrope_section[axis])] = axis
    return rows


def mrope_positions(token_ids: Sequence[int], image_grid_thw: Sequence[tuple[int, int, int]], *,
                    image_token_id: int, spatial_merge_size: int) -> tuple[np.ndarray, int]:
    """(positions [3, n] int32, delta) of a prompt whose runs of `image_token_id` hold the images
    of `image_grid_thw` (patch grids, in order; adjacent images may share a run)."""
    ids = np.asarray(token_ids, np.int64)
    n = len(ids)
    positions = np.zeros((3, n), np.int32)
    grids = list(image_grid_thw)
    is_image = ids == image_token_id
    starts = np.flatnonzero(np.diff(is_image.astype(np.int8), prepend=np.int8(-1)))  # each run's first token
    ends = np.append(starts[1:], n)
    pos = 0  # the position the next text token would have
    for start, end in zip(starts, ends):
        if not is_image[start]:  # text: pos, pos + 1, ...
            positions[:, start:end] = pos + np.arange(end - start)
            pos += int(end - start)
            continue
        i = int(start)
        while i < end:  # one image after another
            if not grids:
                raise ValueError(f"image tokens at {i}..{end - 1} have no image grid left (grids: {list(image_grid_thw)})")
            t, h, w = grids.pop(0)
            h, w = h // spatial_merge_size, w // spatial_merge_size
            if i + t * h * w > end:
                raise ValueError(f"an image of grid {(t, h * spatial_merge_size, w * spatial_merge_size)} needs {t * h * w} "
                                 f"tokens at {i}; its run of image tokens holds {end - i}")
            grid = np.stack(np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")).reshape(3, -1)  # [3, t*h*w]
            positions[:, i:i + t * h * w] = pos + grid
            pos += max(h, w)
            i += t * h * w
    if grids:
        raise ValueError(f"{len(grids)} image grid(s) have no image tokens in the prompt")
    delta = int(positions.max()) + 1 - n if n else 0
    return positions, delta


def decode_rope_positions(start: int, n: int, delta: int) -> np.ndarray:
    """[3, n] int32: the M-RoPE positions of the tokens at sequence positions start .. start + n - 1
    past the prompt (each p + delta, in all three)."""
    return np.broadcast_to(np.arange(start, start + n, dtype=np.int32) + np.int32(delta), (3, n)).copy()
