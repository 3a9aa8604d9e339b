#!/usr/bin/env python
"""Train draft heads (EAGLE-style or Medusa-style) for a model on text the model writes itself,
and compare them with prompt lookup on held-out prompts.

    python scripts/train_draft_head.py --out heads/smollm2            # SmolLM2 on the CPU, ~8 min
    python scripts/train_draft_head.py --kind medusa --out heads/smollm2-medusa --data-cache /tmp/smollm2.npz
    python scripts/train_draft_head.py --model ./Qwen2.5-0.5B-Instruct --out heads/qwen --heads 4
    python scripts/train_draft_head.py --kind eagle3 --out heads/smollm2-eagle3   # an EAGLE-3 head, published format
    LLM(model, speculative_config={"method": "eagle", "model": "heads/smollm2", "num_speculative_tokens": 3})
    LLM(model, speculative_config={"method": "eagle3", "model": "heads/smollm2-eagle3", "num_speculative_tokens": 3})

With --kind eagle3 the head is an EAGLE-3 head (`jaxinfer.models.eagle3`, `jaxinfer.training.eagle3`):
trained on the target's aux streams of its own text by teacher forcing (and its own second
guess), saved as config.json + model.safetensors in the format vLLM and SGLang load.

1. The model answers chat prompts (templates x topics) greedily: its own text, no data download.
2. One forward pass over each prompt + answer gives the final-normed hidden state at every
   position (`jaxinfer.runtime.evaluate.hidden_states`).
3. The heads (`jaxinfer.models.draft_heads`) learn the 2nd .. (K+1)th tokens after each answer
   position and the target's hidden states at the positions they stand for: optax AdamW, the
   target's LM head and embedding frozen.
4. The heads are saved with orbax; then prompt lookup and the heads (drafting all k, and only
   while confident: --confidence) serve held-out prompts (other topics) through the engine, and
   the script prints each one's acceptance rate and mean accepted length.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import numpy as np

from jaxinfer import LLM, SamplingParams
from jaxinfer.runtime.evaluate import hidden_states
from jaxinfer.models.draft_heads import KINDS, save_heads
from jaxinfer.models.eagle3 import eagle3_spec, head_config_dict, published_tensors, save_eagle3
from jaxinfer.runtime.evaluate import stream_states
from jaxinfer.training.eagle3 import draft_vocabulary, pack, train_eagle3
from jaxinfer.training.draft_heads import evaluate_heads, train_heads, training_windows
from jaxinfer.models.layers import matmul, tied_logits
from jaxinfer.ops.quantization import QuantizedWeight

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
        return lambda x: tied_logits(x, embed)
    head = params["lm_head"].get_value()
    return lambda x: matmul(x, head)


def float_embedding(llm):
    """The target's embedding table [V, H] as floats (a GGUF's quantized table is stored [H, V])."""
    embed = llm.runner.params["embed"].get_value()
    return embed.dequantize().T if isinstance(embed, QuantizedWeight) else embed


def dataset(llm, prompts, max_tokens: int, num_heads: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(states [m, K + 1, H], windows [m, K + 1]) over the answers' positions (`training_windows`),
    and the answers' token count."""
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    hs, ws, answered = [], [], 0
    for prompt, out in zip(prompts, outs):
        tokens = prompt + list(out.outputs[0].token_ids)
        answered += len(out.outputs[0].token_ids)
        h = hidden_states(llm.config, llm.runner.graphdef, llm.runner.params, tokens)
        states, window = training_windows(h, np.asarray(tokens), num_heads, first=len(prompt) - 1)
        hs.append(states)
        ws.append(window)
    return np.concatenate(hs), np.concatenate(ws), answered


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
    p.add_argument("--kind", choices=(*KINDS, "eagle3"), default="eagle",
                   help="eagle (one layer, chained; default), medusa (K heads) or eagle3 (a published-format EAGLE-3 head)")
    p.add_argument("--draft-vocab", type=int, default=8192, help="eagle3: the draft vocabulary's size (default 8192)")
    p.add_argument("--prompts", type=int, default=0, help="use only the first N training prompts (0: all; smoke runs)")
    p.add_argument("--heads", type=int, default=3, help="guesses trained (medusa: heads; eagle: unrolled steps)")
    p.add_argument("--max-tokens", type=int, default=128, help="answer length for training text (default 128)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--learning-rate", type=float, default=2e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--feature-weight", type=float, default=1.0, help="weight of the hidden-state regression loss")
    p.add_argument("--confidence", type=float, default=0.8,
                   help="draft_confidence_threshold of the second held-out run (default 0.8)")
    p.add_argument("--data-cache", default=None, help="an .npz to keep the generated data in (reused when it exists)")
    p.add_argument("--overwrite", action="store_true")
    args = p.parse_args(argv)

    started = time.perf_counter()
    # decode batches of up to 128 answers: generating the data is most of the time, and a bigger
    # batch makes more tokens per second on the CPU
    llm_kwargs = dict(model=args.model, max_model_len=512, max_num_batched_tokens=256, max_num_seqs=128, page_size=16,
                      num_pages=1600, progress=False)
    llm = LLM(**llm_kwargs)
    tokenizer = llm.get_tokenizer()
    train_prompts, held_out = chat_prompts(tokenizer, TRAIN_TOPICS), chat_prompts(tokenizer, HELD_OUT_TOPICS)
    if args.prompts:
        train_prompts, held_out = train_prompts[: args.prompts], held_out[: max(1, args.prompts // 4)]
    if args.kind == "eagle3":
        return main_eagle3(args, llm, llm_kwargs, train_prompts, held_out, started)

    t = time.perf_counter()
    if args.data_cache and Path(args.data_cache).exists():
        data = np.load(args.data_cache)
        states, window, s_test, w_test = data["states"], data["window"], data["s_test"], data["w_test"]
        answered = int(data["answered"])
    else:
        states, window, answered = dataset(llm, train_prompts, args.max_tokens, args.heads)
        s_test, w_test, _ = dataset(llm, held_out, args.max_tokens, args.heads)
        if args.data_cache:
            np.savez(args.data_cache, states=states, window=window, s_test=s_test, w_test=w_test, answered=answered)
    print(f"data: {len(train_prompts)} prompts, {answered} answer tokens, {len(window)} training positions; "
          f"{len(w_test)} held-out positions ({time.perf_counter() - t:.0f} s)")

    lm_head = lm_head_of(llm)
    embed = float_embedding(llm)
    t = time.perf_counter()
    heads = train_heads(states, window, lm_head, embed, kind=args.kind, steps=args.steps, batch_size=args.batch_size,
                        learning_rate=args.learning_rate, weight_decay=args.weight_decay, feature_weight=args.feature_weight,
                        log=lambda step, loss, acc: print(f"  step {step:4d}  loss {loss:.3f}  train top-1 {np.round(acc, 3).tolist()}"))
    train_seconds = time.perf_counter() - t
    accuracy = evaluate_heads(heads, s_test, w_test, lm_head, embed)
    print(f"trained {args.kind} heads ({args.heads} guesses) in {train_seconds:.0f} s; held-out top-1 per guess: "
          f"{np.round(accuracy, 3).tolist()}")
    path = save_heads(args.out, jax.device_get(heads), base_model=str(llm.source.path), overwrite=args.overwrite)
    total = time.perf_counter() - started
    print(f"saved {path}; data + training took {total / 60:.1f} min")

    k = args.heads
    heads_spec = {"method": args.kind, "num_speculative_tokens": k, "model": str(path)}
    runs = {
        "ngram": acceptance(llm_kwargs, held_out, {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3},
                            args.max_tokens),
        args.kind: acceptance(llm_kwargs, held_out, heads_spec, args.max_tokens),
        f"{args.kind}, confidence >= {args.confidence}": acceptance(
            llm_kwargs, held_out, {**heads_spec, "draft_confidence_threshold": args.confidence}, args.max_tokens),
    }
    print("\n| proposer (held-out prompts, k = %d) | acceptance | mean accepted length | drafted tokens |" % k)
    print("|---|---|---|---|")
    for name, r in runs.items():
        print(f"| {name} | {r['acceptance']:.0%} | {r['mean_accepted_length']:.2f} | {r['drafted']} |")
    (Path(path) / "report.json").write_text(json.dumps({
        "train_positions": len(window), "held_out_top1": accuracy.tolist(), "train_seconds": train_seconds,
        "total_minutes": total / 60, "kind": args.kind, "runs": runs}, indent=2))
    return 0


def main_eagle3(args, llm, llm_kwargs, train_prompts, held_out, started) -> int:
    """--kind eagle3: generate, read the aux streams, train, save in the published format, compare."""
    config = llm.config
    head_config = head_config_dict(config, draft_vocab=min(args.draft_vocab, config.vocab_size))
    spec = eagle3_spec(head_config, config)
    t = time.perf_counter()
    outs = llm.generate(train_prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens), use_tqdm=False)
    sequences = [np.asarray(prompt + list(out.outputs[0].token_ids), np.int32) for prompt, out in zip(train_prompts, outs)]
    aux = [stream_states(config, llm.runner.graphdef, llm.runner.params, list(tokens), spec.aux_layers) for tokens in sequences]
    tokens, states = pack(sequences, aux, max(len(s) for s in sequences))
    draft_ids = draft_vocabulary(sequences, config.vocab_size, spec.draft_vocab)
    print(f"data: {len(sequences)} texts, {sum(len(s) for s in sequences)} tokens ({time.perf_counter() - t:.0f} s)")
    t = time.perf_counter()
    params = train_eagle3(spec, float_embedding(llm), tokens, states, draft_ids, steps=args.steps,
                          batch_size=min(args.batch_size, 16), learning_rate=args.learning_rate, weight_decay=args.weight_decay,
                          log=lambda step, loss, acc: print(f"  step {step:4d}  loss {loss:.3f}  train top-1 {np.round(acc, 3).tolist()}"))
    print(f"trained an EAGLE-3 head in {time.perf_counter() - t:.0f} s")
    path = save_eagle3(Path(args.out).absolute(), head_config, published_tensors(jax.device_get(params), spec))
    print(f"saved {path}; data + training took {(time.perf_counter() - started) / 60:.1f} min")
    k = args.heads
    runs = {"ngram": acceptance(llm_kwargs, held_out, {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3},
                                args.max_tokens),
            "eagle3": acceptance(llm_kwargs, held_out, {"method": "eagle3", "num_speculative_tokens": k, "model": str(path)},
                                 args.max_tokens)}
    print("\n| proposer (held-out prompts, k = %d) | acceptance | mean accepted length | drafted tokens |" % k)
    print("|---|---|---|---|")
    for name, r in runs.items():
        print(f"| {name} | {r['acceptance']:.0%} | {r['mean_accepted_length']:.2f} | {r['drafted']} |")
    (path / "report.json").write_text(json.dumps({"kind": "eagle3", "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
