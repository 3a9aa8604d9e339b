"""Image encoders on this CPU: jaxinfer's vision towers against transformers', in one run.

    python scripts/benchmark_vision.py                       # real depths: ~20-30 min on 2 cores
    python scripts/benchmark_vision.py --layers 2 --runs 2   # a quick check (time scales with depth)
    python scripts/benchmark_vision.py --models qwen --qwen-sizes 448x448

Two towers at their released shapes, random weights built here (nothing is downloaded): a
transformers model from its config, saved as safetensors to a temporary folder, read back by
jaxinfer's own loader.

- gemma3: Gemma 3's SigLIP so400m (hidden 1152, 27 layers of 16 heads, MLP 4304, image 896,
  patch 14) and its projector to 256 soft tokens of --text-hidden (2560: Gemma-3-4B);
  jaxinfer `siglip.image_features` vs `Gemma3ForConditionalGeneration.get_image_features`.
- qwen: Qwen2.5-VL's ViT (hidden 1280, 32 layers of 16 heads, MLP 3420, patch 14, windows of 112
  pixels, full attention in layers 7/15/23/31) and its 2x2 merger to --qwen-out (2048: 3B; 3584: 7B)
  at each --qwen-sizes (H x W pixels, multiples of 28); jaxinfer `qwen_vl.image_features` vs
  `model.visual(pixel_values, grid_thw)`.

Each encoder runs one image per call in float32 and bfloat16 weights on both sides (transformers:
the whole module cast; jaxinfer: params in that dtype, inputs float32 cast inside). Time: median of
--runs calls after one warm-up call (jaxinfer's warm-up compiles; its seconds are printed), the
result waited for. The ratio divides the peer's best (fastest dtype) time by jaxinfer's time at
each dtype: above 1, jaxinfer is faster. transformers runs first, then jaxinfer, in this process.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import (  # noqa: E402
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
)

from jaxinfer.models.vision import qwen_vl, siglip  # noqa: E402

DTYPES = ("float32", "bfloat16")
SIGLIP_SO400M = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                     image_size=896, patch_size=14, vision_use_head=False)
QWEN25_VL_VIT = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14,
                     temporal_patch_size=2, spatial_merge_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31])
TINY_TEXT = dict(intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                 head_dim=16, vocab_size=300)  # the text decoder is not timed: as small as it can be


def timed(fn, runs: int) -> tuple[float, float]:
    """(seconds of the warm-up call, median seconds of `runs` calls after it)."""
    start = time.perf_counter()
    fn()
    warm = time.perf_counter() - start
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return warm, statistics.median(times)


def torch_times(call, model, inputs: dict, runs: int) -> dict[str, float]:
    """dtype -> median seconds of `call(model, **inputs)`, the model (and float inputs) cast to each."""
    out = {}
    for dtype in DTYPES:
        model.to(getattr(torch, dtype))
        cast = {k: v.to(getattr(torch, dtype)) if v.is_floating_point() else v for k, v in inputs.items()}
        with torch.inference_mode():
            out[dtype] = timed(lambda: call(model, **cast), runs)[1]
    return out


def jax_times(load, call, runs: int) -> dict[str, tuple[float, float]]:
    """dtype -> (warm-up seconds, median seconds) of `call(load(param_dtype))`."""
    out = {}
    for dtype in DTYPES:
        model = load(jnp.dtype(dtype))
        out[dtype] = timed(lambda: jax.block_until_ready(call(model)), runs)
        del model
    return out


# ----------------------------------------------------------------------------- the two towers
def bench_gemma3(args, folder: Path) -> list[dict]:
    vision = dict(SIGLIP_SO400M, num_hidden_layers=args.layers or SIGLIP_SO400M["num_hidden_layers"])
    cfg = Gemma3Config(text_config=dict(TINY_TEXT, hidden_size=args.text_hidden), vision_config=vision,
                       mm_tokens_per_image=256, image_token_index=299, boi_token_index=297, eoi_token_index=298)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(cfg).eval()
    model.save_pretrained(folder)
    size = vision["image_size"]
    pixels = np.random.default_rng(0).uniform(-1, 1, (1, 3, size, size)).astype(np.float32)
    peer = {} if args.skip_hf else torch_times(lambda m, pixel_values: m.get_image_features(pixel_values).pooler_output,
                                               model, {"pixel_values": torch.from_numpy(pixels)}, args.runs)
    del model
    ours = jax_times(lambda dtype: siglip.load_gemma3_vision(folder, param_dtype=dtype),
                     lambda m: siglip.image_features(m, pixels), args.runs)
    what = f"Gemma 3 SigLIP-so400m ({vision['num_hidden_layers']} layers) + projector to {args.text_hidden}"
    return [dict(model=what, image=f"{size}x{size}", tokens=256, peer=peer, ours=ours)]


def bench_qwen(args, folder: Path) -> list[dict]:
    depth = args.layers or QWEN25_VL_VIT["depth"]
    full = [i for i in QWEN25_VL_VIT["fullatt_block_indexes"] if i < depth] or [depth - 1]
    vision = dict(QWEN25_VL_VIT, depth=depth, fullatt_block_indexes=full, out_hidden_size=args.qwen_out)
    cfg = Qwen2_5_VLConfig(
        text_config=dict(TINY_TEXT, hidden_size=args.qwen_out, bos_token_id=None, eos_token_id=None,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}),
        vision_config=vision, image_token_id=299, video_token_id=298, vision_start_token_id=297, vision_end_token_id=296)
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(cfg).eval()
    model.save_pretrained(folder)
    cases = []
    for size in args.qwen_sizes.split(","):
        height, width = (int(v) for v in size.split("x"))
        unit = vision["patch_size"] * vision["spatial_merge_size"]
        if height % unit or width % unit:
            raise SystemExit(f"--qwen-sizes {size}: height and width must be multiples of {unit}")
        grid = (1, height // vision["patch_size"], width // vision["patch_size"])  # one frame, as for an image
        patch_dim = 3 * vision["temporal_patch_size"] * vision["patch_size"] ** 2
        pixels = np.random.default_rng(0).normal(size=(math.prod(grid), patch_dim)).astype(np.float32)
        cases.append((size, grid, pixels, math.prod(grid) // vision["spatial_merge_size"] ** 2))
    results = []
    for size, grid, pixels, tokens in cases:
        peer = {} if args.skip_hf else torch_times(
            lambda m, pixel_values, grid_thw: m.model.visual(pixel_values, grid_thw=grid_thw).pooler_output, model,
            {"pixel_values": torch.from_numpy(pixels), "grid_thw": torch.tensor([grid])}, args.runs)
        results.append(dict(model=f"Qwen2.5-VL ViT ({depth} layers) + merger to {args.qwen_out}", image=size,
                            tokens=tokens, peer=peer, grid=grid, pixels=pixels))
    del model
    for dtype in DTYPES:  # one load per dtype, every size
        tower = qwen_vl.load_qwen2_5_vl_vision(folder, param_dtype=jnp.dtype(dtype))
        for r in results:
            r.setdefault("ours", {})[dtype] = timed(
                lambda: jax.block_until_ready(qwen_vl.image_features(tower, r["pixels"], np.array([r["grid"]]))), args.runs)
        del tower
    return results


# ----------------------------------------------------------------------------- the table
def machine() -> str:
    flags = subprocess.run("lscpu | grep -o -E 'amx_[a-z0-9]+|avx512_bf16|avx512_vnni' | sort -u", shell=True,
                           capture_output=True, text=True).stdout.split()
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return (f"{model} ({', '.join(flags) or 'no bf16/int8 dot ISA'}), {torch.get_num_threads()} torch threads, "
            f"load {', '.join(f'{x:.2f}' for x in os.getloadavg())}; jax {jax.__version__}, "
            f"transformers {transformers.__version__}, torch {torch.__version__}")


def table(rows: list[dict]) -> str:
    lines = ["| encoder | image | soft tokens / image | system | dtype | ms / image | image tokens/s | vs best peer | warm-up s |",
             "|---|---|---:|---|---|---:|---:|---:|---:|"]
    for r in rows:
        best = min(r["peer"].values()) if r["peer"] else None
        for dtype, seconds in r["peer"].items():
            mark = " (best)" if seconds == best else ""
            lines.append(f"| {r['model']} | {r['image']} | {r['tokens']} | transformers | {dtype}{mark} | {seconds * 1e3:,.0f} | "
                         f"{r['tokens'] / seconds:,.1f} | | |")
        for dtype, (warm, seconds) in r["ours"].items():
            ratio = f"{best / seconds:.2f}x" if best else "-"
            lines.append(f"| {r['model']} | {r['image']} | {r['tokens']} | jaxinfer | {dtype} | {seconds * 1e3:,.0f} | "
                         f"{r['tokens'] / seconds:,.1f} | {ratio} | {warm:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="gemma3,qwen", help="comma-separated: gemma3, qwen")
    p.add_argument("--layers", type=int, default=None, help="cut every tower to this depth (default: the real depth)")
    p.add_argument("--runs", type=int, default=3, help="timed calls per configuration, after one warm-up")
    p.add_argument("--text-hidden", type=int, default=2560, help="Gemma 3's text hidden size (4B 2560, 12B 3840, 27B 5376)")
    p.add_argument("--qwen-out", type=int, default=2048, help="Qwen2.5-VL's out_hidden_size (3B 2048, 7B 3584)")
    p.add_argument("--qwen-sizes", default="448x448,896x672", help="image sizes, H x W pixels")
    p.add_argument("--skip-hf", action="store_true", help="jaxinfer only")
    args = p.parse_args(argv)
    rows = []
    for name in args.models.split(","):
        bench = {"gemma3": bench_gemma3, "qwen": bench_qwen}[name.strip()]
        with tempfile.TemporaryDirectory(prefix=f"bench_vision_{name}_") as folder:
            start = time.perf_counter()
            rows += bench(args, Path(folder))
            print(f"{name}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    print(f"# {machine()}\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
