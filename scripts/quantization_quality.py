"""Perplexity and parameter memory of a model under each weight-quantization mode.

    python scripts/quantization_quality.py [--model PATH] [--text FILE]

Default: the embedded SmolLM2-135M-Instruct on tests/data/perplexity_text.txt. Prints one row per
mode: perplexity, its change against the unquantized model, the bytes of the matmul weights
(the ones quantization replaces) and of all parameters, and the ratio against the same weights
in bfloat16.
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import jax
from flax import nnx

from jaxinfer import LLM
from jaxinfer.runtime.evaluate import perplexity
from jaxinfer.tree import nested_to_flat
from jaxinfer.ops.quantization import MATMUL_WEIGHT_NAMES, param_bytes, quantize_model

MODES = [(None, None), ("int8", None), ("fp8", None), ("int4", 128), ("int4", 64), ("int4", 32)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder, .gguf or converted folder (default: embedded SmolLM2)")
    ap.add_argument("--text", default=str(Path(__file__).resolve().parent.parent / "tests/data/perplexity_text.txt"))
    args = ap.parse_args()

    llm = LLM(args.model, max_model_len=None, num_pages=4, max_num_batched_tokens=16, max_num_seqs=1, progress=False)
    ids = llm.get_tokenizer().encode(Path(args.text).read_text())[: llm.config.max_position_embeddings]
    flat = nested_to_flat(nnx.to_pure_dict(llm.runner.params))
    is_matmul = lambda name: name.rsplit(".", 1)[-1] in MATMUL_WEIGHT_NAMES
    bf16_matmul = sum(a.size * 2 for k, a in flat.items() if is_matmul(k))

    print(f"model {llm.source.path.name}, text {Path(args.text).name} ({len(ids)} tokens)")
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, {platform.processor() or platform.machine()}\n")
    print("| mode | perplexity | vs none | matmul weights MB | x smaller than bf16 | all params MB | s |")
    print("|---|---|---|---|---|---|---|")
    base = None
    for mode, group_size in MODES:
        t0 = time.perf_counter()
        graphdef, params = llm.runner.graphdef, llm.runner.params
        if mode is not None:
            graphdef, params = quantize_model(graphdef, params, mode, group_size or 128)
        ppl = perplexity(llm.config, graphdef, params, ids)
        base = base or ppl
        q_flat = nested_to_flat(nnx.to_pure_dict(params))
        matmul_bytes = param_bytes({k: v for k, v in q_flat.items() if is_matmul(k)})
        name = "none (f32)" if mode is None else f"{mode} g{group_size}" if group_size else mode
        print(
            f"| {name} | {ppl:.3f} | {100 * (ppl / base - 1):+.2f} % | {matmul_bytes / 1e6:.1f} | "
            f"{bf16_matmul / matmul_bytes:.2f} | {param_bytes(params) / 1e6:.1f} | {time.perf_counter() - t0:.1f} |"
        )


if __name__ == "__main__":
    main()
