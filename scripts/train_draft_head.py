#!/usr/bin/env python
"""Train Medusa-style draft heads for a model on text the model writes itself, and compare them
with prompt lookup on held-out prompts.

    python scripts/train_draft_head.py --out heads/smollm2            # SmolLM2 on the CPU, ~10 min
    python scripts/train_draft_head.py --model ./Qwen2.5-0.5B-Instruct --out heads/qwen --heads 4
    LLM(model, speculative_config={"method": "medusa", "model": "heads/smollm2", "num_speculative_tokens": 3})

1. The model answers chat prompts (templates x topics) greedily: its own text, no data download.
2. One forward pass over each prompt + answer gives the final-normed hidden state at every
   position (`jaxinfer.evaluate.hidden_states`).
3. Head i learns the token i + 1 places after the LM head's (`jaxinfer.models.draft_heads`): optax
   AdamW on the answers' positions, the LM head frozen.
4. The heads are saved with orbax; then both proposers serve held-out prompts (other topics)
   through the engine, and the script prints each one's acceptance rate and mean accepted length.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import LLM, SamplingParams
from jaxinfer.evaluate import hidden_states
from jaxinfer.models.draft_heads import evaluate_heads, save_heads, train_heads, training_pairs
from jaxinfer.models.layers import matmul

TEMPLATES = [
    "Write a short story about {}.", "Explain {} to a ten-year-old.", "Give three facts about {}.",
    "Describe {} in a few sentences.", "What are the benefits of {}?", "Write a short poem about {}.",
]
TRAIN_TOPICS = [
    "the ocean", "a lighthouse", "bicycles", "volcanoes", "the moon", "honey bees", "rain forests", "chess",
    "a small village", "winter", "trains", "the desert", "music", "gardening", "an old library", "mountains",
    "friendship", "the internet", "rivers", "cooking pasta", "the stars", "a lost dog", "elephants", "clocks",
    "paper airplanes", "recycling", "a thunderstorm", "the solar system", "bread", "robots",
]
HELD_OUT_TOPICS = ["penguins", "a city at night", "the history of maps", "coffee", "dinosaurs", "a sailing trip"]


def chat_prompts(tokenizer, topics) -> list[list[int]]:
    out = []
    for topic in topics:
        for template in TEMPLATES:
            text = tokenizer.apply_chat_template([{"role": "user", "content": template.format(topic)}], tokenize=False,
                                                 add_generation_prompt=True)
            out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


def lm_head_of(llm):
    params = llm.runner.params
    if llm.config.tie_word_embeddings:
        embed = params["embed"].get_value()
        return lambda x: jnp.einsum("nh,vh->nv", x.astype(embed.dtype), embed, preferred_element_type=jnp.float32)
    head = params["lm_head"].get_value()
    return lambda x: matmul(x, head)


def dataset(llm, prompts, max_tokens: int, num_heads: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(hidden [m, H], targets [m, K]) over the answers' positions, and the answers' token count."""
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    hs, ts, answered = [], [], 0
    for prompt, out in zip(prompts, outs):
        tokens = prompt + list(out.outputs[0].token_ids)
        answered += len(out.outputs[0].token_ids)
        h = hidden_states(llm.config, llm.runner.graphdef, llm.runner.params, tokens)
        pair_h, pair_t = training_pairs(h, np.asarray(tokens), num_heads, first=len(prompt) - 1)
        hs.append(pair_h)
        ts.append(pair_t)
    return np.concatenate(hs), np.concatenate(ts), answered


def acceptance(llm_kwargs, prompts, spec: dict, max_tokens: int) -> dict:
    llm = LLM(**llm_kwargs, speculative_config=spec)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    seconds = time.perf_counter() - t0
    stats = llm.engine.get_stats()
    return {"acceptance": stats.acceptance_rate, "mean_accepted_length": stats.mean_accepted_length,
            "drafted": stats.num_draft_tokens, "tokens": sum(len(o.outputs[0].token_ids) for o in outs), "seconds": seconds}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--out", required=True, help="folder to save the heads in")
    p.add_argument("--heads", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128, help="answer length for training text (default 128)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--learning-rate", type=float, default=2e-3)
    p.add_argument("--overwrite", action="store_true")
    args = p.parse_args(argv)

    started = time.perf_counter()
    llm_kwargs = dict(model=args.model, max_model_len=512, max_num_batched_tokens=256, max_num_seqs=32, page_size=16,
                      num_pages=600, progress=False)
    llm = LLM(**llm_kwargs)
    tokenizer = llm.get_tokenizer()
    train_prompts, held_out = chat_prompts(tokenizer, TRAIN_TOPICS), chat_prompts(tokenizer, HELD_OUT_TOPICS)

    t = time.perf_counter()
    h, targets, answered = dataset(llm, train_prompts, args.max_tokens, args.heads)
    h_test, t_test, _ = dataset(llm, held_out, args.max_tokens, args.heads)
    print(f"data: {len(train_prompts)} prompts, {answered} answer tokens, {len(h)} training positions; "
          f"{len(h_test)} held-out positions ({time.perf_counter() - t:.0f} s)")

    lm_head = lm_head_of(llm)
    t = time.perf_counter()
    heads = train_heads(h, targets, lm_head, num_heads=args.heads, steps=args.steps, batch_size=args.batch_size,
                        learning_rate=args.learning_rate,
                        log=lambda step, loss, acc: print(f"  step {step:4d}  loss {loss:.3f}  train top-1 {np.round(acc, 3).tolist()}"))
    train_seconds = time.perf_counter() - t
    accuracy = evaluate_heads(heads, h_test, t_test, lm_head)
    print(f"trained {args.heads} heads in {train_seconds:.0f} s; held-out top-1 per head: {np.round(accuracy, 3).tolist()}")
    path = save_heads(args.out, jax.device_get(heads), base_model=str(llm.source.path), overwrite=args.overwrite)
    total = time.perf_counter() - started
    print(f"saved {path}; data + training took {total / 60:.1f} min")

    k = args.heads
    ngram = acceptance(llm_kwargs, held_out, {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3}, args.max_tokens)
    medusa = acceptance(llm_kwargs, held_out, {"method": "medusa", "num_speculative_tokens": k, "model": str(path)}, args.max_tokens)
    print("\n| proposer (held-out prompts) | acceptance | mean accepted length | drafted tokens |")
    print("|---|---|---|---|")
    for name, r in (("ngram", ngram), ("medusa", medusa)):
        print(f"| {name} | {r['acceptance']:.0%} | {r['mean_accepted_length']:.2f} | {r['drafted']} |")
    (Path(path) / "report.json").write_text(json.dumps({
        "train_positions": len(h), "held_out_top1": accuracy.tolist(), "train_seconds": train_seconds,
        "total_minutes": total / 60, "ngram": ngram, "medusa": medusa}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
