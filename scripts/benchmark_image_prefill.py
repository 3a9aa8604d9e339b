"""Prompts with images through the whole engine on this CPU, against transformers, in one run.

    python scripts/benchmark_image_prefill.py                        # ~5 min on 2 cores
    python scripts/benchmark_image_prefill.py --vision-layers 27 --text-layers 8

A Gemma 3 model built here with random weights (nothing is downloaded): Gemma 3's SigLIP so400m
tower (hidden 1152, 16 heads, MLP 4304, image 896, patch 14; --vision-layers of its 27) and
projector to 256 image tokens, and a text decoder of --text-hidden / --text-layers (Gemma-3-4B's
width by default, fewer layers). Each of --prompts prompts holds one image (all different) and a
short question; the engine computes the prompt and one token (`LLM.generate`, max_tokens=1), the
peer runs `Gemma3ForConditionalGeneration` forward over the same ids and pixels (one prompt per
call, no cache: what producing the first token costs), at its best dtype of float32 / bfloat16.
Printed: seconds per prompt, image tokens per second, and the ratio (peer seconds / jaxinfer
seconds: above 1, jaxinfer is faster). jaxinfer's first prompt (compiles) is run and not timed.
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import PIL.Image  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3ImageProcessorPil  # noqa: E402

from jaxinfer import LLM, SamplingParams  # noqa: E402
from tiny_models import byte_tokenizer  # noqa: E402


def build(folder: Path, args) -> tuple[Gemma3ForConditionalGeneration, object]:
    tok = byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<start_of_image>", "<image_soft_token>", "<end_of_image>"]})
    boi, soft, eoi = tok.convert_tokens_to_ids(["<start_of_image>", "<image_soft_token>", "<end_of_image>"])
    heads = args.text_hidden // 256
    config = Gemma3Config(
        text_config=dict(hidden_size=args.text_hidden, intermediate_size=4 * args.text_hidden, num_hidden_layers=args.text_layers,
                         num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=256,
                         vocab_size=len(tok), sliding_window=1024, max_position_embeddings=4096),
        vision_config=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=args.vision_layers,
                           num_attention_heads=16, image_size=896, patch_size=14, vision_use_head=False),
        mm_tokens_per_image=256, image_token_index=soft, boi_token_index=boi, eoi_token_index=eoi,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).eval()
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    Gemma3ImageProcessorPil(size={"height": 896, "width": 896}).save_pretrained(folder)
    return model, tok


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--vision-layers", type=int, default=4)
    ap.add_argument("--text-layers", type=int, default=4)
    ap.add_argument("--text-hidden", type=int, default=2560)
    ap.add_argument("--max-num-batched-tokens", type=int, default=320,
                    help="the engine's step budget: its largest bucket, which a 306-token prompt is padded to (default 320)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    images = [PIL.Image.fromarray(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8)) for _ in range(args.prompts + 1)]
    prompts = [{"prompt": "<start_of_image>What is in this picture? Answer in one word.", "multi_modal_data": {"image": im}}
               for im in images]
    with tempfile.TemporaryDirectory() as tmp:
        model, _ = build(Path(tmp), args)
        llm = LLM(tmp, max_model_len=512, max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=4, progress=False)
        params = SamplingParams(max_tokens=1, temperature=0)
        llm.generate(prompts[0], params, use_tqdm=False)  # compiles
        t0 = time.perf_counter()
        outs = [llm.generate(p, params, use_tqdm=False)[0] for p in prompts[1:]]
        ours = (time.perf_counter() - t0) / args.prompts
        processor = Gemma3ImageProcessorPil(size={"height": 896, "width": 896})
        peer = {}
        for dtype in (torch.float32, torch.bfloat16):
            m = model.to(dtype)
            times = []
            for out, image in zip(outs, images[1:]):
                ids = torch.tensor([out.prompt_token_ids])
                t0 = time.perf_counter()  # (preprocessing counted on both sides)
                pixels = torch.tensor(processor(images=[image], return_tensors="np")["pixel_values"]).to(dtype)
                with torch.no_grad():
                    m(input_ids=ids, pixel_values=pixels, token_type_ids=(ids == model.config.image_token_index).long(),
                      logits_to_keep=1)
                times.append(time.perf_counter() - t0)
            peer[str(dtype).split(".")[-1]] = float(np.mean(times))
    best = min(peer, key=peer.get)
    print(f"# {platform.processor() or platform.machine()}, jax {jax.__version__}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}; Gemma 3 with SigLIP so400m x {args.vision_layers} layers, text "
          f"{args.text_layers} x {args.text_hidden}; {args.prompts} prompts of {len(outs[0].prompt_token_ids)} tokens "
          f"(256 image tokens each)")
    print("| runner | s / prompt | image tokens / s | ratio (peer best / this) |")
    print("|---|---|---|---|")
    print(f"| jaxinfer LLM.generate (float32, max_num_batched_tokens {args.max_num_batched_tokens}) | {ours:.3f} | {256 / ours:.0f} | {peer[best] / ours:.2f} |")
    for name, t in peer.items():
        print(f"| transformers forward ({name}) | {t:.3f} | {256 / t:.0f} | {peer[best] / t:.2f} |")


if __name__ == "__main__":
    main()
