"""What output constraints cost: the grammar engines' mask time per token on the host, and the
engine's throughput with and without constraints.

1. Mask time: B matchers walk the tokens of one valid JSON document for a schema, each step
   computing the B allowed-token bitmasks in one call, then taking the token; microseconds per
   step and per row, for llguidance (jaxinfer's engine) and xgrammar where it imports (it needs
   torch). Also the time to compile the schema.
2. Throughput: SmolLM2-135M-Instruct (the shipped GGUF) generating the same number of tokens per
   request at batch 1 and 32, unconstrained (ignore_eos, max_tokens = the constrained length)
   and constrained to a JSON array of exactly N one-digit integers (every request the same
   length), each after one warm-up pass that compiles what it needs.

    python scripts/bench_structured_output.py
    python scripts/bench_structured_output.py --batches 1,32 --items 48 --skip-throughput
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.(com|org)$"},
        "tags": {"type": "array", "items": {"enum": ["admin", "user", "guest"]}, "maxItems": 5},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "email", "tags", "address"],
    "additionalProperties": False,
}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["admin", "user"],
            "address": {"city": "London", "zip": "12345"}}


def bench_llguidance(tokenizer, vocab_size, eos, ids, batch):
    from jaxinfer.engine.grammar import GrammarBackend
    from jaxinfer.sampling_params import StructuredOutputsParams

    backend = GrammarBackend(tokenizer, vocab_size, eos)
    _ = backend.tokenizer  # build llguidance's tokenizer outside the timings
    t0 = time.perf_counter()
    grammar = backend.compile(StructuredOutputsParams(json=SCHEMA))
    compile_s = time.perf_counter() - t0
    matchers = [backend.matcher(grammar) for _ in range(batch)]
    out = np.empty((batch, backend.num_words), np.int32)
    times = []
    for token in ids:
        t0 = time.perf_counter()
        backend.fill_bitmasks(matchers, out)
        times.append(time.perf_counter() - t0)
        for m in matchers:
            assert m.accept(token), "the document does not follow the schema"
    return compile_s, times


def bench_xgrammar(tokenizer, vocab_size, eos, ids, batch):
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=eos)
    compiler = xgr.GrammarCompiler(info)
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(", ", ": "))
    compile_s = time.perf_counter() - t0
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    bitmask = xgr.allocate_token_bitmask(batch, vocab_size)
    batched = xgr.BatchGrammarMatcher() if batch > 1 else None
    times = []
    for token in ids:
        t0 = time.perf_counter()
        if batched is not None:
            batched.batch_fill_next_token_bitmask(matchers, bitmask)
        else:
            matchers[0].fill_next_token_bitmask(bitmask, 0)
        times.append(time.perf_counter() - t0)
        for m in matchers:
            assert m.accept_token(token), "the document does not follow the schema"
    return compile_s, times


def mask_table(args, tokenizer, vocab_size, eos):
    text = json.dumps(DOCUMENT)  # ", " and ": " separators, as both engines are configured
    ids = tokenizer.encode(text, add_special_tokens=False)
    engines = {"llguidance": bench_llguidance, "xgrammar": bench_xgrammar}
    print(f"- schema: 5 fields (a pattern, an enum array, a nested object); document: {len(ids)} tokens; vocabulary {vocab_size}")
    print()
    print("| engine | version | batch | compile ms | mask µs / step (mean) | p90 | µs / row |")
    print("|---|---|---|---|---|---|---|")
    for name, fn in engines.items():
        try:
            version = importlib.metadata.version(name)
            for batch in args.batches:
                compile_s, times = fn(tokenizer, vocab_size, eos, ids, batch)
                t = np.array(times) * 1e6
                print(f"| {name} | {version} | {batch} | {compile_s * 1e3:.1f} | {t.mean():.0f} | {np.percentile(t, 90):.0f} | "
                      f"{t.mean() / batch:.1f} |")
        except ImportError as e:
            print(f"| {name} | not installed ({e.name}) | | | | | |")


def throughput_table(args):
    from jaxinfer import LLM, SamplingParams, StructuredOutputsParams

    llm = LLM(dtype=args.dtype, max_model_len=1024, max_num_seqs=max(args.batches), progress=False)
    items = args.items
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": items, "maxItems": items}
    constrained = SamplingParams(temperature=1.0, seed=0, max_tokens=4 * items + 8,
                                 structured_outputs=StructuredOutputsParams(json=schema))
    [probe] = llm.generate(["List digits: "], constrained, use_tqdm=False)
    length = len(probe.outputs[0].token_ids)
    print(f"- {llm.source.path.name}, {args.dtype}; every request generates {length} tokens (an array of {items} digits)")
    print()
    print("| batch | unconstrained tok/s | constrained tok/s | constrained ÷ unconstrained | same length |")
    print("|---|---|---|---|---|")
    for batch in args.batches:
        prompts = [f"List digits ({i}): " for i in range(batch)]
        rates = {}
        for kind in ("unconstrained", "constrained"):
            params = [SamplingParams(temperature=1.0, seed=i, max_tokens=length, ignore_eos=True) if kind == "unconstrained" else
                      SamplingParams(temperature=1.0, seed=i, max_tokens=4 * items + 8,
                                     structured_outputs=StructuredOutputsParams(json=schema)) for i in range(batch)]
            llm.generate(prompts, params, use_tqdm=False)  # warm-up: compiles its variants
            best = 0.0
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                dt = time.perf_counter() - t0
                tokens = [len(o.outputs[0].token_ids) for o in outs]
                best = max(best, sum(tokens) / dt)
            rates[kind] = (best, tokens)
        same = all(t == length for t in rates["constrained"][1] + rates["unconstrained"][1])
        print(f"| {batch} | {rates['unconstrained'][0]:.1f} | {rates['constrained'][0]:.1f} | "
              f"{rates['constrained'][0] / rates['unconstrained'][0]:.2f} | {'yes' if same else 'no'} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,32", help="batch sizes (default 1,32)")
    ap.add_argument("--items", type=int, default=48, help="digits in the constrained array (default 48)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=2, help="timed passes per configuration; the best counts (default 2)")
    ap.add_argument("--skip-throughput", action="store_true")
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]

    import jax

    from jaxinfer.runtime.loading import ModelSource, default_model_path
    from jaxinfer.tokenizer import load_tokenizer

    print(f"- cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} logical CPUs; jax {jax.__version__}; "
          f"{time.strftime('%Y-%m-%d')}")
    tokenizer = load_tokenizer(ModelSource("gguf", default_model_path()))
    mask_table(args, tokenizer, 49152, [tokenizer.eos_token_id])
    if not args.skip_throughput:
        print()
        throughput_table(args)


if __name__ == "__main__":
    main()
