"""The engine end to end on a GPU (or TPU): what only a real device shows about issue 33's parts.

    python scripts/gpu_engine_check.py                  # on the GPU machine (needs torch + transformers
                                                        # to build the random model, as the tests do)
    python scripts/gpu_engine_check.py --family deepseek_v3   # latent attention: the MLA kernel, the
                                                        # expanded prefill's flash kernel, grouped routing

1. A random model at SmolLM2-135M's attention and MLP shapes (fewer layers), or with
   `--family deepseek_v3` a DeepSeek-V3 of 8 heads over a latent of 128 + rope 64 (the Triton MLA
   kernel's case; prompts of 256 tokens and more prefill expanded, by the flash kernel), is
   written with transformers (tests/tiny_models.py).
2. `LLM` at its defaults: the KV pool sized from the device's memory (`gpu_memory_utilization`),
   the Pallas kernels checked on the device before serving; the start-up line and the memory
   figures are printed.
3. The same prompts through the XLA paths (`kernel_impl="reference"`): greedy tokens and
   log-probabilities compared.
4. A step that dies on the device, taking the KV pool with it: its requests fail, the pool is
   re-created, a waiting request and the next `generate` give what they gave before.

Prints one line per check; exit status 1 if a check failed.
"""

from __future__ import annotations

import logging
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxinfer import LLM, SamplingParams  # noqa: E402

SHAPES = {
    "llama3.1": dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
                     num_hidden_layers=4, max_position_embeddings=2048),
    "deepseek_v3": dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=8, intermediate_size=1024,
                        num_hidden_layers=3, q_lora_rank=96, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=64,
                        v_head_dim=64, moe_intermediate_size=256, max_position_embeddings=2048),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
failures: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)
    if not ok:
        failures.append(name)


def prompts(n: int = 8) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [[int(t) for t in rng.integers(3, 250, int(rng.integers(4, 300)))] for _ in range(n)]


def run(llm: LLM, ps) -> tuple[list[list[int]], list[list[float]]]:
    outs = llm.generate(ps, GREEDY, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)] for o in outs]
    return tokens, logprobs


def main(argv=None) -> int:
    import argparse

    from tiny_models import save_hf_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=sorted(SHAPES), default="llama3.1")
    family = parser.parse_args(argv).family

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    device = jax.devices()[0]
    print(f"jax {jax.__version__}, {device.device_kind} ({device.platform})", flush=True)
    model_dir = Path(tempfile.mkdtemp()) / "model"
    save_hf_model(family, model_dir, **SHAPES[family])

    t0 = time.perf_counter()
    llm = LLM(str(model_dir), max_model_len=1024, max_num_seqs=2, progress=False)
    print(f"start-up {time.perf_counter() - t0:.1f} s; kernels {llm.kernels}", flush=True)
    stats = device.memory_stats() or {}
    limit, in_use = stats.get("bytes_limit", 0), stats.get("bytes_in_use", 0)
    pool = sum(a.nbytes for a in jax.tree.leaves(llm.runner.kv))
    print(f"{llm.engine.kv_cache_summary}", flush=True)
    print(f"device: bytes_limit {limit / 2**30:.2f} GiB, in use {in_use / 2**30:.2f} GiB; KV pool {pool / 2**30:.2f} GiB",
          flush=True)
    check("the pool is sized from the device's memory", limit > 0 and 0.80 * limit < in_use <= limit,
          f"{in_use / max(limit, 1):.1%} of the allocator's limit in use")

    ps = prompts()
    kernel_tokens, kernel_logprobs = run(llm, ps)
    reference = LLM(str(model_dir), max_model_len=1024, max_num_seqs=2, num_pages=512, kernel_impl="reference",
                    progress=False)
    ref_tokens, ref_logprobs = run(reference, ps)
    same = sum(a == b for a, b in zip(kernel_tokens, ref_tokens))
    diffs = [abs(x - y) for a, b, ta, tb in zip(kernel_logprobs, ref_logprobs, kernel_tokens, ref_tokens) if ta == tb
             for x, y in zip(a, b)]
    check("Pallas engine == XLA engine (greedy tokens)", same == len(ps), f"{same}/{len(ps)} prompts equal; "
          f"max |logprob diff| {max(diffs, default=0):.3g} (bf16)")
    del reference

    runner, engine = llm.runner, llm.engine
    real = runner.step_fn

    class DiesOnTheDevice:
        def __call__(self, params, kv, *args, **kwargs):
            out = real(params, kv, *args, **kwargs)
            jax.tree.map(lambda a: a.delete(), (kv, out[2]))
            raise RuntimeError("device halted")

        def __getattr__(self, name):
            return getattr(real, name)

    for i, p in enumerate(ps[:3]):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    engine.step()
    runner.step_fn = DiesOnTheDevice()
    failed = [o for o in engine.step() if o.error]
    runner.step_fn = real
    rest = {}
    while engine.has_unfinished_requests():
        rest.update({o.request_id: o for o in engine.step()})
    fresh = not any(a.is_deleted() for a in jax.tree.leaves(runner.kv))
    check("a step that dies on the device fails its requests, the pool is re-created",
          bool(failed) and all(o.outputs[0].finish_reason == "error" for o in failed) and fresh,
          f"{len(failed)} failed ({failed[0].error if failed else '-'}), {len(rest)} others finished")
    survivors = {int(o.request_id[1:]): o.outputs[0].token_ids for o in rest.values() if not o.error}
    check("requests that survived give what they gave alone", all(kernel_tokens[i] == t for i, t in survivors.items()),
          f"{len(survivors)} compared")
    again, _ = run(llm, ps)
    check("the next generate gives what it gave before", again == kernel_tokens)
    print(f"{len(failures)} checks failed", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
