"""Perplexity, memory and decode speed of a model under each quantization mode, with llama.cpp on
the same GGUF file as the peer.

    python scripts/quantization_quality.py [--model PATH.gguf] [--text FILE] [--skip-llama-cpp] [--modes w8a8,smoothquant]

Default: the embedded SmolLM2-135M-Instruct (a Q4_1 GGUF) scored on tests/data/perplexity_text.txt
(held out: GPTQ / AWQ calibrate on jaxinfer/calibration/calibration.txt). One row per mode:

- float32: the GGUF's matrices dequantized at load (the CPU default);
- the GGUF's own grid (keep_checkpoint_quantization=True: Q4_1 int4 g32 with float16 scale and
  minimum, the Q8_0 embedding int8 g32);
- round to nearest from the floats (`quantization=`): int8 per column and per group of 32, fp8,
  int4 symmetric and asymmetric, and w8a8 (int8 activations too);
- calibrated (`jaxinfer quantize`, then loaded): GPTQ and AWQ int4 g128 asymmetric, and
  SmoothQuant W8A8 (alpha 0.5 and 0.8, and the same W8A8 checkpoint without smoothing: int8
  weights per column, int8 activations per token, no rotation; the tied embedding stays float,
  as compressed-tensors' W8A8 leaves the LM head);
- pruned (`jaxinfer prune`, then loaded): magnitude, Wanda and SparseGPT at 50 % unstructured and
  2:4, read back as dense float32 (the CPU expands sparse weights), and SparseGPT 2:4 with GPTQ
  int4 g128 in the same sweep (int4 grids holding the zeros);
- the KV cache in int8 / fp8 (float32 weights).

Columns: perplexity and its change against float32, the bytes of the matmul weights (the ones
quantization replaces; the embedding too when the mode keeps it quantized) and of all parameters
as loaded, the bytes a written checkpoint stores for the matmuls (packed grids; a pruned model's
float32 values plus its bitmasks), and the decode step at batch 1 and 32 (median time per output token of a greedy batch, on this
machine's backend), plus how long quantizing took. llama.cpp (llama-cpp-python, the bench extra)
decodes the same GGUF greedily at batch 1 and 32 (slots), its time per output token measured
the same way. Timings are one run each on a loaded machine: compare within a run.
"""

from __future__ import annotations

import argparse
import importlib.util
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
from flax import nnx

from jaxinfer import LLM, SamplingParams
import safetensors

from jaxinfer.calibration import prune, quantize
from jaxinfer.ops.quantization import MATMUL_WEIGHT_NAMES, QuantizedWeight, param_bytes
from jaxinfer.runtime.evaluate import perplexity
from jaxinfer.runtime.loading import default_model_path
from jaxinfer.tree import nested_to_flat

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
PROMPT_TOKENS, NEW_TOKENS = 64, 33

# (row name, LLM keywords); "calibrate" rows quantize a folder first and load it
MODES = [
    ("float32 (GGUF dequantized)", dict(dtype="float32")),
    ("GGUF grid: Q4_1 int4 g32 + Q8_0 embedding", dict(keep_checkpoint_quantization=True)),
    ("RTN int8 per column", dict(dtype="float32", quantization="int8")),
    ("RTN int8 g32", dict(dtype="float32", quantization="int8", quantization_group_size=32)),
    ("RTN fp8 per column", dict(dtype="float32", quantization="fp8")),
    ("w8a8: int8 weights per column, int8 activations per row", dict(dtype="float32", quantization="w8a8")),
    ("RTN int4 g128 symmetric", dict(dtype="float32", quantization="int4", quantization_group_size=128)),
    ("RTN int4 g128 asymmetric", dict(dtype="float32", quantization="int4", quantization_group_size=128,
                                      quantization_symmetric=False)),
    ("RTN int4 g32 asymmetric", dict(dtype="float32", quantization="int4", quantization_group_size=32,
                                     quantization_symmetric=False)),
    ("GPTQ int4 g128 (512 calibration tokens)", dict(calibrate="gptq")),
    ("AWQ int4 g128 (512 calibration tokens)", dict(calibrate="awq")),
    ("SmoothQuant W8A8 alpha 0.5 (512 calibration tokens)", dict(calibrate="smoothquant", alpha=0.5)),
    ("SmoothQuant W8A8 alpha 0.8 (512 calibration tokens)", dict(calibrate="smoothquant", alpha=0.8)),
    ("W8A8 checkpoint without smoothing (int8 per column, no rotation)", dict(calibrate="smoothquant", alpha=None)),
    ("magnitude 50 % unstructured (float32, sparse-bitmask)", dict(prune="magnitude")),
    ("Wanda 50 % unstructured (float32, sparse-bitmask)", dict(prune="wanda")),
    ("SparseGPT 50 % unstructured (float32, sparse-bitmask)", dict(prune="sparsegpt")),
    ("magnitude 2:4 (float32, sparse-24-bitmask)", dict(prune="magnitude", pattern="2:4")),
    ("Wanda 2:4 (float32, sparse-24-bitmask)", dict(prune="wanda", pattern="2:4")),
    ("SparseGPT 2:4 (float32, sparse-24-bitmask)", dict(prune="sparsegpt", pattern="2:4")),
    ("SparseGPT 2:4 + GPTQ int4 g128 (pack-quantized)", dict(prune="sparsegpt", pattern="2:4", bits=4)),
    ("KV cache int8 (float32 weights)", dict(dtype="float32", kv_cache_dtype="int8")),
    ("KV cache fp8 (float32 weights)", dict(dtype="float32", kv_cache_dtype="fp8")),
]


def decode_ms(generate, batch: int) -> float:
    """Median time per output token (first token excluded) of `batch` greedy requests decoding
    together, after one untimed run of the same shapes (compiles)."""
    prompts = [[3 + (i * 7 + j) % 200 for j in range(PROMPT_TOKENS)] for i in range(batch)]
    generate(prompts)
    spans = generate(prompts)  # [(first_token_at, last_token_at)]
    return 1000 * statistics.median((last - first) / (NEW_TOKENS - 1) for first, last in spans)


def jaxinfer_generate(llm: LLM):
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)

    def run(prompts):
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.metrics.first_token_time, o.metrics.last_token_time) for o in outs]

    return run


def matmul_bytes(params) -> tuple[int, int]:
    """(bytes of the matmul weights and of a quantized embedding, bytes of every parameter)."""
    flat = nested_to_flat(nnx.to_pure_dict(params))
    quantizable = {k: v for k, v in flat.items() if k.rsplit(".", 1)[-1] in MATMUL_WEIGHT_NAMES
                   or (k == "embed" and isinstance(v, QuantizedWeight))}
    return param_bytes(quantizable), param_bytes(params)


def stored_matmul_bytes(folder) -> int:
    """The bytes a written folder stores for its layers' linear weights (packed grids, sparse
    values and bitmasks, or dense floats)."""
    total = 0
    with safetensors.safe_open(str(Path(folder) / "model.safetensors"), "np") as f:
        for name in f.keys():
            if "_proj." in name:
                total += f.get_tensor(name).nbytes
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help=".gguf file (default: the embedded SmolLM2)")
    ap.add_argument("--text", default=str(ROOT / "tests/data/perplexity_text.txt"))
    ap.add_argument("--batches", default="1,32", help="decode batch sizes")
    ap.add_argument("--skip-llama-cpp", action="store_true")
    ap.add_argument("--modes", default=None, help="comma-separated words: only the rows whose name holds one "
                    "(case-insensitive; the float32 row always runs, as the reference)")
    args = ap.parse_args()
    model = args.model or str(default_model_path())
    batches = [int(b) for b in args.batches.split(",")]
    text = Path(args.text).read_text()
    work = Path(tempfile.mkdtemp(prefix="jaxinfer-quality-"))
    settings = dict(max_model_len=1024, page_size=16, max_num_seqs=max(batches), max_num_batched_tokens=512, progress=False)

    print(f"model {Path(model).name}, text {Path(args.text).name}; jax {jax.__version__}, backend {jax.default_backend()}, "
          f"{platform.processor() or platform.machine()}\n")
    head = ["mode", "perplexity", "vs float32", "matmul weights MB", "all params MB", "checkpoint matmul MB",
            *[f"decode B={b} ms/token" for b in batches], "quantize s"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    base = None
    words = [w.strip().lower() for w in args.modes.split(",")] if args.modes else None
    for i, (name, options) in enumerate(MODES):
        if words is not None and i > 0 and not any(w in name.lower() for w in words):
            continue
        options = dict(options)
        t0 = time.perf_counter()
        method = options.pop("calibrate", None)
        pruning = options.pop("prune", None)
        path = model
        if pruning:
            bits = options.pop("bits", None)
            path = str(prune(model, work / f"{pruning}-{options.get('pattern', 'unstructured').replace(':', 'of')}-{bits}",
                             method=pruning, pattern=options.pop("pattern", None), bits=bits))
            options.update(keep_checkpoint_quantization=True) if bits else options.update(dtype="float32")
        elif method == "smoothquant":
            alpha = options.pop("alpha")
            path = str(quantize(model, work / f"{method}-{alpha}", method=method, bits=8, alpha=alpha))
            options["keep_checkpoint_quantization"] = True
        elif method:
            path = str(quantize(model, work / method, method=method, bits=4, group_size=128))
            options["keep_checkpoint_quantization"] = True
        llm = LLM(path, **settings, **options)
        seconds = time.perf_counter() - t0
        ids = llm.get_tokenizer().encode(text)
        ppl = perplexity(llm.config, llm.runner.graphdef, llm.runner.params, ids, kv_dtype=llm.kv_cache_dtype)
        base = base or ppl
        matmul, total = matmul_bytes(llm.runner.params)
        run = jaxinfer_generate(llm)
        speeds = [decode_ms(run, b) for b in batches]
        stored = f"{stored_matmul_bytes(path) / 1e6:.1f}" if path != model else "-"
        print(f"| {name} | {ppl:.3f} | {100 * (ppl / base - 1):+.2f} % | {matmul / 1e6:.1f} | {total / 1e6:.1f} | {stored} | "
              + " | ".join(f"{ms:.1f}" for ms in speeds) + f" | {seconds:.0f} |", flush=True)
        del llm

    if not args.skip_llama_cpp and importlib.util.find_spec("llama_cpp") is not None:
        from llama_cpp_peer import LlamaCppPeer

        speeds = []
        for b in batches:
            peer = LlamaCppPeer(model, slots=b, n_ctx=b * (PROMPT_TOKENS + NEW_TOKENS + 8), threads=2)

            def run(prompts, peer=peer):
                return [(r["first_token_at"], r["last_token_at"]) for r in peer.generate([(p, NEW_TOKENS) for p in prompts])]

            speeds.append(decode_ms(run, b))
            peer.close()
        print(f"| llama.cpp on the GGUF ({Path(model).name}, its own kernels) | - | - | - | - | - | "
              + " | ".join(f"{ms:.1f}" for ms in speeds) + " | - |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
