"""Every Pallas kernel of this machine's chip run against its XLA path at a preset model's shapes
(the check `build_engine` runs before serving, jaxinfer.runtime.kernel_selfcheck), as a table.

    python scripts/kernel_selfcheck.py                          # SmolLM2-135M and Llama-3.1-8B, bf16, on the default device
    python scripts/kernel_selfcheck.py --preset llama-3.1-8b --kernel ragged_attention --kernel quantized_matmul
    python scripts/kernel_selfcheck.py --out kernels.md         # the table written as markdown too
    python scripts/kernel_selfcheck.py --platform gpu           # elsewhere: the GPU kernels in interpret mode (slow)

Each preset runs as one device (tensor-parallel degree 1) would: its heads, head_dim, hidden and
MLP sizes, a bf16 KV pool of 16-token pages, the quantized matmul in every form a model may load
(`--quantization`: ours int8 / int4 / fp8, GGUF's Q4_1 and Q8_0 as they load), LoRA stacks of
rank 16 over 8 adapters, flash attention at its smallest step. Each operation is checked on its
own: an exception anywhere in one is a row of the table, and the rest go on. Exit status 1 when
a kernel failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from jaxinfer.aot.presets import PRESETS, read_model_config  # noqa: E402
from jaxinfer.models.lora import LoraTable  # noqa: E402
from jaxinfer.ops.kernels import OPERATIONS, Kernels, resolve_kernels  # noqa: E402
from jaxinfer.ops.quantization import MATMUL_WEIGHT_NAMES, QuantizedWeight, quantize_params  # noqa: E402
from jaxinfer.runtime.kernel_selfcheck import Verdict, code_version, device_kind, run_checks, step_shapes  # noqa: E402
from jaxinfer.runtime.loading import abstract_model  # noqa: E402
from jaxinfer.tree import nested_to_flat  # noqa: E402

# name -> (mode, group size, symmetric, scales' dtype as loaded; None: the quantizer's)
QUANTIZED_FORMS = {
    "int8": ("int8", None, True, None),
    "int4": ("int4", 128, True, None),
    "fp8": ("fp8", None, True, None),
    "q4_1": ("int4", 32, False, jnp.float16),  # GGUF Q4_1: int4 groups of 32, float16 scales and offsets
    "q8_0": ("int8", 32, True, jnp.float16),  # GGUF Q8_0
}
LORA_ADAPTERS = 8


def preset_params(preset: str, kernels: Kernels, *, dtype, forms: list[str], lora_rank: int):
    """(ModelConfig, flat name -> ShapeDtypeStruct / QuantizedWeight of them): the preset's
    parameters as one device holds them, plus each matmul weight in every quantized form."""
    config = read_model_config(preset)
    lora = LoraTable(LORA_ADAPTERS + 1, lora_rank) if lora_rank else None
    _, state = abstract_model(config, dtype, dtype, Kernels(), lora=lora)
    flat = nested_to_flat(nnx.to_pure_dict(state))
    matrices = {name: w for name, w in flat.items() if name.rsplit(".", 1)[-1] in MATMUL_WEIGHT_NAMES}
    for form in forms:
        mode, group, symmetric, scale_dtype = QUANTIZED_FORMS[form]
        quantized = jax.eval_shape(lambda p: quantize_params(p, mode, group, symmetric=symmetric), matrices)  # noqa: B023
        for name, w in quantized.items():
            placed = lambda a: None if a is None else jax.ShapeDtypeStruct(  # noqa: E731  (as build_engine places them)
                a.shape, kernels.scale_dtype(jnp.dtype(scale_dtype or a.dtype)))
            flat[f"{name}@{form}"] = dataclasses.replace(w, scales=placed(w.scales), offsets=placed(w.offsets))
    assert all(isinstance(flat[f"{name}@{form}"], QuantizedWeight) for name in matrices for form in forms)
    return config, flat


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", action="append", choices=sorted(PRESETS), help="default: smollm2-135m and llama-3.1-8b")
    parser.add_argument("--platform", choices=("tpu", "gpu"),
                        help="whose kernels (default: the device's; interpret mode off that platform)")
    parser.add_argument("--kernel", action="append", choices=OPERATIONS, help="only these operations (repeatable)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--kv-dtype", default=None, help="the KV pool's dtype (default: --dtype)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--quantization", action="append", choices=sorted(QUANTIZED_FORMS),
                        help="quantized matmul forms (repeatable; default: all)")
    parser.add_argument("--lora-rank", type=int, default=16, help="0: no LoRA")
    parser.add_argument("--max-tokens", type=int, default=512, help="the largest step (flash attention from 256 tokens)")
    parser.add_argument("--cache", type=Path, default=None, help="a verdict cache file to read and add to (default: none)")
    parser.add_argument("--out", type=Path, default=None, help="also write the table here (markdown)")
    args = parser.parse_args(argv)

    device = jax.devices()[0]
    kernels = resolve_kernels(f"pallas-{args.platform}" if args.platform else "pallas")
    dtype = jnp.dtype(args.dtype)
    kv_dtype = jnp.dtype(args.kv_dtype or args.dtype)
    forms = args.quantization or list(QUANTIZED_FORMS)
    lines = [f"# Kernel check: {device_kind(device, kernels)}", "",
             f"jax {jax.__version__}, jaxinfer {code_version()}, {args.dtype} activations, {kv_dtype.name} KV pages of "
             f"{args.page_size}" + (" (interpret mode: NOT a run on the chip)" if kernels.interpret else ""), "",
             "| preset | kernel | case | max error | tolerance | verdict | seconds |", "|---|---|---|---:|---:|---|---:|"]
    for line in lines:
        print(line, flush=True)
    counts = {"pass": 0, "FAIL": 0, "unchecked": 0, "error": 0}

    def row(preset: str, v: Verdict):
        error = "" if v.error is None else f"{v.error:.2e}"
        verdict = v.verdict + ("" if v.reason is None or v.verdict == "pass" else f": {v.reason.removeprefix(v.case + ': ')}")
        lines.append(f"| {preset} | {v.operation} | {v.case} | {error} | {v.tolerance:.0e} | {verdict} | {v.seconds:.2f} |")
        counts[v.verdict] += 1
        print(lines[-1], flush=True)

    for preset in args.preset or ["smollm2-135m", "llama-3.1-8b"]:
        try:
            config, params = preset_params(preset, kernels, dtype=dtype, forms=forms, lora_rank=args.lora_rank)
            shapes = step_shapes(config, params, dtype=dtype, kv_dtype=kv_dtype, page_size=args.page_size,
                                 max_tokens=args.max_tokens)
        except Exception as e:  # noqa: BLE001  (report it, go on with the next preset)
            lines.append(f"| {preset} | (shapes) | | | | ERROR: {type(e).__name__}: {e} | |")
            counts["error"] += 1
            print(lines[-1], flush=True)
            continue
        for operation in args.kernel or OPERATIONS:
            start = time.perf_counter()
            try:
                run_checks(kernels, shapes, operations={operation}, cache=args.cache, device=device,
                           on_verdict=lambda v: row(preset, v))  # noqa: B023
            except Exception as e:  # noqa: BLE001  (one operation's failure must not stop the table)
                lines.append(f"| {preset} | {operation} | (building its cases) | | | ERROR: {type(e).__name__}: {e} | "
                             f"{time.perf_counter() - start:.2f} |")
                counts["error"] += 1
                print(lines[-1], flush=True)
    summary = ", ".join(f"{n} {name}" for name, n in counts.items())
    print(summary)
    if args.out:
        args.out.write_text("\n".join(lines + ["", summary]) + "\n")
    return 1 if counts["FAIL"] or counts["error"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
